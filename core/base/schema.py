"""Batch keys shared by every stage (the plugin contract of DESIGN.md), and a validator.

One PPO step passes one TensorDict with ``batch_size=[B]``. Prompts are left-padded to ``P``
tokens, responses right-padded to ``R`` tokens; masks are never rebuilt from ``ids != pad``.

>>> import torch
>>> from tensordict import TensorDict
>>> from rlpipe.core.base import schema
>>> td = TensorDict({schema.SCORE: torch.zeros(2)}, batch_size=[2])
>>> schema.validate(td, [schema.SCORE])
"""

from __future__ import annotations

import torch

from rlpipe.core.base.errors import UserError

# name = key                     # shape, dtype: meaning
PROMPT_IDS = "prompt_ids"        # [B, P] long: prompt tokens, left-padded
PROMPT_MASK = "prompt_mask"      # [B, P] bool: true on real prompt tokens
RESPONSE_IDS = "response_ids"    # [B, R] long: response tokens, right-padded, EOS kept
RESPONSE_MASK = "response_mask"  # [B, R] bool: true on real response tokens (EOS included)
PROMPT_TEXT = "prompt_text"      # [B] non-tensor str
RESPONSE_TEXT = "response_text"  # [B] non-tensor str
PROMPT_MESSAGES = "prompt_messages"  # [B] non-tensor: a chat prompt's messages (chat datasets only)
ACTION_MASK = "action_mask"      # [B, R] bool, optional: the tokens the policy sampled (multi-turn:
                                 # not the environment's); absent: equal to response_mask
TURN_ID = "turn_id"              # [B, R] long, multi-turn: the turn each response token belongs to
TURN_REWARD = "turn_reward"      # [B, T] float, multi-turn: the environment's reward per turn
NUM_TURNS = "num_turns"          # [B] long, multi-turn: the policy's turns in the conversation
STOP_REASON = "stop_reason"      # [B] long, multi-turn: index into STOP_REASONS
CONVERSATION = "conversation"    # [B] non-tensor, multi-turn: the conversation's chat messages
ENV = "env"                      # ("env", NAME) [B], multi-turn: tool_calls, tool_errors, timeouts,
                                 # receipt (index into RECEIPTS), error (non-tensor str)
GROUP_ID = "group_id"            # [B] long: index of the prompt a sample came from
FINISHED = "finished"            # [B] bool: ended with EOS (false: cut at max_new_tokens)
ENGINE_LOG_PROB = "engine_log_prob"  # [B, R] float: log-probs reported by the engine
ENGINE_HIDDEN = "engine_hidden"  # [B, R, H] float, optional: the actor's LM-head input per token
ACTOR_LOG_PROB = "actor_log_prob"  # [B, R] float, optional: the trainer's log pi(a_t|s_t) from the
                                 # sampling pass's own logits (core/collectors.request_actor_log_prob)
OLD_LOG_PROB = "old_log_prob"    # [B, R] float: log pi_old(a_t|s_t), trainer-side forward
REF_LOG_PROB = "ref_log_prob"    # [B, R] float: log pi_ref(a_t|s_t)
VALUE = "value"                  # [B, R] float: critic V(s_t) at rollout time, 0 on padding
SCORE = "score"                  # [B] float: weighted sum of reward components
SCORE_PARTS = "score_parts"      # ("score_parts", NAME) [B] float: each component, unweighted
DATA = "data"                    # ("data", COLUMN) [B]: the prompt row's other dataset columns
REWARD = "reward"                # [B, R] float: score on the last valid token, -beta*KL per token
ADVANTAGE = "advantage"          # [B, R] float: 0 on padding
VALUE_TARGET = "value_target"    # [B, R] float: return target for the critic
ROLLOUT_IS_WEIGHT = "rollout_is_weight"  # [B, R] float, tis/mis only: weight of each token's
                                 # policy-gradient term (rlpipe.core.step.rollout_correction), 0 on padding

# Why a multi-turn conversation ended (``stop_reason`` holds the index).
STOP_REASONS = ("done", "max_turns", "length", "tool_error", "timeout", "turn_length")
# A multi-turn row's receipt (``("env", "receipt")`` holds the index; rlpipe.core.step.multiturn).
RECEIPTS = ("exact", "assistant_drift", "boundary_drift")

# Written by the trainer into each PPO micro-batch, read by loss plugins.
LOG_PROB = "log_prob"            # [b, R] float: log pi_theta(a_t|s_t) under the current weights (grad)
ENTROPY = "entropy"              # [b, R] float: entropy of pi_theta(.|s_t) (grad)
VALUE_PRED = "value_pred"        # [b, R] float: current critic V(s_t) (grad)
NUM_TOKENS = "num_tokens"        # [b] float: action tokens (action_mask) in the whole minibatch (all ranks)
NUM_SEQS = "num_seqs"            # [b] float: non-empty sequences in the whole minibatch (all ranks)

# Expected (ndim, dtype kind) per key, for `validate`.
_SPEC = {
    PROMPT_IDS: (2, "int"), PROMPT_MASK: (2, "bool"),
    RESPONSE_IDS: (2, "int"), RESPONSE_MASK: (2, "bool"),
    GROUP_ID: (1, "int"), FINISHED: (1, "bool"), ENGINE_LOG_PROB: (2, "float"),
    ENGINE_HIDDEN: (3, "float"), ACTOR_LOG_PROB: (2, "float"),
    OLD_LOG_PROB: (2, "float"), REF_LOG_PROB: (2, "float"), VALUE: (2, "float"),
    SCORE: (1, "float"), REWARD: (2, "float"), ADVANTAGE: (2, "float"), VALUE_TARGET: (2, "float"),
    ROLLOUT_IS_WEIGHT: (2, "float"), ACTION_MASK: (2, "bool"), TURN_ID: (2, "int"),
    TURN_REWARD: (2, "float"), NUM_TURNS: (1, "int"), STOP_REASON: (1, "int"),
    LOG_PROB: (2, "float"), ENTROPY: (2, "float"), VALUE_PRED: (2, "float"),
    NUM_TOKENS: (1, "float"), NUM_SEQS: (1, "float"),
}
_RESPONSE_SHAPED = {RESPONSE_MASK, ENGINE_LOG_PROB, ACTOR_LOG_PROB, OLD_LOG_PROB, REF_LOG_PROB, VALUE,
                    REWARD, ADVANTAGE, VALUE_TARGET, LOG_PROB, ENTROPY, VALUE_PRED, ROLLOUT_IS_WEIGHT,
                    ACTION_MASK, TURN_ID}


def action_mask(td) -> torch.Tensor:
    """The tokens the policy chose: ``action_mask`` where a multi-turn collector wrote it, else
    ``response_mask`` (single turn: every response token is the policy's).

    >>> from tensordict import TensorDict
    >>> td = TensorDict({RESPONSE_MASK: torch.tensor([[True, True, False]])}, batch_size=[1])
    >>> action_mask(td).tolist()
    [[True, True, False]]
    >>> td[ACTION_MASK] = torch.tensor([[True, False, False]])
    >>> action_mask(td).tolist()
    [[True, False, False]]
    """
    return td.get(ACTION_MASK) if ACTION_MASK in td.keys() else td.get(RESPONSE_MASK)


def _kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    return "float" if t.is_floating_point() else "int"


def validate(td, keys, where: str = "batch") -> None:
    """Check that ``td`` holds ``keys`` with the documented rank and dtype, and that every
    response-shaped tensor matches ``response_ids``. Raises `UserError` naming the key and
    ``where`` (the stage that produced the batch). Used at stage boundaries in debug mode."""
    for key in keys:
        if key not in td.keys(include_nested=True):
            raise UserError(f"{where}: missing key {key!r}")
        value = td.get(key)
        if key in _SPEC and isinstance(value, torch.Tensor):
            ndim, kind = _SPEC[key]
            if value.ndim != ndim or _kind(value) != kind:
                raise UserError(f"{where}: key {key!r} should be {ndim}-d {kind}, "
                                f"got shape {tuple(value.shape)} dtype {value.dtype}")
            if kind == "float" and not torch.isfinite(value).all():
                raise UserError(f"{where}: key {key!r} holds NaN or inf")
    if RESPONSE_IDS in td.keys():
        shape = td.get(RESPONSE_IDS).shape
        for key in _RESPONSE_SHAPED & set(keys):
            if td.get(key).shape != shape:
                raise UserError(f"{where}: key {key!r} has shape {tuple(td.get(key).shape)}, "
                                f"expected {tuple(shape)} like {RESPONSE_IDS!r}")
