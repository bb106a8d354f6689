"""A better critic start: value pretraining until the critic explains the returns, and a critic
initialised from a reward model, head included.

A fresh value head gives biased values at first, and PPO's early policy updates follow them
(VC-PPO, arXiv 2503.01491; VAPO, arXiv 2504.05118). Two remedies:

- **value pretraining** (`CriticWarmup`): the first ``train.critic_warmup_steps`` PPO steps update
  the critic only; with ``train.critic_warmup_explained_var`` set, critic-only steps go on until a
  step's ``value/explained_var`` reaches it, at most ``train.critic_warmup_max_steps`` in all;
- **a reward-model critic** (`critic_from_reward_model`, ``models.critic.from_reward_model``): the
  critic's backbone and value head are the reward model's backbone and score head, as TRL does.

>>> from rlpipe.core.config.settings import TrainConfig
>>> warmup = CriticWarmup(TrainConfig(critic_warmup_steps=1, critic_warmup_explained_var=0.5,
...                                   critic_warmup_max_steps=3), has_critic=True)
>>> [warmup.active(0), warmup.active(1)]
[True, True]
>>> warmup.observe({"value/explained_var": 0.7})
>>> warmup.active(1), warmup.state_dict()
(False, {'reached': True})
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlpipe.core.base.errors import UserError
from rlpipe.core.models.lm import ValueModel, _from_folder, load_tokenizer

EXPLAINED_VAR = "value/explained_var"


class CriticWarmup:
    """Whether PPO step ``step`` (from 0) updates the critic only: always before
    ``train.critic_warmup_steps``; after that, while ``train.critic_warmup_explained_var`` is set
    and no step's ``value/explained_var`` has reached it yet (`observe`), up to
    ``train.critic_warmup_max_steps`` critic-only steps. Once reached, warm-up is over for good
    (a later dip does not restart it); the flag is checkpointed (`state_dict`)."""

    def __init__(self, train, has_critic: bool):
        self.steps, self.threshold = train.critic_warmup_steps, train.critic_warmup_explained_var
        self.max_steps = train.critic_warmup_max_steps
        if self.threshold is not None and not has_critic:
            raise UserError("train.critic_warmup_explained_var: this run has no critic (the "
                            "advantage estimator needs none); unset it")
        self.reached = False

    def active(self, step: int) -> bool:
        if step < self.steps:
            return True
        return self.threshold is not None and not self.reached and step < self.max_steps

    def observe(self, metrics: dict) -> None:
        """Take one step's update metrics; latch once ``value/explained_var`` reaches the threshold."""
        if self.threshold is None or self.reached:
            return
        if EXPLAINED_VAR not in metrics:
            raise UserError(f"train.critic_warmup_explained_var: the loss wrote no {EXPLAINED_VAR} "
                            f"metric to compare with; unset it or use a loss that reports it")
        self.reached = metrics[EXPLAINED_VAR] >= self.threshold

    def state_dict(self) -> dict:
        return {"reached": self.reached}

    def load_state_dict(self, state: dict) -> None:
        self.reached = bool(state.get("reached", False))  # absent in older checkpoints


def check_critic_start(cfg) -> None:
    """The rules between the keys of this module, at config load (before any model is built)."""
    t, critic = cfg.train, cfg.models.critic
    if t.critic_warmup_explained_var is not None and t.critic_warmup_max_steps < t.critic_warmup_steps:
        raise UserError(f"train.critic_warmup_max_steps={t.critic_warmup_max_steps} is below "
                        f"train.critic_warmup_steps={t.critic_warmup_steps}; it caps all "
                        f"critic-only steps, so raise it")
    if critic.from_reward_model:
        if critic.path is None:
            raise UserError("models.critic.from_reward_model: set models.critic.path to the "
                            "reward model's folder")
        if critic.init != "pretrained" or critic.shared_backbone:
            raise UserError("models.critic.from_reward_model takes the reward model's trained "
                            "weights: it excludes models.critic.init: random and shared_backbone")


def critic_from_reward_model(path: Path, actor_tokenizer, trust_remote_code: bool = False
                             ) -> ValueModel:
    """A `ValueModel` whose backbone and head are those of the one-output sequence classifier in
    ``path`` (float32): at the last token of a sequence its value equals the classifier's score.
    The classifier must be a decoder whose head is a per-token linear layer ``score`` (every
    ``*ForSequenceClassification`` of a causal LM in transformers), and must use the actor's
    tokenizer: the critic reads the actor's token ids."""
    from transformers import AutoModelForSequenceClassification

    path, key = Path(path), "models.critic.from_reward_model"
    setting = "models.critic.trust_remote_code"
    classifier = _from_folder(AutoModelForSequenceClassification, path, "pretrained",
                              trust_remote_code, setting, "the reward model", dtype=torch.float32)
    head = getattr(classifier, "score", None)
    if classifier.config.num_labels != 1 or not isinstance(head, nn.Linear):
        raise UserError(f"{key}: {path} holds a {type(classifier).__name__} with "
                        f"num_labels={classifier.config.num_labels}; the critic needs a one-output "
                        f"classifier of a causal LM, with a linear `score` head on every token")
    tokenizer = load_tokenizer(path, trust_remote_code, setting)
    if tokenizer.get_vocab() != actor_tokenizer.get_vocab():
        raise UserError(f"{key}: the tokenizer in {path} differs from the actor's; the critic "
                        f"reads the actor's token ids, so the reward model must share its tokenizer")
    critic = ValueModel(classifier.base_model, head.in_features)
    with torch.no_grad():
        critic.head.weight.copy_(head.weight)
        critic.head.bias.copy_(head.bias if head.bias is not None else torch.zeros(1))
    return critic
