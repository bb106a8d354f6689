"""Issue 54: bad inputs refused instead of trained on. Labels (missing, NaN, dict answers) with
``answer_match``; chat messages stored as JSON text in a CSV column; ``kl.coef: 0`` with
``kl.target``; identical samples in a group said at step 1; ``rlpipe report`` labels of runs
whose folder names and parents are equal. Each runs the case on the tiny example and checks
the exit code, the one line and the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlpipe.core.observe.health.groups import identical_frac
from rlpipe.plugins.rewards.answer_match import AnswerMatch
from rlpipe.tools.compare import compare_summary

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
FAST = ["run.steps=1", "data.batch_size=4", "collector.max_new_tokens=6", "train.epochs=1",
        "train.minibatches=1", "log.progress=false", "data.shuffle=false"]


def answers_file(tmp_path: Path, answers: list) -> Path:
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": f"{i} + 1 =", **({} if a is ... else {"answer": a})}
            for i, a in enumerate(answers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("bad, why", [
    (..., "missing (None)"),          # the key absent from the row
    (None, "missing (None)"),
    (float("nan"), "NaN"),            # a number column (below): NaN stays a float
    ({"value": 4}, "a dict {'value': 4}"),
    ("  ", "empty"),
])
def test_a_label_answer_match_cannot_use_is_one_line(bad, why, tmp_path, harness):
    data = answers_file(tmp_path, [1, bad, 3, 4] if isinstance(bad, float) else ["1", bad, "3", "4"])
    result = harness.run(["run", TINY, f"run.output_dir={tmp_path / 'run'}", *FAST,
                          f"data.prompts={data}", "rewards=[{name: answer_match}]"])
    # at step 1 (the batch's rows); with the plan's hook, before any model loads (the data's)
    harness.error(result, "answer_match: column 'answer' of ", "rows have no usable reference "
                  "answer", f": {why}")
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or \
        not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_good_labels_pass_the_check():
    AnswerMatch.check_column(["7", 7, 2.5, "#### 12", True])


def test_chat_messages_as_json_text_in_a_csv_column_are_one_line(tmp_path, harness):
    messages = json.dumps([{"role": "user", "content": "2 + 2 ="}])
    data = tmp_path / "chat.csv"
    data.write_text("prompt\n" + "".join('"' + messages.replace('"', '""') + '"\n'
                                         for _ in range(4)))
    result = harness.run(["run", TINY, f"run.output_dir={tmp_path / 'run'}", *FAST,
                          f"data.prompts={data}"])
    harness.error(result, "data.prompts: row 1: 'prompt' is chat messages written as JSON text",
                  "store the data as .jsonl, .json or .parquet")


def test_kl_target_with_coef_0_is_one_line(tmp_path, harness):
    result = harness.run(["run", TINY, f"run.output_dir={tmp_path / 'run'}", *FAST,
                          "kl.coef=0", "kl.target=0.1"])
    harness.error(result, "kl.coef: 0 with kl.target: 0.1: the adaptive controller multiplies "
                          "the coefficient, so it would stay 0")


def test_identical_frac_against_a_python_loop():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(1, 3, (8, 3), generator=gen)
        mask = torch.arange(3) < torch.randint(1, 4, (8, 1), generator=gen)  # right-padded
        group = torch.randint(0, 3, (8,), generator=gen)
        texts = [tuple(i for i, m in zip(r.tolist(), k.tolist()) if m) for r, k in zip(ids, mask)]
        groups = {}
        for g, t in zip(group.tolist(), texts):
            groups.setdefault(g, []).append(t)
        several = [v for v in groups.values() if len(v) >= 2]
        expected = {} if not several else {
            "response/identical_frac": sum(len(set(v)) == 1 for v in several) / len(several)}
        assert identical_frac(ids, mask, group) == expected


def test_identical_samples_are_flat_and_said_at_step_1(tmp_path, harness):
    run_dir = tmp_path / "run"
    result = harness.run(["run", TINY, f"run.output_dir={run_dir}", *FAST, "advantage.name=grpo",
                          "collector.temperature=0"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "health: flat_groups at step 1: response/identical_frac 1 at step 1 > 0.5" \
        in result.stderr
    row = json.loads((run_dir / "metrics.jsonl").read_text())
    assert row["reward/zero_std_frac"] == 1.0 and row["health/flat_groups"] == 1


def test_report_labels_runs_by_the_shortest_part_of_their_paths_that_differs(tmp_path):
    runs = [tmp_path / "one" / "seed" / "run", tmp_path / "two" / "seed" / "run"]
    for run in runs:
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/score": 0.5}) + "\n")
    names = [line.split()[0] for line in compare_summary(runs).splitlines()[1:]]
    assert names == ["one/seed/run", "two/seed/run"]
