"""Writes the calculator task: 3-4 digit + - x word problems that a 135M model cannot work out
in its head, and a `calc` tool (calc_tools.py) that can.

    python -m examples.calculator.make_data     # from the repository root: (re)writes the splits

Each prompt opens with a system line and two worked conversations (a tool call, the tool's
answer, the final answer; the same two for every question), then the question. train.jsonl and
test.jsonl hold different numbers in the training wordings; wording.jsonl holds more new numbers
in wordings that training never uses (held out twice: new numbers, new sentences).
"""

import json
import random
from pathlib import Path

from examples.calculator.calc_tools import calc

HERE = Path(__file__).resolve().parent
SYSTEM = ("You solve word problems. Do not compute in your head: call the calc tool with the "
          "expression, then give the answer.")
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivo", "Jin", "Kemal", "Lea"]
# (operator, wording); {n} a name, {a} and {b} the numbers
TRAIN_WORDING = [
    ("+", "{n} has {a} stamps and buys {b} more. How many stamps does {n} have now?"),
    ("+", "A library had {a} books and received {b} new ones. How many books does it have?"),
    ("-", "A warehouse holds {a} boxes. {b} boxes are shipped out. How many boxes are left?"),
    ("-", "{n} saved {a} coins and spent {b} of them. How many coins are left?"),
    ("*", "Each crate holds {a} bottles. How many bottles are in {b} crates?"),
    ("*", "A printer prints {a} pages an hour. How many pages does it print in {b} hours?"),
]
NEW_WORDING = [
    ("+", "Add {b} visitors to the {a} who came this morning: how many visitors in total?"),
    ("-", "Out of {a} tickets, {b} were sold. Find the number of unsold tickets."),
    ("*", "What do {b} rows of {a} seats come to, in seats?"),
]


def numbers(rng: random.Random, op: str) -> tuple[int, int]:
    a = rng.randrange(100, 10000)
    if op == "*":
        return a, rng.randrange(12, 1000)
    b = rng.randrange(100, 10000)
    return (max(a, b), min(a, b)) if op == "-" else (a, b)


def shot(question: str, expr: str) -> list[dict]:
    call = json.dumps({"name": "calc", "arguments": {"expr": expr}})
    answer = calc(expr)
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": str(answer)},
            {"role": "assistant", "content": f"The answer is {answer}."}]


DEMOS = [*shot("A farm has 4821 hens and buys 736 more. How many hens does it have?", "4821 + 736"),
         *shot("Each bus carries 52 people. How many people ride in 317 buses?", "52 * 317")]


def row(rng: random.Random, wording: list) -> dict:
    op, text = rng.choice(wording)
    a, b = numbers(rng, op)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    messages = [{"role": "system", "content": SYSTEM}, *DEMOS,
                {"role": "user", "content": text.format(n=rng.choice(NAMES), a=a, b=b)}]
    return {"prompt": messages, "answer": answer, "op": op}


def main(seed: int = 0) -> None:
    rng = random.Random(seed)
    for name, count, wording in (("train", 400, TRAIN_WORDING), ("test", 100, TRAIN_WORDING),
                                 ("wording", 100, NEW_WORDING)):
        with open(HERE / f"{name}.jsonl", "w") as f:
            for _ in range(count):
                f.write(json.dumps(row(rng, wording)) + "\n")


if __name__ == "__main__":
    main()
