"""``eval.prompts`` as a mapping name -> source: every set evaluated at each evaluation, the first
under ``eval/*`` (and ``samples/eval-step-N.jsonl``), the others under ``eval/<name>/*`` (and
``samples/eval-step-N.<name>.jsonl``). Oracle: each set's numbers equal those of a run that
evaluates that set alone, as the single-path form (greedy, same seed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpipe.core.base.errors import UserError
from rlpipe.core.config.settings import load_config
from rlpipe.core.run.pipeline import train

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
CUT = ["run.steps=1", "data.batch_size=2", "collector.max_new_tokens=4", "eval.every=1"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def sets(tmp_path):
    lines = (TINY.parent / "prompts.txt").read_text().splitlines()
    (tmp_path / "a.txt").write_text("\n".join(lines[:3]) + "\n")
    (tmp_path / "b.txt").write_text("\n".join(lines[3:5]) + "\n")
    return tmp_path / "a.txt", tmp_path / "b.txt"


def run(tmp_path, name, *overrides) -> Path:
    cfg = load_config(TINY, [*CUT, f"run.output_dir={tmp_path / name}", *overrides])
    return train(cfg, progress=False)


def test_each_set_is_evaluated_as_it_would_be_alone(tmp_path, sets):
    a, b = sets
    both = run(tmp_path, "both", f"eval.prompts.main={a}", f"eval.prompts.other={b}")
    alone = {name: rows(run(tmp_path, name, f"eval.prompts={path}"))
             for name, path in (("a", a), ("b", b))}
    for step, row in enumerate(rows(both)):
        for key in ("score", "reward/length", "response/length"):
            assert row[f"eval/{key}"] == alone["a"][step][f"eval/{key}"]
            assert row[f"eval/other/{key}"] == alone["b"][step][f"eval/{key}"]
        assert row.get("reward/score") == alone["a"][step].get("reward/score")  # training alike
    samples = sorted(p.name for p in (both / "samples").glob("eval-*"))
    assert samples == ["eval-step-0.jsonl", "eval-step-0.other.jsonl",
                       "eval-step-1.jsonl", "eval-step-1.other.jsonl"]
    assert len((both / "samples" / "eval-step-1.other.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("prompts, message", [
    ({"a/b": "x"}, "eval.prompts: a mapping needs names made of letters, digits and _"),
    ({}, "eval.prompts: a mapping needs names"),
    ({"extra": "missing.jsonl"}, "eval.prompts.extra: file not found: "),
])
def test_a_bad_mapping_is_one_line(tmp_path, prompts, message):
    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", f"eval.prompts={json.dumps(prompts)}"])
