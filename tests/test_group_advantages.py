"""Critic-free estimators (grpo, rloo, reinforce_pp) and the blocked discounted sum under GAE,
against float64 plain-Python loops; and a one-step tiny run with each estimator."""

import json
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.kinds import advantage_contract
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.base.schema import ADVANTAGE, GROUP_ID, RESPONSE_MASK, REWARD, VALUE_TARGET
from rlpipe.plugins.advantages.gae import discounted_cumsum, masked_gae
from rlpipe.plugins.advantages.grpo import GRPO, grpo_advantage
from rlpipe.plugins.advantages.reinforce_pp import ReinforcePP, reinforce_pp_advantage
from rlpipe.plugins.advantages.rloo import RLOO, rloo_advantage

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
R = 6
# Groups 42 (4 samples, one empty), 7 (3), 1000 (2, both empty), 3 (1: a singleton), 9 (2),
# shuffled so that no group is contiguous.
GROUPS = [42, 7, 42, 1000, 3, 7, 9, 42, 1000, 7, 9, 42]
LENGTHS = [6, 2, 0, 0, 4, 6, 1, 3, 0, 5, 6, 2]


def make_batch(groups=GROUPS, lengths=LENGTHS, seed=0, garbage=0.0):
    """float64 reward with ``garbage`` on padding, a right-padded mask and [B] group ids."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(R) < torch.tensor(lengths).unsqueeze(-1)
    reward = torch.randn(len(lengths), R, generator=gen, dtype=torch.float64)
    return torch.where(mask, reward, garbage), mask, torch.tensor(groups)


def scores_loop(reward, mask):
    """Per-row sum of valid token rewards, and whether the row has any valid token."""
    rows = zip(reward.tolist(), mask.tolist())
    return [sum(r for r, m in zip(rr, mm) if m) for rr, mm in rows], [any(m) for m in mask.tolist()]


def spread(per_row, mask):
    """[B] per-sequence values on every valid token, 0 on padding (float64)."""
    return torch.tensor([[a if m else 0.0 for m in row] for a, row in zip(per_row, mask.tolist())],
                        dtype=torch.float64)


def grpo_loop(reward, mask, groups, scale_std, eps):
    score, valid = scores_loop(reward, mask)
    out = []
    for i, gid in enumerate(groups.tolist()):
        members = [score[j] for j, g in enumerate(groups.tolist()) if g == gid and valid[j]]
        if not valid[i]:
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        a = score[i] - mean
        if scale_std:
            n = len(members)
            std = (sum((s - mean) ** 2 for s in members) / (n - 1)) ** 0.5 if n > 1 else 0.0
            a = a / (std + eps)
        out.append(a)
    return spread(out, mask)


def rloo_loop(reward, mask, groups):
    score, valid = scores_loop(reward, mask)
    out = []
    for i, gid in enumerate(groups.tolist()):
        others = [score[j] for j, g in enumerate(groups.tolist())
                  if g == gid and valid[j] and j != i]
        out.append(score[i] - sum(others) / len(others) if valid[i] and others else 0.0)
    return spread(out, mask)


def whiten_loop(x, mask, eps=1e-8):
    """Whitened with the mean and population std of the valid entries; 0 on padding."""
    valid = [a for a, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    mean = sum(valid) / len(valid)
    var = sum((a - mean) ** 2 for a in valid) / len(valid)
    return torch.where(mask, (x - mean) / (var + eps) ** 0.5, 0)


def returns_loop(reward, mask, gamma):
    out = torch.zeros_like(reward)
    for b, n in enumerate(mask.sum(-1).tolist()):
        running = 0.0
        for t in reversed(range(n)):
            running = reward[b, t].item() + gamma * running
            out[b, t] = running
    return out


@pytest.mark.parametrize("scale_std", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_matches_loop(scale_std, seed):
    reward, mask, groups = make_batch(seed=seed)
    got = grpo_advantage(reward, mask, groups, scale_std=scale_std, eps=1e-4)
    torch.testing.assert_close(got, grpo_loop(reward, mask, groups, scale_std, 1e-4),
                               rtol=1e-12, atol=1e-12)


def test_grpo_matches_trl_on_contiguous_groups():
    """TRL: (s - mean) / (std + 1e-4) with torch's default (unbiased) std over each group."""
    reward, mask, groups = make_batch(groups=[0, 0, 0, 1, 1, 1], lengths=[6, 2, 4, 1, 3, 5])
    score = reward.where(mask, 0).sum(-1).view(2, 3)
    trl = (score - score.mean(1, keepdim=True)) / (score.std(1, keepdim=True) + 1e-4)
    got = grpo_advantage(reward, mask, groups)
    torch.testing.assert_close(got, spread(trl.flatten().tolist(), mask), rtol=1e-12, atol=0)


def test_rloo_matches_loop():
    for seed in range(3):
        reward, mask, groups = make_batch(seed=seed)
        torch.testing.assert_close(rloo_advantage(reward, mask, groups),
                                   rloo_loop(reward, mask, groups), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_pp_matches_loop(gamma):
    reward, mask, _ = make_batch(seed=3)
    advantage, returns = reinforce_pp_advantage(reward, mask, gamma)
    expected = returns_loop(reward, mask, gamma)
    torch.testing.assert_close(returns, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(advantage, whiten_loop(expected, mask), rtol=1e-9, atol=1e-12)


ESTIMATORS = {
    "grpo": lambda r, m, g: grpo_advantage(r, m, g),
    "dr_grpo": lambda r, m, g: grpo_advantage(r, m, g, scale_std=False),
    "rloo": rloo_advantage,
    "reinforce_pp": lambda r, m, g: torch.stack(reinforce_pp_advantage(r, m, 0.95)),
}


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("garbage", [1e6, float("nan"), float("inf")])
def test_padding_garbage_changes_nothing(name, garbage):
    clean = ESTIMATORS[name](*make_batch(seed=4))
    dirty = ESTIMATORS[name](*make_batch(seed=4, garbage=garbage))
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)
    assert (clean[..., ~make_batch()[1]] == 0).all()


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_singletons_and_empty_rows_get_zero(name):
    reward, mask, groups = make_batch(seed=5)
    advantage = ESTIMATORS[name](reward, mask, groups)
    by_row = advantage.abs().sum(-1)
    assert by_row[groups == 3].eq(0).all()  # the singleton group
    assert by_row[~mask.any(-1)].eq(0).all()  # zero-length responses
    assert by_row[groups == 42].gt(0).sum() == 3  # the empty member does not count
    reward, mask, groups = make_batch(groups=[5, 8, 8], lengths=[4, 3, 0])  # 8: one non-empty
    assert ESTIMATORS[name](reward, mask, groups).eq(0).all()


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("lengths", [[0] * 4, [R] * 4, [0, R, 0, 1]])
def test_empty_and_full_batches_are_finite(name, lengths):
    reward, mask, _ = make_batch(lengths=lengths, garbage=float("nan"))
    out = ESTIMATORS[name](reward, mask, torch.tensor([1, 1, 2, 2]))
    assert torch.isfinite(out).all() and (out[..., ~mask] == 0).all()


def test_group_equal_scores_give_zero_not_nan():
    reward, mask, groups = make_batch(groups=[0, 0, 0], lengths=[1, 1, 1])
    reward = torch.where(mask, 2.0, reward)
    assert grpo_advantage(reward, mask, groups).eq(0).all()


def make_td(reward, mask, groups):
    return TensorDict({REWARD: reward, RESPONSE_MASK: mask, GROUP_ID: groups},
                      batch_size=[len(mask)])


@pytest.mark.parametrize("module,in_keys", [
    (GRPO(scale_std=False, eps=0.01), [REWARD, RESPONSE_MASK, GROUP_ID]),
    (RLOO(), [REWARD, RESPONSE_MASK, GROUP_ID]),
    (ReinforcePP(gamma=0.9), [REWARD, RESPONSE_MASK]),
])
def test_modules_read_and_write_schema_keys(module, in_keys):
    assert module.in_keys == in_keys and module.out_keys == [ADVANTAGE, VALUE_TARGET]
    assert advantage_contract(module).needs_critic is False
    reward, mask, groups = make_batch(seed=6)
    td = module(make_td(reward, mask, groups))
    if isinstance(module, ReinforcePP):
        expected = reinforce_pp_advantage(reward, mask, 0.9)
    else:
        fn = rloo_advantage if isinstance(module, RLOO) else grpo_advantage
        extra = {"scale_std": False, "eps": 0.01} if isinstance(module, GRPO) else {}
        expected = (fn(reward, mask, groups, **extra),) * 2
    torch.testing.assert_close((td[ADVANTAGE], td[VALUE_TARGET]), expected, rtol=0, atol=0)
    assert td[ADVANTAGE].data_ptr() != td[VALUE_TARGET].data_ptr()


def test_rloo_whiten_over_valid_tokens():
    reward, mask, groups = make_batch(seed=7)
    td = RLOO(whiten=True)(make_td(reward, mask, groups))
    expected = whiten_loop(rloo_loop(reward, mask, groups), mask)
    torch.testing.assert_close(td[ADVANTAGE], expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cls,kwargs", [
    (GRPO, {"scale_std": "yes"}), (GRPO, {"eps": 0}), (GRPO, {"eps": float("nan")}),
    (RLOO, {"whiten": 1}), (ReinforcePP, {"gamma": 1.5}), (ReinforcePP, {"gamma": True}),
])
def test_bad_arguments_raise_user_error(cls, kwargs):
    with pytest.raises(UserError, match=next(iter(kwargs))):
        cls(**kwargs)


def discount_loop(x, discount):
    out, running = torch.zeros_like(x), x.new_zeros(len(x))
    for t in reversed(range(x.shape[1])):
        running = x[:, t] + discount * running
        out[:, t] = running
    return out


@pytest.mark.parametrize("steps,block", [(0, 32), (1, 32), (31, 8), (32, 8), (100, 7), (257, 32)])
@pytest.mark.parametrize("discount", [1.0, 0.95, 0.3, 0.0])
def test_discounted_cumsum_matches_loop_across_blocks(steps, block, discount):
    x = torch.randn(5, steps, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    torch.testing.assert_close(discounted_cumsum(x, discount, block), discount_loop(x, discount),
                               rtol=1e-12, atol=1e-12)


def test_masked_gae_on_long_responses_matches_loop():
    """Responses longer than one block of `discounted_cumsum`, right-padded with garbage."""
    gen = torch.Generator().manual_seed(9)
    mask = torch.arange(300) < torch.tensor([300, 0, 33, 129, 64, 1]).unsqueeze(-1)
    reward, value = torch.randn(2, 6, 300, generator=gen, dtype=torch.float64)
    value = torch.where(mask, value, 1e6)
    advantage, target = masked_gae(reward.where(mask, float("nan")), value, mask, 0.99, 0.95)
    masked_value = value.where(mask, 0)
    next_value = torch.nn.functional.pad(masked_value[:, 1:], (0, 1))
    delta = torch.where(mask, reward + 0.99 * next_value - masked_value, 0)
    expected = discount_loop(delta, 0.99 * 0.95)
    torch.testing.assert_close(advantage, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(target, expected + masked_value, rtol=1e-12, atol=1e-12)


@pytest.fixture
def one_thread():
    """One torch thread: on a small machine shared with other jobs, multi-threaded ops of a tiny
    model stall on descheduled threads (seconds per step instead of a fraction of one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce_pp"])
def test_tiny_run_with_each_estimator(tmp_path, name, one_thread):
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "run.steps=1", "train.epochs=1",
                             f"advantage={{name: {name}}}", "collector.n=2"])
    pipe = Pipeline(cfg, progress=False)
    assert (pipe.models.critic is None) == (name != "gae")
    rows = [json.loads(line) for line in (pipe.train() / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert all(isinstance(rows[0][k], float) for k in ("reward/score", "policy/loss"))


def test_zero_std_frac_matches_a_python_loop():
    """`reward/zero_std_frac`: groups of two or more whose scores are all equal, over those
    groups, against a plain loop over random groups with repeated scores."""
    from rlpipe.core.observe.samples import flat_groups, zero_std_frac

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        group_id = torch.randint(0, 6, (24,), generator=g) * 7 - 3
        score = torch.randint(0, 2, (24,), generator=g).float()
        groups = {}
        for i, gid in enumerate(group_id.tolist()):
            groups.setdefault(gid, []).append(score[i].item())
        sized = [v for v in groups.values() if len(v) >= 2]
        expected = sum(max(v) == min(v) for v in sized) / len(sized)
        assert zero_std_frac(score, group_id) == {"reward/zero_std_frac": expected}
        flat, count = flat_groups(score, group_id)
        assert count == len(sized)
        assert flat.tolist() == [len(groups[k]) >= 2 and max(groups[k]) == min(groups[k])
                                 for k in group_id.tolist()]
