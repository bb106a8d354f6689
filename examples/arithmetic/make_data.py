"""Write the arithmetic example's data: short word problems with their answers, in three
disjoint splits (no problem text appears in two of them), and a fourth in new wording.
Deterministic (seeds 0 and 1):

    python examples/arithmetic/make_data.py     # rewrites train, dev, test and wording.jsonl here

Each line: ``{"prompt": [chat messages], "answer": int, "kind": str}``. ``train`` (1000 problems)
is what PPO samples from; ``dev`` (100) is the split the settings are chosen on; ``test`` (200)
is the held-out split from the same generator (`problem`). ``wording`` (200) holds the same five
kinds written by another function (`reworded`): other sentences, names, objects, instruction and
order of the facts, none of `problem`'s phrases; it is never used for training or tuning.
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


KINDS = ["add", "add_total", "sub", "mul", "add_sub"]
TEMPLATES = {   # `problem`'s sentences, by kind
    "add": "{name} has {a} {obj}. {other} gives {name} {b} more. How many {obj} does {name} have now?",
    "add_total": "There are {a} {obj} in a box and {b} {obj} on the table. How many {obj} are there in total?",
    "sub": "{name} had {a} {obj} and gave {b} of them to {other}. How many {obj} does {name} have left?",
    "mul": "{name} buys {a} bags with {b} {obj} in each bag. How many {obj} does {name} buy?",
    "add_sub": "{name} has {a} {obj}, finds {b} more and then loses {c}. How many {obj} does {name} have?",
}

# The new wording's own names, objects, instruction and sentences (none of the above).
NEW_INSTRUCTION = "Reply with one number only."
NEW_NAMES = ["Priya", "Omar", "Kenji", "Sofia", "Ines", "Dmitri", "Amara", "Lucas", "Yara", "Felix"]
NEW_THINGS = ["seashells", "crayons", "beads", "erasers", "postcards", "buttons", "tickets",
              "pebbles", "candles", "badges"]
NEW_TEMPLATES = {   # the facts in another order; no phrase of TEMPLATES recurs (a test checks)
    "add": "{other} handed {b} {obj} to {name}, who already owned {a}. What is the number of {obj} {name} owns at this point?",
    "add_total": "A drawer holds {b} {obj}, while a shelf holds {a}. Counting both places together, what is the number of {obj}?",
    "sub": "Out of {a} {obj} that {name} owned, {b} went to {other}. What number of {obj} remains with {name}?",
    "mul": "Every packet contains {b} {obj}. If {name} picks up {a} packets, what number of {obj} is that altogether?",
    "add_sub": "{name} lost {c} {obj} on the way home, after finding {b} to add to the {a} already at home. What number of {obj} does {name} end up with?",
}


def draw(rng: random.Random, names: list, things: list, templates: dict) -> tuple[str, int, str]:
    """One problem: (text, answer, kind), its facts drawn (the same ranges for every wording),
    then written with ``templates``."""
    name, other, obj = rng.choice(names), rng.choice(names), rng.choice(things)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(1, 9)
    kind = rng.choice(KINDS)
    if kind == "sub":
        a, b = max(a, b) + c, min(a, b)
    if kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
    answer = {"add": a + b, "add_total": a + b, "sub": a - b, "mul": a * b, "add_sub": a + b - c}[kind]
    return templates[kind].format(name=name, other=other, obj=obj, a=a, b=b, c=c), answer, kind


def problem(rng: random.Random) -> tuple[str, int, str]:
    """One problem of the generator's wording."""
    return draw(rng, NAMES, THINGS, TEMPLATES)


def reworded(rng: random.Random) -> tuple[str, int, str]:
    """One problem of the same five kinds and number ranges as `problem`, in other words."""
    return draw(rng, NEW_NAMES, NEW_THINGS, NEW_TEMPLATES)


def write(path: Path, rows: list[tuple[str, int, str]], instruction: str) -> None:
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{text} {instruction}"}],
                                        "answer": answer, "kind": kind}) + "\n"
                            for text, answer, kind in rows))
    print(f"{path.stem}: {len(rows)} problems -> {path}")


def main() -> None:
    rng, seen = random.Random(0), set()
    for split, size in SIZES.items():
        rows = []
        while len(rows) < size:
            row = problem(rng)
            if row[0] not in seen:
                seen.add(row[0])
                rows.append(row)
        write(HERE / f"{split}.jsonl", rows, INSTRUCTION)
    rng, rows = random.Random(1), {}
    while len(rows) < 200:  # distinct texts, in the order drawn
        row = reworded(rng)
        rows.setdefault(row[0], row)
    write(HERE / "wording.jsonl", list(rows.values()), NEW_INSTRUCTION)


if __name__ == "__main__":
    main()
