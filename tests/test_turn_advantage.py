"""Per-turn credit (the ``turn`` advantage): a float64 loop oracle, the action-token placement
through core's compaction, the bias of per-turn-index normalisation by exact enumeration (verl
RFC #7244) and its absence here, the one-line refusal of a single-turn batch, and a tiny
multi-turn run through ``rlpipe.train``."""

import itertools
import math
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from click.testing import CliRunner

from tests.test_multiturn_pipeline import Echo, chat_tiny, config  # noqa: F401 (a fixture)
from rlpipe import load_config, train
from rlpipe.core.base import schema as S
from rlpipe.cli import main
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.callbacks import Callback
from rlpipe.core.step.actions import run_advantage
from rlpipe.plugins.advantages.turn import TurnCredit, turn_advantage

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny"
U32 = 2.0 ** -24   # float32 unit round-off


def oracle(reward, mask, turn_id, group_id, turns, gamma):
    """The advantage and return per token, in float64 Python numbers, one row and turn at a time."""
    B, R = reward.shape
    r = [[0.0] * turns for _ in range(B)]
    for i, p in itertools.product(range(B), range(R)):
        if mask[i, p] and 0 <= turn_id[i, p] < turns:
            r[i][int(turn_id[i, p])] += float(reward[i, p])
    G = [[sum(gamma ** (k - t) * r[i][k] for k in range(t, turns)) for t in range(turns)]
         for i in range(B)]
    adv = torch.zeros(B, R, dtype=torch.float64)
    ret = torch.zeros(B, R, dtype=torch.float64)
    for i, p in itertools.product(range(B), range(R)):
        if not (mask[i, p] and 0 <= turn_id[i, p] < turns):
            continue
        t = int(turn_id[i, p])
        others = [j for j in range(B) if j != i and group_id[j] == group_id[i] and mask[j].any()]
        ret[i, p] = G[i][t]
        adv[i, p] = G[i][t] - sum(G[j][t] for j in others) / len(others) if others else 0.0
    return adv, ret


def random_batch(gen, rows=9, turns=4, width=14, holes=False):
    """Rows of 1..turns turns of 0..3 action tokens (an empty row, a one-row group included);
    ``holes``: 1..2 observation tokens after each turn's action, ``action_mask`` set."""
    reward = torch.randn(rows, width, generator=gen)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    action = torch.zeros(rows, width, dtype=torch.bool)
    turn_id = torch.zeros(rows, width, dtype=torch.long)
    for i in range(rows - 1):   # the last row stays empty
        p = 0
        for t in range(int(torch.randint(1, turns + 1, (1,), generator=gen))):
            length = int(torch.randint(0, 4, (1,), generator=gen))
            obs = int(torch.randint(1, 3, (1,), generator=gen)) if holes else 0
            for k in range(length + obs):
                if p < width:
                    mask[i, p], action[i, p], turn_id[i, p] = True, k < length, t
                    p += 1
    group_id = torch.tensor([3, 3, 3, 1, 1, 7, 7, 7, 9])[:rows]   # 9: one row (and empty)
    return reward, mask, action, turn_id, group_id


def tolerance(reward, mask, group_id, turns):
    """A float32 bound on |vectorised - oracle|: sums of k terms err by at most (k - 1) u times
    the sum of their magnitudes; the turn sums (<= R terms), the discounted cumsum (<= 2 T
    roundings, gamma <= 1), the group sum (n terms), the leave-one-out difference and division
    and ``G - b`` (4) each add theirs, on both ``G`` and ``b`` (factor 2), each term bounded by
    the group's total magnitude ``sum |reward|``."""
    magnitude = max(float(reward[(group_id == g).unsqueeze(-1) & mask].abs().sum())
                    for g in group_id.unique())
    steps = reward.shape[-1] + 2 * turns + int(group_id.bincount().max()) + 4
    return 2 * steps * U32 * magnitude


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("seed", range(4))
def test_matches_the_float64_loop(gamma, seed):
    gen = torch.Generator().manual_seed(seed)
    reward, mask, _, turn_id, group_id = random_batch(gen)
    adv, ret = turn_advantage(reward, mask, turn_id, group_id, 4, gamma)
    want_adv, want_ret = oracle(reward, mask, turn_id, group_id, 4, gamma)
    atol = tolerance(reward, mask, group_id, 4)
    torch.testing.assert_close(adv.double(), want_adv, rtol=0, atol=atol)
    torch.testing.assert_close(ret.double(), want_ret, rtol=0, atol=atol)
    assert adv.dtype == torch.float32 and (adv[~mask] == 0).all() and (adv[-1] == 0).all()
    assert (adv[group_id == 9] == 0).all() and adv.abs().sum() > 0


def test_in_float64_it_is_the_loop_exactly():
    gen = torch.Generator().manual_seed(11)
    reward, mask, _, turn_id, group_id = random_batch(gen)
    adv, _ = turn_advantage(reward.double(), mask, turn_id, group_id, 4, 0.5)
    torch.testing.assert_close(adv, oracle(reward, mask, turn_id, group_id, 4, 0.5)[0],
                               rtol=0, atol=1e-12)


def test_through_core_compaction_only_action_tokens_get_their_turns_credit():
    """A multi-turn batch with observations between turns, through `run_advantage` as the
    pipeline calls it: the oracle over the action tokens, 0 on the observations."""
    gen = torch.Generator().manual_seed(5)
    reward, mask, action, turn_id, group_id = random_batch(gen, holes=True)
    reward = torch.where(action, reward, 0)   # rewards sit on action tokens (KL, score, turns)
    td = TensorDict({S.REWARD: reward, S.RESPONSE_MASK: mask, S.ACTION_MASK: action,
                     S.TURN_ID: turn_id, S.TURN_REWARD: torch.zeros(len(reward), 4),
                     S.GROUP_ID: group_id}, batch_size=[len(reward)])
    out = run_advantage(lambda batch: TurnCredit(gamma=0.8)(batch), td)
    want, _ = oracle(reward, action, turn_id, group_id, 4, 0.8)
    torch.testing.assert_close(out[S.ADVANTAGE].double(), want, rtol=0,
                               atol=tolerance(reward, action, group_id, 4))
    assert (out[S.ADVANTAGE][~action] == 0).all() and (out[S.ADVANTAGE][action] != 0).any()


# --- the bias of per-turn-index normalisation, by exact enumeration ------------------------------
# Turn 0: the policy continues with probability q = sigmoid(theta) (grad log pi: 1 - q) or stops
# (grad log pi: -q); the environment pays 1 for turn 0 either way. Stopping ends the conversation
# with an outcome score STOP on turn 0; continuing takes turn 1 (no parameter: grad log pi 0),
# whose outcome the environment draws: 0 or 2, each with probability 1/2.
# J(theta) = 1 + q * 1 + (1 - q) * STOP, so dJ/dtheta = q (1 - q) (1 - STOP): 0 when STOP = 1.
OUTCOMES = (("stop", None), ("continue", 0.0), ("continue", 2.0))


def _turn_rewards(outcome, stop_score):
    kind, second = outcome
    return [1.0 + stop_score] if kind == "stop" else [1.0, second]


def per_index_advantage(turn_rewards, scale_std):
    """MT-GRPO's per-turn-index normalisation (verl RFC #7244): each turn k's reward normalised
    over the rows that reached k, the advantage of turn 0 the sum of a row's normalised rewards."""
    out = []
    for rewards in turn_rewards:
        total = 0.0
        for k, r in enumerate(rewards):
            reached = [other[k] for other in turn_rewards if len(other) > k]
            mean = sum(reached) / len(reached)
            std = math.sqrt(sum((x - mean) ** 2 for x in reached) / len(reached))
            total += (r - mean) / (std + 1e-6 if scale_std else 1.0)
        out.append(total)
    return out


def turn_zero_advantage(turn_rewards):
    """This plugin's advantage of turn 0 for each row, from the batch the rows make."""
    n = len(turn_rewards)
    reward = torch.tensor([rw + [0.0] * (2 - len(rw)) for rw in turn_rewards], dtype=torch.float64)
    mask = torch.tensor([[True, len(rw) == 2] for rw in turn_rewards])
    adv, _ = turn_advantage(reward, mask, torch.tensor([[0, 1]] * n), torch.zeros(n), turns=2)
    return adv[:, 0].tolist()


def expected_gradient(advantage_of, q, stop_score, n=3):
    """E[(1/n) sum_i grad log pi(a_i0) A_i0] over every joint outcome of a group of ``n``."""
    probability = {"stop": 1 - q, "continue": q / 2}
    score = {"stop": -q, "continue": 1 - q}
    total = 0.0
    for joint in itertools.product(OUTCOMES, repeat=n):
        p = math.prod(probability[kind] for kind, _ in joint)
        adv = advantage_of([_turn_rewards(o, stop_score) for o in joint])
        total += p * sum(score[kind] * a for (kind, _), a in zip(joint, adv)) / n
    return total


@pytest.mark.parametrize("q", [0.3, 0.5, 0.8])
@pytest.mark.parametrize("stop_score", [1.0, 0.25])
def test_unbiased_where_per_turn_index_normalisation_is_not(q, stop_score):
    """Ours: E[gradient] is dJ/dtheta exactly (0 when stopping changes nothing); per-index
    normalisation, with or without its std, pushes the stop decision away from it."""
    true = q * (1 - q) * (1 - stop_score)
    ours = expected_gradient(turn_zero_advantage, q, stop_score)
    assert ours == pytest.approx(true, abs=1e-12)
    for scale_std in (False, True):
        biased = expected_gradient(lambda rows: per_index_advantage(rows, scale_std), q,
                                   stop_score)
        assert abs(biased - true) > 0.02, (scale_std, biased, true)


# --- contract, arguments, refusals -------------------------------------------------------------

def test_contract_and_arguments():
    c = TurnCredit.contract(gamma=0.5)
    assert (c.needs_critic, c.needs_groups, c.kl_in, c.group_normalised, c.declared) == \
        (False, True, "loss", False, True)
    for bad in (1.5, -0.1, True, "1"):
        with pytest.raises(UserError, match=r"^advantage 'turn': gamma must be a number in"):
            TurnCredit(gamma=bad)


def test_a_single_turn_batch_is_one_line():
    td = TensorDict({S.REWARD: torch.ones(2, 3), S.GROUP_ID: torch.tensor([0, 0]),
                     S.RESPONSE_MASK: torch.ones(2, 3, dtype=torch.bool)}, batch_size=[2])
    with pytest.raises(UserError, match="needs a multi-turn run.*use advantage.name: grpo") as err:
        TurnCredit()(td)
    assert "\n" not in str(err.value)


def test_a_single_turn_config_is_refused_before_any_model_loads(tmp_path):
    """The contract says it reads turns (``needs_turns``): `plan_run` refuses a run without an
    environment on one line as the config loads, before a model is (`rlpipe check` exits 2)."""
    with pytest.raises(UserError, match=r"^advantage .*turn.* scores turns \(turn_reward\), which a "
                                        r"run without an environment does not have"):
        load_config(TINY / "config.yaml", ["advantage.name=turn", f"run.output_dir={tmp_path}"])
    result = CliRunner().invoke(main, ["check", str(TINY / "config.yaml"), "advantage.name=turn"])
    assert result.exit_code == 2 and "models" not in result.output, result.output


# --- a tiny multi-turn run ---------------------------------------------------------------------

class Words(Echo):
    """Echo, paying each turn 0.1 per word of the action: turn rewards that differ by row."""

    def step(self, action):
        messages, _, done, info = super().step(action)
        return messages, 0.1 * len(action.split()), done, info


class Batches(Callback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, pipe, batch, metrics):
        if batch is not None:   # step 0: the row before any update
            self.seen.append((batch.clone(), dict(metrics)))


def test_a_tiny_multi_turn_run_trains_with_per_turn_credit(chat_tiny, tmp_path):  # noqa: F811
    cfg = config(chat_tiny, tmp_path, "advantage.name=turn", "environment.max_turns=3",
                 "collector.max_new_tokens=24", "data.batch_size=8",
                 "environment.name=tests.test_turn_advantage:Words")
    record = Batches()
    train(cfg, progress=False, callbacks=[record])
    assert len(record.seen) == 2
    for batch, metrics in record.seen:
        batch = batch.cpu()   # the oracle's tensors are the CPU's (RLPIPE_TEST_DEVICE=cuda)
        action, adv = batch[S.ACTION_MASK], batch[S.ADVANTAGE]
        assert (adv[~action] == 0).all() and (adv[action] != 0).any()
        assert batch[S.NUM_TURNS].max() >= 2   # several turns, so per-turn credit is exercised
        numbers = [v for v in metrics.values() if isinstance(v, (int, float))]
        assert all(math.isfinite(v) for v in numbers) and "policy/loss" in metrics
        # each action token carries its row's return-to-go from its turn, minus the others' mean
        want, _ = oracle(batch[S.REWARD], action, batch[S.TURN_ID], batch[S.GROUP_ID],
                         batch[S.TURN_REWARD].shape[-1], 1.0)
        torch.testing.assert_close(adv.double(), want, rtol=0, atol=tolerance(
            batch[S.REWARD], action, batch[S.GROUP_ID], batch[S.TURN_REWARD].shape[-1]))
