"""Multi-turn through the whole step: an environment from config or Python, the two masks in the
loss, KL, advantages and metrics, and a single-turn step bit-identical with ``action_mask`` given."""

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import CHAT_TEMPLATE, final_weights, logged_metrics
from rlpipe import load_config, train
from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.core.config.plan import plan_run
from rlpipe.core.contracts.environment import EnvironmentContract
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.plugins.collectors.hf import HFCollector

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny"


@pytest.fixture
def chat_tiny(tmp_path) -> Path:
    """The tiny example's warm-started model, with a chat template."""
    out = tmp_path / "model"
    shutil.copytree(TINY / "model", out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


class Echo:
    """Answers every turn with a user message; done after the model said 'stop'."""

    @classmethod
    def contract(cls, max_turns: int = 3):
        return EnvironmentContract(max_turns=max_turns, timeout_s=5.0)

    def __init__(self, max_turns: int = 3):
        self.turns = 0

    def reset(self, row, seed):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.turns += 1
        return [{"role": "user", "content": "the cat sat"}], 0.25, "stop" in action, {"tool_calls": 1}


def config(chat_tiny, tmp_path, *extra):
    return load_config(TINY / "config.yaml", [f"models.actor.path={chat_tiny}", "run.steps=2",
                                              f"run.output_dir={tmp_path / 'run'}",
                                              "collector.max_new_tokens=6", *extra])


def test_a_multi_turn_run_trains_on_the_policys_tokens_only(chat_tiny, tmp_path):
    pipe = Pipeline(config(chat_tiny, tmp_path), environment=Echo, progress=False)
    batch, metrics = pipe.step()
    action, response = batch[S.ACTION_MASK], batch[S.RESPONSE_MASK]
    assert (action <= response).all() and (response & ~action).any()   # observations present
    assert (batch[S.ADVANTAGE][~action] == 0).all()                      # no credit off actions
    reward_at = batch[S.REWARD] != 0
    assert not (reward_at & ~action).any()                               # score, turn rewards, KL
    for key in ("env/turns", "env/obs_token_frac", "env/tool_calls", "env/receipt/exact"):
        assert key in metrics
    assert metrics["env/turns"] >= 1 and torch.isfinite(torch.tensor(metrics["policy/loss"]))
    assert pipe.plan.to_dict()["contracts"]["environment"]["max_turns"] == 3
    pipe.plugins.environment.close()


def test_an_environment_from_config_by_reference(chat_tiny, tmp_path):
    run_dir = train(config(chat_tiny, tmp_path, "environment.name=tests.test_multiturn_pipeline:Echo",
                           "environment.max_turns=2"), progress=False)
    rows = logged_metrics(run_dir)
    assert rows[-1]["step"] == 2 and rows[-1]["env/turns"] <= 2
    assert json.loads((run_dir / "plan.json").read_text())["stages"]["environment"]


def test_staleness_with_an_environment_is_one_line(chat_tiny, tmp_path):
    with pytest.raises(UserError, match="rollout.staleness"):
        load_config(TINY / "config.yaml", ["environment.name=tools", "environment.tools=[]",
                                           "rollout.staleness=1",
                                           "rollout_correction.mode=tis"])


class WithActionMask(HFCollector):
    """The hf collector, writing ``action_mask`` equal to ``response_mask``."""

    def collect(self, prompts):
        batch = super().collect(prompts)
        batch[S.ACTION_MASK] = batch[S.RESPONSE_MASK].clone()
        return batch


def test_single_turn_is_bit_identical_through_the_action_mask_path(tmp_path):
    """The oracle of the two masks: a step whose batch carries action_mask == response_mask
    (compacted advantages, action-mask reads everywhere) equals today's single-turn step."""
    runs = []
    for name, collector in (("plain", None), ("masked", WithActionMask)):
        cfg = load_config(TINY / "config.yaml", ["run.steps=2", f"run.output_dir={tmp_path / name}"])
        stages = {} if collector is None else {
            "collector": functools.partial(collector, **cfg.collector.args)}
        runs.append(train(cfg, progress=False, **stages))
    plain, masked = (logged_metrics(r) for r in runs)
    drop = ("time/", "perf/")
    for a, b in zip(plain, masked):
        assert {k: v for k, v in a.items() if not k.startswith(drop)} == \
               {k: v for k, v in b.items() if not k.startswith(drop)}
    wa, wb = final_weights(runs[0]), final_weights(runs[1])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_tool_lookup_example_loads_and_its_tool_answers(monkeypatch):
    monkeypatch.chdir(ROOT)   # the config names its tool as a module of the repository
    # the tiny model stands in for SmolLM2 (a quickstart-tier package, not installed in the main
    # tier); this test reads the environment, the tool and the data, not the model
    cfg = load_config(ROOT / "examples" / "tool_lookup" / "config.yaml",
                      [f"models.actor.path={TINY / 'model'}"])
    assert cfg.environment.name == "tools"
    contract = plan_run(cfg).environment_contract
    assert [t["function"]["name"] for t in contract.tools] == ["lookup"]
    rows = [json.loads(x) for x in (ROOT / "examples/tool_lookup/test.jsonl").read_text().splitlines()]
    table = json.loads((ROOT / "examples/tool_lookup/table.json").read_text())
    train_names = {json.loads(x)["name"] for x in
                   (ROOT / "examples/tool_lookup/train.jsonl").read_text().splitlines()}
    assert all(int(table[r["name"]]) == r["answer"] for r in rows)
    assert not train_names & {r["name"] for r in rows}   # held-out names
