"""`rlpipe.plugin`, the one module plugin authors import: its names are pinned (a removed or
renamed name fails here, and needs a deprecation shim for one minor release), each resolves,
importing it loads no run code, and the plugin example and the composition docs import nothing
else of rlpipe."""

import ast
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import rlpipe
import rlpipe.plugin
from rlpipe.core.base import schema

ROOT = Path(__file__).resolve().parents[1]

SURFACE = [
    "ACTION_MASK", "ACTOR_LOG_PROB", "ADVANTAGE", "AdvantageContract", "Bound", "CONVERSATION",
    "Callback", "Collector", "CollectorContract", "Count", "DATA", "ENGINE_HIDDEN",
    "ENGINE_LOG_PROB", "ENTROPY", "EXPLAINED_VAR", "FINISHED", "Fraction", "GROUP_ID", "LOG_PROB",
    "LossContract", "ModelPath", "NUM_SEQS", "NUM_TOKENS", "NUM_TURNS", "OLD_LOG_PROB",
    "PROMPT_IDS", "PROMPT_MASK", "PROMPT_MESSAGES", "PROMPT_TEXT", "PipelineLoss", "PluginError",
    "REF_LOG_PROB", "RESPONSE_IDS", "RESPONSE_MASK", "RESPONSE_TEXT", "REWARD",
    "ROLLOUT_IS_WEIGHT", "Range", "RewardContract", "Rule", "RunContext", "SCORE", "SCORE_PARTS",
    "SEQ", "STOP_REASON", "TOKEN", "TURN_ID", "TURN_REWARD", "Temperature", "Tokens", "TopK",
    "UserError", "VALUE", "VALUE_PRED", "VALUE_TARGET", "advantage_contract", "batch_texts",
    "explained_var", "explained_var_sums", "global_count", "kl", "masked_mean", "masked_whiten",
    "num", "pad_rows", "reward_contract", "schema",
    # environments (issue 51)
    "ENV", "EnvironmentContract", "STOP_REASONS", "ToolCall", "action_mask", "call_env", "parse_tool_calls",
]


def test_the_surface_is_pinned_and_every_name_resolves():
    assert sorted(rlpipe.plugin.__all__) == sorted(SURFACE)
    assert len(set(rlpipe.plugin.__all__)) == len(rlpipe.plugin.__all__)
    for name in SURFACE:
        assert getattr(rlpipe.plugin, name) is not None, name
    assert rlpipe.plugin.Callback is rlpipe.Callback


def test_every_batch_key_is_exported():
    keys = {name for name, value in vars(schema).items()
            if name.isupper() and not name.startswith("_") and isinstance(value, str)}
    assert keys <= set(SURFACE), keys - set(SURFACE)


def test_a_moved_name_warns_for_one_release(monkeypatch):
    monkeypatch.setitem(rlpipe.plugin._MOVED, "OldContract",
                        ("rlpipe.core.contracts.kinds:AdvantageContract", "0.3"))
    with pytest.warns(DeprecationWarning, match=r"rlpipe.plugin.OldContract moved to "
                                                r"rlpipe.core.contracts.kinds.AdvantageContract"):
        assert rlpipe.plugin.OldContract is rlpipe.plugin.AdvantageContract
    with pytest.raises(AttributeError, match="has no attribute 'Missing'"):
        rlpipe.plugin.Missing  # noqa: B018


def test_importing_it_loads_no_run_code():
    code = ("import sys, rlpipe.plugin; "
            "print(sorted(m for m in sys.modules if m.startswith('rlpipe.core.run')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def rlpipe_imports(source: str) -> set[str]:
    """The rlpipe modules that ``source`` imports from."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found |= {n for n in names if n == "rlpipe" or n.startswith("rlpipe.")}
    return found


def python_blocks(page: Path) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)\n```", page.read_text(), re.S))


PLUGIN_AUTHOR = {"rlpipe", "rlpipe.plugin"}
BUILTINS = {f"rlpipe.plugins.{kind}" for kind in ("collectors", "rewards", "advantages", "losses")}


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "custom_plugin").rglob("*.py")),
                         ids=lambda p: p.name)
def test_the_plugin_example_imports_only_the_public_modules(path):
    assert rlpipe_imports(path.read_text()) <= PLUGIN_AUTHOR


@pytest.mark.parametrize("page, allowed", [("plugins.md", PLUGIN_AUTHOR),
                                           ("compose.md", PLUGIN_AUTHOR | BUILTINS)])
def test_the_docs_import_only_the_public_modules(page, allowed):
    """A page for plugin authors imports rlpipe and rlpipe.plugin; composing a run may also
    name the built-ins by their documented packages (``rlpipe.plugins.advantages``, ...)."""
    imported = rlpipe_imports(python_blocks(ROOT / "docs" / page))
    assert imported and imported <= allowed, imported - allowed


def test_loose_attributes_still_work_for_one_release_with_a_warning():
    class Legacy:
        needs_critic, needs_groups = False, True

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        contract = rlpipe.plugin.advantage_contract(Legacy)
    assert (contract.needs_critic, contract.needs_groups, contract.declared) == (False, True, True)
    assert [w.category for w in caught] == [DeprecationWarning]
