"""A better critic start (core/models/critic_start.py): critic-only steps until value/explained_var
reaches a threshold (with a cap, checkpointed), and a critic initialised from a reward model's
backbone and score head, checked against the reward model's own forward."""

import shutil

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, LlamaConfig
from transformers import LlamaForSequenceClassification

from rlpipe.core.config.settings import TrainConfig, load_config
from rlpipe.core.models.critic_start import CriticWarmup, critic_from_reward_model
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.pipeline import Pipeline

from tests.conftest import build_tokenizer
from tests.test_trainer import TINY, params, same, tiny

MODEL = TINY.parent / "model"


def warmup(steps=0, ev=None, cap=50, has_critic=True):
    return CriticWarmup(TrainConfig(critic_warmup_steps=steps, critic_warmup_explained_var=ev,
                                    critic_warmup_max_steps=cap), has_critic)


def schedule(w, evs):
    """Which steps are critic-only when the steps report ``evs`` in turn."""
    out = []
    for step, ev in enumerate(evs):
        out.append(w.active(step))
        w.observe({"value/explained_var": ev})
    return out


@pytest.mark.parametrize("kwargs,evs,expected", [
    ({"steps": 2}, [0.9, 0.9, 0.9], [True, True, False]),                   # today's warm-up
    ({"ev": 0.5}, [0.1, 0.4, 0.6, 0.2, 0.1], [True, True, True, False, False]),  # latched
    ({"steps": 3, "ev": 0.5}, [0.9, 0.1, 0.1, 0.1], [True, True, True, False]),  # at least 3
    ({"steps": 1, "ev": 0.5, "cap": 3}, [0.1, 0.2, 0.3, 0.4], [True, True, True, False]),  # cap
])
def test_schedule(kwargs, evs, expected):
    assert schedule(warmup(**kwargs), evs) == expected


def test_state_round_trip_and_older_checkpoints():
    w = warmup(ev=0.5)
    w.observe({"value/explained_var": 0.8})
    fresh = warmup(ev=0.5)
    fresh.load_state_dict(w.state_dict())
    assert not fresh.active(1)
    fresh.load_state_dict({})  # a checkpoint written before this option
    assert fresh.active(1)


def test_threshold_needs_a_critic_and_the_metric():
    with pytest.raises(UserError, match="no critic"):
        warmup(ev=0.5, has_critic=False)
    with pytest.raises(UserError, match="wrote no value/explained_var"):
        warmup(ev=0.5).observe({"value/loss": 1.0})


@pytest.mark.parametrize("overrides,message", [
    (["train.critic_warmup_explained_var=1.5"], "train.critic_warmup_explained_var: must be <= 1"),
    (["train.critic_warmup_max_steps=0"], "train.critic_warmup_max_steps: must be >= 1"),
    (["train.critic_warmup_explained_var=0.5", "train.critic_warmup_steps=10",
      "train.critic_warmup_max_steps=5"], "critic_warmup_max_steps=5 is below"),
    (["models.critic.from_reward_model=true"], "set models.critic.path"),
    ([f"models.critic.path={MODEL}", "models.critic.from_reward_model=true",
      "models.critic.init=random"], "excludes models.critic.init: random"),
])
def test_config_mistakes_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(TINY, overrides)


def test_tiny_run_trains_the_critic_only_until_the_cap(tmp_path):
    """Explained variance 1.0 is out of reach: the cap (1 step) ends the warm-up."""
    cfg = tiny(tmp_path, "run.steps=2", "train.epochs=1", "train.critic_warmup_explained_var=1.0",
               "train.critic_warmup_max_steps=1")
    pipe = Pipeline(cfg, progress=False)
    actor0, critic0 = params(pipe.models.actor), params(pipe.models.critic)
    _, metrics = pipe.step()
    assert metrics["train/critic_only"] == 1 and metrics["value/explained_var"] < 1.0
    assert same(actor0, params(pipe.models.actor)) and not same(critic0, params(pipe.models.critic))
    assert pipe.state_dict()["critic_warmup"] == {"reached": False}
    _, metrics = pipe.step()
    assert metrics["train/critic_only"] == 0 and not same(actor0, params(pipe.models.actor))


def reward_model(folder, seed=0, num_labels=1, bert=False):
    """A random one-output classifier saved with the tiny example's tokenizer."""
    torch.manual_seed(seed)
    if bert:
        config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=64, num_labels=num_labels)
        model = BertForSequenceClassification(config)
    else:
        config = LlamaConfig.from_pretrained(MODEL)
        config.num_labels = num_labels
        model = LlamaForSequenceClassification(config)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL / name, folder / name)
    return model.eval()


def test_critic_values_equal_the_reward_models_scores(tmp_path):
    classifier = reward_model(tmp_path / "rm")
    critic = critic_from_reward_model(tmp_path / "rm", AutoTokenizer.from_pretrained(MODEL)).eval()
    ids = torch.randint(4, 1000, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    position_ids = torch.arange(9).expand(3, 9)
    with torch.no_grad():
        values = critic(input_ids=ids, attention_mask=mask, position_ids=position_ids)
        scores = classifier(input_ids=ids, attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(values[:, -1], scores, rtol=1e-5, atol=1e-6)
    assert torch.equal(critic.head.weight, classifier.score.weight)
    assert (critic.head.bias == 0).all()  # Llama's score head has no bias


def test_pipeline_builds_the_critic_from_the_reward_model_and_trains(tmp_path):
    classifier = reward_model(tmp_path / "rm", seed=3)
    cfg = tiny(tmp_path / "run", "run.steps=1", "train.epochs=1",
               f"models.critic.path={tmp_path / 'rm'}", "models.critic.from_reward_model=true")
    pipe = Pipeline(cfg, progress=False)
    critic = pipe.models.critic
    classifier.to(critic.head.weight.device)
    assert torch.equal(critic.head.weight, classifier.score.weight)
    backbone = dict(classifier.model.named_parameters())
    assert all(torch.equal(p, backbone[n]) for n, p in critic.backbone.named_parameters())
    _, metrics = pipe.step()
    assert metrics["value/loss"] > 0 and not torch.equal(critic.head.weight, classifier.score.weight)


@pytest.mark.parametrize("kind,message", [("two_labels", "num_labels=2"),
                                          ("bert", "BertForSequenceClassification"),
                                          ("other_tokenizer", "differs from the actor's")])
def test_unusable_reward_models_are_one_line(tmp_path, kind, message):
    reward_model(tmp_path / "rm", num_labels=2 if kind == "two_labels" else 1, bert=kind == "bert")
    actor_tokenizer = (build_tokenizer() if kind == "other_tokenizer"
                       else AutoTokenizer.from_pretrained(MODEL))
    with pytest.raises(UserError, match=message):
        critic_from_reward_model(tmp_path / "rm", actor_tokenizer)
