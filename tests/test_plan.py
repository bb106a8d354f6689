"""The run planned once (`rlpipe.core.config.plan`): every derived fact in one frozen `RunPlan`,
never written back into the config, the scoring path as one value, the plan printed by
``rlpipe check`` and recorded in the run directory, and `Pipeline.__init__` within its budget."""

import ast
import dataclasses
import inspect
import json
import textwrap

import pytest
import torch
from click.testing import CliRunner
from tensordict.nn import TensorDictModuleBase

from rlpipe import load_config, train
from rlpipe.cli import main
from rlpipe.core.base import schema as S
from rlpipe.core.config import compose
from rlpipe.core.config import plan as planning
from rlpipe.core.config.plan import Scoring, plan_run
from rlpipe.tools import check
from rlpipe.core.run.pipeline import Pipeline
from tests.test_trainer import TINY, tiny


def test_planning_writes_nothing_into_the_config(tmp_path):
    cfg = tiny(tmp_path, "advantage.name=grpo")
    before = cfg.to_dict()
    plan = plan_run(cfg)
    assert cfg.to_dict() == before and "max_prompt_tokens" not in cfg.collector.args
    assert (cfg.kl.in_, cfg.kl.estimator) == (None, None)
    assert (plan.kl.in_, plan.kl.estimator) == ("loss", "k2")
    assert plan.collector.args["max_prompt_tokens"] == plan.budgets.prompt_tokens == 256 - 24
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.scoring = Scoring.FORWARD
    with pytest.raises(TypeError):
        plan.collector.args["n"] = 3


@pytest.mark.parametrize("overrides, scoring, values", [
    ([], Scoring.SAMPLING, "critic"),       # float32: old log-probs from the sampling pass
    (["rollout_correction.old_log_prob=recompute"], Scoring.FORWARD, "forward"),
    (["rollout_correction.mode=bypass"], Scoring.ENGINE, "critic"),
    (["rollout_correction.mode=bypass", "models.critic.shared_backbone=true"], Scoring.ENGINE,
     "rollout"),
    (["models.autocast=bfloat16"], Scoring.FORWARD, "forward"),  # auto: not exact in bf16
    (["advantage.name=grpo"], Scoring.SAMPLING, "none"),
])
def test_the_scoring_path_is_one_value(tmp_path, overrides, scoring, values):
    plan = plan_run(tiny(tmp_path, *overrides))
    assert (plan.scoring, plan.values, plan.settled) == (scoring, values, False)
    assert (S.ACTOR_LOG_PROB in plan.collected) == (scoring is Scoring.SAMPLING)


def test_a_pipeline_plans_once_settles_and_records_the_plan(tmp_path, monkeypatch):
    cfg = tiny(tmp_path / "run")
    calls = {"contract": 0, "placement": 0}

    def counted(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(planning, "contract_of", counted("contract", planning.contract_of))
    monkeypatch.setattr(planning, "check_placement",
                        counted("placement", planning.check_placement))
    pipe = Pipeline(cfg, progress=False)
    assert calls == {"contract": 1, "placement": 1}  # the collector contract, the KL placement
    assert pipe.plan.settled and pipe.plan.scoring is Scoring.SAMPLING and pipe.old_from_sampling
    assert pipe.ctx.max_new_tokens == pipe.plan.budgets.new_tokens == 24  # before any plugin
    assert (pipe.kl.where, pipe.kl.estimator) == ("reward", "k1")
    batch, _ = pipe.step()
    assert S.ACTOR_LOG_PROB not in batch.keys()  # taken as old_log_prob in stage 2
    pipe = Pipeline(tiny(tmp_path / "trained", "run.steps=1"), progress=False)
    assert not (pipe.run_dir / "plan.json").exists()  # written once training starts
    pipe.train()
    recorded = json.loads((pipe.run_dir / "plan.json").read_text())
    assert recorded == json.loads(json.dumps(pipe.plan.to_dict()))
    assert recorded["scoring"] == "sampling" and recorded["kl"]["in"] == "reward"


class Undeclared(TensorDictModuleBase):
    """A third-party estimator that declares no contract."""

    in_keys, out_keys = [S.REWARD], [S.ADVANTAGE, S.VALUE_TARGET]

    def forward(self, td):
        td[S.ADVANTAGE] = td[S.VALUE_TARGET] = torch.zeros_like(td[S.REWARD])
        return td


def test_an_undeclared_advantage_is_told_once_and_planned_safely(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(planning, "_told", set())
    cfg = compose.apply(tiny(tmp_path), advantage=Undeclared)
    first, _ = plan_run(cfg), plan_run(cfg)
    told = [line for line in capsys.readouterr().err.splitlines() if "Undeclared" in line]
    assert len(told) == 1 and "declares no AdvantageContract" in told[0], told
    assert not first.advantage_contract.declared
    assert (first.kl.in_, first.kl.estimator) == ("loss", "k2")  # safe whatever it normalises


def test_groups_of_one_are_refused_on_one_line(tmp_path):
    result = CliRunner().invoke(main, ["config", str(TINY), "advantage={name: grpo}",
                                       "collector.n=1", "train.minibatches=1"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: collector.n: advantage "), lines
    assert "needs collector.n >= 2 (got 1)" in lines[0]


def test_rlpipe_check_prints_the_plan(tmp_path):
    lines = []
    cfg = tiny(tmp_path / "run", "collector.max_new_tokens=4", "data.batch_size=2",
               "train.minibatches=1")
    check.check_config(cfg, echo=lines.append)
    assert lines[0].startswith("plan (derived from the config")
    assert "scoring: sampling" in lines[0] and "new_tokens: 4" in lines[0]
    assert not (tmp_path / "run").exists()


def test_pipeline_init_keeps_its_budget():
    """DESIGN.md: `Pipeline.__init__` at most 30 lines and 15 attributes."""
    source = textwrap.dedent(inspect.getsource(Pipeline.__init__))
    tree = ast.parse(source).body[0]
    lines = tree.end_lineno - tree.lineno + 1
    names = {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
             for t in ast.walk(t)
             if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
             and t.value.id == "self"}
    assert lines <= 30 and len(names) <= 15, (lines, sorted(names))


def test_each_reward_functions_convention_is_said_and_recorded(tmp_path, capsys):
    """Issue 52: one line per reward at start names the convention detected and the columns
    read; plan.json records the same lines."""
    def completions_only(completions, **kwargs):  # TRL's convention
        return [0.0 for _ in completions]

    run_dir = train(load_config(TINY, ["run.steps=1", f"run.output_dir={tmp_path / 'run'}"]),
                    rewards=[completions_only], progress=False)
    said = capsys.readouterr().err
    line = next(x for x in said.splitlines() if "reward 'completions_only'" in x)
    assert "TRL" in line
    recorded = json.loads((run_dir / "plan.json").read_text())["rewards_detected"]
    assert any("reward 'completions_only'" in x and "TRL" in x for x in recorded)
