"""Write the arithmetic example's data: short word problems with their answers, in three
disjoint splits (no problem text appears in two of them). Deterministic (seed 0):

    python examples/arithmetic/make_data.py     # rewrites train.jsonl, dev.jsonl, test.jsonl here

Each line: ``{"prompt": [chat messages], "answer": int, "kind": str}``. ``train`` (1000 problems)
is what PPO samples from; ``dev`` (100) is the split the settings were chosen on; ``test`` (200)
is the held-out split the run evaluates, never looked at while choosing settings.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZES = {"train": 1000, "dev": 100, "test": 200}
INSTRUCTION = "Answer with a single number."
NAMES = ["Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Zoe", "Jack", "Ella"]
THINGS = ["apples", "books", "marbles", "stickers", "cookies", "pencils", "cards", "shells",
          "stamps", "coins", "balloons", "toy cars"]


def problem(rng: random.Random) -> tuple[str, int, str]:
    """One problem: (text, answer, kind)."""
    name, other, obj = rng.choice(NAMES), rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(1, 9)
    kind = rng.choice(["add", "add_total", "sub", "mul", "add_sub"])
    if kind == "add":
        return f"{name} has {a} {obj}. {other} gives {name} {b} more. How many {obj} does {name} have now?", a + b, kind
    if kind == "add_total":
        return f"There are {a} {obj} in a box and {b} {obj} on the table. How many {obj} are there in total?", a + b, kind
    if kind == "sub":
        a, b = max(a, b) + c, min(a, b)
        return f"{name} had {a} {obj} and gave {b} of them to {other}. How many {obj} does {name} have left?", a - b, kind
    if kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"{name} buys {a} bags with {b} {obj} in each bag. How many {obj} does {name} buy?", a * b, kind
    return f"{name} has {a} {obj}, finds {b} more and then loses {c}. How many {obj} does {name} have?", a + b - c, kind


def main() -> None:
    rng, seen = random.Random(0), set()
    for split, size in SIZES.items():
        rows = []
        while len(rows) < size:
            text, answer, kind = problem(rng)
            if text in seen:
                continue
            seen.add(text)
            messages = [{"role": "user", "content": f"{text} {INSTRUCTION}"}]
            rows.append({"prompt": messages, "answer": answer, "kind": kind})
        (HERE / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{split}: {len(rows)} problems -> {HERE / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
