"""PPOLoss against a float64 plain-loop oracle; micro-batch split invariance; masking; its KL
term (kl.in: loss) and its pooled explained variance."""

import math
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from rlpipe.core.base.errors import UserError
from rlpipe.core.step.kl import KLPenalty
from rlpipe.core.step.loss import add_parts, finish, micro_parts
from rlpipe.core.base.schema import (ADVANTAGE, ENTROPY, LOG_PROB, NUM_SEQS, NUM_TOKENS,
                                OLD_LOG_PROB, REF_LOG_PROB, RESPONSE_MASK, VALUE, VALUE_PRED,
                                VALUE_TARGET)
from rlpipe.plugins.losses.ppo import AGG_MODES, PPOLoss

LENGTHS = [5, 2, 0, 3, 5, 1, 4, 0]  # full-length and zero-length rows included
R = 5
FLOAT_KEYS = [LOG_PROB, OLD_LOG_PROB, ADVANTAGE, ENTROPY, VALUE_PRED, VALUE, VALUE_TARGET]


def make_batch(seed=0, garbage=0.0, lengths=LENGTHS):
    """float64 minibatch; padding positions hold ``garbage`` times a random sign."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(R) < torch.tensor(lengths).unsqueeze(-1)

    def rand(scale=1.0, shift=0.0):
        return shift + scale * torch.randn(len(lengths), R, generator=gen, dtype=torch.float64)
    old = rand(0.5, -2.0)
    value = rand()
    data = {OLD_LOG_PROB: old, LOG_PROB: old + rand(0.6), ADVANTAGE: rand(),
            ENTROPY: rand(0.3, 1.0).abs(), VALUE: value, VALUE_PRED: value + rand(0.4),
            VALUE_TARGET: rand()}
    sign = torch.randn(len(lengths), R, generator=gen).sign().to(torch.float64)
    data = {k: torch.where(mask, v, garbage * sign) for k, v in data.items()}
    return TensorDict({**data, RESPONSE_MASK: mask}, batch_size=[len(lengths)])


def huber(e):
    return 0.5 * e * e if abs(e) <= 1 else abs(e) - 0.5


def per_token_oracle(x, cfg):
    """Plain-Python per-token policy and value losses and clip indicators for one token."""
    clip_low = cfg.get("clip_low", 0.2)
    clip_high = clip_low if cfg.get("clip_high") is None else cfg["clip_high"]
    ratio = math.exp(x[LOG_PROB] - x[OLD_LOG_PROB])
    adv = x[ADVANTAGE]
    s1, s2 = -adv * ratio, -adv * min(max(ratio, 1 - clip_low), 1 + clip_high)
    pg, lower = max(s1, s2), False
    if cfg.get("dual_clip") is not None and adv < 0 and pg > -cfg["dual_clip"] * adv:
        pg, lower = -cfg["dual_clip"] * adv, True
    f = huber if cfg.get("value_loss") == "huber" else (lambda e: 0.5 * e * e)
    vl = f(x[VALUE_PRED] - x[VALUE_TARGET])
    vclipped = False
    if cfg.get("value_clip", 0.2) is not None:
        c = cfg.get("value_clip", 0.2)
        v = x[VALUE] + min(max(x[VALUE_PRED] - x[VALUE], -c), c)
        vclipped = f(v - x[VALUE_TARGET]) > vl
        vl = max(vl, f(v - x[VALUE_TARGET]))
    log_ratio = x[LOG_PROB] - x[OLD_LOG_PROB]
    return {"pg": pg, "vl": vl, "ent": x[ENTROPY], "clip": float(s2 > s1), "lower": float(lower),
            "kl": 0.5 * log_ratio ** 2, "vclip": float(vclipped)}


def oracle(td, cfg):
    """float64 loop oracle of PPOLoss's losses and metrics over the whole batch ``td``."""
    rows = []
    for b, n in enumerate(td[RESPONSE_MASK].sum(-1).tolist()):
        rows.append([per_token_oracle({k: td[k][b, t].item() for k in FLOAT_KEYS}, cfg)
                     for t in range(n)])
    tokens = [tok for row in rows for tok in row]

    def agg(name):
        mode = cfg.get("agg", "token-mean")
        if mode == "token-mean":
            return sum(tok[name] for tok in tokens) / len(tokens)
        sums = [sum(tok[name] for tok in row) for row in rows]
        if mode == "seq-mean-token-mean":
            sums = [s / len(row) if row else 0.0 for s, row in zip(sums, rows)]
        return sum(sums) / max(1, sum(1 for row in rows if row))  # non-empty sequences

    def mean(name):
        return sum(tok[name] for tok in tokens) / len(tokens)
    targets = [td[VALUE_TARGET][b, t].item() for b, row in enumerate(rows) for t in range(len(row))]
    preds = [td[VALUE_PRED][b, t].item() for b, row in enumerate(rows) for t in range(len(row))]
    resid = [y - p for y, p in zip(targets, preds)]
    return {"loss_objective": agg("pg"), "loss_critic": cfg.get("vf_coef", 0.5) * agg("vl"),
            "loss_entropy": -cfg.get("entropy_coef", 0.0) * agg("ent"),
            ("policy", "loss"): mean("pg"), ("policy", "clipfrac"): mean("clip"),
            ("policy", "clipfrac_lower"): mean("lower"), ("policy", "approx_kl"): mean("kl"),
            ("policy", "entropy"): mean("ent"), ("value", "loss"): mean("vl"),
            ("value", "clipfrac"): mean("vclip"),
            ("value", "explained_var"): 1 - pop_var(resid) / pop_var(targets)}


def pop_var(xs):
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


CONFIGS = [
    {},
    {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 2.0, "entropy_coef": 0.01},
    {"clip_low": 0.1, "clip_high": 0.3, "value_clip": None, "value_loss": "huber", "vf_coef": 1.0},
    {"clip_low": 0.15, "dual_clip": 1.5, "value_clip": 0.1, "value_loss": "huber",
     "entropy_coef": 0.1},
]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("cfg", CONFIGS)
def test_matches_float64_loop_oracle(cfg, agg):
    cfg = {**cfg, "agg": agg}
    td = make_batch(seed=1)
    out = PPOLoss(**cfg)(td)
    expected = oracle(td, cfg)
    if not cfg.get("entropy_coef"):
        assert "loss_entropy" not in out.keys()
        del expected["loss_entropy"]
    for key, value in expected.items():
        assert out[key].item() == pytest.approx(value, rel=1e-10, abs=1e-12), key
    assert out[("policy", "clipfrac")] > 0  # the data exercises clipping
    if cfg.get("dual_clip"):
        assert out[("policy", "clipfrac_lower")] > 0
    if cfg.get("value_clip", 0.2) is not None:
        assert out[("value", "clipfrac")] > 0


def test_ratio_one_gives_minus_mean_advantage_and_no_clipping():
    td = make_batch(seed=2, garbage=1e4)
    td[LOG_PROB] = td[OLD_LOG_PROB].clone()
    out = PPOLoss(dual_clip=2.0)(td)
    mask = td[RESPONSE_MASK]
    valid = [a for a, m in zip(td[ADVANTAGE].flatten().tolist(), mask.flatten().tolist()) if m]
    assert out["loss_objective"].item() == pytest.approx(-sum(valid) / len(valid), rel=1e-12)
    for key in ["clipfrac", "clipfrac_lower", "approx_kl"]:
        assert out[("policy", key)].item() == 0.0


def loss_sum(out):
    return sum(out[k] for k in ["loss_objective", "loss_critic", "loss_entropy"] if k in out.keys())


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batch_split_invariance(agg):
    base = make_batch(seed=3)
    num_tokens = float(base[RESPONSE_MASK].sum())
    loss = PPOLoss(clip_high=0.3, dual_clip=2.0, entropy_coef=0.05, agg=agg)
    results = []
    for splits in (1, 2, 4):
        td = base.clone()
        leaves = {k: td[k].detach().requires_grad_() for k in [LOG_PROB, VALUE_PRED, ENTROPY]}
        td.update(leaves)
        td[NUM_TOKENS] = torch.full((len(td),), num_tokens, dtype=torch.float64)
        td[NUM_SEQS] = torch.full((len(td),), float(td[RESPONSE_MASK].any(-1).sum()),
                                  dtype=torch.float64)
        outs = [loss(micro) for micro in td.split(len(td) // splits)]
        total = sum(loss_sum(out) for out in outs)
        total.backward()
        parts = {k: sum(out[k] for out in outs).item()
                 for k in ["loss_objective", "loss_critic", "loss_entropy"]}
        results.append((total.item(), parts, {k: v.grad for k, v in leaves.items()}))
    whole = loss(base)  # no counts: falls back to the local counts of the whole batch
    assert results[0][0] == pytest.approx(loss_sum(whole).item(), rel=1e-12)
    for total, parts, grads in results[1:]:
        assert total == pytest.approx(results[0][0], rel=1e-12)
        assert parts == pytest.approx(results[0][1], rel=1e-12)
        for key, grad in grads.items():
            torch.testing.assert_close(grad, results[0][2][key], rtol=1e-12, atol=1e-15)


def test_garbage_on_padding_changes_nothing():
    loss = PPOLoss(clip_high=0.28, dual_clip=3.0, entropy_coef=0.01)
    results = []
    for garbage in (0.0, 1e4):
        td = make_batch(seed=4, garbage=garbage)
        leaves = {k: td[k].requires_grad_() for k in [LOG_PROB, VALUE_PRED, ENTROPY]}
        out = loss(td)
        loss_sum(out).backward()
        results.append((out.detach(), {k: v.grad for k, v in leaves.items()}))
    (clean, clean_grads), (dirty, dirty_grads) = results
    assert (clean == dirty).all()
    for key, grad in clean_grads.items():
        assert (grad[~td[RESPONSE_MASK]] == 0).all()
        torch.testing.assert_close(dirty_grads[key], grad, rtol=0, atol=0)


def test_all_empty_micro_batch_is_finite_and_zero():
    td = make_batch(seed=7, garbage=1e4, lengths=[0, 0, 0])
    out = PPOLoss(entropy_coef=0.1, agg="seq-mean-token-mean")(td)
    assert all(torch.isfinite(v).all() for v in out.values(include_nested=True, leaves_only=True))
    assert loss_sum(out).item() == 0.0


def test_optional_inputs_and_detached_metrics():
    td = make_batch(seed=5).exclude(VALUE_PRED, VALUE, ENTROPY)
    td[LOG_PROB].requires_grad_()
    out = PPOLoss(entropy_coef=0.1)(td)
    assert set(out.keys()) == {"loss_objective", "policy"}
    assert out["loss_objective"].requires_grad
    assert not any(v.requires_grad for v in out["policy"].values())
    unclipped = PPOLoss(value_clip=None)(make_batch(seed=5).exclude(VALUE))
    assert {"loss_critic", "value"} <= set(unclipped.keys())


def test_set_keys_renames_inputs():
    td = make_batch(seed=6)
    renamed = td.clone().rename_key_(LOG_PROB, ("actor", "lp"))
    loss = PPOLoss()
    loss.set_keys(log_prob=("actor", "lp"))
    assert ("actor", "lp") in loss.in_keys
    torch.testing.assert_close(loss(renamed), PPOLoss()(td), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs", [
    {"clip_low": 0.0}, {"clip_low": 1.0}, {"clip_low": None}, {"clip_high": -0.1},
    {"dual_clip": 1.0}, {"dual_clip": "3"}, {"log_ratio_clamp": 0.0}, {"vf_coef": -1.0},
    {"value_clip": 0.0}, {"value_clip": float("inf")}, {"entropy_coef": -0.01},
    {"value_loss": "l1"}, {"agg": "mean"}, {"vf_coef": True}])
def test_bad_arguments_raise_user_error(kwargs):
    with pytest.raises(UserError, match=next(iter(kwargs))):
        PPOLoss(**kwargs)


KL_FORMULAS = {"k1": lambda lp, ref: lp - ref, "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
               "k3": lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1}


@pytest.mark.parametrize("estimator", sorted(KL_FORMULAS))
def test_kl_term_uses_the_configured_estimator_and_splits(estimator):
    """With the run's penalty handed over (kl.in: loss), loss_kl = coef * sum KL / num_tokens
    (its estimator, float64 loop oracle); its micro-batch parts add up; without a penalty, or
    with kl.in: reward, no loss_kl."""
    base = make_batch(seed=8, garbage=1e4)
    gen = torch.Generator().manual_seed(9)
    ref = base[OLD_LOG_PROB] + 0.5 * torch.randn(base[OLD_LOG_PROB].shape, generator=gen,
                                                 dtype=torch.float64)
    base[REF_LOG_PROB] = torch.where(base[RESPONSE_MASK], ref, -1e4)
    mask, n = base[RESPONSE_MASK], float(base[RESPONSE_MASK].sum())
    expected = 0.3 * sum(KL_FORMULAS[estimator](base[LOG_PROB][b, t].item(), ref[b, t].item())
                         for b, t in mask.nonzero().tolist()) / n
    loss = PPOLoss()
    assert "loss_kl" not in loss(base).keys()
    settings = SimpleNamespace(estimator=estimator, clamp=None, in_="reward", coef=0.3,
                               target=None, horizon=1)
    loss.set_kl(KLPenalty(settings))
    assert "loss_kl" not in loss(base).keys()
    settings.in_ = "loss"
    loss.set_kl(KLPenalty(settings))
    assert loss(base)["loss_kl"].item() == pytest.approx(expected, rel=1e-12)
    base[NUM_TOKENS] = torch.full((len(base),), n, dtype=torch.float64)
    parts = sum(loss(micro)["loss_kl"] for micro in base.split(3))
    assert parts.item() == pytest.approx(expected, rel=1e-12)


def test_explained_var_pools_over_micro_batches():
    """The sums PPOLoss writes pool to the whole batch's explained variance (float64 oracle)
    for 1 and 3 micro-batches; each micro-batch's own entry is its own explained variance."""
    td = make_batch(seed=10, garbage=1e4)
    expected = oracle(td, {})[("value", "explained_var")]
    loss = PPOLoss()
    for splits in (1, 3):
        total = {}
        for micro in td.tensor_split(splits):
            out = loss(micro)
            _, parts = micro_parts(out, loss.contract, float(micro[RESPONSE_MASK].sum()),
                                   float(len(micro)))
            add_parts(total, parts)
        pooled = finish(total, loss.contract)
        assert pooled["value/explained_var"] == pytest.approx(expected, abs=1e-6), splits
        assert "value/explained_var_sums" not in pooled
    assert loss(td)[("value", "explained_var")].item() == pytest.approx(expected, rel=1e-10)
