"""core/step/evaluation.py: held-out evaluation at step 0, every k steps and the last step, its
samples files, and training metrics identical with and without it."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlpipe.core.config.settings import load_config
from rlpipe.core.step.evaluation import Evaluator
from rlpipe.core.observe.metrics import keep_steps
from rlpipe.core.run.pipeline import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
WORDS = "the a cat dog sat ran on under mat rug big small red blue green".split()
COMMON = ["run.steps=3", "data.batch_size=4", "collector.max_new_tokens=6", "reward.normalize=true"]


def read(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 3-step run of the tiny example without and with evaluation (every 2 steps,
    sampled at temperature 0.7: evaluation then draws random numbers of its own)."""
    root = tmp_path_factory.mktemp("eval")
    data = root / "held_out.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{w} {v}", "answer": i}) + "\n"
                            for i, (w, v) in enumerate(zip(WORDS, WORDS[::-1]))))
    plain = train(load_config(TINY, [*COMMON, f"run.output_dir={root / 'plain'}"]),
                  progress=False)
    evaluated = train(load_config(TINY, [*COMMON, f"run.output_dir={root / 'eval'}",
                                         f"eval.prompts={data}", "eval.every=2",
                                         "eval.max_prompts=5", "eval.temperature=0.7",
                                         "eval.batch_size=2"]), progress=False)
    return plain, evaluated


def test_evaluation_runs_at_step_zero_every_k_and_the_last_step(runs):
    _, run_dir = runs
    rows = read(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    with_eval = [r["step"] for r in rows if "eval/score" in r]
    assert with_eval == [0, 2, 3]
    assert set(rows[0]) == {"step", "eval/score", "eval/reward/length", "eval/reward/loop",
                            "eval/response/length", "time/eval_s"}
    files = sorted(p.name for p in (run_dir / "samples").glob("eval-step-*"))  # besides step-N
    assert files == ["eval-step-0.jsonl", "eval-step-2.jsonl", "eval-step-3.jsonl"]
    for row in rows:
        if "eval/score" not in row:
            continue
        samples = read(run_dir / "samples" / f"eval-step-{row['step']}.jsonl")
        assert [s["row"] for s in samples] == [0, 1, 2, 3, 4]  # eval.max_prompts, in order
        assert [s["data"]["answer"] for s in samples] == [0, 1, 2, 3, 4]
        assert samples[1]["prompt"] == f"{WORDS[1]} {WORDS[-2]}"
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        assert row["eval/score"] == pytest.approx(mean([s["score"] for s in samples]))
        for label in ("length", "loop"):
            assert row[f"eval/reward/{label}"] == pytest.approx(
                mean([s["rewards"][label] for s in samples]))
        # the score is the weighted sum of the parts (weights 1): never normalised
        for s in samples:
            assert s["score"] == pytest.approx(s["rewards"]["length"] + s["rewards"]["loop"])


def test_evaluation_does_not_change_training(runs):
    plain, evaluated = runs

    def training(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "eval/"))}
                for r in rows if r["step"] > 0]

    assert training(read(evaluated / "metrics.jsonl")) == training(read(plain / "metrics.jsonl"))
    a, b = load_file(str(plain / "final" / "model.safetensors")), \
        load_file(str(evaluated / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_keeps_the_step_zero_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2, 3)))
    keep_steps(path, 2)
    assert [r["step"] for r in read(path)] == [0, 1, 2]


def test_due_steps():
    assert [s for s in range(8) if Evaluator.due(0, s, 7)] == [0, 7]
    assert [s for s in range(8) if Evaluator.due(3, s, 7)] == [0, 3, 6, 7]


class _Engine:
    """A collector stand-in with an engine of its own (what `vllm` is to evaluation)."""

    temperature, n = 1.0, 4

    def __init__(self, fail: bool = False):
        self.views, self.fail = [], fail

    def collect(self, prompts): ...

    def sync_weights(self, model): ...

    def sampling_view(self, temperature, n):
        if self.fail:
            raise RuntimeError("engine gone")
        self.views.append((temperature, n))
        return ("view", temperature, n)


def test_evaluation_samples_from_a_declared_sampling_view(tmp_path):
    """A collector that offers `sampling_view` is asked for one at eval.temperature and n 1;
    no second collector is built from the config. One that fails to give it is one line."""
    from rlpipe.core.step.evaluation import eval_collector
    from rlpipe.core.contracts.registry import PluginError

    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "eval.temperature=0.3"])
    training = _Engine()
    assert eval_collector(cfg, None, training) == (("view", 0.3, 1), False)  # core syncs it
    assert training.views == [(0.3, 1)]
    with pytest.raises(PluginError, match="sampling_view.*engine gone"):
        eval_collector(cfg, None, _Engine(fail=True))
