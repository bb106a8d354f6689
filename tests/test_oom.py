"""core/run/oom.py: running out of memory is one ``error:`` line (exit 2) naming the stage, the memory
in use and the settings that shrink that stage, not a traceback.

The first test runs out of memory for real: the address-space limit is lowered to what the
process already holds while the update runs, so torch's CPU allocator fails. The others make one
call at a real call site raise torch's own `OutOfMemoryError` (a stand-in for a GPU running out,
which CI has not), so the stage is read from a real traceback through the pipeline.
"""

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.pipeline import Pipeline

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
GPU_OOM = "CUDA out of memory. Tried to allocate 20.00 GiB (stand-in)"

LIMITED_UPDATE = textwrap.dedent('''
    import resource
    from rlpipe.core.step import update

    def _held():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    _update = update.Updater.update

    def limited(self, *args, **kwargs):
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (_held(), hard))   # no new memory from here
        try:
            return _update(self, *args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

    update.Updater.update = limited
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_a_real_allocation_failure_in_the_update_is_one_line(tmp_path, harness):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LIMITED_UPDATE)
    path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    result = harness.run(["run", TINY, f"run.output_dir={tmp_path / 'run'}", "run.steps=1",
                          "run.device=cpu", "--no-progress"], env={"PYTHONPATH": path})
    line = harness.error(result, "out of memory in the PPO update", "train.grad_accum (now 1",
                         "models.actor.gradient_checkpointing: true")
    assert "can't allocate memory" in line or "MemoryError" in line


def pipeline(tmp_path, *overrides):
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "run.steps=1", "run.device=cpu",
                             *overrides])
    return Pipeline(cfg, progress=False)


def failing(inner, when=lambda *args, **kwargs: True):
    """``inner``, except that it raises CUDA's out-of-memory error where ``when`` says."""
    def fn(*args, **kwargs):
        if when(*args, **kwargs):
            raise torch.OutOfMemoryError(GPU_OOM)
        return inner(*args, **kwargs)
    return fn


def test_scoring_and_the_update_are_told_apart(tmp_path, monkeypatch):
    from rlpipe.core.models import lm as models

    forward = models._forward
    monkeypatch.setattr(models, "_forward",
                        failing(forward, lambda *a, **k: not torch.is_grad_enabled()))
    with pytest.raises(UserError, match=r"^out of memory in scoring .*\(CUDA out of memory") as e:
        pipeline(tmp_path / "score").step()
    assert "train.forward_batch_size (now 16)" in str(e.value)
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)

    monkeypatch.setattr(models, "_forward", failing(forward, lambda *a, **k: torch.is_grad_enabled()))
    pipe = pipeline(tmp_path / "update", "models.actor.gradient_checkpointing=true")
    with pytest.raises(UserError, match="^out of memory in the PPO update") as e:
        pipe.step()
    message = str(e.value)   # a saver already on is not suggested again
    assert "models.critic.gradient_checkpointing: true" in message
    assert "models.actor.gradient_checkpointing" not in message


def test_a_run_without_a_critic_gets_no_critic_hints(tmp_path, monkeypatch):
    from rlpipe.core.models import lm as models

    monkeypatch.setattr(models, "_forward",
                        failing(models._forward, lambda *a, **k: torch.is_grad_enabled()))
    pipe = pipeline(tmp_path, "advantage.name=grpo", "collector.n=2")
    assert pipe.models.critic is None
    with pytest.raises(UserError, match="^out of memory in the PPO update") as e:
        pipe.step()
    assert "models.actor.gradient_checkpointing: true" in str(e.value)
    assert "models.critic" not in str(e.value)


def test_generation_names_the_collector(tmp_path, monkeypatch):
    from rlpipe.plugins.collectors.hf import HFCollector

    monkeypatch.setattr(HFCollector, "_generate", failing(HFCollector._generate))
    with pytest.raises(UserError, match=r"^out of memory in generation, collector \(") as e:
        pipeline(tmp_path).step()
    assert "collector.max_new_tokens (now 24)" in str(e.value)


def test_a_reward_function_and_python_memory_errors(tmp_path):
    """A Python MemoryError inside a reward is out of memory too, not a broken plugin."""
    def greedy(prompts, responses, **batch):
        raise MemoryError()

    from rlpipe.core.run.pipeline import train

    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "run.steps=1", "run.device=cpu"])
    with pytest.raises(UserError, match="^out of memory in the rewards, .*greedy"):
        train(cfg, progress=False, rewards=[greedy])


def test_loading_the_models(tmp_path, monkeypatch):
    from rlpipe.core.models import lm as models

    monkeypatch.setattr(models, "_from_folder", failing(models._from_folder))
    with pytest.raises(UserError, match="^out of memory in loading the models") as e:
        pipeline(tmp_path)
    assert "models.actor.lora (now null)" in str(e.value)
    assert "distributed.nproc (now 1: FSDP2 shards the models)" in str(e.value)
    assert "models.critic.shared_backbone: true" in str(e.value)

    # before the models exist, whether there is a critic is what the estimator declares
    with pytest.raises(UserError, match="^out of memory in loading the models") as e:
        pipeline(tmp_path / "grpo", "advantage.name=grpo", "collector.n=2")
    assert "models.actor.lora (now null)" in str(e.value)
    assert "models.critic" not in str(e.value)


def test_evaluation(tmp_path, monkeypatch):
    from rlpipe.core.step.evaluation import Evaluator

    prompts = tmp_path / "held_out.txt"
    prompts.write_text("the cat\nthe dog\n")
    monkeypatch.setattr(Evaluator, "_samples", failing(Evaluator._samples))
    pipe = pipeline(tmp_path / "run", f"eval.prompts={prompts}")
    with pytest.raises(UserError, match="^out of memory in evaluation") as e:
        pipe.train()
    assert "eval.batch_size (now 64)" in str(e.value)


def test_rlpipe_check_explains_it_too(tmp_path, monkeypatch):
    from rlpipe.core.models import lm as models
    from rlpipe.tools.check import check_config

    monkeypatch.setattr(models, "_forward", failing(models._forward))
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "run.device=cpu"])
    with pytest.raises(UserError, match="^out of memory in the preflight"):
        check_config(cfg, echo=lambda line: None)
