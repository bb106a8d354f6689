"""Hugging Face model IDs (core/base/hub.py), resolved offline from a Hub-layout cache that the test
builds under a temporary HF_HOME (``models--ORG--NAME/snapshots/REV/`` + ``refs/main``) from tiny
random models: actor, critic, reward model, ``train-rm``; an unknown ID is one line."""

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaForSequenceClassification

from rlpipe.core.run import build
from rlpipe.core.base import hub
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.plugins.rewards import RewardModel
from rlpipe.tools.train_rm import load_rm_config

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
REV = "0123456789abcdef0123456789abcdef01234567"


def add_to_cache(cache: Path, repo_id: str, model, tokenizer) -> Path:
    """``save_pretrained`` into the Hub cache layout, as ``snapshot_download`` leaves it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REV
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_model, tiny_tokenizer):
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    actor = add_to_cache(home / "hub", "acme/tiny-llama", tiny_model, tiny_tokenizer)
    torch.manual_seed(1)
    classifier = LlamaForSequenceClassification(tiny_model.config.__class__(
        **{**tiny_model.config.to_dict(), "num_labels": 1})).eval()
    rm = add_to_cache(home / "hub", "acme/tiny-rm", classifier, tiny_tokenizer)
    return {"home": home, "actor": actor, "rm": rm}


def test_actor_and_critic_by_hub_id_from_the_cache(cache, tiny_model):
    assert hub.hub_cache() == cache["home"] / "hub"
    cfg = load_config(TINY, ["models.actor.path=acme/tiny-llama", "models.actor.init=pretrained",
                             "models.critic.path=acme/tiny-llama"])
    assert cfg.models.actor.path == cache["actor"] and cfg.models.critic.path == cache["actor"]
    models = build.build_models(cfg, torch.device("cpu"), need_critic=True)
    for name, weight in tiny_model.state_dict().items():
        assert torch.equal(models.actor.state_dict()[name], weight.cpu()), name
    assert models.critic is not None and models.tokenizer.eos_token == "</s>"


def test_reward_model_and_train_rm_by_hub_id(cache, tmp_path):
    cfg = load_config(TINY, ["rewards=[{name: reward_model, path: acme/tiny-rm}]"])
    assert cfg.rewards[0].args["path"] == cache["rm"]
    rm = RewardModel(path="acme/tiny-rm")  # from Python too
    assert rm.classifier.config.num_labels == 1
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    rm_config = tmp_path / "rm.yaml"
    rm_config.write_text(yaml.safe_dump({"model": {"path": "acme/tiny-rm"},
                                         "data": {"pairs": "pairs.jsonl"}}))
    assert load_rm_config(rm_config).model.path == cache["rm"]


def test_a_local_folder_named_like_an_id_wins(cache, tmp_path, monkeypatch):
    local = tmp_path / "work" / "acme" / "tiny-llama"
    shutil.copytree(cache["actor"], local)
    monkeypatch.chdir(tmp_path / "work")
    cfg = load_config(TINY, ["models.actor.path=acme/tiny-llama"])
    assert cfg.models.actor.path == local


def test_an_unknown_id_offline_is_one_line(cache, harness):
    with pytest.raises(UserError) as info:
        load_config(TINY, ["models.actor.path=acme/missing"])
    message = str(info.value)
    assert message.startswith("models.actor.path: 'acme/missing' is not a local folder")
    assert "HF_HUB_OFFLINE" in message and str(cache["home"] / "hub") in message
    with pytest.raises(UserError, match=r"^models\.actor\.path: file not found: "):
        load_config(TINY, ["models.actor.path=./not/here/at/all"])  # not an ID shape
    result = harness.run(["config", TINY, "models.actor.path=acme/missing"],
                         env={"HF_HOME": str(cache["home"]), "HF_HUB_OFFLINE": "1"})
    harness.error(result, "'acme/missing'", "HF_HUB_OFFLINE", str(cache["home"] / "hub"))
