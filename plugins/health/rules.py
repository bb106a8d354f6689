"""The built-in health rules: the PPO-for-RLHF troubleshooting table, as checks.

Each rule is registered under the entry-point group ``rlpipe.health`` (rlpipe's pyproject) like a
third-party one. Windowed rules judge full windows only (no verdict before ``window`` steps), and
every rule is quiet where a metric it reads was not logged (a critic-free run has no ``value/*``).

>>> from rlpipe.core.contracts.rule import History
>>> rows = [{"step": s, "policy/clipfrac": c} for s, c in enumerate([0.1, 0.6, 0.7, 0.8], 1)]
>>> ClipHigh().check(History(rows))
'policy/clipfrac 0.7 (mean of steps 2-4) > 0.5'
>>> ClipHigh(threshold=0.9).check(History(rows)) is None
True
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from rlpipe.core.contracts.rule import History, Rule, finite, halves, mean, slope
from rlpipe.core.base.yamlconf import num


def _span(h: History, n: int) -> str:
    """``steps A-B``: the newest ``n`` steps up to the judged one."""
    return f"steps {h.rows[max(0, h.end - n)]['step']}-{h.step}"


def _per_token_kl(h: History, n: int) -> list[float]:
    """``kl/ref / response/length`` of the newest ``n`` steps that logged both."""
    rows = h.rows[max(0, h.end - n):h.end]
    return [r["kl/ref"] / r["response/length"] for r in rows
            if finite(r.get("kl/ref")) and finite(r.get("response/length"))
            and r["response/length"] > 0]


@dataclass
class KLExplosion(Rule):
    """KL to the reference per response token above ``threshold``, or rising faster than
    ``rate`` per step (least-squares slope over the last ``window`` steps)."""

    window: int = num(5, "in [2, 1000]")
    threshold: float = num(1.0, "> 0")   # nats per response token
    rate: float = num(0.1, "> 0")        # nats per response token, per step
    reads = ("kl/ref", "response/length")
    panel = "kl"
    remedy = ("the policy leaves the reference too fast: raise kl.coef or set kl.target "
              "(adaptive), lower train.lr, or set train.target_kl")

    def check(self, h: History) -> str | None:
        kl = _per_token_kl(h, self.window)
        if not kl or len(_per_token_kl(h, 1)) != 1:
            return None
        if kl[-1] > self.threshold:
            return (f"kl/ref {h.latest['kl/ref']:.3g} nats = {kl[-1]:.3g} per response token "
                    f"> {self.threshold:g}")
        if len(kl) == self.window and slope(kl) > self.rate:
            return (f"kl/ref per response token rose {slope(kl):.3g} per step over "
                    f"{_span(h, self.window)} ({kl[0]:.3g} -> {kl[-1]:.3g}) > {self.rate:g}")
        return None


@dataclass
class KLNonzeroAtStart(Rule):
    """``kl/ref`` at step 1, before any update, not ≈ 0: actor and reference differ."""

    threshold: float = num(1e-3, "> 0")  # nats per response token
    reads = ("kl/ref", "response/length")
    panel = "kl"
    remedy = ("actor and reference disagree before any update (rlpipe starts both from the same "
              "weights): suspect numerics, models.actor.dtype bfloat16/float16 or "
              "distributed.bf16, or a plugin that changes the actor before step 1")

    def check(self, h: History) -> str | None:
        if h.step != 1:
            return None
        kl = _per_token_kl(h, 1)
        if kl and abs(kl[0]) > self.threshold:
            return (f"kl/ref {h.latest['kl/ref']:.3g} nats = {kl[0]:.3g} per response token at "
                    f"step 1 (|.| > {self.threshold:g})")
        return None


def _trend(h: History, key: str, n: int) -> tuple[float, float] | None:
    """Older- and newer-half means of ``key`` over a full window of ``n`` steps, else None."""
    values = h.last(key, n)
    return halves(values) if len(values) == n else None


@dataclass
class RewardHackingLength(Rule):
    """Over the last ``window`` steps (newer half against older half): ``reward/score`` rises,
    ``response/length`` rises by at least ``threshold`` (relative), and another reward part
    falls by more than ``drop``: the policy trades the rule-based parts for length the reward
    model likes. Quiet for a run with a single reward part."""

    window: int = num(10, "in [4, 1000]")
    threshold: float = num(0.25, "> 0")  # relative rise of response/length
    drop: float = num(0.01, ">= 0")      # fall of a reward part, in its own units
    reads = ("reward/score", "response/length", "reward/")
    panel = "length"
    remedy = ("the score climbs with response length: add or tighten a length reward "
              "(rewards: name length, max_tokens, per_token), raise kl.coef, or set reward.clip")

    def check(self, h: History) -> str | None:
        score, length = _trend(h, "reward/score", self.window), _trend(h, "response/length", self.window)
        if score is None or length is None or not (score[1] > score[0] and length[0] > 0):
            return None
        rise = length[1] / length[0] - 1
        if rise < self.threshold:
            return None
        parts = {k: _trend(h, k, self.window) for k in h.names("reward/") if k != "reward/score"}
        falling = [f"{k} {a:.3g} -> {b:.3g}" for k, t in parts.items() if t is not None
                   for a, b in [t] if b < a - self.drop]
        if not falling:
            return None
        return (f"over {_span(h, self.window)} response/length {length[0]:.3g} -> {length[1]:.3g} "
                f"(+{100 * rise:.0f}%) and reward/score {score[0]:.3g} -> {score[1]:.3g} while "
                f"{', '.join(falling)}")


@dataclass
class RewardHackingLoop(Rule):
    """Over the last ``window`` steps (newer half against older half): ``reward/score`` rises
    while the loop reward (label ``part``) falls by more than ``threshold``."""

    window: int = num(10, "in [4, 1000]")
    threshold: float = num(0.05, "> 0")  # fall of the loop reward, in its own units
    part: str = "loop"                   # the loop reward's label (rewards[i].label, else its name)
    reads = ("reward/score", "reward/<part>")
    panel = "reward"
    remedy = ("the score rises while responses repeat themselves more: raise the loop reward's "
              "weight or penalty (rewards[i].weight), raise kl.coef, or set reward.clip")

    def check(self, h: History) -> str | None:
        score = _trend(h, "reward/score", self.window)
        loop = _trend(h, f"reward/{self.part}", self.window)
        if score is None or loop is None or not (score[1] > score[0]):
            return None
        if loop[1] >= loop[0] - self.threshold:
            return None
        return (f"over {_span(h, self.window)} reward/{self.part} {loop[0]:.3g} -> {loop[1]:.3g} "
                f"while reward/score {score[0]:.3g} -> {score[1]:.3g}")


@dataclass
class ValueNotLearning(Rule):
    """From step ``after`` on: ``value/explained_var`` below ``threshold`` on average over the
    last ``window`` steps, or ``value/loss`` flat (its spread over the window at most ``flat``
    times its mean): the critic explains none of the returns."""

    window: int = num(5, "in [2, 1000]")
    threshold: float = num(0.0, "<= 1")  # explained-variance floor
    after: int = num(8, ">= 1")          # a fresh value head starts below 0: judge from this step
    flat: float = num(1e-4, ">= 0")      # relative spread of value/loss that counts as flat
    reads = ("value/explained_var", "value/loss")
    panel = "explained_var"
    remedy = ("the critic is not learning: raise train.critic_lr, give it train.critic_warmup_steps, "
              "loosen loss.value_clip (null for a fresh value head) or raise loss.vf_coef; a short "
              "run on few rollouts may end before a fresh critic catches up: pretrain it on the "
              "reward model's prefix scores (train.critic_pretrain_rollouts), or use a group "
              "estimator (advantage.name: grpo or rloo, collector.n >= 2), which needs none")

    def check(self, h: History) -> str | None:
        if h.step < self.after:
            return None
        ev = h.last("value/explained_var", self.window)
        if len(ev) == self.window and mean(ev) < self.threshold:
            return (f"value/explained_var {mean(ev):.3g} (mean of {_span(h, self.window)}) "
                    f"< {self.threshold:g}")
        loss = h.last("value/loss", self.window)
        if len(loss) == self.window and max(loss) - min(loss) <= self.flat * abs(mean(loss)):
            return f"value/loss flat at {mean(loss):.4g} over {_span(h, self.window)}"
        return None


@dataclass
class ClipHigh(Rule):
    """``policy/clipfrac`` above ``threshold`` on average over the last ``window`` steps: most
    tokens' ratios are clipped, the update is too large for the trust region."""

    window: int = num(3, "in [1, 1000]")
    threshold: float = num(0.5, "in (0, 1)")
    reads = ("policy/clipfrac",)
    panel = "clipfrac"
    remedy = ("each update moves the policy too far: lower train.lr, use fewer train.epochs, "
              "set train.target_kl, or raise loss.clip_low")

    def check(self, h: History) -> str | None:
        clip = h.last("policy/clipfrac", self.window)
        if len(clip) == self.window and mean(clip) > self.threshold:
            where = f"mean of {_span(h, self.window)}" if self.window > 1 else f"step {h.step}"
            return f"policy/clipfrac {mean(clip):.3g} ({where}) > {self.threshold:g}"
        return None


@dataclass
class EntropyCollapse(Rule):
    """``policy/entropy`` over the last ``window`` steps below ``threshold`` times its level over
    the first ``window`` steps: the policy has become nearly deterministic."""

    window: int = num(5, "in [1, 1000]")
    threshold: float = num(0.1, "in (0, 1)")  # fraction of the starting entropy
    reads = ("policy/entropy",)
    panel = "entropy"
    remedy = ("the policy stops exploring: raise loss.entropy_coef, collector.temperature or "
              "kl.coef, or lower train.lr")

    def check(self, h: History) -> str | None:
        start, now = h.first("policy/entropy", self.window), h.last("policy/entropy", self.window)
        if len(now) < self.window or h.step <= self.window or mean(start) <= 0:
            return None
        if mean(now) < self.threshold * mean(start):
            return (f"policy/entropy {mean(now):.3g} (mean of {_span(h, self.window)}) < "
                    f"{self.threshold:g} x its start {mean(start):.3g}")
        return None


@dataclass
class GradSpikes(Rule):
    """The actor's or critic's gradient norm (before clipping) above ``threshold`` times its
    median over the previous ``window`` steps (at least 3 of them)."""

    window: int = num(20, "in [3, 1000]")
    threshold: float = num(10.0, "> 1")  # factor over the median
    reads = ("train/grad_norm", "train/critic_grad_norm")
    panel = "grad_norm"
    remedy = ("a gradient spike (outliers in advantages or rewards, a learning rate too high): "
              "keep train.max_grad_norm set, lower train.lr or train.critic_lr, add "
              "train.warmup_steps, or set reward.clip")

    def check(self, h: History) -> str | None:
        for key in self.reads:
            values = h.last(key, self.window + 1)
            if not finite(h.latest.get(key)) or len(values) < 4:
                continue
            median = statistics.median(values[:-1])
            if median > 0 and values[-1] > self.threshold * median:
                return (f"{key} {values[-1]:.3g} = {values[-1] / median:.3g} x the median "
                        f"{median:.3g} of the {len(values) - 1} steps before")
        return None


def _clipped(row: dict) -> float | None:
    """The fraction of responses cut at max_new_tokens: ``response/clipped_frac``, else
    ``1 - response/finished_frac`` (EOS counts as finished)."""
    if finite(row.get("response/clipped_frac")):
        return float(row["response/clipped_frac"])
    if finite(row.get("response/finished_frac")):
        return 1.0 - float(row["response/finished_frac"])
    return None


@dataclass
class Truncation(Rule):
    """More than ``threshold`` of the responses cut at ``max_new_tokens`` on average over the
    last ``window`` steps: the score of a cut response judges an unfinished answer."""

    window: int = num(3, "in [1, 1000]")
    threshold: float = num(0.5, "in [0, 1)")
    reads = ("response/clipped_frac", "response/finished_frac")
    panel = "length"
    remedy = ("most responses hit the token limit: raise collector.max_new_tokens, or penalise "
              "cut responses (the length reward's truncated_penalty or buffer); check "
              "collector.stop_strings and the EOS token")

    def check(self, h: History) -> str | None:
        cut = [c for c in map(_clipped, h.rows[max(0, h.end - self.window):h.end]) if c is not None]
        if len(cut) == self.window and mean(cut) > self.threshold:
            where = f"mean of {_span(h, self.window)}" if self.window > 1 else f"step {h.step}"
            return f"{mean(cut):.0%} of responses cut at max_new_tokens ({where}) > {self.threshold:.0%}"
        return None


@dataclass
class NanSkips(Rule):
    """More than ``threshold`` minibatches skipped for a non-finite loss or gradient over the
    last ``window`` steps."""

    window: int = num(1, "in [1, 1000]")
    threshold: int = num(0, ">= 0")
    reads = ("train/skipped_minibatches",)
    panel = "skipped"
    remedy = ("non-finite losses or gradients: lower train.lr, keep train.max_grad_norm set, "
              "train in float32 (models.actor.dtype, models.autocast, distributed.bf16), or set "
              "reward.clip; train.max_bad_steps in a row stop the run")

    def check(self, h: History) -> str | None:
        skipped = h.last("train/skipped_minibatches", self.window)
        if skipped and sum(skipped) > self.threshold:
            where = f"over {_span(h, self.window)}" if self.window > 1 else f"at step {h.step}"
            return f"{sum(skipped):g} minibatch(es) skipped {where} (non-finite loss or gradient)"
        return None


@dataclass
class FlatGroups(Rule):
    """More than ``threshold`` of the groups (the samples of one prompt) scored all their samples
    the same, on average over the last ``window`` steps: a group-relative advantage (grpo, rloo)
    is 0 for them, and those prompts teach nothing. Groups whose samples are one and the same
    response (``response/identical_frac``: temperature 0) are said at once, from step 1.

    >>> from rlpipe.core.contracts.rule import History
    >>> FlatGroups().check(History([{"step": s, "reward/zero_std_frac": 0.9} for s in (1, 2, 3)]))
    'reward/zero_std_frac 0.9 (mean of steps 1-3) > 0.5: most groups carry no reward signal'
    >>> FlatGroups().check(History([{"step": 1, "response/identical_frac": 1.0}]))
    'response/identical_frac 1 at step 1 > 0.5: most groups sampled one response n times (collector.temperature 0?), so they carry no reward signal'
    """

    window: int = num(3, "in [1, 1000]")
    threshold: float = num(0.5, "in [0, 1)")
    reads = ("reward/zero_std_frac", "response/identical_frac")
    panel = "reward"
    remedy = ("most prompts get the same score for every sample: make the reward graded "
              "(partial credit), raise collector.n or collector.temperature (above 0: at 0 "
              "every sample of a prompt is the same response), use prompts the policy solves "
              "sometimes (not always or never)")

    def check(self, h: History) -> str | None:
        same = h.latest.get("response/identical_frac")
        if finite(same) and same > self.threshold:
            return (f"response/identical_frac {same:.3g} at step {h.step} > {self.threshold:g}: "
                    f"most groups sampled one response n times (collector.temperature 0?), so "
                    f"they carry no reward signal")
        flat = h.last("reward/zero_std_frac", self.window)
        if len(flat) == self.window and finite(h.latest.get("reward/zero_std_frac")) \
                and mean(flat) > self.threshold:
            where = f"mean of {_span(h, self.window)}" if self.window > 1 else f"step {h.step}"
            return (f"reward/zero_std_frac {mean(flat):.3g} ({where}) > {self.threshold:g}: "
                    f"most groups carry no reward signal")
        return None


@dataclass
class BoundaryDrift(Rule):
    """Conversations whose turn boundaries differ from the chat template's rendering, at any step
    (``env/receipt/boundary_drift`` above ``threshold``): a separator dropped or added between
    turns, a template that does not match the one the rows were built with. Unlike
    ``assistant_drift`` (the model's own words re-encode differently: harmless) this is a bug:
    the policy trains on token sequences its template would never produce.

    >>> from rlpipe.core.contracts.rule import History
    >>> BoundaryDrift().check(History([{"step": 4, "env/receipt/boundary_drift": 0.25}]))
    'env/receipt/boundary_drift 0.25 at step 4 > 0: that fraction of the conversations have turn boundaries the chat template renders differently'
    >>> BoundaryDrift().check(History([{"step": 1, "env/receipt/boundary_drift": 0.0}])) is None
    True
    """

    threshold: float = num(0.0, "in [0, 1)")
    reads = ("env/receipt/boundary_drift",)
    panel = "env"
    remedy = ("the rows' turn boundaries differ from the chat template's rendering (a dropped "
              "turn separator, a template other than the tokenizer's): check "
              "the tokenizer's chat template and the environment's messages (their roles, a "
              "trailing newline); samples/step-N.jsonl shows each conversation's receipt")

    def check(self, h: History) -> str | None:
        drift = h.latest.get("env/receipt/boundary_drift")
        if not finite(drift) or drift <= self.threshold:
            return None
        return (f"env/receipt/boundary_drift {drift:.3g} at step {h.step} > {self.threshold:g}: "
                f"that fraction of the conversations have turn boundaries the chat template "
                f"renders differently")


@dataclass
class ToolsAbandoned(Rule):
    """``env/tool_calls`` (per conversation) over the last ``window`` steps below ``threshold``
    times its level over the first ``window`` steps (judged from step ``2 * window``; quiet for
    a run that started without calling tools): the policy stopped calling its tools.

    >>> from rlpipe.core.contracts.rule import History
    >>> calls = [1.0] * 4 + [0.1] * 4
    >>> ToolsAbandoned(window=4).check(History([{"step": s, "env/tool_calls": c} for s, c in enumerate(calls, 1)]))
    'env/tool_calls 0.1 per conversation (mean of steps 5-8) < 0.25 x its start 1 (mean of its first 4 steps): the policy stopped calling its tools'
    """

    window: int = num(5, "in [1, 1000]")
    threshold: float = num(0.25, "in (0, 1)")  # fraction of the starting tool-call rate
    reads = ("env/tool_calls",)
    panel = "tools"
    remedy = ("the policy answers without its tools: compare eval/score with eval/no_tools/score "
              "(eval.tool_lift: does the tool help?), reward the answer not the call, raise "
              "kl.coef or lower train.lr, describe the tools better (their docstrings)")

    def check(self, h: History) -> str | None:
        key = "env/tool_calls"
        start, now = h.first(key, self.window), h.last(key, self.window)
        if len(now) < self.window or h.step < 2 * self.window or not finite(h.latest.get(key)):
            return None
        if mean(start) > 0 and mean(now) < self.threshold * mean(start):
            return (f"{key} {mean(now):.3g} per conversation (mean of {_span(h, self.window)}) < "
                    f"{self.threshold:g} x its start {mean(start):.3g} (mean of its first "
                    f"{len(start)} steps): the policy stopped calling its tools")
        return None
