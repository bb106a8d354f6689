"""Value pretraining on the rewards' prefix scores (``train.critic_pretrain_rollouts``).

A fresh value head explains none of the return, and learns it slowly from the return alone: on
the quickstart, 96 rollouts' Monte-Carlo returns left it at +0.05 held-out explained variance.
A reward model already reads partial text: re-run on every prefix of a response, it says how the
response is going (+0.31 of the quickstart's return). So before step 1 the critic regresses those
prefix scores: ``train.critic_pretrain_rollouts`` rollouts of the initial policy, every response
prefix scored by the rewards that declare ``scores_prefixes``, ``train.critic_pretrain_epochs``
passes of minibatches as large as the update's, with the run's own critic optimizer (its AdamW
moments carry into step 1; a fresh optimizer's first steps set it back). On the
quickstart the critic reached +0.16 held-out (``examples/quickstart/critic_probe.py --target
prefix``). Unlike ``models.critic.from_reward_model``, any reward model serves, whatever its
architecture and tokenizer: the text is scored again, no weights are shared.

A reward declares ``RewardContract(scores_prefixes=True)`` when its score of a partial response estimates its
score of the finished one (the reward model does; a length penalty does not). The target leaves
out the other rewards and the KL penalty, which the critic learns from the run's returns.

>>> import torch
>>> from tensordict import TensorDict
>>> from rlpipe.core.step.rewards import RewardComposer
>>> class Chars:  # one character per token id
...     def batch_decode(self, rows, skip_special_tokens):
...         return ["".join(map(chr, row)) for row in rows]
>>> from rlpipe.core.contracts.kinds import RewardContract
>>> class Length(torch.nn.Module):  # scores a text by its length
...     @staticmethod
...     def contract():
...         return RewardContract(scores_prefixes=True)
...     def forward(self, td):
...         return torch.tensor([float(len(t)) for t in td["response_text"]])
>>> batch = TensorDict({"response_ids": torch.tensor([[104, 105, 0], [111, 107, 33]]),
...                     "response_mask": torch.tensor([[True, True, False], [True, True, True]]),
...                     "prompt_text": ["p", "q"]}, batch_size=[2])
>>> prefix_targets(batch, RewardComposer([("len", 2.0, Length())]), Chars())
tensor([[0., 2., 0.],
        [0., 2., 4.]])
"""

from __future__ import annotations

import sys
import time

import torch
from tensordict import NonTensorStack, TensorDict

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.kinds import reward_contract
from rlpipe.core.contracts.reward_fn import batch_texts
from rlpipe.core.models.lm import response_values
from rlpipe.core.step.dynamic_sampling import concat_rounds
from rlpipe.core.step.loss import explained_var, explained_var_sums
from rlpipe.core.step.rewards import RewardComposer
from rlpipe.core.step.update import grad_norm

INPUTS = (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)


def prefix_scorer(rewards: RewardComposer) -> RewardComposer:
    """The components of ``rewards`` that declare ``scores_prefixes``, with their weights."""
    parts = [(label, weight, module) for label, weight, module
             in zip(rewards.labels, rewards.weights, rewards.parts)
             if reward_contract(module, label=f"reward {label!r}").scores_prefixes]
    return RewardComposer(parts, clip=rewards.clip)


def prefix_targets(batch: TensorDict, scorer: RewardComposer, tokenizer) -> torch.Tensor:
    """[B, R]: ``scorer``'s score of each response prefix ``ids[:t]`` (decoded as the collector
    decodes), at position t: the value of the state before token t. 0 on padding."""
    mask = batch[S.RESPONSE_MASK]
    lengths = mask.sum(-1).tolist()
    rows = [ids[:t].tolist() for ids, n in zip(batch[S.RESPONSE_IDS], lengths) for t in range(n)]
    prompts = [p for p, n in zip(batch_texts(batch, S.PROMPT_TEXT), lengths) for _ in range(n)]
    prefixes = TensorDict({S.PROMPT_TEXT: NonTensorStack(*prompts),
                           S.RESPONSE_TEXT: NonTensorStack(*tokenizer.batch_decode(
                               rows, skip_special_tokens=True))}, batch_size=[len(rows)])
    scores = scorer.evaluate(prefixes)[S.SCORE]  # weighted and clipped, never normalised
    target = torch.zeros(mask.shape, device=mask.device)
    target[mask] = scores.to(mask.device)
    return target


def regress(critic, optimizer, batch: TensorDict, size: int, epochs: int,
            max_grad_norm: float | None, seed: int, dist=None) -> torch.Tensor:
    """``epochs`` shuffled passes of minibatches of ``size`` rows, one optimizer step each on
    ``0.5 * mean((V - value_target)^2)`` over the minibatch's response tokens; returns this
    rank's `explained_var_sums` of the last pass (each minibatch's values before its step).
    Under ``dist`` (a `Dist`) every rank holds the whole ``batch`` and runs the rows
    ``rank::world`` of each minibatch, as the PPO update does; FSDP averages the gradients."""
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    params = [p for p in critic.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(seed)
    critic.train()
    for _ in range(epochs):
        sums = torch.zeros(5, dtype=torch.float64)
        for rows in torch.randperm(batch.batch_size[0], generator=gen).split(size):
            tokens = batch[S.RESPONSE_MASK][rows].sum().clamp_min(1) / world
            part = batch[rows[rank::world]]
            values = response_values(critic, *(part[k] for k in INPUTS))
            target, mask = part[S.VALUE_TARGET], part[S.RESPONSE_MASK]
            sums += explained_var_sums(values, target, mask).cpu()
            loss = 0.5 * ((values - target)[mask].pow(2).sum() / tokens)  # FSDP: mean of ranks
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm(params, max_grad_norm)
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return sums


MAX_ROUNDS = 1000      # collection rounds at most (a typo of critic_pretrain_rollouts stops here)
MAX_SECONDS = 3600.0   # and at most this long
PROGRESS_S = 30.0      # a long collection says how far it got this often


def check_weights(scorer: RewardComposer) -> None:
    """The rewards that score prefixes, all at weight 0, would pretrain on all-zero targets:
    one `UserError`."""
    if not any(float(w) != 0 for w in scorer.weights):
        raise UserError(f"train.critic_pretrain_rollouts: the rewards that score partial "
                        f"responses ({', '.join(scorer.labels)}) have weight 0, so every target "
                        f"would be 0; give one a weight, or set critic_pretrain_rollouts to 0")


def collect_rounds(collect, rounds: int, target, echo, dist) -> list[TensorDict]:
    """``collect()`` (each batch given its ``target``) ``rounds`` times, at most `MAX_ROUNDS`
    and `MAX_SECONDS` (every rank agrees), with a progress line every `PROGRESS_S` seconds and
    one when a cap ends it."""
    t0 = said = time.monotonic()
    parts = []
    for i in range(rounds):
        over = time.monotonic() - t0 > MAX_SECONDS
        if dist.enabled:
            over = dist.mean({"over": float(over)})["over"] > 0
        if i >= MAX_ROUNDS or over:
            echo(f"warning: critic pretraining stopped collecting at {i} of {rounds} rounds "
                 f"({MAX_ROUNDS} rounds or {MAX_SECONDS:.0f} s at most); train.critic_"
                 f"pretrain_rollouts asks for more (a typo?); pretraining on those collected")
            break
        td = collect()
        td[S.VALUE_TARGET] = target(td)
        parts.append(td.select(*INPUTS, S.VALUE_TARGET, S.PROMPT_TEXT, S.GROUP_ID))
        if time.monotonic() - said >= PROGRESS_S:
            said = time.monotonic()
            echo(f"rlpipe: critic pretraining: {i + 1} of {rounds} rounds collected "
                 f"({said - t0:.0f} s)")
    return parts


def pretrain(train, collect, rounds: int, critic, optimizer, rewards: RewardComposer, tokenizer,
             size: int, seed: int, dist) -> str:
    """``rounds`` batches of the run's collector (``collect()``, this rank's share; bounded by
    `collect_rounds`), their prefixes scored (`prefix_targets`), gathered from every rank and
    cut to ``train.critic_pretrain_rollouts``; then `regress` for
    ``train.critic_pretrain_epochs`` passes. Returns what it cost and what it reached, in words."""
    t0, scorer = time.perf_counter(), prefix_scorer(rewards)
    if not scorer.labels:
        raise UserError(f"train.critic_pretrain_rollouts: none of the rewards ({', '.join(rewards.labels)}) "
                        f"scores partial responses (declares scores_prefixes, as reward_model does)")
    check_weights(scorer)
    echo = (lambda line: print(line, file=sys.stderr, flush=True)) if dist.is_main else \
        (lambda line: None)
    parts = collect_rounds(collect, rounds, lambda td: prefix_targets(td, scorer, tokenizer),
                           echo, dist)
    batch = dist.gather(concat_rounds(parts))[:train.critic_pretrain_rollouts]
    t1 = time.perf_counter()
    sums = regress(critic, optimizer, batch, size, train.critic_pretrain_epochs,
                   train.max_grad_norm, seed, dist)
    ev = explained_var(sum(dist.gather_object(sums)))
    return (f"critic pretraining: {batch.batch_size[0]} rollouts, "
            f"{int(batch[S.RESPONSE_MASK].sum())} prefixes scored by {', '.join(scorer.labels)} "
            f"({t1 - t0:.0f} s); {train.critic_pretrain_epochs} passes ({time.perf_counter() - t1:.0f} "
            f"s), explained variance of the prefix scores in the last one {ev:+.2f}")
