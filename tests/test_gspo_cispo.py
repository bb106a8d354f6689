"""GSPO and CISPO losses against float64 plain-loop oracles of the papers' formulas (losses,
metrics and gradients), against verl's formulas (verl 0.8.0.dev, commit b178a3c,
``compute_policy_loss_gspo`` / ``compute_policy_loss_cispo``, rewritten here from their
equations), micro-batch split invariance, ratio 1, padding, and one real tiny run of each."""

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.schema import (ADVANTAGE, LOG_PROB, NUM_SEQS, NUM_TOKENS, OLD_LOG_PROB,
                                     RESPONSE_MASK)
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.step.loss import add_parts, finish, micro_parts
from rlpipe.plugins.losses.cispo import CISPOLoss
from rlpipe.plugins.losses.gspo import GSPOLoss
from rlpipe.plugins.losses.ppo import AGG_MODES

from tests.test_ppo_loss import make_batch
from tests.test_trainer import rows, tiny


def seq_advantage_batch(seed, scale=0.6, garbage=0.0):
    """`make_batch` with one advantage per row (as grpo gives) and ``log_prob - old`` of
    ``scale`` times the original deviation."""
    td = make_batch(seed=seed, garbage=garbage)
    mask = td[RESPONSE_MASK]
    row_adv = td[ADVANTAGE][:, :1].expand_as(mask)
    td[ADVANTAGE] = torch.where(mask, row_adv, td[ADVANTAGE])
    dev = (td[LOG_PROB] - td[OLD_LOG_PROB]) * scale / 0.6
    td[LOG_PROB] = torch.where(mask, td[OLD_LOG_PROB] + dev, td[LOG_PROB])
    return td


def rows_of(td):
    """Per row: lists of (log_prob, old_log_prob, advantage) of its valid tokens, floats."""
    out = []
    for b, n in enumerate(td[RESPONSE_MASK].sum(-1).tolist()):
        out.append([(td[LOG_PROB][b, t].item(), td[OLD_LOG_PROB][b, t].item(),
                     td[ADVANTAGE][b, t].item()) for t in range(n)])
    return out


def reduce(per_row, lengths, agg):
    """Plain-loop aggregation of one number per row that each of the row's tokens carries
    (``per_row``) or of per-token lists."""
    nonempty = sum(1 for n in lengths if n)
    if agg == "token-mean":
        return sum(x * n for x, n in zip(per_row, lengths)) / sum(lengths)
    if agg == "seq-mean-token-mean":
        return sum(x for x, n in zip(per_row, lengths) if n) / nonempty
    return sum(x * n for x, n in zip(per_row, lengths)) / nonempty


def gspo_oracle(td, clip_low, clip_high, agg):
    """The paper's GSPO objective in plain float64 loops: loss, clip count, and d loss / d lp."""
    losses, clipped, grads, lengths = [], [], {}, []
    for b, row in enumerate(rows_of(td)):
        n = len(row)
        lengths.append(n)
        if n == 0:
            losses.append(0.0), clipped.append(0.0)
            continue
        s = math.exp(sum(lp - old for lp, old, _ in row) / n)
        a = sum(adv for _, _, adv in row) / n
        unclipped, cl = -a * s, -a * min(max(s, 1 - clip_low), 1 + clip_high)
        losses.append(max(unclipped, cl))
        clipped.append(float(cl > unclipped))
        dloss_ds = 0.0 if cl > unclipped else -a  # the clipped branch is constant in s
        for t in range(n):  # d s / d lp_t = s / n
            grads[b, t] = dloss_ds * s / n
    weight = {"token-mean": lambda n: n / sum(lengths),
              "seq-mean-token-mean": lambda n: 1 / sum(1 for m in lengths if m),
              "seq-mean-token-sum": lambda n: n / sum(1 for m in lengths if m)}[agg]
    grads = {k: g * weight(lengths[k[0]]) for k, g in grads.items()}
    return {"loss_objective": reduce(losses, lengths, agg),
            ("policy", "loss"): sum(losses) / len(losses),
            ("policy", "clipfrac"): sum(clipped) / len(clipped)}, grads


def cispo_oracle(td, clip_low, clip_high):
    """CISPO in plain float64 loops, token-mean: loss, clip fractions, d loss / d lp."""
    terms, upper, lower, grads = [], [], [], {}
    tokens = sum(len(r) for r in rows_of(td))
    for b, row in enumerate(rows_of(td)):
        for t, (lp, old, adv) in enumerate(row):
            r = math.exp(lp - old)
            w = min(r, 1 + clip_high)
            if clip_low is not None:
                w = max(w, 1 - clip_low)
            terms.append(-w * adv * lp)
            upper.append(float(w < r)), lower.append(float(w > r))
            grads[b, t] = -w * adv / tokens  # w is a constant: only log pi is differentiated
    return {"loss_objective": sum(terms) / tokens, ("policy", "loss"): sum(terms) / tokens,
            ("policy", "clipfrac"): sum(upper) / tokens,
            ("policy", "clipfrac_lower"): sum(lower) / tokens}, grads


def run_loss(loss, td):
    """The loss's output and the gradient of loss_objective with respect to log_prob."""
    td = td.clone()
    td[LOG_PROB] = td[LOG_PROB].detach().requires_grad_()
    out = loss(td)
    out["loss_objective"].backward()
    return out, td[LOG_PROB].grad


def check(out, grad, expected, expected_grads, mask):
    for key, value in expected.items():
        assert out[key].item() == pytest.approx(value, rel=1e-10, abs=1e-12), key
    want = torch.zeros_like(grad)
    for (b, t), g in expected_grads.items():
        want[b, t] = g
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-14)
    assert (grad[~mask] == 0).all()


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("clip", [(0.1, 0.15), (3e-4, 4e-4)])
def test_gspo_matches_float64_loop_oracle(clip, agg):
    scale = 0.6 if clip[0] > 0.01 else 1e-3  # the paper's tiny range needs tiny deviations
    for td in (seq_advantage_batch(seed=1, scale=scale), make_batch(seed=2)):  # also per-token A
        out, grad = run_loss(GSPOLoss(clip_low=clip[0], clip_high=clip[1], agg=agg,
                                      wide_clip=clip[0] > 0.01), td)
        expected, grads = gspo_oracle(td, *clip, agg)
        check(out, grad, expected, grads, td[RESPONSE_MASK])
        assert 0 < out["policy", "clipfrac"] < 1  # the data clips some sequences, not all


@pytest.mark.parametrize("clip_low", [None, 0.3])
def test_cispo_matches_float64_loop_oracle(clip_low):
    td = make_batch(seed=3)
    out, grad = run_loss(CISPOLoss(clip_low=clip_low, clip_high=0.25,
                                   lower_bound=clip_low is not None), td)
    expected, grads = cispo_oracle(td, clip_low, 0.25)
    check(out, grad, expected, grads, td[RESPONSE_MASK])
    assert out["policy", "clipfrac"] > 0
    assert (out["policy", "clipfrac_lower"] > 0) == (clip_low is not None)
    # every token has a gradient, clipped ones included (PPO's clip would zero those)
    assert (grad[td[RESPONSE_MASK] & (td[ADVANTAGE] != 0)] != 0).all()


def verl_gspo_token(lp, old, adv, mask, clip_low, clip_high):
    """verl's GSPO-token formula: log s_it = lp - sg(lp) + sg(mean log ratio), clamped above at
    10; max(-A s_it, -A clip(s_it)); always seq-mean-token-mean over non-empty rows."""
    m = mask.to(lp.dtype)
    seq = ((lp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    s = torch.exp((lp - lp.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0))
    pg = torch.maximum(-adv * s, -adv * s.clamp(1 - clip_low, 1 + clip_high))
    per_seq = (pg * m).sum(-1) / (m.sum(-1) + 1e-8)
    return (per_seq * (m.sum(-1) > 0)).sum() / (m.sum(-1) > 0).sum()


def verl_cispo(lp, old, adv, mask, clip_low, clip_high):
    """verl's CISPO formula: -sg(clamp(exp(clamp(lp - old, +-20)), 1 - low, 1 + high)) A lp,
    token-mean."""
    ratio = torch.exp((lp - old).clamp(-20.0, 20.0))
    pg = -ratio.clamp(1 - clip_low, 1 + clip_high).detach() * adv * lp
    m = mask.to(lp.dtype)
    return (pg * m).sum() / m.sum()


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_same_numbers_as_verl(name):
    """With a per-sequence advantage GSPO's sequence form and verl's GSPO-token form give the
    same loss and gradient; CISPO with verl's example setting (clip_ratio_low=10: no lower
    bound, clip_ratio_high=0.2) equals ours with clip_low=None."""
    td = seq_advantage_batch(seed=4)
    mask = td[RESPONSE_MASK]
    td = td.apply(lambda x: torch.where(mask, x, 0) if x.is_floating_point() else x)
    if name == "gspo":
        ours, verl, args = GSPOLoss(clip_low=0.1, clip_high=0.15, wide_clip=True), verl_gspo_token, (0.1, 0.15)
    else:
        ours, verl, args = CISPOLoss(clip_high=0.2), verl_cispo, (10.0, 0.2)
    out, grad = run_loss(ours, td)
    lp = td[LOG_PROB].clone().requires_grad_()
    theirs = verl(lp, td[OLD_LOG_PROB], td[ADVANTAGE], mask, *args)
    theirs.backward()
    # verl divides a row's token sum by (length + 1e-8): agreement to ~1e-8 of each term
    assert out["loss_objective"].item() == pytest.approx(theirs.item(), rel=1e-9, abs=1e-8)
    torch.testing.assert_close(grad, lp.grad, rtol=1e-7, atol=1e-14)
    assert 0 < out["policy", "clipfrac"] < 1


def test_ratio_one_gives_the_plain_policy_gradient():
    """lp == old (the first minibatch): GSPO's loss is -mean over sequences of A_i and nothing
    clips, even at the paper's 3e-4; CISPO's gradient is -A / N on every token."""
    td = seq_advantage_batch(seed=5, garbage=1e4)
    td[LOG_PROB] = td[OLD_LOG_PROB].clone()
    mask = td[RESPONSE_MASK]
    adv = [r[0][2] for r in rows_of(td) if r]
    out, _ = run_loss(GSPOLoss(), td)
    assert out["loss_objective"].item() == pytest.approx(-sum(adv) / len(adv), rel=1e-12)
    assert out["policy", "clipfrac"].item() == 0 and out["policy", "approx_kl"].item() == 0
    out, grad = run_loss(CISPOLoss(clip_low=0.2, lower_bound=True), td)
    torch.testing.assert_close(grad, torch.where(mask, -td[ADVANTAGE] / mask.sum(), 0))
    assert out["policy", "clipfrac"].item() == 0 and out["policy", "clipfrac_lower"].item() == 0


@pytest.mark.parametrize("make", [lambda: GSPOLoss(clip_low=0.1, clip_high=0.1, wide_clip=True),
                                  lambda: CISPOLoss(clip_low=0.3, clip_high=0.1, lower_bound=True),
                                  lambda: GSPOLoss(clip_low=0.1, agg="token-mean",
                                                   entropy_coef=0.05, wide_clip=True)],
                         ids=["gspo", "cispo", "gspo-token-mean"])
def test_micro_batch_split_invariance(make):
    """Loss, gradients and the pooled metrics (sequence-weighted for GSPO's) do not depend on
    the micro-batch split, given the minibatch-wide counts, as the trainer passes them."""
    base = seq_advantage_batch(seed=6)
    loss = make()
    results = []
    for splits in (1, 2, 4):
        td = base.clone()
        leaves = {k: td[k].detach().requires_grad_() for k in ["log_prob", "value_pred",
                                                               "entropy"]}
        td.update(leaves)
        td[NUM_TOKENS] = torch.full((len(td),), float(td[RESPONSE_MASK].sum()),
                                    dtype=torch.float64)
        td[NUM_SEQS] = torch.full((len(td),), float(td[RESPONSE_MASK].any(-1).sum()),
                                  dtype=torch.float64)
        total, pooled = 0, {}
        for micro in td.split(len(td) // splits):
            out = loss(micro)
            total = total + sum(out[k] for k in out.keys() if k.startswith("loss_"))
            add_parts(pooled, micro_parts(out, loss.contract, float(micro[RESPONSE_MASK].sum()),
                                          float(len(micro)))[1])
        total.backward()
        results.append((total.item(), finish(pooled, loss.contract),
                        {k: v.grad for k, v in leaves.items()}))
    for total, metrics, grads in results[1:]:
        assert total == pytest.approx(results[0][0], rel=1e-12)
        assert metrics == pytest.approx(results[0][1], rel=1e-6)  # parts pass through float32
        for key, grad in grads.items():
            torch.testing.assert_close(grad, results[0][2][key], rtol=1e-12, atol=1e-15)
    whole = loss(base)  # one micro-batch: its own metrics are the pooled ones
    for key in ("policy/loss", "policy/clipfrac"):
        assert whole[tuple(key.split("/"))].item() == pytest.approx(results[0][1][key], rel=1e-6)


@pytest.mark.parametrize("loss", [GSPOLoss(clip_low=0.1, wide_clip=True),
                                  CISPOLoss(clip_low=0.5, lower_bound=True)],
                         ids=["gspo", "cispo"])
def test_garbage_on_padding_changes_nothing(loss):
    (clean, g_clean), (dirty, g_dirty) = [run_loss(loss, seq_advantage_batch(seed=7, garbage=g))
                                          for g in (0.0, 1e4)]
    assert (clean.detach() == dirty.detach()).all()
    torch.testing.assert_close(g_dirty, g_clean, rtol=0, atol=0)


@pytest.mark.parametrize("make, kwargs", [
    (GSPOLoss, {"clip_low": 1.0}), (GSPOLoss, {"clip_high": 0.0}), (GSPOLoss, {"agg": "mean"}),
    (GSPOLoss, {"vf_coef": -1.0}), (CISPOLoss, {"clip_low": 0.0}), (CISPOLoss, {"clip_high": None}),
    (CISPOLoss, {"value_loss": "l1"}), (CISPOLoss, {"log_ratio_clamp": float("nan")})])
def test_bad_arguments_raise_user_error(make, kwargs):
    with pytest.raises(UserError, match=f"loss '{make.NAME}': {next(iter(kwargs))}"):
        make(**kwargs)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_tiny_run_with_grpo(tmp_path, name):
    """A real tiny run (examples/tiny, grpo, n=2): the entry point loads, one step logs finite
    metrics; its only minibatch is the first, so the ratio is 1 within float32 round-off."""
    cfg = tiny(tmp_path, "advantage={name: grpo}", f"loss={{name: {name}}}", "collector.n=2",
               "rewards=[{name: loop, n: 1}]",  # unigram repeats: rewards differ in a group
               "run.steps=1", "train.epochs=1", "train.minibatches=1")
    pipe = Pipeline(cfg, progress=False)
    assert type(pipe.updater.loss).__name__ == {"gspo": "GSPOLoss", "cispo": "CISPOLoss"}[name]
    pipe.train()
    row = rows(tmp_path)[-1]
    for key in ("loss/objective", "policy/loss", "policy/clipfrac", "policy/approx_kl",
                "train/grad_norm"):
        assert math.isfinite(row[key]), key
    assert row["train/grad_norm"] > 0 and row["policy/clipfrac"] == 0
    assert row["policy/approx_kl"] < 1e-10
    assert "value/loss" not in row  # grpo: no critic


@pytest.mark.parametrize("make, kwargs, line", [
    (GSPOLoss, {"clip_low": 0.2}, "loss 'gspo': clip_low=0.2: a per-token \\(PPO-scale\\) clip range"),
    (GSPOLoss, {"clip_high": 0.28}, "loss 'gspo': clip_high=0.28: a per-token"),
    (CISPOLoss, {"clip_low": 0.2}, "loss 'cispo': clip_low=0.2 puts a floor under the IS weight")])
def test_ppo_scale_clip_ranges_are_refused_unless_asked(make, kwargs, line):
    """Issue 54: PPO's clip_low 0.2 kept by `loss.name=gspo` is a range GSPO's sequence ratio
    never leaves (clip fraction 0: no clip at all); CISPO has no floor. Refused, one line; the
    explicit switch keeps them."""
    with pytest.raises(UserError, match=line):
        make(**kwargs)
    switch = {"wide_clip": True} if make is GSPOLoss else {"lower_bound": True}
    assert next(iter(kwargs.values())) in (make(**kwargs, **switch).clip_low,
                                          make(**kwargs, **switch).clip_high)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_switching_a_ppo_config_to_gspo_or_cispo_on_the_command_line_exits_2(name):
    config = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
    result = CliRunner().invoke(main, ["check", str(config), f"loss.name={name}"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith(f"error: loss '{name}': clip_low=0.2")
