"""Plugins by reference (core/contracts/references.py): ``name: module:attr``, a reward ``path`` +
``function``, and changing a plugin on the command line (``advantage.name=grpo``)."""

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from tensordict import NonTensorStack, TensorDict

from rlpipe.cli import main
from rlpipe.core.run import build
from rlpipe.core.base import schema
from rlpipe.core.config.compose import save_config
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"

BREVITY = '''
def brevity(prompts, responses, *, limit: int = 5, **batch):
    """1 for a response of at most `limit` words, else 0."""
    return [float(len(r.split()) <= limit) for r in responses]
'''


def write_config(folder: Path, rewards) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["models"]["actor"]["path"] = str(TINY.parent / "model")
    raw["data"]["prompts"] = str(TINY.parent / "prompts.txt")
    raw["rewards"] = rewards
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def texts_batch(responses):
    td = TensorDict({}, batch_size=[len(responses)])  # as the collectors write the texts
    td[schema.PROMPT_TEXT] = NonTensorStack(*["p"] * len(responses))
    td[schema.RESPONSE_TEXT] = NonTensorStack(*responses)
    return td


RESPONSES = ["the cat sat", "one two three four five six seven"]


def scores(cfg, ctx):
    rewards = build.build_plugins(cfg, ctx).rewards
    return rewards(texts_batch(RESPONSES))[schema.SCORE].tolist()


def test_reward_by_module_and_function(tmp_path, monkeypatch, ctx):
    (tmp_path / "my_rewards.py").write_text(BREVITY)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(write_config(tmp_path, [{"name": "my_rewards:brevity", "limit": 3,
                                               "weight": 2.0}]))
    section = cfg.rewards[0]
    assert section.key == "brevity" and section.args == {"limit": 3}
    assert section.resolved.spec.label == "my_rewards:brevity (not from an installed distribution)"
    assert scores(cfg, ctx) == [2.0, 0.0]  # 2 x brevity(limit=3)
    with pytest.raises(UserError, match=r"^rewards\.0\.limt: unknown argument for plugin "
                                        r"my_rewards:brevity .*; accepted: limit, columns$"):
        load_config(write_config(tmp_path, [{"name": "my_rewards:brevity", "limt": 3}]))
    with pytest.raises(UserError, match=r"^rewards\.0\.limit: expected int, got str 'x'"):
        load_config(write_config(tmp_path, [{"name": "my_rewards:brevity", "limit": "x"}]))


def test_module_reference_works_for_any_section_and_its_import_error_names_file_and_line(
        tmp_path, monkeypatch):
    cfg = load_config(TINY, ["advantage={name: 'rlpipe.plugins.advantages.grpo:GRPO'}"])
    assert cfg.advantage.resolved.obj.__name__ == "GRPO" and build.needs_critic(cfg) is False
    (tmp_path / "broken_rewards.py").write_text("import os\nraise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as info:
        load_config(write_config(tmp_path, [{"name": "broken_rewards:score"}]))
    assert str(info.value) == (
        "broken_rewards:score (not from an installed distribution): failed to import "
        f"broken_rewards:score: RuntimeError: no GPU here (at {tmp_path / 'broken_rewards.py'}:2)")
    with pytest.raises(UserError, match=r"plugin reference 'a b:c': expected module:attribute"):
        load_config(write_config(tmp_path, [{"name": "a b:c"}]))


def test_reward_by_file_next_to_the_config(tmp_path, ctx):
    (tmp_path / "my_reward.py").write_text(BREVITY.replace("brevity", "score"))
    config = write_config(tmp_path, [{"path": "my_reward.py", "function": "score", "limit": 4},
                                     {"name": "length", "max_tokens": 8}])
    cfg = load_config(config)
    section = cfg.rewards[0]
    assert section.key == "score" and section.args == {"path": tmp_path / "my_reward.py", "limit": 4}
    assert section.resolved.spec.label.startswith(f"{tmp_path / 'my_reward.py'}:score (file sha256 ")
    rewards = build.build_plugins(cfg, ctx).rewards
    assert rewards.labels == ["score", "length"]
    assert rewards.parts[0](texts_batch(RESPONSES)).tolist() == [1.0, 0.0]  # score(limit=4)
    save_config(cfg, tmp_path / "saved.yaml")  # the record reloads to the same file reward
    assert load_config(tmp_path / "saved.yaml").rewards[0].args["path"] == tmp_path / "my_reward.py"


@pytest.mark.parametrize("reward, source, message", [
    ({"path": "nope.py", "function": "score"}, None, r"^rewards\.0\.path: file not found: .*nope\.py$"),
    ({"path": "r.py", "function": "nope"}, "def score(p, r, **b):\n    return [0.0] * len(r)\n",
     r"^.*r\.py has no function 'nope'; it defines: score$"),
    ({"path": "r.py", "function": "score"}, "def score(p, r, **b)\n    return []\n",
     r"^.*r\.py:score \(file sha256 \w+\): failed to import .*r\.py: SyntaxError: .* \(at .*r\.py:1\)$"),
    ({"path": "r.py", "function": "score"}, "score = 3\n",
     r"^.*r\.py:score \(file sha256 \w+\): wrong shape: expected a torch\.nn\.Module subclass"),
    ({"function": "score"}, None, r"^rewards\.0\.function: needs `path`, the Python file"),
    ({"name": "length", "path": "r.py", "function": "score"}, "", r"^rewards\.0: give either `name`"),
    ({"weight": 1.0}, None, r"^rewards\.0: give `name` \(a plugin or module:attr\) or `path`"),
])
def test_bad_reward_reference_is_one_line(tmp_path, reward, source, message):
    if source is not None:
        (tmp_path / "r.py").write_text(source)
    with pytest.raises(UserError, match=message):
        load_config(write_config(tmp_path, [reward]))


def test_a_reward_path_that_is_not_a_python_file_is_one_line(tmp_path):
    (tmp_path / "prompts.txt").write_text("the cat\n")   # importlib found no loader for it
    with pytest.raises(UserError, match=r"^reward file .*prompts\.txt is not a Python file"):
        load_config(write_config(tmp_path, [{"path": "prompts.txt", "function": "f"}]))


def test_bad_references_on_the_command_line_exit_2(tmp_path, harness):
    config = write_config(tmp_path, [{"name": "no_such_pkg_x.rewards:brevity"}])
    result = harness.run(["config", config])
    harness.error(result, "no_such_pkg_x.rewards:brevity", "failed to import",
                  "ModuleNotFoundError: No module named 'no_such_pkg_x'")
    result = harness.run(["config", write_config(tmp_path, [{"path": "gone.py", "function": "f"}])])
    harness.error(result, "rewards.0.path: file not found:", "gone.py")


def test_changing_the_plugin_on_the_command_line_drops_foreign_arguments(capsys):
    cfg = load_config(TINY, ["advantage.name=grpo"])
    assert cfg.advantage.name == "grpo" and cfg.advantage.args == {}
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: advantage.name=grpo: dropped advantage.gamma, advantage.lmbda "
                   "(not arguments of grpo)"]
    cfg = load_config(TINY, ["advantage.name=grpo", "advantage.scale_std=false"])
    assert cfg.advantage.args == {"scale_std": False}
    with pytest.raises(UserError, match=r"^advantage\.gamma: unknown argument for plugin "
                                        r"rlpipe\.advantages:grpo"):
        load_config(TINY, ["advantage.name=grpo", "advantage.gamma=0.9"])  # kept, so checked
    capsys.readouterr()
    cfg = load_config(TINY, ["rewards.1.name=length", "rewards.1.label=length2"])  # loop's `n`
    assert cfg.rewards[1].name == "length" and "n" not in cfg.rewards[1].args
    assert "dropped rewards.1.n (not arguments of length)" in capsys.readouterr().err
    cfg = load_config(TINY, ["advantage={name: grpo, scale_std: false}"])  # the whole section
    assert cfg.advantage.args == {"scale_std": False} and capsys.readouterr().err == ""
    cfg = load_config(TINY, ["advantage.gamma=0.9"])  # no plugin change: nothing dropped
    assert cfg.advantage.args["gamma"] == 0.9


def test_plugin_swap_through_the_cli():
    result = CliRunner().invoke(main, ["config", str(TINY), "advantage.name=rloo"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["advantage"] == {"name": "rloo", "whiten": False}  # + defaults
    assert "dropped advantage.gamma, advantage.lmbda (not arguments of rloo)" in result.stderr


def test_changing_the_loss_says_which_arguments_it_kept(capsys):
    """Issue 54: `loss.name=gspo` on a PPO config kept PPO's clip_low (0.2, 670x GSPO's) without a
    word; now every argument kept from the file is named on the warning line."""
    load_config(TINY, ["loss.name=gspo"])
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: loss.name=gspo: kept loss.clip_low=0.2, loss.vf_coef=0.5 from the "
                   "config: check each means what you want for gspo"]
