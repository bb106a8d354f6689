"""The package map of DESIGN.md holds: core's layers import one way (`lint-imports` with the
contracts in pyproject.toml), core imports no plugin, and no rlpipe import hides in a function."""

import ast
import os
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("base", "contracts", "models", "data", "observe", "config", "step", "run")


def test_import_contracts_hold(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def test_every_core_module_sits_in_a_layer():
    loose = sorted(p.name for p in (ROOT / "core").glob("*.py") if p.name != "__init__.py")
    folders = sorted(p.name for p in (ROOT / "core").iterdir()
                     if p.is_dir() and (p / "__init__.py").exists())
    assert loose == [] and folders == sorted(LAYERS)


def function_level_imports(path: Path) -> list[str]:
    """``line: module`` for each import of an rlpipe module inside a function of ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                names = ([sub.module or ""] if isinstance(sub, ast.ImportFrom) else
                         [a.name for a in sub.names] if isinstance(sub, ast.Import) else [])
                found += [f"{sub.lineno}: {n}" for n in names if n.startswith("rlpipe")]
    return found


def test_no_rlpipe_import_inside_a_function_of_core_or_plugins():
    found = {}
    for folder in ("core", "plugins"):
        for dirpath, _, files in os.walk(ROOT / folder):
            for name in files:
                if name.endswith(".py"):
                    path = Path(dirpath) / name
                    if hits := function_level_imports(path):
                        found[str(path.relative_to(ROOT))] = hits
    assert found == {}


def test_the_scan_finds_a_function_level_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from rlpipe.core.base import errors\n")
    assert function_level_imports(bad) == ["2: rlpipe.core.base"]


def test_the_package_map_in_design_md_names_every_module_of_each_layer():
    rows = {line.split("`")[1].rstrip("/"): line
            for line in (ROOT / "DESIGN.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| `") and line.split("`")[1].rstrip("/") in LAYERS}
    assert sorted(rows) == sorted(LAYERS)
    for layer in LAYERS:
        modules = sorted(p.stem for p in (ROOT / "core" / layer).glob("*.py") if p.stem != "__init__")
        missing = [m for m in modules if f"`{m}`" not in rows[layer]]
        assert missing == [], f"DESIGN.md's package map lacks core/{layer}/{missing}"
