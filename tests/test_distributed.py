"""FSDP2 on CPU with gloo, through the CLI, with the real HF collector on the tiny model.

- 1 and 2 processes give the same update: greedy decoding, one prompt per `generate` call
  (``micro_batch_size=1``), so both see identical rollouts and differ only in how the work is
  distributed; also with activation checkpointing of the FSDP-wrapped blocks.
- A sampled 2-process run with a LoRA actor, checkpointed and resumed, equals the same run
  uninterrupted; its ``final/`` adapter loads with peft.
- Two "nodes" (two launchers joining one c10d rendezvous on 127.0.0.1) equal one 2-process node.
- Packed rows (``models.packed``) in 2 processes give the update of 1 process with padded rows.
- One-step off-policy rollouts (``rollout.staleness: 1``) in 2 processes: the update of 1
  process, and a resume that saved each rank's batch in flight.
- Distributed mistakes give one line and an exit status, never a hang.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests import clip_edges
from tests.conftest import final_weights as weights, logged_metrics as metrics, python_path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "tiny" / "config.yaml"
GREEDY = ["collector.temperature=0", "collector.micro_batch_size=1"]
SMALL = ["run.steps=2", "train.epochs=2", "train.minibatches=2", "--no-progress"]
UPDATE_KEYS = ("reward/score", "kl/ref", "loss/objective", "loss/critic", "policy/loss",
               "policy/clipfrac", "policy/approx_kl", "policy/entropy", "value/loss",
               "value/clipfrac", "value/explained_var", "response/length", "response/finished_frac")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(out_dir, *args):
    return [sys.executable, "-m", "rlpipe.cli", "run", str(CONFIG), f"run.output_dir={out_dir}",
            *SMALL, *args]


# gloo on CPU also under RLPIPE_TEST_DEVICE=cuda: NCCL needs a GPU per process (test_gpu.py runs
# FSDP2 on NCCL with one process).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RLPIPE_DEVICE": "cpu"}


# A clip fraction counts discrete events: the two runs' fractions may differ by the tokens that
# lie within round-off of a clip edge (tests/clip_edges.py derives the bound), which EDGE_HOOK (a
# `sitecustomize` on every run's PYTHONPATH) counts in each run, over all its steps and ranks.
EDGE_HOOK = f"""import importlib.util, os
from rlpipe.plugins.losses import ppo
_spec = importlib.util.spec_from_file_location("clip_edges",
                                               {str(ROOT / "tests" / "clip_edges.py")!r})
_edges = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_edges)
_policy, _value = ppo.ppo_policy_loss, ppo.ppo_value_loss
def _count(key, near):
    with open(os.environ["RLPIPE_TEST_EDGES"], "a") as f:
        f.write(key + " " + str(int(near.sum())) + chr(10))
def _policy_edges(log_prob, old_log_prob, advantage, *, clip_low, clip_high, **kw):
    _count("policy/clipfrac", _edges.edges((log_prob - old_log_prob).detach(), clip_low, clip_high))
    return _policy(log_prob, old_log_prob, advantage, clip_low=clip_low, clip_high=clip_high, **kw)
def _value_edges(value_pred, old_value, value_target, *, value_clip=0.2, **kw):
    if value_clip is not None:
        _count("value/clipfrac",
               _edges.value_edges(value_pred.detach(), old_value.detach(), value_clip))
    return _value(value_pred, old_value, value_target, value_clip=value_clip, **kw)
ppo.ppo_policy_loss, ppo.ppo_value_loss = _policy_edges, _value_edges
"""


def edge_env(out_dir, site: Path | None = None, hooks: str = "") -> dict:
    """``ENV`` with EDGE_HOOK (and ``hooks``) as the ``sitecustomize`` of a run into ``out_dir``,
    counting its edge tokens in ``out_dir``.edges."""
    out_dir = Path(out_dir)
    site = site or out_dir.parent / f"{out_dir.name}.site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(EDGE_HOOK + hooks)
    return {**ENV, "PYTHONPATH": python_path(site),
            "RLPIPE_TEST_EDGES": str(out_dir.parent / f"{out_dir.name}.edges")}


def run(out_dir, *args, code=0):
    out = subprocess.run(command(out_dir, *args), env=edge_env(out_dir), capture_output=True,
                         text=True, timeout=400, stdin=subprocess.DEVNULL)
    assert out.returncode == code, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def edge_tokens(out_dir) -> dict[str, int]:
    """``{clip fraction: tokens}`` a run found within round-off of that clip's edge
    (EDGE_HOOK), over all its steps and ranks."""
    counts = dict.fromkeys(clip_edges.FRACTIONS, 0)
    for line in (Path(out_dir).parent / f"{Path(out_dir).name}.edges").read_text().splitlines():
        key, n = line.split()
        counts[key] += int(n)
    return counts


def assert_same_update(one, two, rel=1e-4):
    m1, m2 = metrics(one), metrics(two)
    assert [r["step"] for r in m1] == [r["step"] for r in m2] == [1, 2]  # rank 0 alone writes
    cfg = yaml.safe_load((Path(one) / "config.yaml").read_text())
    samples = cfg["data"]["batch_size"] * cfg["collector"]["n"] * cfg["train"]["epochs"]
    e1, e2 = edge_tokens(one), edge_tokens(two)
    for a, b in zip(m1, m2):
        for key in UPDATE_KEYS:
            tol = (clip_edges.tolerance(key, e1, e2, samples * a["response/length"])
                   if key in clip_edges.FRACTIONS else 1e-5)
            assert a[key] == pytest.approx(b[key], rel=rel, abs=tol), (key, e1, e2)
    w1, w2 = weights(one), weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-4), k


@pytest.fixture(scope="module")
def greedy_two(tmp_path_factory):
    """A 2-process greedy run of the tiny example (shared by the comparisons below)."""
    out = tmp_path_factory.mktemp("greedy") / "two"
    run(out, *GREEDY, "distributed.nproc=2")
    return out


GRAD_CKPT = ["models.actor.gradient_checkpointing=true", "models.critic.gradient_checkpointing=true"]


def test_one_and_two_processes_give_the_same_update(greedy_two, tmp_path):
    """Generation, scoring (actor, sharded frozen reference, critic) and the update under FSDP2
    with the real collector: the update equals one process's."""
    one = tmp_path / "one"
    run(one, *GREEDY)
    assert_same_update(one, greedy_two)


PACK_LOG = """import os
from rlpipe.core.models import packing
_run = packing.run
def _logged(forward, rows, *args, **kwargs):
    with open(os.environ["RLPIPE_TEST_PACKED"], "a") as f:
        f.write(f"{os.environ.get('RANK', '-')} {rows.tokens}\\n")
    return _run(forward, rows, *args, **kwargs)
packing.run = _logged
"""


def test_packed_rows_under_fsdp2_give_the_padded_update(tmp_path):
    """``models.packed`` in 2 processes equals 1 process with padded rows, on prompts of 2 and
    about 40 tokens (so every rank's forwards drop their padding); each rank's packed forwards
    are logged from inside the run (a ``sitecustomize`` on ``PYTHONPATH``)."""
    words = "a long and winding prompt that keeps going on about the weather in the hills"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"{words} {words} {i}\nHello {i}\n" for i in range(4)))
    log = tmp_path / "packed.log"
    data = [f"data.prompts={prompts}", "data.shuffle=false"]
    one, two = tmp_path / "one", tmp_path / "two"
    run(one, *GREEDY, *data, "models.packed=false")
    env = {**edge_env(two, tmp_path / "site", PACK_LOG), "RLPIPE_TEST_PACKED": str(log)}
    out = subprocess.run(command(two, *GREEDY, *data, "distributed.nproc=2"), env=env,
                         capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [line.split()[0] for line in log.read_text().splitlines()]
    assert ranks.count("0") >= 2 and ranks.count("1") >= 2, ranks  # scoring and updates packed
    assert_same_update(one, two)


def test_checkpointed_blocks_give_the_same_update(greedy_two, tmp_path):
    two = tmp_path / "two-ckpt"
    run(two, *GREEDY, "distributed.nproc=2", "distributed.shard_frozen=false", *GRAD_CKPT)
    assert_same_update(greedy_two, two)


def test_lora_one_and_two_processes_give_the_same_merged_policy(tmp_path):
    """A LoRA actor (reference = adapters disabled) under FSDP2: the same update as one process,
    and ``final/`` merges the gathered adapters into a plain model, as one process does."""
    lora = ["models.actor.lora.r=4", "models.actor.lora.alpha=8"]
    one, two = tmp_path / "one", tmp_path / "two"
    run(one, *GREEDY, *lora)
    run(two, *GREEDY, *lora, "distributed.nproc=2")
    assert not (two / "final" / "adapter_config.json").exists()
    assert_same_update(one, two)


def test_two_nodes_on_one_machine_equal_one_node_of_two(greedy_two, tmp_path):
    """``distributed.nnodes=2``: each launcher is one "node" of one process (loopback only)."""
    out, port = tmp_path / "nodes", free_port()
    nodes = ["distributed.nnodes=2", f"distributed.rdzv_endpoint=127.0.0.1:{port}"]
    procs = [subprocess.Popen(command(out, *GREEDY, *nodes), env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for _ in range(2)]
    outputs = [p.communicate(timeout=400) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outputs]
    assert metrics(out) == metrics(greedy_two)  # the same global rollout and update, exactly
    assert all(torch.equal(a, b) for a, b in zip(weights(out).values(), weights(greedy_two).values()))


def test_lora_two_processes_checkpoint_resume_and_export(tmp_path):
    """Sampling (a seeded stream per rank), LoRA actor, critic, checkpoints every step: stopped
    after step 2 and resumed, the run equals the uninterrupted one; ``final/`` is an adapter."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    common = ["distributed.nproc=2", "checkpoint.every=1", "models.actor.lora.r=4",
              "models.actor.lora.alpha=8", "export.merge_lora=false"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(full, *common, "run.steps=3")
    run(cut, *common, "run.steps=2")
    run(cut, *common, "run.steps=3", "--resume")
    m_full, m_cut = metrics(full), metrics(cut)
    assert [r["step"] for r in m_cut] == [1, 2, 3] and m_cut == m_full
    w_full, w_cut = (weights(d, "adapter_model.safetensors") for d in (full, cut))
    assert w_full.keys() == w_cut.keys() and all(torch.equal(w_full[k], w_cut[k]) for k in w_full)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG.parent / "model"))
    policy = PeftModel.from_pretrained(base, cut / "final")
    assert sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n) > 0


STALE = ["rollout.staleness=1", "rollout_correction.mode=tis"]


def test_staleness_one_in_two_processes_gives_one_process_update(tmp_path):
    """``rollout.staleness: 1`` under FSDP2: each rank samples its next batch with the sharded
    actor before the update; greedy, the two processes' steps equal one process's."""
    one, two = tmp_path / "one", tmp_path / "two"
    run(one, *GREEDY, *STALE)
    run(two, *GREEDY, *STALE, "distributed.nproc=2")
    assert_same_update(one, two)


def test_staleness_one_two_processes_resume_with_each_rank_batch_in_flight(tmp_path):
    """Sampled, 2 processes, staleness 1, checkpoints every step: each rank's batch in flight is
    saved with the step, so the run stopped after step 2 and resumed equals the uninterrupted
    one, metrics and weights exactly."""
    common = ["distributed.nproc=2", "checkpoint.every=1", *STALE]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(full, *common, "run.steps=3")
    run(cut, *common, "run.steps=2")
    run(cut, *common, "run.steps=3", "--resume")
    assert [r["step"] for r in metrics(cut)] == [1, 2, 3] and metrics(cut) == metrics(full)
    w_full, w_cut = weights(full), weights(cut)
    assert w_full.keys() == w_cut.keys() and all(torch.equal(w_full[k], w_cut[k]) for k in w_full)


# ---- distributed mistakes: one line, an exit status, no hang --------------------------------

def test_more_processes_than_prompts_is_refused_before_launch(tmp_path, harness):
    out = harness.run(["run", CONFIG, f"run.output_dir={tmp_path / 'r'}", "data.batch_size=2",
                       "distributed.nproc=3"])
    harness.error(out, "data.batch_size=2", "3 processes")
    assert not (tmp_path / "r").exists()


def test_more_processes_than_gpus_is_refused_before_launch(monkeypatch):
    """NCCL puts one rank on each GPU: 2 processes on a machine with 1 GPU are one line, not a
    worker's 'invalid device ordinal' traceback (torch's CUDA queries faked: CI has no GPU)."""
    from rlpipe.core.config.settings import load_config
    from rlpipe.core.base.errors import UserError
    from rlpipe.tools.launch import check_before_launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for device in ("cuda", "auto"):
        cfg = load_config(CONFIG, ["distributed.nproc=2", f"run.device={device}"])
        with pytest.raises(UserError, match="distributed.nproc=2 needs one CUDA device per process, "
                                            "but torch sees 1"):
            check_before_launch(cfg)
    check_before_launch(load_config(CONFIG, ["distributed.nproc=2", "run.device=cpu"]))  # gloo


def test_a_two_process_checkpoint_resumes_on_one_process(tmp_path):
    """Distributed checkpoints are sharded (torch.distributed.checkpoint, one file per rank) and
    reshard on load: a 2-process run continues on 1 process, saying that its sampling streams
    were reseeded."""
    out = tmp_path / "r"
    run(out, "distributed.nproc=2", "checkpoint.every=1", "run.steps=1")
    step1 = out / "checkpoints" / "step-000001"
    assert sorted(p.name for p in (step1 / "dcp").iterdir()) == [".metadata", "__0_0.distcp",
                                                                  "__1_0.distcp"]
    assert not (step1 / "actor.safetensors").exists()  # nothing gathered on rank 0
    result = run(out, "run.steps=2", "checkpoint.every=1", "--resume")
    assert "resumed on 1" in result.stderr and "Traceback" not in result.stderr
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(isinstance(v, (int, float)) and v == v for r in rows for v in r.values())
    assert (out / "checkpoints" / "step-000002" / "actor.safetensors").is_file()  # 1 process


def test_a_rank_that_dies_ends_the_run_with_its_error(tmp_path, harness):
    """Rank 1 fails alone (a reward plugin that raises only there): the launcher prints that
    rank's error line once, stops rank 0 instead of letting it wait, and exits 2."""
    site = tmp_path / "site"
    info = site / "rankbomb-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rankbomb\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rlpipe.rewards]\nrankbomb = rankbomb:score\n")
    (site / "rankbomb.py").write_text(
        "import os\n"
        "def score(prompts, responses, **batch):\n"
        "    if os.environ.get('RANK') == '1':\n"
        "        raise RuntimeError('rank one cannot score')\n"
        "    return [0.0] * len(prompts)\n")
    raw = yaml.safe_load(CONFIG.read_text())
    raw["models"]["actor"]["path"] = str(CONFIG.parent / "model")
    raw["data"]["prompts"] = str(CONFIG.parent / "prompts.txt")
    raw["rewards"][1] = {"name": "rankbomb"}
    config = tmp_path / "bomb.yaml"
    config.write_text(yaml.safe_dump(raw))
    start = time.monotonic()
    result = harness.run(["run", config, f"run.output_dir={tmp_path / 'r'}", *SMALL,
                          "distributed.nproc=2", "distributed.timeout_s=60"],
                         env={"PYTHONPATH": python_path(site), "RLPIPE_DEVICE": "cpu"})
    harness.error(result, "rank one cannot score")
    assert time.monotonic() - start < 200


def test_rendezvous_port_in_use_is_one_line(tmp_path, harness):
    with socket.socket() as busy:  # a port held by something that is not a rendezvous
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = harness.run(["run", CONFIG, f"run.output_dir={tmp_path / 'r'}", *SMALL,
                              "distributed.nnodes=2", f"distributed.rdzv_endpoint=127.0.0.1:{port}"],
                             timeout=300)
    harness.error(result, f"127.0.0.1:{port}")


@pytest.mark.parametrize("rank0_code, rank1_code", [(-6, -15), (-15, 2), (3, 2)])
def test_the_launcher_reports_the_rank_that_printed_an_error(tmp_path, capsys, rank0_code,
                                                             rank1_code):
    """However the workers ended (rank 0 aborted by gloo first, or stopped after rank 1 exited),
    the launcher prints rank 1's own error line once and exits 2."""
    from types import SimpleNamespace

    from rlpipe.tools.launch import _report

    log = tmp_path / "run" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("warning: something\nerror (rank 1): rewards.1 failed in forward\n")
    failures = {0: SimpleNamespace(local_rank=0, exitcode=rank0_code, timestamp=1.0),
                1: SimpleNamespace(local_rank=1, exitcode=rank1_code, timestamp=2.0)}
    assert _report(failures, tmp_path) == 2
    assert capsys.readouterr().err == "error (rank 1): rewards.1 failed in forward\n"


def test_the_launcher_keeps_a_crashing_workers_traceback(tmp_path, capsys):
    from types import SimpleNamespace

    from rlpipe.tools.launch import _report

    log = tmp_path / "run" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("Traceback (most recent call last):\nZeroDivisionError: division by zero\n")
    failures = {1: SimpleNamespace(local_rank=1, exitcode=1, timestamp=1.0),
                0: SimpleNamespace(local_rank=0, exitcode=-15, timestamp=2.0)}
    assert _report(failures, tmp_path) == 1
    err = capsys.readouterr().err
    assert "ZeroDivisionError" in err and err.endswith("error: worker rank 1 exited with status 1\n")
