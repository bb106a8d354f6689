"""The race against TRL (benchmarks/race_trl_grpo.py) gives TRL rlpipe's rewards and stop rule
written out in plain Python (benchmarks/vs_trl_grpo_worker.py, which runs without rlpipe): each
is checked here against rlpipe's own implementation, the oracle, on random and edge cases."""

import importlib.util
import random
from pathlib import Path

import pytest
import torch
import transformers

from rlpipe.plugins.collectors.hf import _EndTracker
from rlpipe.plugins.rewards.answer_match import answer_scores
from rlpipe.plugins.rewards.length import length_penalty
from rlpipe.plugins.rewards.loop import loop_penalty

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("vs_trl_grpo_worker",
                                              ROOT / "benchmarks" / "vs_trl_grpo_worker.py")
worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worker)


def test_answer_score_is_answer_match_without_boxed_or_hash():
    texts = ["So 4 + 3 = 7.", "7", "The answer is 1,250 apples", "-3", "x = 2.50", "none",
             "12 then 13", "3.", "1e3", ".5", "He has 9 - 4 = 5 marbles left.", ""]
    refs = [7, 7, 1250, -3, 2.5, 1, 12, 3, 1000, 0.5, 5, 0]
    expected = answer_scores(texts, refs)
    assert [worker.answer_score(t, r) for t, r in zip(texts, refs)] == expected
    assert sum(expected) == 9  # the cases cover both outcomes


@pytest.mark.parametrize("args", [dict(max_tokens=12, per_token=0.02, truncated_penalty=0.2),
                                  dict(min_tokens=4, max_tokens=6, per_token=0.5),
                                  dict(truncated_penalty=1.0)])
def test_length_penalty_is_rlpipes(args):
    lengths = list(range(0, 30))
    finished = [i % 3 != 0 for i in lengths]
    want = length_penalty(torch.tensor(lengths), torch.tensor(finished), **args).tolist()
    got = [worker.length_penalty(n, f, **args) for n, f in zip(lengths, finished)]
    # float32 (rlpipe) against float64 (here): both round the same few products of 0.02 or 0.5
    assert got == pytest.approx(want, abs=1e-6)


def test_loop_penalty_is_rlpipes():
    rng = random.Random(0)
    rows = [[1, 2, 3, 4, 5, 6], [7, 8] * 3, [5] * 4, [9, 9, 1, 2, 1, 2, 1, 2, 1], [], [3]]
    rows += [[rng.randrange(4) for _ in range(rng.randrange(1, 25))] for _ in range(200)]
    rows += [[rng.randrange(50) for _ in range(5)] + [1, 2, 3] * rng.randrange(1, 6)
             for _ in range(50)]
    for args in (dict(n=3), dict(n=2, penalty=0.5, min_repeats=2), dict(tail=False)):
        for row in rows:
            ids = torch.tensor([row or [0]])
            mask = torch.tensor([[bool(row)] * max(len(row), 1)])
            want = loop_penalty(ids, mask, **args).item()
            assert worker.loop_penalty(row, **args) == pytest.approx(want, abs=1e-6), (row, args)


def test_end_rule_is_rlpipes_collector():
    tokenizer = transformers.AutoTokenizer.from_pretrained(ROOT / "examples" / "tiny" / "model")
    stops = [".", "\n"]
    rule = worker.EndRule(tokenizer, stops)
    rng = random.Random(0)
    pool = [tokenizer.encode(t, add_special_tokens=False) for t in
            ("The", " answer", " is", " 7", ".", "\n", " 1", "2", ",", " so", "..")]
    pool = [ids for ids in pool if ids] + [[tokenizer.eos_token_id]]
    rows = [sum((rng.choice(pool) for _ in range(8)), [])[:16] for _ in range(64)]
    width = min(map(len, rows))
    rows = [r[:width] for r in rows]
    tracker = _EndTracker(1, len(rows), [tokenizer.eos_token_id], tuple(stops), tokenizer, "cpu",
                          [])
    for t in range(1, width + 1):
        tracker(torch.tensor([[0] + r[:t] for r in rows]), None)
    want = [n if n >= 0 else width for n in tracker.lengths.tolist()]
    assert [len(rule.cut(r)) for r in rows] == want
    assert [rule.ends(rule.cut(r)) for r in rows] == [n >= 0 for n in tracker.lengths.tolist()]
    assert len(set(want)) > 3  # rows end at many places, some not at all
    # eos_after_stop: a row ended by a stop string with room left gets EOS (hf.py's docstring)
    room = worker.EndRule(tokenizer, stops, eos_after_stop=True, max_new_tokens=width)
    eos = tokenizer.eos_token_id
    at_stop = [n >= 0 and r[n - 1] != eos for n, r in zip(tracker.lengths.tolist(), rows)]
    assert [room.cut(r) for r in rows] == [
        r[:n] + [eos] * (stop and n < width) for r, n, stop in zip(rows, want, at_stop)]
    assert 0 < sum(at_stop) < len(rows)
