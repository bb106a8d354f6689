"""Checkpoints that load without rlpipe (``checkpoints/step-N/policy``: transformers for a full
actor, peft for a LoRA adapter) and ``rlpipe export`` (merged or adapter), on real tiny runs."""

import copy
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlpipe.cli import main
from rlpipe.core.run import checkpoint
from rlpipe.core.models.lm import load_causal_lm, load_tokenizer
from rlpipe.core.run.pipeline import Pipeline

from tests.test_trainer import LORA, TINY, tiny

IDS = torch.tensor([[1, 5, 9, 13, 20, 7]])


def logits(model) -> torch.Tensor:
    """On CPU (a copy of a model that sits on a GPU), so both sides of a comparison run alike."""
    if next(model.parameters()).device.type != "cpu":
        model = copy.deepcopy(model).cpu()
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def policy(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}" / "policy"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    pipe = Pipeline(tiny(out, "checkpoint.every=1", "train.epochs=1"), progress=False)
    pipe.train()
    return out, pipe


def test_checkpoint_policy_loads_with_transformers(full_run):
    run_dir, pipe = full_run
    last = AutoModelForCausalLM.from_pretrained(policy(run_dir, 2))
    assert torch.allclose(logits(last), logits(pipe.models.actor), atol=1e-6)
    first = AutoModelForCausalLM.from_pretrained(policy(run_dir, 1))
    assert not torch.allclose(logits(first), logits(last), atol=1e-4)  # another step's weights
    tok = AutoTokenizer.from_pretrained(policy(run_dir, 2))
    assert tok("hello").input_ids == pipe.models.tokenizer("hello").input_ids
    assert checkpoint.verify(policy(run_dir, 2).parent) is None  # the manifest covers policy/


def test_export_cli_writes_the_chosen_step(full_run, tmp_path):
    run_dir, _ = full_run
    result = run_cli("export", run_dir, tmp_path / "one", "--step", 1)
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.output.strip() == f"exported: {tmp_path / 'one'}"
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "one")
    saved = AutoModelForCausalLM.from_pretrained(policy(run_dir, 1))
    assert torch.equal(logits(exported), logits(saved))
    assert run_cli("export", run_dir, tmp_path / "newest").exit_code == 0
    newest = AutoModelForCausalLM.from_pretrained(tmp_path / "newest")
    assert torch.equal(logits(newest), logits(AutoModelForCausalLM.from_pretrained(policy(run_dir, 2))))


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_export_errors_are_one_line(full_run, tmp_path):
    run_dir, _ = full_run
    assert "no checkpoint of step 7 (steps: 1, 2)" in one_error_line(
        run_cli("export", run_dir, tmp_path / "x", "--step", 7))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert "not an empty directory" in one_error_line(run_cli("export", run_dir, tmp_path / "full"))
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert "not an rlpipe run directory" in one_error_line(run_cli("export", tmp_path, tmp_path / "y"))
    assert "actor has no LoRA adapter" in one_error_line(
        run_cli("export", run_dir, tmp_path / "z", "--adapter"))
    assert not (tmp_path / "z").exists()


def test_a_damaged_newest_checkpoint_is_refused_unless_a_step_is_named(full_run, tmp_path):
    """The red-team case: a truncated policy/model.safetensors in the newest checkpoint; export
    used to write the step before without a word."""
    import shutil
    run_dir = tmp_path / "run"
    shutil.copytree(full_run[0], run_dir)
    weights = policy(run_dir, 2) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    line = one_error_line(run_cli("export", run_dir, tmp_path / "out"))
    assert "newest checkpoint" in line and "step-000002 is damaged" in line
    assert "pass --step 1 to export the newest intact one, step-000001" in line
    assert not (tmp_path / "out").exists()
    assert run_cli("export", run_dir, tmp_path / "out", "--step", 1).exit_code == 0
    assert "damaged" in one_error_line(run_cli("export", run_dir, tmp_path / "o2", "--step", 2))


def test_export_into_the_run_directory_is_refused(full_run, tmp_path):
    """``rlpipe export RUN RUN/exported`` was accepted, and --resume then refused the run."""
    run_dir = full_run[0]
    before = sorted(p.name for p in run_dir.iterdir())
    for out in (run_dir / "exported", run_dir, run_dir / "final" / "x", run_dir.parent):
        line = one_error_line(run_cli("export", run_dir, out))
        assert "the run directory" in line and "choose a folder outside it" in line, line
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_export_without_checkpoints_says_so(tmp_path):
    Pipeline(tiny(tmp_path / "run", "run.steps=1", "train.epochs=1", "log.samples_every=0"),
             progress=False).train()
    line = one_error_line(run_cli("export", tmp_path / "run", tmp_path / "out"))
    assert "no intact checkpoint" in line and "final/ already holds" in line


def pretrained_base(folder: Path) -> Path:
    """The tiny example's model with saved random weights: a base that from_pretrained can read."""
    torch.manual_seed(3)
    load_causal_lm(TINY.parent / "model", "random").save_pretrained(folder)
    load_tokenizer(TINY.parent / "model").save_pretrained(folder)
    return folder


def test_lora_checkpoint_is_an_adapter_and_exports_merged(tmp_path):
    from peft import PeftModel

    base = pretrained_base(tmp_path / "base")
    run_dir = tmp_path / "run"
    pipe = Pipeline(tiny(run_dir, *LORA, "train.lr=0.05", f"models.actor.path={base}",
                         "models.actor.init=pretrained", "checkpoint.every=1", "run.steps=1",
                         "train.epochs=1"), progress=False)
    pipe.train()
    adapter = policy(run_dir, 1)
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    want = logits(pipe.models.actor)
    assert torch.allclose(logits(loaded), want, atol=1e-5)
    assert not torch.allclose(logits(AutoModelForCausalLM.from_pretrained(base)), want, atol=1e-3)

    assert run_cli("export", run_dir, tmp_path / "merged").exit_code == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(logits(merged), want, atol=1e-5)
    assert run_cli("export", run_dir, tmp_path / "adapter", "--adapter").exit_code == 0
    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    assert torch.allclose(logits(again), want, atol=1e-5)


def test_lora_on_a_random_init_base_exports_merged(tmp_path):
    """A base built with init: random has no weights file; export rebuilds it from the run's seed."""
    run_dir = tmp_path / "run"
    pipe = Pipeline(tiny(run_dir, *LORA, "models.actor.init=random", "train.lr=0.05",
                         "checkpoint.every=1", "run.steps=1", "train.epochs=1"), progress=False)
    pipe.train()
    assert run_cli("export", run_dir, tmp_path / "merged").exit_code == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(logits(merged), logits(pipe.models.actor), atol=1e-5)


def test_export_of_a_sharded_checkpoint(tmp_path):
    """A torch.distributed.checkpoint folder (what distributed runs write; written here by one
    process through the same code) has no policy/ folder: export rebuilds the actor from it."""
    run_dir = tmp_path / "run"
    pipe = Pipeline(tiny(run_dir, "run.steps=1", "train.epochs=1"), progress=False)
    pipe.step()
    state = pipe.state_dict(sharded=True)
    checkpoint.save_sharded(run_dir, 1, pipe._shards(state), state, 2, pipe.dist)
    assert checkpoint.is_sharded(checkpoint.latest(run_dir))
    assert run_cli("export", run_dir, tmp_path / "out").exit_code == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.allclose(logits(exported), logits(pipe.models.actor), atol=1e-6)
