"""Dataset columns travel with their samples through real PPO steps: a plain reward function gets
them as keyword lists, a reward module reads ``td["data", COLUMN]``; n > 1, shuffled passes,
and a 2-process gloo run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from torch import nn

from rlpipe.core.base import schema as S
from rlpipe.core.config.settings import load_config
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.contracts.reward_fn import wrap_reward_function
from rlpipe.core.step.rewards import RewardComposer
from tests.conftest import python_path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
WORDS = "the a cat dog sat ran on under mat rug big small red blue green".split()


def rows(count=6):
    """Unique prompts; each row's columns are a function of its index."""
    return [{"prompt": f"{WORDS[i]} {WORDS[-1 - i]}", "answer": i, "weight": i / 4,
             "name": f"row{i}", "tests": {"cases": [i, i + 1]}} for i in range(count)]


def test_columns_reach_a_function_and_a_module_for_every_sample(tmp_path):
    table = rows()
    by_prompt = {r["prompt"]: r for r in table}
    seen = []

    def check(prompts, responses, answer, name, **batch):
        assert isinstance(answer, list) and isinstance(name, list)
        for p, a, nm, t, w in zip(prompts, answer, name, batch["tests"], batch["weight"]):
            seen.append(p)
            assert (a, nm, t, w) == tuple(by_prompt[p][k] for k in ("answer", "name", "tests",
                                                                    "weight")), p
        assert "data" not in batch and isinstance(batch["response_mask"], torch.Tensor)
        return [0.0] * len(prompts)

    class Module(nn.Module):
        def forward(self, td):
            answer = td["data", "answer"]
            assert answer.dtype == torch.int64 and td["data", "weight"].dtype == torch.float64
            expect = [by_prompt[p]["answer"] for p in td[S.PROMPT_TEXT]]
            assert answer.tolist() == expect
            return answer.float()

    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "data.batch_size=4",
                             "collector.n=3", "train.minibatches=3", "collector.max_new_tokens=4"])
    pipe = Pipeline(cfg, progress=False, dataset=datasets.Dataset.from_list(table))
    Check = wrap_reward_function(check)
    assert Check.columns == ("answer", "name")
    pipe.plugins.rewards = RewardComposer([("check", 1.0, Check()), ("module", 1.0, Module())])
    groups = []
    for _ in range(3):  # 12 prompts: two shuffled passes over the 6 rows
        batch, _ = pipe.step()
        groups.append(batch[S.GROUP_ID].tolist())
        for i, prompt in enumerate(batch[S.PROMPT_TEXT]):
            assert batch[S.DATA, "answer"][i] == by_prompt[prompt]["answer"]
            assert batch[S.DATA, "name"][i] == by_prompt[prompt]["name"]
        assert batch[S.SCORE_PARTS, "module"].tolist() == batch[S.DATA, "answer"].float().tolist()
    assert len(seen) == 3 * 4 * 3 and sorted(set(seen)) == sorted(by_prompt)
    order = [p for p in seen[::3]]  # one per prompt: the served order
    assert order[:6] != [r["prompt"] for r in table]  # shuffled, not the file order


def test_a_column_named_like_a_batch_key_stays_nested(tmp_path):
    """A "score" column cannot overwrite the score; a function receives the column by name."""
    table = [{"prompt": r["prompt"], "score": 100 + i} for i, r in enumerate(rows(4))]
    got = []

    def read(prompts, responses, score, **batch):
        got.extend(score)
        return [1.0] * len(prompts)

    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "data.batch_size=4",
                             "collector.max_new_tokens=4"])
    pipe = Pipeline(cfg, progress=False, dataset=datasets.Dataset.from_list(table))
    pipe.plugins.rewards = RewardComposer([("read", 2.0, wrap_reward_function(read)())])
    batch, metrics = pipe.step()
    assert sorted(set(got)) == [100, 101, 102, 103]
    assert batch[S.SCORE].tolist() == [2.0] * 8 and metrics["reward/score"] == 2.0
    assert sorted(batch[S.DATA, "score"].tolist()) == sorted([100, 101, 102, 103] * 2)


SITE_REWARD = '''
import json, os

def check(prompts, responses, answer, name, **batch):
    rows = {r["prompt"]: r for r in map(json.loads, open(os.environ["ROWS_FILE"]))}
    for p, a, n in zip(prompts, answer, name):
        if (a, n) != (rows[p]["answer"], rows[p]["name"]):
            raise RuntimeError(f"rank {os.environ.get('RANK')}: {p!r} got {(a, n)}")
    with open(os.environ["SEEN_FILE"] + os.environ.get("RANK", "0"), "a") as f:
        f.write(json.dumps([prompts, answer]) + "\\n")
    return [float(a) for a in answer]
'''


def test_columns_survive_a_two_process_gloo_run(tmp_path):
    """Each rank scores its share with the right columns, the step's gather and update run with
    the nested entries, and the held-out evaluation's samples keep their rows in order."""
    site = tmp_path / "site"
    info = site / "colcheck-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: colcheck\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rlpipe.rewards]\ncolcheck = colcheck:check\n")
    (site / "colcheck.py").write_text(SITE_REWARD)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(6)))
    raw = yaml.safe_load(TINY.read_text())
    raw["models"]["actor"]["path"] = str(TINY.parent / "model")
    raw["data"] = {"prompts": str(data), "batch_size": 4}
    raw["eval"] = {"prompts": str(data), "max_prompts": 5}
    raw["rewards"] = [{"name": "colcheck"}]
    raw["collector"]["max_new_tokens"] = 4
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(site), "RLPIPE_DEVICE": "cpu",
           "ROWS_FILE": str(data), "SEEN_FILE": str(tmp_path / "seen")}
    result = subprocess.run([sys.executable, "-m", "rlpipe.cli", "run", str(config),
                             f"run.output_dir={out}", "run.steps=2", "distributed.nproc=2",
                             "--no-progress"], env=env, capture_output=True, text=True,
                            timeout=400, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = {rank: [json.loads(x) for x in (tmp_path / f"seen{rank}").read_text().splitlines()]
            for rank in (0, 1)}
    assert all(seen[0]) and all(seen[1])  # both ranks scored samples with columns
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    train_answers = [a for calls in seen.values() for _, answers in calls for a in answers]
    assert len(train_answers) > 2 * 4 * 2  # training calls and eval calls, on both ranks
    samples = [json.loads(x) for x in (out / "samples" / "eval-step-2.jsonl").read_text().splitlines()]
    assert [s["row"] for s in samples] == [0, 1, 2, 3, 4]
    assert [s["data"]["answer"] for s in samples] == [0, 1, 2, 3, 4]
    assert [s["score"] for s in samples] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert metrics[2]["eval/score"] == pytest.approx(2.0)


def _gather_worker(rank, store):
    import torch.distributed as dist
    from tensordict import NonTensorStack, TensorDict

    from rlpipe.core.models.distributed import Dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        n, width = (3, 2) if rank == 0 else (2, 4)  # different batch and response widths
        td = TensorDict({S.PROMPT_IDS: torch.ones(n, 2, dtype=torch.long),
                         S.PROMPT_MASK: torch.ones(n, 2, dtype=torch.bool),
                         S.RESPONSE_IDS: torch.ones(n, width, dtype=torch.long),
                         S.GROUP_ID: torch.arange(n),
                         (S.DATA, "answer"): torch.arange(n) + 10 * rank,
                         (S.DATA, "weight"): torch.arange(n, dtype=torch.float64) / 4 + rank},
                        batch_size=[n])
        td[S.DATA, "name"] = NonTensorStack(*(f"r{rank}-{i}" for i in range(n)))
        td[S.PROMPT_TEXT] = NonTensorStack(*(f"p{rank}{i}" for i in range(n)))
        td[S.DATA, "tests"] = NonTensorStack(*({"case": [rank, i]} for i in range(n)))
        out = Dist(rank, 2).gather(td)
        assert out[S.DATA, "answer"].tolist() == [0, 1, 2, 10, 11]
        assert out[S.DATA, "weight"].tolist() == [0.0, 0.25, 0.5, 1.0, 1.25]
        assert list(out[S.DATA, "name"]) == ["r0-0", "r0-1", "r0-2", "r1-0", "r1-1"]
        assert list(out[S.DATA, "tests"]) == [{"case": [0, 0]}, {"case": [0, 1]},
                                              {"case": [0, 2]}, {"case": [1, 0]},
                                              {"case": [1, 1]}]
        assert out[S.GROUP_ID].tolist() == [0, 1, 2, 3, 4]
        assert list(out[S.PROMPT_TEXT]) == ["p00", "p01", "p02", "p10", "p11"]  # texts too
    finally:
        dist.destroy_process_group()


def test_the_rollout_gather_keeps_columns_in_rank_order(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_gather_worker, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def test_a_missing_column_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """Every column check (a configured reward's, a Python function's, the held-out data's) runs
    on the data as read, before any model or run directory exists; `rlpipe config` catches it."""
    from click.testing import CliRunner

    from rlpipe.cli import main
    from rlpipe.core.base.errors import UserError
    from rlpipe.core.run import build

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the column check")

    monkeypatch.setattr(build, "load_tokenizer", no_model)
    monkeypatch.setattr(build, "load_causal_lm", no_model)
    data, held_out = tmp_path / "rows.jsonl", tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(4)))
    held_out.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows(2)))
    out = tmp_path / "run"
    base = [f"run.output_dir={out}", f"data.prompts={data}", "data.batch_size=4"]
    match = "columns: answer, weight, name, tests"
    cfg = load_config(TINY, [*base, "rewards=[{name: answer_match, column: solution}]"])
    with pytest.raises(UserError, match=rf"^reward 'answer_match' reads column 'solution', which "
                                        rf"data.prompts does not have; {match}$"):
        Pipeline(cfg, progress=False)

    def solved(prompts, responses, solution, **batch):
        return [0.0] * len(prompts)

    with pytest.raises(UserError, match=r"^reward 'solved' reads column 'solution'"):
        Pipeline(load_config(TINY, base), progress=False, rewards=[solved])
    cfg = load_config(TINY, [*base, "rewards=[{name: answer_match, column: answer}]",
                             f"eval.prompts={held_out}"])
    with pytest.raises(UserError, match=r"^reward 'answer_match' reads column 'answer', which "
                                        r"eval.prompts does not have; columns: none$"):
        Pipeline(cfg, progress=False)
    assert not out.exists()
    result = CliRunner().invoke(main, ["config", str(TINY), *base,
                                       "rewards=[{name: answer_match, column: solution}]"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert result.stderr.startswith("error: reward 'answer_match' reads column 'solution'")


def test_unusable_labels_are_refused_before_any_model_loads(tmp_path, monkeypatch):
    """Issue 54: rows without an answer, NaN answers and dict answers would score 0 like wrong
    answers; answer_match's contract declares a check of its labels, run on the data as read."""
    from rlpipe.core.base.errors import UserError
    from rlpipe.core.run import build

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the label check")

    monkeypatch.setattr(build, "load_tokenizer", no_model)
    monkeypatch.setattr(build, "load_causal_lm", no_model)
    data = tmp_path / "rows.jsonl"
    answers = [4, float("nan"), {"value": 4}, None]
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": a}) + "\n"
                            for i, a in enumerate(answers)))
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", f"data.prompts={data}",
                             "data.batch_size=4", "rewards=[{name: answer_match, column: answer}]"])
    with pytest.raises(UserError, match=r"3 of 4 rows have no usable reference answer"):
        Pipeline(cfg, progress=False)
    assert not (tmp_path / "run").exists()
