"""Held-out accuracy per kind of problem, from a run's evaluation samples:

    python examples/arithmetic/per_kind.py runs/arithmetic

prints, for each held-out set (the first of ``eval.prompts``: ``samples/eval-step-N.jsonl``;
``wording``: ``eval-step-N.wording.jsonl``) and each evaluated step, the greedy accuracy (``answer_match``)
of each kind and of all rows, and the number of rows of each kind.
"""

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import yaml

FILE = re.compile(r"eval-step-(\d+)(?:\.(\w+))?\.jsonl")


def per_kind(run_dir) -> dict:
    """``{set: {step: {kind: (right, rows)}}}``, the kind ``all`` included."""
    found, prompts = defaultdict(dict), yaml.safe_load(Path(run_dir, "config.yaml").read_text())
    prompts = (prompts.get("eval") or {}).get("prompts")
    first = next(iter(prompts)) if isinstance(prompts, dict) else "eval"  # its files: no suffix
    for path in sorted(Path(run_dir, "samples").glob("eval-step-*.jsonl")):
        match = FILE.fullmatch(path.name)
        if match is None:
            continue
        counts = defaultdict(lambda: [0, 0])
        for line in path.read_text().splitlines():
            row = json.loads(line)
            for kind in (row["data"]["kind"], "all"):
                counts[kind][0] += row["rewards"]["answer_match"]
                counts[kind][1] += 1
        found[match[2] or first][int(match[1])] = {k: tuple(v) for k, v in counts.items()}
    return found


def main(run_dir: str) -> None:
    for name, steps in per_kind(run_dir).items():
        kinds = sorted({k for counts in steps.values() for k in counts} - {"all"}) + ["all"]
        print(f"{name}: step | " + " | ".join(kinds))
        for step, counts in sorted(steps.items()):
            print(f"{name}: {step} | " + " | ".join(
                f"{counts[k][0] / counts[k][1]:.3f} ({counts[k][1]})" for k in kinds))


if __name__ == "__main__":
    main(sys.argv[1])
