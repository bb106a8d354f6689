"""The loss contract (core/step/loss.py): declared defaults, the adapter's errors, and the metric
reductions against plain float64 loops -- explained variance pooled over any split."""

import math
import random

import pytest
import torch
from tensordict import TensorDict

from rlpipe.core.base.errors import UserError
from rlpipe.core.step.loss import (LossContract, PipelineLoss, add_parts, contract_of, exceeds,
                              explained_var, explained_var_sums, finish, micro_parts)
from rlpipe.plugins.losses.ppo import PPOLoss


def test_defaults_are_the_documented_ones():
    c = LossContract()
    assert (c.entropy, c.values, c.kl_term, c.approx_kl_metric, dict(c.metrics),
            c.critic_terms) == ("grad", True, False, None, {}, ())
    assert c.reduction("anything/at_all") == "token"


def test_a_loss_without_contract_gets_the_defaults():
    class Bare(torch.nn.Module):
        pass
    assert contract_of(Bare()) == LossContract()
    assert contract_of(PipelineLoss()) == LossContract()  # the base class declares nothing


def test_ppo_declares_its_needs():
    c = contract_of(PPOLoss())
    assert (c.entropy, c.values, c.kl_term, c.approx_kl_metric, c.critic_terms) == \
        ("detached", True, True, "policy/approx_kl", ("loss_critic",))
    assert c.reduction("value/explained_var") == "explained_var"
    assert c.reduction("policy/clipfrac") == "token"
    assert contract_of(PPOLoss(entropy_coef=0.1)).entropy == "grad"
    assert PPOLoss.contract.entropy == "grad"  # an instance's own need leaves the class as is


@pytest.mark.parametrize("kwargs, match", [
    ({"entropy": "yes"}, "entropy"), ({"metrics": {"a/b": "median"}}, "median"),
    ({"critic_terms": "loss_critic"}, "critic_terms"), ({"critic_terms": ("value",)}, "loss_")])
def test_bad_declarations_fail_at_class_definition(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossContract(**kwargs)


def test_contract_is_frozen():
    c = LossContract(metrics={"a": "seq"})
    with pytest.raises(AttributeError):
        c.entropy = "none"
    with pytest.raises(TypeError):
        c.metrics["a"] = "token"


def test_adapter_errors_name_the_loss():
    class WrongType(torch.nn.Module):
        contract = {"entropy": "grad"}

    class NoSetter(torch.nn.Module):
        contract = LossContract(kl_term=True)
    with pytest.raises(UserError, match="contract must be a rlpipe.core.step.loss.LossContract"):
        contract_of(WrongType())
    with pytest.raises(UserError, match=r"declares kl_term but has no set_kl\(penalty\)"):
        contract_of(NoSetter())


def pop_var(xs):
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


def ev_oracle(preds, targets):
    """1 - Var(target - pred) / Var(target), two-pass float64 over plain Python lists."""
    return 1 - pop_var([y - p for p, y in zip(preds, targets)]) / max(pop_var(targets), 1e-8)


def random_tokens(seed, rows=9, width=7):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=gen) < 0.7
    mask[2] = False  # a zero-length row
    rows_apart = torch.arange(rows, dtype=torch.float64).unsqueeze(-1)  # parts differ in mean
    target = 3.0 + rows_apart + torch.randn(rows, width, generator=gen, dtype=torch.float64)
    pred = target + 0.8 * torch.randn(rows, width, generator=gen, dtype=torch.float64) - 0.3
    garbage = torch.full_like(target, 1e30)  # padding is never read
    return torch.where(mask, pred, garbage), torch.where(mask, target, garbage), mask


def test_explained_var_from_sums_matches_the_two_pass_oracle():
    pred, target, mask = random_tokens(0)
    preds, targets = pred[mask].tolist(), target[mask].tolist()
    got = explained_var(explained_var_sums(pred, target, mask)).item()
    assert got == pytest.approx(ev_oracle(preds, targets), rel=1e-12)
    assert explained_var(explained_var_sums(pred, target, torch.zeros_like(mask))).item() == 1.0


@pytest.mark.parametrize("splits", [1, 3, 9])
def test_explained_var_is_split_invariant(splits):
    """The same tokens in 1, 3 or 9 micro-batches (or processes) give one explained variance;
    the mean of the micro-batches' own explained variances does not."""
    pred, target, mask = random_tokens(1)
    whole = explained_var(explained_var_sums(pred, target, mask)).item()
    total, per_part = {}, []
    contract = LossContract(metrics={"value/ev": "explained_var"})
    for p, y, m in zip(pred.tensor_split(splits), target.tensor_split(splits),
                       mask.tensor_split(splits)):
        sums = explained_var_sums(p, y, m)
        out = TensorDict({"loss_x": torch.zeros(()),
                          "value": {"ev": explained_var(sums), "ev_sums": sums}}, [])
        _, parts = micro_parts(out, contract, tokens=float(m.sum()), seqs=float(len(m)))
        add_parts(total, parts)
        per_part.append((explained_var(sums).item(), float(m.sum())))
    assert finish(total, contract)["value/ev"] == pytest.approx(whole, abs=1e-6)
    assert whole == pytest.approx(ev_oracle(pred[mask].tolist(), target[mask].tolist()), rel=1e-12)
    if splits > 1:
        weighted = sum(v * n for v, n in per_part) / sum(n for _, n in per_part)
        assert abs(weighted - whole) > 1e-3  # what the token-weighted mean used to report


def test_token_and_seq_weighted_reductions_match_plain_loops():
    """Per micro-batch means, weighted back by tokens or sequences, give the pooled means."""
    rng = random.Random(0)
    micro = [[[rng.gauss(0, 1) for _ in range(rng.randint(0, 5))] for _ in range(rng.randint(1, 4))]
             for _ in range(5)]  # micro-batches of sequences of token values
    contract = LossContract(metrics={"m/seq": "seq"})
    total = {}
    for seqs in micro:
        tokens = [x for s in seqs for x in s]
        tok_mean = sum(tokens) / len(tokens) if tokens else 0.0
        seq_mean = sum(sum(s) for s in seqs) / len(seqs)
        means = {"tok": torch.tensor(tok_mean, dtype=torch.float64),
                 "seq": torch.tensor(seq_mean, dtype=torch.float64)}
        out = TensorDict({"loss_a": torch.tensor(1.5), "m": means}, [])
        losses, parts = micro_parts(out, contract, float(len(tokens)), float(len(seqs)))
        assert losses == {"loss_a": 1.5}
        add_parts(total, parts)
    all_tokens = [x for seqs in micro for s in seqs for x in s]
    all_seqs = [s for seqs in micro for s in seqs]
    got = finish(total, contract)
    assert list(got) == ["m/tok", "m/seq"]  # the loss's own order
    assert got["m/tok"] == pytest.approx(sum(all_tokens) / len(all_tokens), rel=1e-6)  # float32
    assert got["m/seq"] == pytest.approx(sum(sum(s) for s in all_seqs) / len(all_seqs), rel=1e-6)
    assert finish({"m/tok": [0.0, 0.0]}, contract) == {"m/tok": 0.0}  # no token: 0, not NaN


def test_declared_explained_var_without_sums_is_an_error():
    contract = LossContract(metrics={"value/ev": "explained_var"})
    out = TensorDict({"loss_x": torch.zeros(()), "value": {"ev": torch.tensor(0.5)}}, [])
    with pytest.raises(UserError, match="'value/ev_sums'"):
        micro_parts(out, contract, 3.0, 1.0, who="loss 'mine'")


def test_exceeds_compares_the_reduced_value():
    assert exceeds([0.31, 3.0], "token", 0.1) and not exceeds([0.29, 3.0], "seq", 0.1)
    sums = [5.0, 1.0, 26.0, 6.0, 2.0]  # explained variance 0.4375
    assert exceeds(sums, "explained_var", 0.4) and not exceeds(sums, "explained_var", 0.5)
    assert math.isclose(float(explained_var(sums)), 0.4375)
