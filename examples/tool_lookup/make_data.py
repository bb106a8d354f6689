"""Writes the lookup task: a table of made-up names and their 4-digit codes, and questions whose
answer exists only behind the `lookup` tool (tools.py).

    python examples/tool_lookup/make_data.py     # (re)writes table.json, train/test/wording.jsonl

Each prompt opens with a system line and two worked conversations (a tool call, the tool's
answer, the final answer) (the same two for every question, about names that are not in the table), then the question. train.jsonl
and test.jsonl ask about disjoint names in the training wording; wording.jsonl asks about the
test names in wordings that training never uses (held out twice: new names, new sentences).
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEM = "You answer questions about codes. You do not know any code: look it up with the lookup tool."
TRAIN_WORDING = ["What is the code of {k}?", "Tell me the code of {k}.", "Which code does {k} have?"]
NEW_WORDING = ["I need the access code for {k}, please.", "{k}: what code is on file?",
               "Could you find out {k}'s code?"]


def call(key: str) -> str:
    return json.dumps({"name": "lookup", "arguments": {"key": key}})


def shot(key: str, code: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the code of {key}?"},
            {"role": "assistant", "content": f"<tool_call>{call(key)}</tool_call>"},
            {"role": "tool", "content": code},
            {"role": "assistant", "content": f"The code is {code}."}]


def names(rng: random.Random, n: int) -> list[str]:
    """Made-up names (two or three syllables): no model has seen their codes."""
    syllables = ["ka", "zo", "mi", "vel", "tor", "ra", "ni", "bu", "sel", "qua", "dre", "lo",
                 "fen", "gri", "pa", "wu", "xi", "mor", "tal", "ene"]
    out = set()
    while len(out) < n:
        out.add("".join(rng.choice(syllables) for _ in range(rng.choice((2, 3)))).capitalize())
    return sorted(out)


def row(rng, key, code, wording, demos) -> dict:
    (k1, c1), (k2, c2) = demos   # the same two for every question: a prefix the forwards share
    messages = [{"role": "system", "content": SYSTEM}, *shot(k1, c1), *shot(k2, c2),
                {"role": "user", "content": rng.choice(wording).format(k=key)}]
    return {"prompt": messages, "answer": int(code), "name": key}


def main(seed: int = 0) -> None:
    rng = random.Random(seed)
    all_names = names(rng, 502)
    demos = [(k, f"{rng.randrange(1000, 10000)}") for k in all_names[:2]]   # worked examples
    table = {k: f"{rng.randrange(1000, 10000)}" for k in all_names[2:]}
    keys = list(table)
    rng.shuffle(keys)
    train, test = keys[:400], keys[400:]
    (HERE / "table.json").write_text(json.dumps(table, indent=0, sort_keys=True) + "\n")
    for name, chosen, wording in (("train", train, TRAIN_WORDING), ("test", test, TRAIN_WORDING),
                                  ("wording", test, NEW_WORDING)):
        with open(HERE / f"{name}.jsonl", "w") as f:
            for key in chosen:
                f.write(json.dumps(row(rng, key, table[key], wording, demos)) + "\n")


if __name__ == "__main__":
    main()
