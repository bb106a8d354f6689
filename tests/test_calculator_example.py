"""examples/calculator: its tool (integer arithmetic through `ast`, never `eval`), its data (the
answers are the arithmetic of the numbers in each question; held-out wordings training never
sees) and its config (the `tools` environment with `calc`). The trained results are in the
example's README; the run itself needs SmolLM2 (the quickstart tier's package)."""

import json
import re
from pathlib import Path

import pytest

from rlpipe import load_config
from rlpipe.core.config.plan import plan_run
from examples.calculator.calc_tools import calc
from examples.calculator.make_data import NEW_WORDING, TRAIN_WORDING

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "examples" / "calculator"


def split(name: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / f"{name}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("expr, value", [("1234 * 56", "69104"), ("(7 - 10) * 2", "-6"),
                                         ("9,999 + 1", "10000"), ("12 × 3", "36"), ("-4", "-4")])
def test_calc_does_integer_arithmetic(expr, value):
    assert calc(expr) == value


@pytest.mark.parametrize("expr, line", [
    ("__import__('os').system('true')", "only integers, \\+ - \\* and parentheses"),
    ("2 ** 100000", "only integers"), ("10 / 3", "only integers"), ("1.5 + 1", "only integers"),
    ("x + 1", "only integers"), ("9" * 8 + " * " + "9" * 8, "a result is over"),
    ("1 +", "not an expression"), ("1" * 201, "longer than 200")])
def test_calc_refuses_everything_else_on_one_line(expr, line):
    with pytest.raises(ValueError, match=line):
        calc(expr)


@pytest.mark.parametrize("name, wording", [("train", TRAIN_WORDING), ("test", TRAIN_WORDING),
                                           ("wording", NEW_WORDING)])
def test_each_answer_is_the_arithmetic_of_its_question(name, wording):
    rows = split(name)
    templates = {re.sub(r"\{[nab]\}", "", text) for _, text in wording}
    for row in rows:
        question = row["prompt"][-1]["content"]
        a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
        if row["op"] == "*" and question.startswith("What do"):   # "{b} rows of {a} seats"
            a, b = b, a
        assert row["answer"] == {"+": a + b, "-": a - b, "*": a * b}[row["op"]], question
        shape = re.sub(r"\d+|" + "|".join(
            ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivo", "Jin", "Kemal", "Lea"]),
            "", question)
        assert shape in templates, question


def test_held_out_questions_are_new():
    train = {r["prompt"][-1]["content"] for r in split("train")}
    assert not train & {r["prompt"][-1]["content"] for r in split("test")}
    new = {t for _, t in NEW_WORDING}
    assert not new & {t for _, t in TRAIN_WORDING}


def test_the_config_names_the_calc_tool(monkeypatch):
    monkeypatch.chdir(ROOT)   # the config names its tool as a module of the repository
    cfg = load_config(HERE / "config.yaml",    # the tiny model stands in for SmolLM2 here
                      [f"models.actor.path={ROOT / 'examples' / 'tiny' / 'model'}"])
    tools = plan_run(cfg).environment_contract.tools
    assert [t["function"]["name"] for t in tools] == ["calc"]
    assert tools[0]["function"]["parameters"]["required"] == ["expr"]
