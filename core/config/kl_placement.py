"""Where the KL penalty acts and which estimator it uses, chosen from the advantage's declaration
when the config leaves them out (``kl.in``, ``kl.estimator``), and the combinations refused.
"""

from __future__ import annotations

from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts import registry

WHERE = ("reward", "loss")
# kl.estimator when unset: k1 in the reward (an unbiased estimate of the KL the score pays);
# k2 in the loss, whose gradient on-policy is exactly the gradient of KL(pi || pi_ref) (k1's
# is 0 there: E[grad log pi] = 0; k3's is the gradient of the forward KL(pi_ref || pi))
DEFAULT_ESTIMATOR = {"reward": "k1", "loss": "k2"}


def resolve_placement(kl_cfg, advantage) -> None:
    """Fill in ``kl.in`` and ``kl.estimator`` where the config leaves them null (`KLConfig`):
    the place the advantage declares (``kl_in``, `rlpipe.core.contracts.registry.DECLARED`), and
    `DEFAULT_ESTIMATOR` for that place. The keys it chose are kept in ``kl_cfg.auto``, so that a
    later call for another advantage (a stage given from Python) chooses them again. k1 in the
    loss is refused: its expected gradient on-policy is 0, it regularises nothing.

    >>> from rlpipe.core.config.settings import KLConfig
    >>> class Grouped:
    ...     kl_in = "loss"
    >>> cfg = KLConfig(); resolve_placement(cfg, Grouped); (cfg.in_, cfg.estimator)
    ('loss', 'k2')
    >>> resolve_placement(cfg, object); (cfg.in_, cfg.estimator)
    ('reward', 'k1')
    >>> resolve_placement(KLConfig(estimator="k1"), Grouped)
    Traceback (most recent call last):
    ...
    rlpipe.core.base.errors.UserError: kl.estimator: k1 in the loss regularises nothing (its gradient, E[grad log pi], is 0 on-policy); set kl.estimator: k2 (the exact gradient of KL(pi || pi_ref)) or k3, or kl.in: reward
    """
    auto = kl_cfg.auto
    if auto is None:
        auto = tuple(name for name in ("in_", "estimator") if getattr(kl_cfg, name) is None)
    where = registry.declared("advantages", advantage, "kl_in") if "in_" in auto else kl_cfg.in_
    if where not in WHERE:
        raise UserError(f"{registry.label_of(advantage)} declares kl_in={where!r}; "
                        f"expected one of {', '.join(WHERE)}")
    estimator = DEFAULT_ESTIMATOR[where] if "estimator" in auto else kl_cfg.estimator
    if where == "loss" and estimator == "k1":
        raise UserError("kl.estimator: k1 in the loss regularises nothing (its gradient, "
                        "E[grad log pi], is 0 on-policy); set kl.estimator: k2 (the exact "
                        "gradient of KL(pi || pi_ref)) or k3, or kl.in: reward")
    kl_cfg.in_, kl_cfg.estimator, kl_cfg.auto = where, estimator, auto


def check_placement(where: str, coef: float, advantage, label: str) -> None:
    """``kl.in: reward`` with an advantage that divides each group's scores by their spread
    (declares ``group_normalised``, e.g. GRPO's std scaling) is refused when ``coef > 0``: the
    KL part of the scores would be blown up to unit-size advantages, noise as signal.

    >>> class Normalised:
    ...     group_normalised = True
    >>> check_placement("loss", 0.05, Normalised(), "advantage 'grpo'")
    >>> check_placement("reward", 0.05, Normalised(), "advantage 'grpo'")
    Traceback (most recent call last):
    ...
    rlpipe.core.base.errors.UserError: kl.in: reward puts -coef * KL into each sample's score, and advantage 'grpo' divides each group's scores by their std, which turns KL noise into unit-size advantages; set kl.in: loss (its default) or kl.coef: 0
    """
    if where == "reward" and coef > 0 and registry.declared("advantages", advantage,
                                                             "group_normalised"):
        raise UserError(f"kl.in: reward puts -coef * KL into each sample's score, and {label} "
                        f"divides each group's scores by their std, which turns KL noise into "
                        f"unit-size advantages; set kl.in: loss (its default) or kl.coef: 0")
