"""FSDP2 on CPU with gloo: 1 and 2 processes give the same update; a 2-process run resumes exactly.

The rollout comes from a deterministic collector plugin (installed as a fake distribution), so the
runs differ only in how the update is distributed.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]

FIXED_COLLECTOR = '''
import zlib
import torch
from tensordict import TensorDict
from rlpipe.core import schema as S


class FixedCollector:
    """Deterministic responses: a function of the prompt only (for exact cross-run comparisons)."""

    def __init__(self, ctx, *, max_new_tokens: int = 12):
        self.tokenizer, self.device = ctx.tokenizer, ctx.device
        self.max_new_tokens, self.temperature = max_new_tokens, 1.0

    def collect(self, prompts):
        rows = []
        for p in prompts:
            seed = zlib.crc32(p.encode())
            ids = self.tokenizer(p, add_special_tokens=False)["input_ids"][-8:] or [5]
            n = 1 + seed % self.max_new_tokens
            resp = [(seed >> k) % 300 + 10 for k in range(n)]
            rows.append((ids, resp, seed % 3 == 0))
        P = max(len(r[0]) for r in rows)
        R = max(len(r[1]) for r in rows)
        pid = torch.zeros(len(rows), P, dtype=torch.long)
        pm = torch.zeros(len(rows), P, dtype=torch.bool)
        rid = torch.zeros(len(rows), R, dtype=torch.long)
        rm = torch.zeros(len(rows), R, dtype=torch.bool)
        for i, (ids, resp, _) in enumerate(rows):
            pid[i, P - len(ids):], pm[i, P - len(ids):] = torch.tensor(ids), True
            rid[i, :len(resp)], rm[i, :len(resp)] = torch.tensor(resp), True
        td = TensorDict({S.PROMPT_IDS: pid, S.PROMPT_MASK: pm, S.RESPONSE_IDS: rid,
                         S.RESPONSE_MASK: rm, S.GROUP_ID: torch.arange(len(rows)),
                         S.FINISHED: torch.tensor([r[2] for r in rows])}, batch_size=[len(rows)])
        td[S.PROMPT_TEXT] = list(prompts)
        td[S.RESPONSE_TEXT] = ["x" * len(r[1]) for r in rows]
        return td.to(self.device)

    def sync_weights(self, model):
        pass
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    info = site / "fixedcollector-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fixedcollector\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rlpipe.collectors]\nfixed = fixedcollector:FixedCollector\n")
    (site / "fixedcollector.py").write_text(textwrap.dedent(FIXED_COLLECTOR))
    return site


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(site, tmp_path, name, *overrides, flags=()):
    raw = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    raw["models"]["actor"]["path"] = str(ROOT / "examples" / "tiny" / "model")
    raw["data"]["prompts"] = str(ROOT / "examples" / "tiny" / "prompts.txt")
    raw["collector"] = {"name": "fixed"}
    raw["run"].update(output_dir=str(tmp_path / name), steps=2)
    raw["train"].update(epochs=2, minibatches=2, lr=0.003, critic_lr=0.003)
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": str(site), "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rlpipe.cli", "run", str(config), "--no-progress", *flags, *overrides]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return tmp_path / name


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir):
    return load_file(str(run_dir / "final" / "model.safetensors"))


GRAD_CKPT = ["models.actor.gradient_checkpointing=true", "models.critic.gradient_checkpointing=true"]


@pytest.mark.parametrize("sharded_extra", [[], GRAD_CKPT], ids=["plain", "checkpointed-blocks"])
def test_one_and_two_processes_give_the_same_update(site, tmp_path, sharded_extra):
    """Also with activation checkpointing of the FSDP-wrapped blocks on the 2-process side."""
    one = run(site, tmp_path, "one")
    two = run(site, tmp_path, "two", "distributed.nproc=2", *sharded_extra)
    m1, m2 = metrics(one), metrics(two)
    assert len(m1) == len(m2) == 2  # rank 0 alone writes metrics.jsonl
    for a, b in zip(m1, m2):
        for key in ("reward/score", "kl/ref", "loss/objective", "loss/critic", "policy/loss",
                    "policy/clipfrac", "policy/approx_kl", "value/loss", "response/length"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    w1, w2 = weights(one), weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-4), k


def test_two_process_checkpoint_resumes_identically(site, tmp_path):
    common = ["distributed.nproc=2", "checkpoint.every=1"]
    full = run(site, tmp_path, "full", *common, "run.steps=3")
    run(site, tmp_path, "cut", *common, "run.steps=2")
    run(site, tmp_path, "cut", *common, "run.steps=3", flags=["--resume"])
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
                          for r in rows]
    assert strip(metrics(tmp_path / "cut")) == strip(metrics(full))
    w_full, w_cut = weights(full), weights(tmp_path / "cut")
    assert all(torch.equal(w_full[k], w_cut[k]) for k in w_full)
