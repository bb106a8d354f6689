"""Where the KL penalty acts and which estimator it uses, chosen from the advantage's contract
when the config leaves them out (``kl.in``, ``kl.estimator``), and the combinations refused.
`rlpipe.core.config.plan.plan_run` asks once per plan; the config is never written.
"""

from __future__ import annotations

from rlpipe.core.base.errors import UserError

WHERE = ("reward", "loss")
# kl.estimator when unset: k1 in the reward (an unbiased estimate of the KL the score pays);
# k2 in the loss, whose gradient on-policy is exactly the gradient of KL(pi || pi_ref) (k1's
# is 0 there: E[grad log pi] = 0; k3's is the gradient of the forward KL(pi_ref || pi))
DEFAULT_ESTIMATOR = {"reward": "k1", "loss": "k2"}


def resolve_placement(kl_cfg, contract) -> tuple[str, str, tuple[str, ...]]:
    """``(where, estimator, chosen)``: ``kl.in`` and ``kl.estimator``, each the config's or, left
    null, the place the advantage's contract declares (``kl_in``) and `DEFAULT_ESTIMATOR` for
    that place; ``chosen`` names the keys chosen so. k1 in the loss is refused: its expected
    gradient on-policy is 0, it regularises nothing.

    >>> from rlpipe.core.config.settings import KLConfig
    >>> from rlpipe.core.contracts.kinds import AdvantageContract
    >>> grouped = AdvantageContract(kl_in="loss")
    >>> resolve_placement(KLConfig(), grouped), resolve_placement(KLConfig(), AdvantageContract())
    (('loss', 'k2', ('kl.in', 'kl.estimator')), ('reward', 'k1', ('kl.in', 'kl.estimator')))
    >>> resolve_placement(KLConfig(estimator="k1"), grouped)
    Traceback (most recent call last):
    ...
    rlpipe.core.base.errors.UserError: kl.estimator: k1 in the loss regularises nothing (its gradient, E[grad log pi], is 0 on-policy); set kl.estimator: k2 (the exact gradient of KL(pi || pi_ref)) or k3, or kl.in: reward
    """
    chosen = tuple(key for key, value in (("kl.in", kl_cfg.in_), ("kl.estimator", kl_cfg.estimator))
                   if value is None)
    where = contract.kl_in if "kl.in" in chosen else kl_cfg.in_
    estimator = DEFAULT_ESTIMATOR[where] if "kl.estimator" in chosen else kl_cfg.estimator
    if where == "loss" and estimator == "k1":
        raise UserError("kl.estimator: k1 in the loss regularises nothing (its gradient, "
                        "E[grad log pi], is 0 on-policy); set kl.estimator: k2 (the exact "
                        "gradient of KL(pi || pi_ref)) or k3, or kl.in: reward")
    return where, estimator, chosen


def check_placement(where: str, coef: float, contract, label: str) -> None:
    """``kl.in: reward`` with an advantage that divides each group's scores by their spread
    (its contract says ``group_normalised``, e.g. GRPO's std scaling) is refused when
    ``coef > 0``: the KL part of the scores would be blown up to unit-size advantages, noise as
    signal.

    >>> from rlpipe.core.contracts.kinds import AdvantageContract
    >>> normalised = AdvantageContract(group_normalised=True)
    >>> check_placement("loss", 0.05, normalised, "advantage 'grpo'")
    >>> check_placement("reward", 0.05, normalised, "advantage 'grpo'")
    Traceback (most recent call last):
    ...
    rlpipe.core.base.errors.UserError: kl.in: reward puts -coef * KL into each sample's score, and advantage 'grpo' divides each group's scores by their std, which turns KL noise into unit-size advantages; set kl.in: loss (its default) or kl.coef: 0
    """
    if where == "reward" and coef > 0 and contract.group_normalised:
        raise UserError(f"kl.in: reward puts -coef * KL into each sample's score, and {label} "
                        f"divides each group's scores by their std, which turns KL noise into "
                        f"unit-size advantages; set kl.in: loss (its default) or kl.coef: 0")
