"""Checks at the boundaries between core and plugin code, so that a bad value names its source.

A plugin's output of the wrong kind, or a NaN or inf it wrote, stops the run with one `UserError`
line naming the plugin (``advantage (rlpipe.advantages:gae (rlpipe 0.1.0))``); a non-finite KL
says which log-probs (actor's or reference's) were not finite, or that the estimator overflowed.

>>> import torch
>>> from tensordict import TensorDict
>>> td = TensorDict({"response_mask": torch.tensor([[True, False]]),
...                  "advantage": torch.tensor([[1.0, float("nan")]])}, batch_size=[1])
>>> check_output(td, torch.nn.Identity(), ("advantage",)) is td   # NaN on padding only: fine
True
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from rlpipe.core.contracts import registry
from rlpipe.core.base import schema
from rlpipe.core.base.errors import UserError

S = schema


def nonfinite(value, mask: torch.Tensor | None = None) -> int:
    """How many entries of ``value`` are NaN or inf (only where ``mask`` is true, when it has the
    same shape); 0 for a non-float tensor or a non-tensor."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return 0
    value = value.detach()
    if mask is not None and mask.shape == value.shape:
        value = value[mask.to(value.device)]
    return int((~torch.isfinite(value)).sum())


def check_output(td, plugin, keys: tuple = (), required: tuple = ()):
    """``td`` if it is a TensorDict that holds ``required`` and whose ``keys`` (where present)
    are finite on response tokens; else a `UserError` naming ``plugin``, which returned ``td``."""
    who = registry.label_of(plugin)
    if not isinstance(td, TensorDictBase):
        raise UserError(f"{who} returned {type(td).__name__}; expected the batch TensorDict")
    mask = td.get(S.RESPONSE_MASK, None)
    missing = [k for k in required if k not in td.keys()]
    if missing:
        raise UserError(f"{who} did not write {', '.join(map(repr, missing))} into the batch")
    bad = {k: n for k in keys if (n := nonfinite(td.get(k, None), mask))}
    if bad:
        where = ", ".join(f"{k!r} at {n}" for k, n in bad.items())
        total = int(mask.sum()) if mask is not None else "all"
        raise UserError(f"{who} wrote NaN or inf: {where} of {total} response tokens")
    return td


def check_kl(td, kl_tok: torch.Tensor, estimator: str) -> None:
    """A non-finite per-token KL names its cause: the actor's (``old_log_prob``) or the
    reference's (``ref_log_prob``) log-probs, or the estimator overflowing on finite ones.
    Non-finite log-probs are an error even where ``kl.clamp`` made their KL finite."""
    mask = td[S.RESPONSE_MASK]
    owners = {S.OLD_LOG_PROB: "actor", S.REF_LOG_PROB: "reference"}
    broken = ~torch.isfinite(kl_tok)  # everywhere: core multiplies by the mask, and NaN * 0 is NaN
    for key in owners:
        broken |= ~torch.isfinite(td[key])
    n = int(broken.sum())
    if not n:
        return
    bad = [f"{k} ({owners[k]}) at {c}" for k in owners if (c := nonfinite(td[k]))]
    if bad:
        cause = f"non-finite {' and '.join(bad)} positions (weights or logits not finite)"
    else:
        cause = (f"the {estimator} estimator overflowed on finite log-probs (k1 cannot "
                 f"overflow); set kl.clamp (10 bounds the log-ratio to +-10)")
    raise UserError(f"KL to the reference is NaN or inf at {n} of {kl_tok.numel()} token "
                    f"positions ({int(mask.sum())} response tokens): {cause}")


def loss_terms(out, loss) -> list[str]:
    """The ``loss_*`` keys of a loss plugin's output; a `UserError` naming ``loss`` when the
    output is not a TensorDict of tensors with at least one such key."""
    if not isinstance(out, TensorDictBase):
        raise UserError(f"{registry.label_of(loss)} returned {type(out).__name__}; expected a "
                        f"TensorDict with loss_* entries")
    terms = [k for k in out.keys() if isinstance(k, str) and k.startswith("loss_")]
    if not terms:
        raise UserError(f"{registry.label_of(loss)} returned no loss_* entry "
                        f"(keys: {', '.join(map(str, out.keys())) or 'none'})")
    if torch.is_grad_enabled() and not any(getattr(out[k], "requires_grad", False) for k in terms):
        raise UserError(f"{registry.label_of(loss)}: none of its loss terms ({', '.join(terms)}) "
                        f"has a gradient, so nothing would train; compute them from the batch's "
                        f"log_prob (and value_pred), not under torch.no_grad or .detach()")
    return terms
