"""What a run shows: the batch statistics of `core/observe/samples.py` against plain float64 loops, the
sample files, the gradient norms before clipping, the terminal (bar postfix, one line per step
off a terminal, status lines, library bars silenced) and the final summary."""

import json
import math

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlpipe.core.observe import console
from rlpipe.core.base import schema as S
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.observe.samples import (first_vs_last, sample_files, sample_rows, step_stats,
                                         write_samples)

from tests.conftest import TEST_DEVICE
from tests.test_trainer import rows, tiny


def random_batch(seed=0, b=7, r=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, r + 1, (b,), generator=g)
    lengths[0] = r  # one response at the budget
    mask = torch.arange(r) < lengths[:, None]
    parts = TensorDict({"length": torch.randn(b, generator=g), "loop": torch.randn(b, generator=g)},
                       batch_size=[b])
    finished = torch.rand(b, generator=g) < 0.5
    finished[0] = False
    td = TensorDict({S.RESPONSE_MASK: mask, S.SCORE: torch.randn(b, generator=g),
                     S.SCORE_PARTS: parts, S.FINISHED: finished,
                     S.VALUE: torch.randn(b, r, generator=g) * mask,
                     S.VALUE_TARGET: torch.randn(b, r, generator=g) * mask}, batch_size=[b])
    kl_tok = torch.randn(b, r, generator=g) * mask
    return td, kl_tok


def test_step_stats_match_a_float64_loop():
    td, kl_tok = random_batch()
    stats = step_stats(td, kl_tok, max_new_tokens=6, has_critic=True)
    b, r = td[S.RESPONSE_MASK].shape
    lengths = [sum(bool(td[S.RESPONSE_MASK][i, t]) for t in range(r)) for i in range(b)]
    for name, values in [("reward/score", td[S.SCORE].tolist()),
                         ("reward/length", td[S.SCORE_PARTS, "length"].tolist()),
                         ("reward/loop", td[S.SCORE_PARTS, "loop"].tolist())]:
        mean = sum(values) / b
        assert stats[f"{name}/std"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values) / b))
        assert stats[f"{name}/min"] == pytest.approx(min(values))
        assert stats[f"{name}/max"] == pytest.approx(max(values))
    assert stats["response/length_max"] == max(lengths)
    assert stats["response/length_p90"] == pytest.approx(np.percentile(lengths, 90))
    cut = [lengths[i] >= 6 and not bool(td[S.FINISHED][i]) for i in range(b)]
    assert stats["response/clipped_frac"] == pytest.approx(sum(cut) / b) and sum(cut) >= 1
    seq_kl = [sum(float(kl_tok[i, t]) for t in range(lengths[i])) for i in range(b)]
    assert stats["kl/ref_max"] == pytest.approx(max(seq_kl), abs=1e-6)
    valid = [(i, t) for i in range(b) for t in range(lengths[i])]
    for key, name in ((S.VALUE, "value/mean"), (S.VALUE_TARGET, "returns/mean")):
        want = sum(float(td[key][i, t]) for i, t in valid) / len(valid)
        assert stats[name] == pytest.approx(want, abs=1e-6)
    no_critic = step_stats(td, kl_tok, max_new_tokens=0, has_critic=False)
    assert "value/mean" not in no_critic and "returns/mean" not in no_critic
    # without a known budget, "clipped" is "not finished"
    assert no_critic["response/clipped_frac"] == pytest.approx(1 - td[S.FINISHED].double().mean().item())


def test_sample_rows_are_evenly_spaced_and_json_ready():
    td, kl_tok = random_batch(b=9)
    td[S.PROMPT_TEXT] = [f"p{i}" for i in range(9)]
    td[S.RESPONSE_TEXT] = [f"r{i}" for i in range(9)]
    picked = sample_rows(td, kl_tok, 3)
    assert [row["index"] for row in picked] == [0, 4, 8]
    row = json.loads(json.dumps(picked[1]))
    assert row["prompt"] == "p4" and row["response"] == "r4"
    assert row["score"] == pytest.approx(float(td[S.SCORE][4]))
    assert row["rewards"]["loop"] == pytest.approx(float(td[S.SCORE_PARTS, "loop"][4]))
    assert row["length"] == int(td[S.RESPONSE_MASK][4].sum())
    assert row["kl"] == pytest.approx(float(kl_tok[4].sum()))
    assert "conversation" not in row and "stop_reason" not in row  # single-turn: unchanged


def multi_turn_batch():
    """Two conversations as `MultiTurn` writes them: a tool call answered, then a final answer."""
    td, kl_tok = random_batch(b=2, r=6)
    td[S.PROMPT_TEXT], td[S.RESPONSE_TEXT] = ["2+3?", "2+3?"], ["5", "five"]
    td[S.ACTION_MASK] = td[S.RESPONSE_MASK] & (torch.arange(6) % 3 != 1)
    td[S.NUM_TURNS], td[S.STOP_REASON] = torch.tensor([2, 1]), torch.tensor([0, 4])
    td["env"] = TensorDict({"tool_calls": torch.tensor([1, 1]), "tool_errors": torch.tensor([0, 1]),
                            "timeouts": torch.tensor([0, 1]), "receipt": torch.tensor([0, 2])},
                           batch_size=[2])
    talk = [{"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "<tool_call>add|2|3</tool_call>"},
            {"role": "tool", "name": "add", "content": "5"}]
    td[S.CONVERSATION] = NonTensorStack(talk + [{"role": "assistant", "content": "5"}], talk[:2])
    td["env", "error"] = NonTensorStack("", "environment: step timed out")
    return td, kl_tok


def test_a_multi_turn_sample_holds_its_conversation():
    td, kl_tok = multi_turn_batch()
    first, second = (json.loads(json.dumps(r)) for r in sample_rows(td, kl_tok, 2))
    assert first["conversation"] == list(td[S.CONVERSATION][0]) and first["turns"] == 2
    assert first["stop_reason"] == "done" and first["receipt"] == "exact" and "error" not in first
    assert first["action_tokens"] == int(td[S.ACTION_MASK][0].sum()) <= first["length"]
    assert second["stop_reason"] == "timeout" and second["receipt"] == "boundary_drift"
    assert second["env"] == {"tool_calls": 1, "tool_errors": 1, "timeouts": 1}
    assert second["error"] == "environment: step timed out"


def test_samples_md_shows_each_message_on_its_own_line(tmp_path):
    td, kl_tok = multi_turn_batch()
    for step in (1, 2):
        write_samples(tmp_path, step, sample_rows(td, kl_tok, 2))
    page = first_vs_last(tmp_path)
    lines = page.splitlines()
    assert "### Conversations, step 1" in lines and "### Conversations, step 2" in lines
    at = lines.index("### Conversations, step 2")
    block = lines[at + 2:at + 8]
    assert block[0].startswith("**#1** · 2 turns · stop `done` · receipt `exact` · score ")
    assert block[2:] == ["- **user:** 2+3?",
                         "- **assistant, turn 1:** <tool_call>add\\|2\\|3</tool_call>",
                         "- ⟶ **tool result** (add): 5", "- **assistant, turn 2:** 5"]
    assert "receipt `boundary_drift`" in page and "- ⚠ environment error: environment: step " \
        "timed out" in page


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """2 steps, samples of every step (3 each), a checkpoint each step; stderr captured."""
    out = tmp_path_factory.mktemp("obs") / "run"
    pipe = Pipeline(tiny(out, "log.samples=3", "checkpoint.every=1"), progress=False)
    pipe.train()
    return out


def test_sample_files_of_a_run(tiny_run):
    files = sample_files(tiny_run)
    assert [step for step, _ in files] == [1, 2]
    metrics = rows(tiny_run)
    for step, path in files:
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        assert len(lines) == 3 and all(x["step"] == step for x in lines)
        assert set(lines[0]) == {"step", "index", "prompt", "response", "score", "rewards",
                                 "length", "finished", "kl"}
        assert set(lines[0]["rewards"]) == {"length", "loop"}
        assert all(isinstance(x["prompt"], str) and x["prompt"] for x in lines)
        assert all(0 <= x["length"] <= 24 for x in lines)
        row = metrics[step - 1]
        assert all(row["reward/score/min"] - 1e-6 <= x["score"] <= row["reward/score/max"] + 1e-6
                   for x in lines)
        assert all(x["kl"] <= row["kl/ref_max"] + 1e-5 for x in lines)


def test_samples_every_and_off(tmp_path):
    Pipeline(tiny(tmp_path / "a", "log.samples_every=2", "run.steps=2", "train.epochs=1"),
             progress=False).train()
    assert [s for s, _ in sample_files(tmp_path / "a")] == [2]
    Pipeline(tiny(tmp_path / "b", "log.samples_every=0", "run.steps=1", "train.epochs=1"),
             progress=False).train()
    assert not (tmp_path / "b" / "samples").exists()


def test_new_metrics_in_every_row(tiny_run):
    for row in rows(tiny_run):
        for key in ("train/grad_norm", "train/critic_grad_norm", "reward/length/std",
                    "reward/loop/max", "response/length_max", "response/length_p90",
                    "response/clipped_frac", "kl/ref_max", "value/mean", "returns/mean",
                    "time/score_s"):
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), key
        assert row["response/length_p90"] <= row["response/length_max"] <= 24
        assert 0 < row["time/score_s"] < row["time/step_s"]


def grad_norm_at_step(opt) -> list:
    """Record the float64 norm of the gradients ``opt`` is about to apply, at each step."""
    seen = []

    def record(opt, args, kwargs):
        grads = [p.grad.double() for g in opt.param_groups for p in g["params"] if p.grad is not None]
        seen.append(math.sqrt(sum(float((x * x).sum()) for x in grads)))

    opt.register_step_pre_hook(record)
    return seen


@pytest.mark.parametrize("clip", ["null", "0.001"])
def test_grad_norms_are_taken_before_clipping(tmp_path, clip):
    pipe = Pipeline(tiny(tmp_path, "run.steps=1", "train.epochs=1",
                         f"train.max_grad_norm={clip}"), progress=False)
    seen = {name: grad_norm_at_step(opt) for name, opt in pipe.updater.opts.items()}
    _, metrics = pipe.step()
    assert len(seen["actor"]) == len(seen["critic"]) == 2
    for name, key in (("actor", "train/grad_norm"), ("critic", "train/critic_grad_norm")):
        if clip == "null":  # nothing clipped: the applied gradient has the logged norm
            assert metrics[key] == pytest.approx(sum(seen[name]) / 2, rel=1e-4)
        else:               # clipped to 0.001, the logged norm is the one before
            assert seen[name] == pytest.approx([0.001, 0.001], rel=1e-3)
            assert metrics[key] > 0.01


def test_critic_warmup_logs_no_actor_grad_norm(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "run.steps=1", "train.epochs=1",
                         "train.critic_warmup_steps=1"), progress=False)
    _, metrics = pipe.step()
    assert "train/grad_norm" not in metrics and metrics["train/critic_grad_norm"] > 0


# ---- the terminal ----------------------------------------------------------------------------

METRICS = {"step": 3, "reward/score": -0.4213, "kl/ref": 0.01312, "policy/clipfrac": 0.081,
           "response/length": 11.25, "perf/tokens_per_s": 85.3, "time/step_s": 3.14}


def test_postfix_names_are_readable_and_fit_the_width():
    wide = console.postfix(METRICS, width=160)
    assert wide == "reward=-0.421 kl=0.0131 clip=0.081 len=11.2 tok/s=85.3"
    for width in (60, 80, 100):
        text = console.postfix(METRICS, width)
        line = f"rlpipe 100/100 |{'#' * console.MIN_BAR}| 00:00<00:00 {text}"
        assert len(line) <= width, (width, line)
        assert text.startswith("reward=")  # the most watched number survives at 80 columns


@pytest.mark.parametrize("width", [80, 120])
def test_bar_keeps_its_bar_and_fits(width):
    from tqdm import tqdm

    bar = tqdm(total=10, initial=3, ncols=width, bar_format=console.BAR_FORMAT, desc="rlpipe",
               disable=False, file=open("/dev/null", "w"))
    bar.set_postfix_str(" " + console.postfix(METRICS, width), refresh=False)
    line = str(bar)
    bar.close()
    assert len(line) <= width and "reward=-0.421" in line, line
    assert line.count("|") == 2 and len(line.split("|")[1]) >= console.MIN_BAR, line


def test_one_line_per_step_when_not_a_terminal(tmp_path, capfd):
    from rlpipe.core.observe.metrics import MetricsWriter

    with MetricsWriter(tmp_path / "metrics.jsonl", 2, progress=True) as w:  # stderr is no tty here
        w.write(METRICS)
        w.write({**METRICS, "step": 4})
    err = capfd.readouterr().err
    assert err.splitlines() == [
        "step 3/2  reward -0.421  kl 0.0131  clip 0.081  len 11.2  tok/s 85.3  3.1 s/step",
        "step 4/2  reward -0.421  kl 0.0131  clip 0.081  len 11.2  tok/s 85.3  3.1 s/step"]
    assert "\r" not in err


def test_library_bars_are_off_inside_and_restored_after():
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    with console.quiet_libraries():
        assert not hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()


def test_status_lines_and_final_summary(tmp_path, capfd):
    from click.testing import CliRunner

    from rlpipe.cli import main
    from tests.test_trainer import TINY

    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", str(TINY), f"run.output_dir={out}", "run.steps=1",
                                       "train.epochs=1", "checkpoint.every=1"])
    assert result.exit_code == 0, (result.output, result.exception)
    err = result.stderr
    for phase in ("loading models from", "actor ", "critic ", "reference ", "building plugins",
                  "data: 200 prompts"):
        assert f"rlpipe: {phase}" in err, (phase, err)
    assert f"params, float32, {TEST_DEVICE}" in err
    assert "step 1/1  reward " in err
    assert "Writing model shards" not in err and "Loading weights" not in err  # transformers' bars
    summary = result.stdout.splitlines()
    assert summary[0] == f"run finished: {out}"
    for label, path in (("metrics", out / "metrics.jsonl"), ("samples", out / "samples"),
                        ("checkpoint", out / "checkpoints" / "step-000001"),
                        ("policy", out / "final")):
        assert any(line.split()[:2] == [label, str(path)] for line in summary), (label, summary)
    assert any(f"rlpipe report {out}" in line for line in summary)


# ---- samples in the TensorBoard and W&B sinks (faked: these tests run without either) -------

ROWS = [{"prompt": "a | b", "response": "c", "score": 0.5, "rewards": {}, "length": 3,
         "finished": True, "kl": 0.01}]


def test_samples_go_to_tensorboard_as_text(tmp_path, monkeypatch):
    import sys
    import types

    texts = []

    class Writer:
        def __init__(self, log_dir):
            pass

        def add_text(self, tag, text, step):
            texts.append((tag, text, step))

        def add_scalar(self, *a):
            pass

        def flush(self):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=Writer))
    from rlpipe.core.observe.metrics import MetricsWriter

    with MetricsWriter(tmp_path / "metrics.jsonl", 1, progress=False, tensorboard=True) as w:
        w.log_samples(ROWS, 5)
    (tag, text, step), = texts
    assert tag == "samples" and step == 5
    assert text.splitlines()[2] == "| a \\| b | c | 0.5 | 3 | True | 0.01 |"


def test_samples_go_to_wandb_as_a_table(tmp_path, monkeypatch):
    import sys
    import types

    logged = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    run = types.SimpleNamespace(log=lambda data, step: logged.append((data, step)),
                                finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **k: run, Table=Table))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    from rlpipe.core.observe.metrics import MetricsWriter

    with MetricsWriter(tmp_path / "metrics.jsonl", 1, progress=False, wandb=True) as w:
        w.log_samples(ROWS, 2)
    (data, step), = logged
    table = data["samples"]
    assert step == 2 and table.columns == ["prompt", "response", "score", "length", "finished", "kl"]
    assert table.data == [["a | b", "c", 0.5, 3, True, 0.01]]
