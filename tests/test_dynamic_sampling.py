"""DAPO dynamic sampling (``data.dynamic_sampling``): flat groups are dropped and never reach the
update, the batch is full, the cap on extra rounds holds; against plain-Python group loops."""

import json
import zlib
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.core.config.settings import load_config
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.step.dynamic_sampling import GroupFilter
from rlpipe.core.step.update import Updater

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"


def scored_round(scores, group_ids, width_r, width_p=3, seed=0):
    """A float64 round: ragged widths, so that concatenation has to pad."""
    g = torch.Generator().manual_seed(seed)
    n = len(scores)
    return TensorDict({
        S.SCORE: torch.tensor(scores, dtype=torch.float64),
        S.GROUP_ID: torch.tensor(group_ids),
        S.PROMPT_IDS: torch.randint(1, 50, (n, width_p), generator=g),
        S.PROMPT_MASK: torch.ones(n, width_p, dtype=torch.bool),
        S.RESPONSE_IDS: torch.randint(1, 50, (n, width_r), generator=g),
        S.RESPONSE_MASK: torch.ones(n, width_r, dtype=torch.bool),
        S.OLD_LOG_PROB: torch.randn(n, width_r, dtype=torch.float64, generator=g),
    }, batch_size=[n])


def flat_by_loop(scores, group_ids, tol=1e-6):
    """The groups (of two or more) whose scores are all within ``tol``, by a plain loop."""
    groups = {}
    for s, gid in zip(scores, group_ids):
        groups.setdefault(gid, []).append(s)
    return {gid for gid, ss in groups.items() if len(ss) >= 2 and max(ss) - min(ss) <= tol}


def test_kept_samples_are_exactly_the_informative_groups_in_collection_order():
    g = torch.Generator().manual_seed(1)
    rounds, expected = [], []   # expected: the (round, group) keys of kept samples, in order
    for r in range(3):
        ids = torch.randperm(12, generator=g).remainder(4).tolist()   # 4 groups of 3, shuffled
        scores = [float(torch.randint(0, 2, (), generator=g)) + 1e-9 * i for i, _ in enumerate(ids)]
        rounds.append(scored_round(scores, ids, width_r=4 + 2 * r, width_p=5 - r, seed=r))
        flat = flat_by_loop(scores, ids)
        expected += [(r, gid) for gid in sorted(set(ids)) if gid not in flat]
    need = 5
    f = GroupFilter(groups=need, max_rounds=10)
    for td in rounds:
        if not f.add(td):
            break
    batch, metrics = f.result()
    # every group of the batch has a spread; none of its samples came from a flat group
    trained = {}
    for s, gid in zip(batch[S.SCORE].tolist(), batch[S.GROUP_ID].tolist()):
        trained.setdefault(gid, []).append(s)
    assert len(trained) == need and all(max(v) - min(v) > 1e-6 for v in trained.values())
    # and they are the first `need` informative groups, samples and padding exact
    chosen = set(expected[:need])   # rows keep their order within a round
    kept_rows = [(r, i) for r, td in enumerate(rounds)
                 for i, gid in enumerate(td[S.GROUP_ID].tolist()) if (r, gid) in chosen]
    assert batch.batch_size[0] == len(kept_rows)
    width_r, width_p = batch[S.RESPONSE_IDS].shape[1], batch[S.PROMPT_IDS].shape[1]
    for j, (r, i) in enumerate(kept_rows):
        src = rounds[r][i]
        pad_r, pad_p = width_r - src[S.RESPONSE_IDS].shape[0], width_p - src[S.PROMPT_IDS].shape[0]
        assert batch[S.SCORE][j].item() == src[S.SCORE].item()
        assert batch[S.RESPONSE_IDS][j].tolist() == src[S.RESPONSE_IDS].tolist() + [0] * pad_r
        assert batch[S.OLD_LOG_PROB][j].tolist() == src[S.OLD_LOG_PROB].tolist() + [0.0] * pad_r
        assert batch[S.RESPONSE_MASK][j].tolist() == [True] * (width_r - pad_r) + [False] * pad_r
        assert batch[S.PROMPT_IDS][j].tolist() == [0] * pad_p + src[S.PROMPT_IDS].tolist()
        assert batch[S.PROMPT_MASK][j].tolist() == [False] * pad_p + [True] * (width_p - pad_p)
    collected = 4 * f.rounds
    n_flat = sum(len(flat_by_loop(td[S.SCORE].tolist(), td[S.GROUP_ID].tolist()))
                 for td in rounds[:f.rounds])
    assert metrics == {"data/dropped_groups": collected - need,
                       "data/extra_rounds": f.rounds - 1, "data/flat_groups_trained": 0,
                       "data/flat_frac": n_flat / collected}


def test_cap_tops_up_with_flat_groups():
    flat = scored_round([1.0] * 4, [0, 0, 1, 1], width_r=3)
    f = GroupFilter(groups=2, max_rounds=2)
    assert f.add(flat) and f.add(flat) and not f.add(flat)   # the first round and two extra
    batch, metrics = f.result()
    assert batch.batch_size[0] == 4 and batch[S.GROUP_ID].tolist() == [0, 0, 1, 1]
    assert metrics == {"data/dropped_groups": 4, "data/extra_rounds": 2,
                       "data/flat_groups_trained": 2, "data/flat_frac": 1.0}


# --- in a run: the tiny model, GRPO, a reward that is flat for some prompts --------------------

FLAT_PROMPTS = 3   # prompts whose line number (in prompts.txt) is a multiple: always flat


def make_reward(prompt_lines):
    flat = {p for i, p in enumerate(prompt_lines) if i % FLAT_PROMPTS == 0}

    def reward(prompts, responses, **batch):
        # a flat prompt scores 0 for every sample; any other prompt a number from the response
        return [0.0 if p in flat else zlib.crc32(r.encode()) / 2**32 for p, r in zip(prompts, responses)]
    return reward, flat


@pytest.fixture
def recorded(monkeypatch):
    """The batches the update receives."""
    seen = []
    update = Updater.update

    def record(self, batch, **kwargs):
        seen.append(batch.clone())
        return update(self, batch, **kwargs)
    monkeypatch.setattr(Updater, "update", record)
    return seen


def grpo_tiny(tmp_path, *overrides):
    return load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "run.steps=2", "train.epochs=1",
                              "data.batch_size=4", "collector.max_new_tokens=6",
                              "advantage={name: grpo}", "data.dynamic_sampling.enabled=true",
                              *overrides])


def test_flat_groups_never_reach_the_update_and_the_batch_is_full(tmp_path, recorded):
    lines = [l for l in (TINY.parent / "prompts.txt").read_text().splitlines() if l.strip()]
    reward, flat = make_reward(lines)
    pipe = Pipeline(grpo_tiny(tmp_path, "data.dynamic_sampling.max_rounds=20"), progress=False,
                    rewards=[reward])
    rows = [json.loads(x) for x in (pipe.train() / "metrics.jsonl").read_text().splitlines()]
    assert len(recorded) == 2
    for batch in recorded:
        assert batch.batch_size[0] == 4 * 2   # data.batch_size groups of collector.n samples
        assert not set(batch[S.PROMPT_TEXT]) & flat
        assert len(set(batch[S.GROUP_ID].tolist())) == 4
        assert (batch[S.ADVANTAGE].abs().sum(-1) > 0).all()   # every sample carries a signal
    assert all(r["data/flat_groups_trained"] == 0 and r["reward/zero_std_frac"] == 0.0 for r in rows)
    # prompts served: the first round's batch and every extra round's
    served = sum(4 * (1 + r["data/extra_rounds"]) for r in rows)
    assert pipe.prompts.position == served
    assert sum(r["data/dropped_groups"] for r in rows) >= 1


def test_the_cap_on_extra_rounds(tmp_path, recorded):
    pipe = Pipeline(grpo_tiny(tmp_path, "data.dynamic_sampling.max_rounds=1", "run.steps=1"),
                    progress=False, rewards=[lambda prompts, responses, **batch: [1.0] * len(prompts)])
    rows = [json.loads(x) for x in (pipe.train() / "metrics.jsonl").read_text().splitlines()]
    assert pipe.prompts.position == 8   # the first round and one extra, then no more
    assert rows[0]["data/extra_rounds"] == 1 and rows[0]["data/flat_groups_trained"] == 4
    assert rows[0]["data/dropped_groups"] == 4 and recorded[0].batch_size[0] == 8


def test_needs_groups(tmp_path):
    with pytest.raises(UserError, match=r"data.dynamic_sampling .* needs collector.n >= 2 \(got 1\)"):
        load_config(TINY, ["collector.n=1", "data.dynamic_sampling.enabled=true"])
