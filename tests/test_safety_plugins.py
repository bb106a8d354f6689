"""Plugin isolation: a third-party plugin that raises, calls ``sys.exit``, or writes NaN, at import,
construction or call time, ends the run with one ``error:`` line naming it, exit status 2.

The plugins live in a fake installed distribution, ``evilplug 1.0`` (a dist-info folder on
``sys.path``). Most cases run the CLI in-process (`CliRunner`); those where a real process
matters (``sys.exit``, a broken import in ``rlpipe plugins``) run ``python -m rlpipe.cli``.
"""

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from click.testing import CliRunner
from tensordict import TensorDict

from rlpipe.cli import main
from tests.conftest import python_path
from rlpipe.core.contracts import guards, registry
from rlpipe.core.base import schema
from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.registry import PluginError
from rlpipe.core.step.rewards import RewardComposer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny"

EVIL = """
    import sys

    import torch

    from rlpipe.core.base import schema as S
    from rlpipe.plugins.advantages.grpo import GRPO
    from rlpipe.plugins.collectors.hf import HFCollector
    from rlpipe.plugins.losses.ppo import PPOLoss


    class RaiseInit(torch.nn.Module):
        def __init__(self):
            super().__init__()
            raise RuntimeError("boom in init")


    class ExitInit(torch.nn.Module):
        def __init__(self):
            super().__init__()
            sys.exit(7)


    class RaiseCall(torch.nn.Module):
        def forward(self, td):
            return 1 / 0


    class NaNReward(torch.nn.Module):
        def forward(self, td):
            return torch.full((td.batch_size[0],), float("nan"))


    class RaiseAdvantage(GRPO):
        def forward(self, td):
            raise KeyError("no such key")


    class NaNAdvantage(GRPO):
        def forward(self, td):
            td = super().forward(td)
            td[S.ADVANTAGE] = td[S.ADVANTAGE] * float("nan")
            return td


    class NoneAdvantage(GRPO):
        def forward(self, td):
            return None


    class RaiseLoss(PPOLoss):
        def forward(self, td):
            raise ValueError("bad loss\\nsecond line")


    class NaNLoss(PPOLoss):
        def forward(self, td):
            out = super().forward(td)
            out["loss_objective"] = out["loss_objective"] * float("nan")
            return out


    class RaiseCollect(HFCollector):
        def collect(self, prompts):
            raise RuntimeError("engine died")


    class ExitCollect(HFCollector):
        def collect(self, prompts):
            sys.exit(0)


    class NoFinished(HFCollector):
        def collect(self, prompts):
            td = super().collect(prompts)
            del td[S.FINISHED]
            return td


    class ExitSync(HFCollector):
        def sync_weights(self, model):
            sys.exit(0)
"""

ENTRY_POINTS = {
    "rewards": {"raise_init": "RaiseInit", "exit_init": "ExitInit", "raise_call": "RaiseCall",
                "nan_reward": "NaNReward"},
    "advantages": {"raise_adv": "RaiseAdvantage", "nan_adv": "NaNAdvantage",
                   "none_adv": "NoneAdvantage"},
    "losses": {"raise_loss": "RaiseLoss", "nan_loss": "NaNLoss"},
    "collectors": {"raise_collect": "RaiseCollect", "exit_collect": "ExitCollect",
                   "exit_sync": "ExitSync", "no_finished": "NoFinished"},
}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A fake installed distribution ``evilplug 1.0`` with misbehaving plugins."""
    site = tmp_path_factory.mktemp("site")
    info = site / "evilplug-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: evilplug\nVersion: 1.0\n")
    lines = []
    for group, entries in ENTRY_POINTS.items():
        lines += [f"[rlpipe.{group}]", *(f"{n} = evilplug:{cls}" for n, cls in entries.items())]
        if group == "rewards":
            lines.append("exit_import = evilplug_exit:Reward")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (site / "evilplug.py").write_text(textwrap.dedent(EVIL))
    (site / "evilplug_exit.py").write_text("import sys\nsys.exit(3)\n")
    return site


@pytest.fixture
def installed(site, monkeypatch):
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    return site


def write_config(tmp_path: Path, **sections) -> Path:
    """The tiny example cut to one small step (4 samples, GRPO, one minibatch), with
    ``sections`` replaced (e.g. ``rewards=[{"name": "nan_reward"}]``)."""
    raw = yaml.safe_load((TINY / "config.yaml").read_text())
    raw["models"]["actor"]["path"] = str(TINY / "model")
    raw["data"] = {"prompts": str(TINY / "prompts.txt"), "batch_size": 2}
    raw["run"].update(steps=1, output_dir=str(tmp_path / "run"))
    raw["collector"].update(max_new_tokens=6, n=2)
    raw["advantage"] = {"name": "grpo"}
    raw["train"].update(epochs=1, minibatches=1)
    for key, value in sections.items():
        raw[key] = {"n": 2, **value} if key == "collector" else value  # GRPO needs groups
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def one_error(harness, result, *fragments) -> str:
    """`harness.error` for an in-process `CliRunner` result."""
    proc = SimpleNamespace(returncode=result.exit_code, stderr=result.stderr, stdout=result.stdout)
    return harness.error(proc, *fragments)


def label(where: str, group: str, name: str) -> str:
    return f"{where} (rlpipe.{group}:{name} (evilplug 1.0))"


CASES = [  # id, config sections, fragments of the one error line
    ("reward raises in __init__", {"rewards": [{"name": "raise_init"}]},
     [label("rewards.0", "rewards", "raise_init"), "failed in __init__: RuntimeError: boom in init"]),
    ("reward sys.exit in __init__", {"rewards": [{"name": "length"}, {"name": "exit_init"}]},
     [label("rewards.1", "rewards", "exit_init"), "failed in __init__: sys.exit(7)"]),
    ("reward raises in forward", {"rewards": [{"name": "raise_call"}]},
     [label("rewards.0", "rewards", "raise_call"), "failed in forward: ZeroDivisionError"]),
    ("reward returns NaN", {"rewards": [{"name": "nan_reward"}]},
     ["reward 'nan_reward' returned NaN or inf for 4 of 4 samples",
      label("rewards.0", "rewards", "nan_reward")]),
    ("advantage raises", {"advantage": {"name": "raise_adv"}},
     [label("advantage", "advantages", "raise_adv"), "failed in forward: KeyError"]),
    ("advantage writes NaN", {"advantage": {"name": "nan_adv"}},
     [label("advantage", "advantages", "nan_adv"), "wrote NaN or inf: 'advantage' at"]),
    ("advantage returns None", {"advantage": {"name": "none_adv"}},
     [label("advantage", "advantages", "none_adv"), "returned NoneType"]),
    ("loss raises", {"loss": {"name": "raise_loss"}},
     [label("loss", "losses", "raise_loss"), "failed in forward: ValueError: bad loss"]),
    ("loss always NaN", {"loss": {"name": "nan_loss"}, "overrides": ["train.max_bad_steps=1"]},
     ["training diverged", "non-finite loss_objective", label("loss", "losses", "nan_loss")]),
    ("collector raises in collect", {"collector": {"name": "raise_collect", "max_new_tokens": 6}},
     [label("collector", "collectors", "raise_collect"), "failed in collect: RuntimeError: engine died"]),
    ("collector leaves out a key", {"collector": {"name": "no_finished", "max_new_tokens": 6}},
     [label("collector", "collectors", "no_finished"), "did not write 'finished'"]),
    ("collector sys.exit in sync_weights", {"collector": {"name": "exit_sync", "max_new_tokens": 6}},
     [label("collector", "collectors", "exit_sync"), "failed in sync_weights: sys.exit(0)"]),
    ("reward sys.exit at import", {"rewards": [{"name": "exit_import"}]},
     ["rlpipe.rewards:exit_import (evilplug 1.0): failed to import evilplug_exit:Reward: sys.exit(3)"]),
]


@pytest.mark.parametrize("sections, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_misbehaving_plugin_is_one_line(installed, tmp_path, harness, sections, fragments):
    sections = dict(sections)
    overrides = sections.pop("overrides", [])
    config = write_config(tmp_path, **sections)
    before = harness.snapshot(TINY), harness.snapshot(tmp_path)
    result = CliRunner().invoke(main, ["run", str(config), "--no-progress", *overrides])
    one_error(harness, result, *fragments)
    assert "Traceback" not in result.output
    after = harness.snapshot(TINY), {k: v for k, v in harness.snapshot(tmp_path).items()
                                     if not k.startswith("run/")}
    assert after == (before[0], before[1])


def test_debug_shows_the_plugins_traceback(installed, tmp_path):
    config = write_config(tmp_path, rewards=[{"name": "raise_call"}])
    result = CliRunner().invoke(main, ["run", str(config), "--no-progress", "--debug"])
    assert isinstance(result.exception, PluginError), result.output
    assert isinstance(result.exception.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("collector, fragments", [
    ("exit_collect", [label("collector", "collectors", "exit_collect"),
                      "failed in collect: sys.exit(0)"]),
])
def test_sys_exit_in_a_real_process_is_not_a_silent_success(site, tmp_path, harness, collector,
                                                            fragments):
    config = write_config(tmp_path, collector={"name": collector, "max_new_tokens": 6})
    result = harness.run(["run", config, "--no-progress"], env={"PYTHONPATH": python_path(site),
                                                                 registry.DISABLE_ENV: ""})
    line = harness.error(result, *fragments)
    assert line.endswith("(--debug shows the traceback)")


def test_plugins_lists_the_others_when_one_exits_at_import(site, harness):
    result = harness.run(["plugins"], env={"PYTHONPATH": python_path(site), registry.DISABLE_ENV: ""})
    assert result.returncode == 0, result.stderr
    rows = {tuple(line.split()[:2]): line for line in result.stdout.splitlines()}
    assert "broken: failed to import evilplug_exit:Reward: sys.exit(3)" in rows[("rewards", "exit_import")]
    assert rows[("rewards", "raise_init")].split()[2:5] == ["evilplug", "1.0", "ok"]
    assert rows[("rewards", "length")].split()[2:5] == ["rlpipe", "0.1.0", "ok"]


def batch(old, ref):
    mask = torch.tensor([[True, True, False]])
    return TensorDict({schema.RESPONSE_MASK: mask, schema.OLD_LOG_PROB: torch.tensor([old]),
                       schema.REF_LOG_PROB: torch.tensor([ref])}, batch_size=[1])


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("old, ref, estimator, fragments", [
    ([-1.0, NAN, 0.0], [-1.0, -1.0, 0.0], "k1", ["old_log_prob (actor) at 1"]),
    ([-1.0, -1.0, 0.0], [-INF, -1.0, 0.0], "k1", ["ref_log_prob (reference) at 1"]),
    ([-1.0, NAN, 0.0], [INF, -1.0, 0.0], "k2", ["old_log_prob (actor) at 1 and ref_log_prob"]),
    ([-200.0, -1.0, 0.0], [-1.0, -1.0, 0.0], "k3", ["the k3 estimator overflowed"]),
], ids=["actor", "reference", "both", "k3 overflow"])
def test_non_finite_kl_names_its_source(old, ref, estimator, fragments):
    from rlpipe.core.step import kl

    td = batch(old, ref)
    kl_tok = kl.kl_per_token(td[schema.OLD_LOG_PROB], td[schema.REF_LOG_PROB], estimator)
    with pytest.raises(UserError, match="KL to the reference is NaN or inf") as info:
        guards.check_kl(td, kl_tok * td[schema.RESPONSE_MASK], estimator)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_finite_kl_passes():
    td = batch([-1.0, -2.0, 0.0], [-1.5, -2.0, 0.0])
    guards.check_kl(td, td[schema.OLD_LOG_PROB] - td[schema.REF_LOG_PROB], "k1")


def test_non_plugin_exceptions_in_core_are_not_wrapped():
    """`calling` wraps only what runs inside it; a UserError keeps its own message."""
    with pytest.raises(UserError, match="^plain$"):
        with registry.calling("x", "forward"):
            raise UserError("plain")
    with pytest.raises(KeyboardInterrupt):
        with registry.calling("x", "forward"):
            raise KeyboardInterrupt
    assert registry.label_of(torch.nn.Identity()) == "plugin torch.nn.modules.linear.Identity"


class Const(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, td):
        return torch.full((td.batch_size[0],), self.value)


@pytest.mark.parametrize("check, fragment", [
    (lambda: RewardComposer([("big", 3e38, Const(10.0))])(TensorDict({}, batch_size=[2])),
     "reward score is not finite for 2 samples: weight x part overflows float32 (rewards: big)"),
    (lambda: guards.loss_terms(TensorDict({"objective": torch.ones(())}, []), torch.nn.Identity()),
     "plugin torch.nn.modules.linear.Identity returned no loss_* entry (keys: objective)"),
    (lambda: guards.loss_terms(torch.ones(()), torch.nn.Identity()),
     "returned Tensor; expected a TensorDict with loss_* entries"),
], ids=["weighted score overflows", "loss without loss_ entries", "loss returns a tensor"])
def test_bad_values_between_stages(check, fragment):
    with pytest.raises(UserError) as info:
        check()
    assert fragment in str(info.value)
