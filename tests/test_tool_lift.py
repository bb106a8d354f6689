"""The tool-lift report (issue 55): `ToolsDisabled` answers every tool call "tool unavailable"
without calling the environment and passes the final answer through; evaluation with an
environment that has tools runs a second pass without them and logs ``eval/no_tools/*`` and
``eval/tool_lift``; ``rlpipe report`` draws the lift and the tool use; the ``tools_abandoned``
health rule fires when the policy stops calling its tools.

The evaluator's oracle runs on a scripted engine (labelled: it reacts to what the tool answered,
as a policy that uses its tool would) so that the two passes differ by a known amount; the tiny
model's pipeline then checks the wiring from a config."""

import importlib
import json
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlpipe.core.base import schema as S
from rlpipe.core.contracts.environment import EnvironmentContract, call_env
from rlpipe.core.contracts.rule import History
from rlpipe.core.data.prompts import PromptData
from rlpipe.core.observe.health import Rule
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.step.evaluation import Evaluator
from rlpipe.core.step.multiturn import MultiTurn
from rlpipe.core.step.tool_lift import UNAVAILABLE, ToolsDisabled, without_tools
from rlpipe.plugins.environments.tools import ToolsEnvironment
from rlpipe.plugins.health.rules import ToolsAbandoned
from rlpipe.tools.report import PANELS, _draw, summary, write_report
from tests.test_metric_table import documented
from tests.test_multiturn import CALL, add, chatml_tokenizer, run
from tests.test_multiturn_pipeline import TINY, Echo, chat_tiny, config  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
TOOLS = EnvironmentContract(max_turns=4, tools=({"type": "function", "function": {"name": "add"}},))


class Counting:
    """An environment that records every call it gets."""

    def __init__(self):
        self.calls = []

    def reset(self, row, seed):
        self.calls.append(("reset", seed))
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.calls.append(("step", action))
        return [], 1.0, True, {"tool_calls": 0}


class AsyncCounting(Counting):
    async def step(self, action):
        return super().step(action)


# ---------------------------------------------------------------- the wrapper

def test_a_tool_call_is_unavailable_counted_and_never_reaches_the_environment():
    inner = Counting()
    env = ToolsDisabled(inner)
    assert call_env(env.reset, {"prompt": "hi"}, 7) == [{"role": "user", "content": "hi"}]
    two = CALL + " and " + CALL.replace('"a": 2', '"a": 4')
    messages, reward, done, info = call_env(env.step, two)
    assert messages == [{"role": "tool", "name": "add", "content": UNAVAILABLE}] * 2
    assert (reward, done, info) == (0.0, False, {"tool_calls": 2, "tool_errors": 2})
    messages, _, _, info = call_env(env.step, "<tool_call>{not json</tool_call>")  # malformed
    assert messages == [{"role": "tool", "content": "error: tool unavailable"}]
    assert info == {"tool_calls": 0, "tool_errors": 1}                  # as `tools` counts it
    assert inner.calls == [("reset", 7)]                                # no step reached it


@pytest.mark.parametrize("make", [Counting, AsyncCounting])
def test_a_final_answer_passes_through_plain_or_async(make):
    inner = make()
    assert call_env(ToolsDisabled(inner).step, "It is 5.") == ([], 1.0, True, {"tool_calls": 0})
    assert inner.calls == [("step", "It is 5.")]


def test_a_conversation_without_tools_sees_unavailable_and_ends_on_its_answer():
    batch, _, _ = run([[CALL, "It is 5."]], env=lambda: ToolsDisabled(ToolsEnvironment([add])))
    tool = [m for m in batch[S.CONVERSATION][0] if m["role"] == "tool"]
    assert tool == [{"role": "tool", "name": "add", "content": UNAVAILABLE}]
    assert batch[S.ENV, "tool_calls"].tolist() == [1] and batch[S.ENV, "tool_errors"].tolist() == [1]
    assert S.STOP_REASONS[int(batch[S.STOP_REASON][0])] == "done"


# ---------------------------------------------------------------- the evaluator

class Reactive:
    """Scripted engine (stand-in for a policy that uses its tool): asks ``add`` on the first turn
    of a sum question, then answers with what the tool said, or guesses 4 when it got nothing;
    answers "Say 5." at once. The collector attributes core reads are the base `Collector`'s."""

    def __init__(self, tok):
        self.tok, self.n, self.max_new_tokens = tok, 1, 64
        self.pad_id, self.eos_ids, self.device = tok.pad_token_id, [tok.eos_token_id], torch.device("cpu")

    def reply(self, text: str) -> str:
        if "Say 5." in text:
            return "It is 5."
        if "<|im_start|>tool" not in text:
            return CALL
        return "It is 4." if UNAVAILABLE in text else "It is 5."

    def generate(self, rows, prompt_ids, prompt_mask):
        outs = [self.tok(self.reply(self.tok.decode(r)), add_special_tokens=False)["input_ids"]
                + self.eos_ids for r in rows]
        width = max(map(len, outs))
        return {S.RESPONSE_IDS: torch.tensor([o + [self.pad_id] * (width - len(o)) for o in outs]),
                S.RESPONSE_MASK: torch.tensor([[True] * len(o) + [False] * (width - len(o)) for o in outs]),
                S.FINISHED: torch.ones(len(outs), dtype=torch.bool),
                S.ENGINE_LOG_PROB: -torch.ones(len(outs), width)}


class Match:
    """Scores 1 where the last reply holds the row's ``answer``."""

    labels = ["match"]

    def evaluate(self, batch):
        answers = batch[S.DATA, "answer"].tolist()
        score = torch.tensor([float(str(a) in r) for a, r in zip(answers, batch[S.RESPONSE_TEXT])])
        batch.set((S.SCORE_PARTS, "match"), score)
        batch.set(S.SCORE, score)


PROMPTS = ["What is 2 + 3?", "Say 5.", "What is 2 + 3, please?"]


def evaluator(tmp_path, make_env=lambda: ToolsEnvironment([add]), contract=TOOLS, lift=True):
    tok = chatml_tokenizer()
    turns = MultiTurn(Reactive(tok), make_env, contract, tok, 200)
    cfg = SimpleNamespace(eval=SimpleNamespace(max_prompts=None, batch_size=2, tool_lift=lift),
                          run=SimpleNamespace(seed=3))
    data = PromptData(PROMPTS, {"answer": [5] * 3}, kinds={"answer": "int"})
    dist = SimpleNamespace(world=1, rank=0, is_main=True, gather_object=lambda x: [x])
    return Evaluator(cfg, data, turns.collector, Match(), dist, torch.device("cpu"), tmp_path,
                     own_engine=False, turns=turns)


def test_evaluation_runs_again_without_tools_and_logs_the_lift(tmp_path):
    ev = evaluator(tmp_path)
    metrics = ev.run(2, actor=None)
    # the oracle: with the tool every answer is 5; without, the two sum questions guess 4
    assert metrics["eval/score"] == 1.0 and metrics["eval/no_tools/score"] == pytest.approx(1 / 3)
    assert metrics["eval/tool_lift"] == metrics["eval/score"] - metrics["eval/no_tools/score"]
    assert metrics["eval/no_tools/reward/match"] == pytest.approx(1 / 3)
    assert metrics["eval/env/tool_calls"] == metrics["eval/no_tools/env/tool_calls"] == pytest.approx(2 / 3)
    assert metrics["eval/env/tool_errors"] == 0
    assert metrics["eval/no_tools/env/tool_errors"] == pytest.approx(2 / 3)  # every call fails
    assert metrics["eval/no_tools/env/turns"] == metrics["eval/env/turns"] == pytest.approx(5 / 3)
    # every eval/* name has its eval/no_tools/* twin, and nothing else is added
    plain = {k for k in metrics if k.startswith("eval/") and not k.startswith("eval/no_tools/")}
    assert {k for k in metrics if k.startswith("eval/no_tools/")} == \
        {k.replace("eval/", "eval/no_tools/", 1) for k in plain - {"eval/tool_lift"}}
    names = {k.replace("/match", "/<label>") for k in metrics if "no_tools" in k or "lift" in k}
    assert not names - documented(), sorted(names - documented())
    # the samples file is the run with tools; the no-tools pass leaves the torch RNG as it was
    rows = [json.loads(line) for line in (tmp_path / "samples" / "eval-step-2.jsonl").read_text().splitlines()]
    assert [r["response"] for r in rows] == ["It is 5."] * 3
    state = torch.random.get_rng_state()
    again = ev.run(2, actor=None)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert {k: v for k, v in again.items() if k != "time/eval_s"} == \
        {k: v for k, v in metrics.items() if k != "time/eval_s"}


@pytest.mark.parametrize("case", ["no tools declared", "eval.tool_lift false"])
def test_no_second_pass_without_tools_or_when_switched_off(tmp_path, case):
    ev = (evaluator(tmp_path, contract=EnvironmentContract(max_turns=4)) if case == "no tools declared"
          else evaluator(tmp_path, lift=False))
    assert ev.no_tools is None
    metrics = ev.run(0, actor=None)
    assert "eval/env/turns" in metrics and not [k for k in metrics if "no_tools" in k or "lift" in k]


def test_without_tools_keeps_the_engine_contract_and_budget():
    tok = chatml_tokenizer()
    turns = MultiTurn(Reactive(tok), lambda: ToolsEnvironment([add]), TOOLS, tok, 123, "env X")
    bare = without_tools(turns)
    assert (bare.collector, bare.contract, bare.budget, bare.label) == (turns.collector, TOOLS, 123, "env X")
    assert bare.render.tools == turns.render.tools       # the same prompts: the schemas stay
    assert isinstance(bare.make_env(), ToolsDisabled)


def test_a_pipeline_with_the_tools_environment_logs_the_lift(chat_tiny, tmp_path):  # noqa: F811
    pipe = Pipeline(config(chat_tiny, tmp_path, f"eval.prompts={TINY / 'prompts.txt'}",
                           "eval.max_prompts=2", "environment.name=tools",
                           "environment.tools=[tests.test_multiturn:add]",
                           "environment.max_turns=2"), progress=False)
    try:
        assert isinstance(pipe.evaluator.no_tools, MultiTurn)
        metrics = pipe.evaluator.run(0, pipe.models.actor)
    finally:
        pipe.plugins.environment.close()
        pipe.evaluator.close()
    assert metrics["eval/tool_lift"] == metrics["eval/score"] - metrics["eval/no_tools/score"]
    labels = [r.key for r in pipe.cfg.rewards]
    names = {next(("eval/no_tools/reward/<label>" for label in labels
                   if k == f"eval/no_tools/reward/{label}"), k) for k in metrics if "no_tools" in k}
    assert len(names) > 10 and not names - documented(), sorted(names - documented())


def test_echo_has_no_tools_so_no_second_pass(chat_tiny, tmp_path):  # noqa: F811
    pipe = Pipeline(config(chat_tiny, tmp_path, f"eval.prompts={TINY / 'prompts.txt'}",
                           "eval.max_prompts=1"), environment=Echo, progress=False)
    assert pipe.evaluator.turns is not None and pipe.evaluator.no_tools is None
    pipe.plugins.environment.close()


# ---------------------------------------------------------------- the health rule

KEY = "env/tool_calls"


def rows(*calls):
    return [{"step": i + 1, KEY: c} for i, c in enumerate(calls)]


def test_it_fires_when_the_tool_call_rate_falls_below_a_quarter_of_its_start():
    history = rows(*[1.0] * 5, 0.8, 0.5, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1)
    fired = [History(history, end).step for end in range(1, len(history) + 1)
             if ToolsAbandoned().check(History(history, end)) is not None]
    # the mean of the last 5 steps against 0.25 x 1.0: step 10 (0.8+0.5+0.3+0.2+0.1)/5 = 0.38,
    # step 11 (0.5+0.3+0.2+0.1+0.1)/5 = 0.24: fires from step 11 on
    assert fired[0] == 11 and fired == list(range(11, 15))
    line = ToolsAbandoned().check(History(history))
    assert line.startswith(f"{KEY} 0.1 per conversation (mean of steps 10-14) < 0.25 x its start 1 ")


@pytest.mark.parametrize("history", [
    rows(*[1.0] * 5, *[0.9] * 10),                     # healthy: a slight fall
    rows(*[0.0] * 15),                                  # never called its tools (no tools)
    rows(1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),  # before step 2 x window: no verdict
    [{"step": s, "reward/score": 1.0} for s in range(1, 20)],  # single-turn: no env metrics
    rows(*[1.0] * 10) + [{"step": 11, KEY: float("nan")}],     # not a number at the judged step
])
def test_it_is_quiet_otherwise(history):
    assert ToolsAbandoned().check(History(history)) is None


def test_its_parameters_change_the_verdict():
    history = rows(*[1.0] * 5, *[0.4] * 5)
    assert ToolsAbandoned().check(History(history)) is None
    assert ToolsAbandoned(threshold=0.5).check(History(history)) is not None
    short = rows(1.0, 1.0, 0.4, 0.4)
    assert ToolsAbandoned(window=2, threshold=0.5).check(History(short)) is not None
    assert ToolsAbandoned(window=2, threshold=0.5).check(History(short, 3)) is None  # step 3 < 4


def test_the_rule_is_registered_documented_and_drawn():
    points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    module, _, attr = points["rlpipe.health"]["tools_abandoned"].partition(":")
    rule = getattr(importlib.import_module(module), attr)
    assert rule is ToolsAbandoned and issubclass(rule, Rule)
    assert rule.reads == (KEY,) and "." in rule.remedy and "eval.tool_lift" in rule.remedy
    assert rule.panel in {p.name for p in PANELS} and KEY in next(p for p in PANELS if p.name == rule.panel).left
    assert "`tools_abandoned`" in (ROOT / "docs" / "health.md").read_text()


# ---------------------------------------------------------------- the report

def test_the_report_draws_the_lift_and_the_tool_use(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    metrics = []
    for s in range(0, 7):
        row = {"step": s}
        if s:
            row |= {"reward/score": 0.1 * s, "env/tool_calls": 1.0 - 0.1 * s, "env/tool_errors": 0.1,
                    "env/timeouts": 0.0, "env/turns": 2.0, "env/obs_token_frac": 0.3}
        if s % 3 == 0:   # evaluation at steps 0, 3 and 6
            row |= {"eval/score": 0.5 + 0.05 * s, "eval/no_tools/score": 0.2,
                    "eval/no_tools/env/tool_calls": 1.0, "eval/tool_lift": 0.3 + 0.05 * s}
        metrics.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    names = {p.stem for p in write_report(run)}
    assert {"tool_lift", "tools", "eval", "reward"} <= names
    assert "eval/tool_lift     0.3 -> 0.6  (score with tools - without)" in summary(run)

    from matplotlib.figure import Figure
    from rlpipe.core.observe.metrics import load_metrics

    ax = Figure().subplots()
    _draw(ax, load_metrics(run), next(p for p in PANELS if p.name == "tool_lift"))
    (lift,) = ax.get_lines()
    assert list(lift.get_xdata()) == [0, 3, 6]     # the evaluations, joined by one line
    twin = [a for a in ax.figure.axes if a is not ax][0]
    assert [line.get_label() for line in twin.get_lines()] == ["eval/score", "eval/no_tools/score"]
    ax = Figure().subplots()
    _draw(ax, load_metrics(run), next(p for p in PANELS if p.name == "eval"))
    assert [line.get_label() for line in ax.get_lines()] == ["eval/score"]  # no_tools: its own panel


def test_a_run_without_an_environment_has_no_tool_panels(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/score": 1.0,
                                                           "eval/score": 0.5}) + "\n" for s in (1, 2)))
    assert {p.stem for p in write_report(run)} == {"overview", "reward", "eval"}
    assert "tool_lift" not in summary(run)
