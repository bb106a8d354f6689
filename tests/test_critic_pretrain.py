"""Value pretraining on the rewards' prefix scores (core/step/critic_pretrain.py): the targets
against a loop that decodes and scores each prefix, the regression against its own targets, the
run's wiring (before step 1, with the run's critic optimizer) and its config mistakes."""

import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from transformers import AutoTokenizer, LlamaConfig, LlamaModel

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.core.config.settings import load_config
from rlpipe.core.models.lm import ValueModel, response_values
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.step.critic_pretrain import INPUTS, prefix_scorer, prefix_targets, regress
from rlpipe.core.step.loss import explained_var, explained_var_sums
from rlpipe.core.step.rewards import RewardComposer

from tests.test_critic_start import MODEL, reward_model
from tests.test_trainer import TINY, params, same, tiny


class Vowels(torch.nn.Module):
    """Scores a text by its vowels; declares that a prefix's score means something."""
    scores_prefixes = True

    def forward(self, td):
        return torch.tensor([float(sum(c in "aeiou" for c in t)) for t in td[S.RESPONSE_TEXT]])


class Chars(torch.nn.Module):
    """Scores a text by its length; declares nothing, so prefix scoring leaves it out."""

    def forward(self, td):
        return torch.tensor([float(len(t)) for t in td[S.RESPONSE_TEXT]])


def rollouts(tokenizer, rows=3, width=7, seed=0):
    """Random response ids of random lengths (right-padded), with prompts."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, tokenizer.vocab_size, (rows, width), generator=gen)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = torch.arange(width) < lengths[:, None]
    prompt_ids = torch.randint(4, tokenizer.vocab_size, (rows, 3), generator=gen)
    return TensorDict({S.PROMPT_IDS: prompt_ids, S.PROMPT_MASK: torch.ones_like(prompt_ids).bool(),
                       S.RESPONSE_IDS: ids * mask, S.RESPONSE_MASK: mask,
                       S.PROMPT_TEXT: NonTensorStack(*(f"prompt {i}" for i in range(rows)))},
                      batch_size=[rows])


def test_prefix_targets_are_each_prefix_decoded_and_scored():
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    batch = rollouts(tokenizer)
    scorer = prefix_scorer(RewardComposer([("vowels", 0.5, Vowels()), ("chars", 1.0, Chars())]))
    assert scorer.labels == ["vowels"]
    target = prefix_targets(batch, scorer, tokenizer)
    for b in range(3):
        n = int(batch[S.RESPONSE_MASK][b].sum())
        for t in range(batch[S.RESPONSE_IDS].shape[1]):
            text = tokenizer.decode(batch[S.RESPONSE_IDS][b, :t], skip_special_tokens=True)
            expected = 0.5 * sum(c in "aeiou" for c in text) if t < n else 0.0
            assert target[b, t].item() == expected, (b, t, text)


def test_regression_fits_prefix_targets():
    """A tiny critic learns a target that depends on the prefix (the running count of even
    token ids): explained variance from about 0 to above 0.5."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    batch = rollouts(tokenizer, rows=32, width=10, seed=1)
    ids, mask = batch[S.RESPONSE_IDS], batch[S.RESPONSE_MASK]
    before_token = torch.cat([torch.zeros(32, 1), (ids[:, :-1] % 2 == 0).float()], 1)
    batch[S.VALUE_TARGET] = before_token.cumsum(1) * mask
    config = LlamaConfig.from_pretrained(MODEL)
    critic = ValueModel(LlamaModel(config), config.hidden_size)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=3e-3)
    first = explained_var(regress(critic, optimizer, batch, 8, epochs=1, max_grad_norm=1.0, seed=0))
    last = explained_var(regress(critic, optimizer, batch, 8, epochs=30, max_grad_norm=1.0, seed=1))
    assert first < 0.1 and last > 0.5, (first, last)
    sums = explained_var_sums(response_values(critic, *(batch[k] for k in INPUTS)),
                              batch[S.VALUE_TARGET], mask)  # the same, recomputed after the fit
    assert explained_var(sums) > 0.5


def test_run_pretrains_the_critic_before_step_one(tmp_path):
    reward_model(tmp_path / "rm", bert=True)
    cfg = tiny(tmp_path / "run", "run.steps=1", "train.epochs=1", "data.batch_size=4",
               "collector.max_new_tokens=6", "train.critic_pretrain_rollouts=10",
               "train.critic_pretrain_epochs=2",
               f"rewards=[{{name: reward_model, path: {tmp_path / 'rm'}}}, {{name: length}}]")
    pipe = Pipeline(cfg, progress=False)
    said = []
    pipe.status.say = said.append
    actor, critic = params(pipe.models.actor), params(pipe.models.critic)
    pipe._pretrain_critic()
    assert same(actor, params(pipe.models.actor)) and not same(critic, params(pipe.models.critic))
    adam = pipe.updater.opts["critic"]
    # 10 rollouts (two rounds of 4 prompts x 2 samples, cut to 10), minibatches of 8 / 2 = 4
    # rows: 3 optimizer steps a pass, 2 passes
    assert {int(s["step"]) for s in adam.state.values()} == {6}
    assert "10 rollouts" in said[-1] and "by reward_model" in said[-1]
    _, metrics = pipe.step()
    assert metrics["value/loss"] > 0


@pytest.mark.parametrize("overrides,message", [
    (["advantage.name=grpo"], "reads no value"),
    (["reward.normalize=true"], "reward.normalize rescales"),
    (["models.critic.shared_backbone=true"], "would move the policy"),
    ([], "none of the rewards (length, loop) scores partial"),
])
def test_config_mistakes_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(TINY, ["train.critic_pretrain_rollouts=8", *overrides])
