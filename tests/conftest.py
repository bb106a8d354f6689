"""Shared test fixtures: a tiny in-memory tokenizer, a tiny Llama and a `RunContext`.

Fixtures (all function-scoped, built in milliseconds, no downloads):

- ``tiny_tokenizer``: word-level `PreTrainedTokenizerFast` over `WORDS`, specials ``<pad>``=0,
  ``<s>``=1 (prepended to every encoding), ``</s>``=2 (EOS), ``<unk>``=3; pad != eos; padding side
  right; a chat template ``"user : ... assistant : "``. Decoding joins words with spaces.
- ``tiny_tokenizer_pad_eos``: the same vocabulary with pad == eos (``</s>``), like Llama checkpoints.
- ``tiny_tokenizer_no_pad``: the same vocabulary with no pad token at all.
- ``tiny_model``: seeded random `LlamaForCausalLM` (hidden 32, 2 layers, 4 heads, 2 kv heads,
  intermediate 64, untied head), vocab = ``len(tiny_tokenizer)``, in eval mode.
- ``ctx``: `RunContext(tokenizer=tiny_tokenizer, actor=tiny_model, max_new_tokens=8)`.

The device switch: ``RLPIPE_TEST_DEVICE=cuda python -m pytest`` puts ``tiny_model`` and ``ctx`` on
that device and sets ``RLPIPE_DEVICE`` (which replaces ``run.device`` of every config rlpipe
loads, subprocesses included), so every test that builds models runs them there. Tests marked
``gpu`` (tests/test_gpu.py) skip where torch sees no CUDA device.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlpipe.core.base.context import RunContext

TEST_DEVICE = os.environ.get("RLPIPE_TEST_DEVICE", "cpu")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped where there is none")
    if TEST_DEVICE != "cpu":
        os.environ["RLPIPE_DEVICE"] = TEST_DEVICE


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: torch sees no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = ("the a cat dog sat ran on under mat rug and big small red blue green one two three four "
         "is was hello world stop user assistant : .").split()
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")


def build_tokenizer(pad_token: str | None = "<pad>") -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `WORDS`; ``pad_token=None`` gives one without a pad token.

    >>> build_tokenizer()("the cat").input_ids
    [1, 4, 6]
    """
    vocab = {word: i for i, word in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token=pad_token)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture
def tiny_tokenizer_pad_eos() -> PreTrainedTokenizerFast:
    return build_tokenizer(pad_token="</s>")


@pytest.fixture
def tiny_tokenizer_no_pad() -> PreTrainedTokenizerFast:
    return build_tokenizer(pad_token=None)


@pytest.fixture
def tiny_model(tiny_tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval().to(TEST_DEVICE)


@pytest.fixture
def ctx(tiny_tokenizer, tiny_model) -> RunContext:
    return RunContext(tokenizer=tiny_tokenizer, actor=tiny_model, device=torch.device(TEST_DEVICE),
                      max_new_tokens=8)


# pip builds a local package with the setuptools already installed (torch needs it on 3.12+), so
# that ``pip install PATH`` works without the network too; else pip fetches one.
NO_ISOLATION = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []


def python_path(*dirs) -> str:
    """``PYTHONPATH`` for a subprocess: ``dirs`` first, then the inherited one (a machine whose
    packages live on ``PYTHONPATH`` keeps them)."""
    return os.pathsep.join([*map(str, dirs), *filter(None, [os.environ.get("PYTHONPATH")])])


# ---- the bad-input harness: one line, exit 2, no traceback, nothing outside the run changed ----

def run_cli(args, cwd=None, env=None, timeout: float = 600):
    """``python -m rlpipe.cli ARGS`` in a subprocess (a real process: ``sys.exit`` in a plugin,
    stderr and the exit code are exactly what a user sees). Returns the CompletedProcess."""
    import os
    import subprocess
    import sys

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "rlpipe.cli", *map(str, args)], cwd=cwd,
                          env=full_env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def assert_one_line_error(result, *fragments: str, code: int = 2) -> str:
    """The run failed with ``code``, printed no traceback, and its stderr holds exactly one
    ``error: ...`` line (other lines only from ``warning:``) that contains every fragment."""
    err = result.stderr
    assert result.returncode == code, (result.returncode, err[-2000:])
    assert "Traceback" not in err and "Traceback" not in result.stdout, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1, err[-2000:]
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


def snapshot(root) -> dict:
    """``{relative path: (size, mtime_ns)}`` of every file and link under ``root``: compare two
    snapshots to prove that nothing there was created, changed or deleted."""
    from pathlib import Path

    root = Path(root)
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() or p.is_symlink()}


@pytest.fixture
def harness():
    """The bad-input harness as a fixture (test modules cannot import conftest under
    ``--import-mode=importlib``): ``harness.run(args)``, ``harness.error(result, ...)``,
    ``harness.snapshot(root)``."""
    from types import SimpleNamespace

    return SimpleNamespace(run=run_cli, error=assert_one_line_error, snapshot=snapshot)


# ---- reading a finished run: what two runs are compared on ----------------------------------

def logged_metrics(run_dir) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` without the wall-clock entries (``time/*``,
    ``perf/*``): what two runs of the same computation must agree on exactly."""
    import json
    from pathlib import Path

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in lines]


def final_weights(run_dir, name: str = "model.safetensors") -> dict:
    """The tensors of ``run_dir/final/NAME``."""
    from pathlib import Path

    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "final" / name))


@pytest.fixture
def one_thread():
    """Single-threaded torch for the test, as in a subprocess with OMP_NUM_THREADS=1: runs that
    must agree to the bit (resume, replay) reduce in the same order. Modules that need it:
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
