"""Issue 54: bounded loops with progress. Dynamic sampling with a constant reward and a huge
``max_rounds``, critic pretraining with ``critic_pretrain_rollouts`` a typo of 96: each stops
at its cap with a line and says how far it got while it collects. Misconfigured critic
pretraining (a prefix-scoring reward at weight 0, epochs without rollouts, a change on
``--resume`` past step 0) is one line. The caps are lowered by patching the module constants
(the defaults are minutes), on the tiny example."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.base.errors import UserError
from rlpipe.core.config.settings import load_config
from rlpipe.core.run.pipeline import Pipeline, train
from rlpipe.core.step import critic_pretrain, dynamic_sampling

from tests.test_critic_start import reward_model
from tests.test_trainer import tiny

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
FAST = ["data.batch_size=2", "collector.max_new_tokens=6", "train.epochs=1",
        "train.minibatches=1", "log.progress=false"]


def cli(*args) -> SimpleNamespace:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


def test_dynamic_sampling_with_a_constant_reward_stops_at_its_time_cap_and_says_so(tmp_path,
                                                                                   monkeypatch):
    (tmp_path / "const.py").write_text("def score(prompts, responses, **batch):\n"
                                       "    return [1.0] * len(responses)\n")
    monkeypatch.setattr(dynamic_sampling, "MAX_SECONDS", 0.3)
    monkeypatch.setattr(dynamic_sampling, "PROGRESS_S", 0.0)
    run_dir = tmp_path / "run"
    result = cli("run", TINY, f"run.output_dir={run_dir}", "run.steps=1", *FAST,
                 "advantage.name=grpo", "data.dynamic_sampling.enabled=true",
                 "data.dynamic_sampling.max_rounds=100000",
                 f"rewards=[{{path: {tmp_path / 'const.py'}, function: score}}]")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    caps = [line for line in lines if line.startswith("warning: dynamic sampling stopped")]
    assert len(caps) == 1 and "the cap of 0 s of collection per step: 0 of 2 groups" in caps[0]
    assert "is the reward constant?" in caps[0]
    assert any(line.startswith("rlpipe: dynamic sampling: 0 of 2 groups with a reward signal "
                               "after 1 rounds") for line in lines)
    row = json.loads((run_dir / "metrics.jsonl").read_text())
    assert row["data/flat_groups_trained"] == 2 and 0 < row["data/extra_rounds"] < 100000


def test_dynamic_sampling_rounds_cap_is_said(monkeypatch, capsys):
    import torch
    from tensordict import TensorDict
    from rlpipe.core.base import schema as S

    monkeypatch.setattr(dynamic_sampling, "_SAID", set())
    flat = TensorDict({S.SCORE: torch.ones(4), S.GROUP_ID: torch.arange(4) // 2,
                       S.RESPONSE_IDS: torch.zeros(4, 3, dtype=torch.long)}, [4])
    groups = dynamic_sampling.GroupFilter(groups=2, max_rounds=2)
    assert groups.add(flat) and groups.add(flat) and not groups.add(flat)
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: dynamic sampling stopped at the cap of "
                   "data.dynamic_sampling.max_rounds (2) (said once): 0 of 2 groups had a reward "
                   "signal after 2 extra rounds; the step is topped up with flat groups (samples "
                   "that all scored the same: is the reward constant?)"]


@pytest.fixture(scope="module")
def rm(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rm") / "rm"
    reward_model(path, bert=True)
    return path


def pretraining(run_dir, rm, *extra, weight=1.0):
    return tiny(run_dir, "run.steps=1", "train.epochs=1", "data.batch_size=4",
                "collector.max_new_tokens=6", *extra,
                f"rewards=[{{name: reward_model, path: {rm}, weight: {weight}}}, "
                f"{{name: length}}]")


def test_critic_pretraining_rollouts_typo_stops_at_its_round_cap_with_progress(
        tmp_path, rm, monkeypatch, capsys):
    monkeypatch.setattr(critic_pretrain, "MAX_ROUNDS", 2)
    monkeypatch.setattr(critic_pretrain, "PROGRESS_S", 0.0)
    pipe = Pipeline(pretraining(tmp_path / "run", rm, "train.critic_pretrain_rollouts=1000000"),
                    progress=False)
    capsys.readouterr()   # the loading lines
    said = []
    pipe.status.say = said.append
    pipe._pretrain_critic()
    err = capsys.readouterr().err.splitlines()
    assert "rlpipe: critic pretraining: 1 of 125000 rounds collected" in err[0]
    assert [line for line in err if line.startswith("warning:")] == [
        "warning: critic pretraining stopped collecting at 2 of 125000 rounds (2 rounds or "
        "3600 s at most); train.critic_pretrain_rollouts asks for more (a typo?); pretraining "
        "on those collected"]
    assert "16 rollouts" in said[-1]   # 2 rounds of 4 prompts x 2 samples


def test_a_prefix_scoring_reward_at_weight_0_is_one_line(tmp_path, rm):
    pipe = Pipeline(pretraining(tmp_path / "run", rm, "train.critic_pretrain_rollouts=8",
                                weight=0.0), progress=False)
    with pytest.raises(UserError) as exc:
        pipe._pretrain_critic()
    assert str(exc.value) == (
        "train.critic_pretrain_rollouts: the rewards that score partial responses "
        "(reward_model) have weight 0, so every target would be 0; give one a weight, or set "
        "critic_pretrain_rollouts to 0")


def test_critic_pretrain_epochs_without_rollouts_is_one_line():
    """Refused at load (core/config/checks.py), before any model is built."""
    load_config(TINY, [])
    with pytest.raises(UserError, match=r"^train.critic_pretrain_epochs: 5 passes over no "
                                        r"rollouts"):
        load_config(TINY, ["train.critic_pretrain_epochs=5"])


def test_raising_critic_pretrain_rollouts_on_resume_past_step_0_is_one_line(tmp_path, rm):
    run_dir = tmp_path / "run"
    train(pretraining(run_dir, rm, "checkpoint.every=1"), progress=False)
    cfg = pretraining(run_dir, rm, "checkpoint.every=1", "run.steps=2",
                      "train.critic_pretrain_rollouts=8")
    with pytest.raises(UserError) as exc:
        Pipeline(cfg, progress=False, resume=True).train()
    assert str(exc.value).startswith(
        "train.critic_pretrain_rollouts: critic pretraining runs only before step 1, and "
        "step-000001 is past it, so the change would do nothing")


def test_the_rendezvous_wait_says_how_long_and_ctrl_c_stops_it(tmp_path):
    """``distributed.nnodes: 2`` with no second node: the default wait (600 s) is said at once,
    and Ctrl-C (SIGINT to the process group, as a terminal sends it) ends it with status 130."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # As from a terminal: none of the launcher state that earlier in-process launches of this
    # test session leave in os.environ (RLPIPE_LAUNCHED, torchrun's TORCHELASTIC_*, ranks), and
    # SIGINT not ignored (an ignored signal is inherited across exec; a handled one is not: CI's
    # full suite left it ignored, and the child then waited out the join timeout).
    leaked = ("RLPIPE_LAUNCHED", "TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_", "LOCAL_", "RANK",
              "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(leaked)}
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlpipe.cli", "run", str(TINY), "run.steps=1",
             f"run.output_dir={tmp_path / 'run'}", "log.progress=false", "distributed.nnodes=2",
             f"distributed.rdzv_endpoint=127.0.0.1:{port}"],
            stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**env, "OMP_NUM_THREADS": "1"})
    finally:
        signal.signal(signal.SIGINT, handler)
    try:
        start = time.monotonic()
        line = proc.stderr.readline()
        assert line.strip() == (f"rlpipe: waiting up to distributed.timeout_s=600 s for 2 nodes "
                                f"to join at 127.0.0.1:{port} (Ctrl-C stops)")
        # Ctrl-C once the wait has begun (the rendezvous store listens on the endpoint), as a
        # user would press it: not while torchrun is still starting under a loaded CPU
        while time.monotonic() - start < 60 and proc.poll() is None:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            status = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"Ctrl-C did not end the wait; its stderr: {proc.stderr.read()[-2000:]}")
        assert status == 130
        assert "Traceback" not in proc.stderr.read()
        assert time.monotonic() - start < 120
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
