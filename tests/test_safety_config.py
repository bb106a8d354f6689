"""Complete config validation at load (issue 13): every bad value, key or override is one
``error:`` line naming the key, exit status 2, no traceback, before any model is built.

Most cases run ``rlpipe config CONFIG KEY=VALUE`` in-process (click's CliRunner); a few run the
real process through the ``harness`` fixture (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.run import build
from rlpipe.core.base.yamlconf import build_section
from rlpipe.core.config.settings import Config, LoraConfig, load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.yamlconf import Range, _set_dotted, rule_text, yaml_key
from rlpipe.tools.train_rm import load_rm_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny"
CONTEXT = f"max_position_embeddings=256 in {TINY / 'model' / 'config.json'}"

# (overrides, fragments of the one error line); the tiny config: 8 prompts x n=2 = 16 samples,
# minibatches 2, max_new_tokens 24, a model context of 256 tokens.
BAD = [
    (["train.lr=-0.001"], "train.lr: must be > 0 and finite, got -0.001"),
    (["train.lr=0"], "train.lr: must be > 0 and finite, got 0"),
    (["train.lr=.nan"], "train.lr: must be > 0 and finite, got nan"),
    (["train.critic_lr=.inf"], "train.critic_lr: must be > 0 and finite, got inf"),
    (["train.critic_lr=-.inf"], "train.critic_lr: must be > 0 and finite, got -inf"),
    (["train.grad_accum=0"], "train.grad_accum: must be >= 1, got 0"),
    (["train.minibatches=0"], "train.minibatches: must be >= 1, got 0"),
    (["train.forward_batch_size=-4"], "train.forward_batch_size: must be >= 1, got -4"),
    (["data.batch_size=0"], "data.batch_size: must be >= 1, got 0"),
    (["ptx.batch_size=0"], "ptx.batch_size: must be >= 1, got 0"),
    (["ptx.max_tokens=0"], "ptx.max_tokens: must be >= 1, got 0"),
    (["train.epochs=0"], "train.epochs: must be >= 1, got 0"),
    (["run.steps=0"], "run.steps: must be >= 1, got 0"),
    (["run.steps=-3"], "run.steps: must be >= 1, got -3"),
    (["run.seed=-1"], "run.seed: must be >= 0, got -1"),
    (["train.max_grad_norm=-1.0"], "train.max_grad_norm: must be > 0 and finite (or null), got -1.0"),
    (["train.max_grad_norm=0"], "train.max_grad_norm: must be > 0 and finite (or null), got 0"),
    (["checkpoint.every=-1"], "checkpoint.every: must be >= 0, got -1"),
    (["checkpoint.keep=0"], "checkpoint.keep: must be >= 1, got 0"),
    (["distributed.nproc=0"], "distributed.nproc: must be >= 1, got 0"),
    (["distributed.nnodes=0"], "distributed.nnodes: must be >= 1, got 0"),
    (["distributed.timeout_s=0"], "distributed.timeout_s: must be > 0 and finite, got 0"),
    (["distributed.timeout_s=.nan"], "distributed.timeout_s: must be > 0 and finite, got nan"),
    (["train.warmup_steps=-1"], "train.warmup_steps: must be >= 0, got -1"),
    (["train.critic_warmup_steps=-2"], "train.critic_warmup_steps: must be >= 0, got -2"),
    (["train.max_bad_steps=0"], "train.max_bad_steps: must be >= 1, got 0"),
    (["train.target_kl=-0.1"], "train.target_kl: must be >= 0 and finite (or null), got -0.1"),
    (["kl.coef=-0.05"], "kl.coef: must be >= 0 and finite, got -0.05"),
    (["kl.coef=.inf"], "kl.coef: must be >= 0 and finite, got inf"),
    (["kl.target=0"], "kl.target: must be > 0 and finite (or null), got 0"),
    (["kl.horizon=0"], "kl.horizon: must be >= 1, got 0"),
    (["train.weight_decay=-0.01"], "train.weight_decay: must be >= 0 and finite, got -0.01"),
    (["reward.clip=0"], "reward.clip: must be > 0 and finite (or null), got 0"),
    (["reward.clip=.nan"], "reward.clip: must be > 0 and finite (or null), got nan"),
    (["ptx.coef=-1"], "ptx.coef: must be >= 0 and finite, got -1"),
    (["models.actor.lora.r=0"], "models.actor.lora.r: must be >= 1, got 0"),
    (["models.actor.lora.alpha=0"], "models.actor.lora.alpha: must be > 0, got 0"),
    (["models.critic.lora.dropout=1.0"], "models.critic.lora.dropout: must be in [0, 1) and finite"),
    (["models.actor.lora.dropout=-0.1"], "models.actor.lora.dropout: must be in [0, 1) and finite"),
    (["rewards.0.weight=.nan"], "rewards.0.weight: must be finite, got nan"),
    (["collector.temperature=.inf"], "collector.temperature: must be finite, got inf"),
    (["rewards.0.per_token=.nan"], "rewards.0.per_token: must be finite, got nan"),
    (["run.steps=99999999999999999999"], "run.steps: must fit in a 64-bit integer"),
    (["train.epochs=2.5"], "train.epochs: expected int, got float 2.5"),
    # divisibility, at load rather than after the first rollout
    (["train.minibatches=3"], "train.minibatches: 3 does not divide the 16 samples per step "
                              "(data.batch_size=8 x collector n=2)"),
    (["collector.n=3", "data.batch_size=3", "train.minibatches=2"],
     "train.minibatches: 2 does not divide the 9 samples per step"),
    (["train.grad_accum=16"], "train.grad_accum: a minibatch of 8 samples (16 samples per step / "
                              "train.minibatches=2) cannot be split into train.grad_accum=16"),
    (["distributed.nproc=4", "train.minibatches=8"],
     "train.minibatches: a minibatch of 2 samples", "4 processes x train.grad_accum=1"),
    (["distributed.nproc=16"], "data.batch_size=8 gives some of the 16 processes no prompt"),
    # distributed rendezvous
    (["distributed.nnodes=2"], "distributed.rdzv_endpoint: required when distributed.nnodes > 1"),
    (["distributed.rdzv_endpoint=node0"], "distributed.rdzv_endpoint: expected HOST:PORT", "'node0'"),
    (["distributed.rdzv_endpoint=node0:0"], "distributed.rdzv_endpoint: expected HOST:PORT"),
    (["distributed.rdzv_endpoint=node0:70000"], "distributed.rdzv_endpoint: expected HOST:PORT"),
    (["distributed.rdzv_endpoint=:29500"], "distributed.rdzv_endpoint: expected HOST:PORT"),
    (["distributed.rdzv_endpoint=a b:1"], "distributed.rdzv_endpoint: expected HOST:PORT"),
    (["distributed.rdzv_id=' '"], "distributed.rdzv_id: must not be empty"),
    # overrides that do not fit the tree
    (["rewards.5.weight=2"], "override rewards.5.weight: rewards is a list, '5' is not one of its "
                             "indices (0 to 1)"),
    (["rewards.x.weight=2"], "override rewards.x.weight: rewards is a list, 'x'"),
    (["rewards.-1.weight=2"], "override rewards.-1.weight: rewards is a list"),
    (["run.steps.x=1"], "override run.steps.x: run.steps is a value (int 10), not a section"),
    (["train.weight_decay.x=1"],  # a key the file does not set: caught by the converter
     "override train.weight_decay.x: train.weight_decay is a value, not a section"),
    (["run..steps=1"], "override run..steps: empty part in the key"),
    (["run.steps=[1, 2"], "override 'run.steps=[1, 2': cannot parse value (line 1"),
    (["x={a: 1, a: 2}"], "override 'x={a: 1, a: 2}': duplicate key a"),
    # context length: explicit budgets over the model's 256 positions
    (["collector.max_prompt_tokens=250"],
     "collector.max_prompt_tokens + collector.max_new_tokens = 250 + 24 = 274 tokens exceed the "
     f"actor model's context of 256 tokens ({CONTEXT})"),
    (["collector.max_new_tokens=300"], "= 256 (default) + 300 = 556 tokens exceed the actor model's"),
    (["ptx.coef=0.1", f"ptx.data={TINY / 'prompts.txt'}", "ptx.max_tokens=300"],
     "ptx.max_tokens: 300 exceeds the actor model's context of 256 tokens"),
    (["train.min_lr_ratio=0.1", "train.schedule=constant"],
     "train.min_lr_ratio: the floor of the cosine schedule; set train.schedule: cosine"),
    (["train.min_lr_ratio=1.5"], "train.min_lr_ratio: must be in [0, 1]"),
]


@pytest.fixture(scope="module")
def cfg_file(tmp_path_factory):
    """The tiny example's config, its paths absolute, in a temporary folder."""
    tmp = tmp_path_factory.mktemp("cfg")
    raw = yaml.safe_load((TINY / "config.yaml").read_text())
    raw["models"]["actor"]["path"] = str(TINY / "model")
    raw["data"]["prompts"] = str(TINY / "prompts.txt")
    raw["run"]["output_dir"] = str(tmp / "run")
    raw["run"]["steps"], raw["data"]["batch_size"] = 10, 8  # what the messages below are written for
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def one_error(args) -> str:
    """Run the CLI in-process; exit 2, only SystemExit, exactly one stderr line: ``error: ...``."""
    result = CliRunner().invoke(main, [str(a) for a in args], prog_name="rlpipe")
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert type(result.exception) is SystemExit, result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("overrides, fragments", [(c[0], c[1:]) for c in BAD],
                         ids=[" ".join(c[0]) for c in BAD])
def test_bad_value_is_one_error_line_naming_the_key(cfg_file, overrides, fragments):
    line = one_error(["config", cfg_file, *overrides])
    for fragment in fragments:
        assert fragment in line, line


BAD_FILES = [
    ("run:\n  steps: 2\ntrain:\n  lr: 1.0e-3\ntrain:\n  epochs: 1\n",
     "duplicate key train (line 5; first given on line 3)"),
    ("run:\n  steps: 2\n  seed: 1\n  steps: 3\n", "duplicate key run.steps (line 4; first given on line 2)"),
    ("rewards:\n  - {name: loop, n: 2, n: 3}\n", "duplicate key rewards.0.n (line 2"),
    ("run:\n  steps: 2\n# caf\xe9\n".encode("latin-1"), "not UTF-8 text (line 3)"),
    ("run: [" * 2000, "malformed YAML"),
    ("- just\n- a list\n", "expected a mapping of sections at the top level"),
]


@pytest.mark.parametrize("content, fragment", BAD_FILES, ids=["dup-section", "dup-key", "dup-in-list",
                                                             "latin-1", "deep", "top-list"])
def test_bad_yaml_file_names_the_file(tmp_path, content, fragment):
    path = tmp_path / "config.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = one_error(["config", path])
    assert str(path) in line and fragment in line, line


def test_merge_keys_and_aliases_are_not_duplicates(cfg_file, tmp_path):
    """A key that overrides a ``<<:`` merge, and an alias used twice, are not duplicates."""
    path = tmp_path / "merge.yaml"
    path.write_text(cfg_file.read_text() + "export: {<<: {merge_lora: true}, merge_lora: false}\n"
                    "checkpoint: {every: &n 2, keep: *n}\n")
    cfg = load_config(path)
    assert cfg.export.merge_lora is False and cfg.checkpoint.keep == 2


def test_config_errors_come_before_any_model_or_run_dir(cfg_file, monkeypatch):
    """`rlpipe run` with a bad value stops at load: no model built, no run directory made."""
    def boom(*args, **kwargs):
        raise AssertionError("a model was built or a run dir prepared for a bad config")

    monkeypatch.setattr(build, "build_models", boom)
    monkeypatch.setattr(build, "prepare_run_dir", boom)
    for bad in (["train.lr=-1"], ["train.minibatches=3"], ["collector.max_prompt_tokens=250"]):
        assert "error: " in one_error(["run", cfg_file, *bad])
    assert not (cfg_file.parent / "run").exists()


@pytest.mark.parametrize("overrides", [
    ["train.lr=1e-9", "kl.coef=0", "checkpoint.every=0", "train.warmup_steps=0", "ptx.coef=0"],
    ["train.max_grad_norm=null", "reward.clip=null", "kl.target=null", "train.target_kl=null"],
    ["train.target_kl=0.0"],  # stop the epochs as soon as the policy moves (tests/test_trainer.py)
    ["models.actor.lora.r=1", "models.actor.lora.dropout=0", "models.critic.lora.alpha=1"],
    ["distributed.nnodes=2", "distributed.rdzv_endpoint=node0.example.com:29500"],
    ["distributed.rdzv_endpoint='[::1]:29500'"],
    ["distributed.nproc=2", "train.minibatches=4", "train.grad_accum=2"],
    ["train.minibatches=16", "rewards.1.weight=-2", "collector.max_prompt_tokens=232"],
    ["run.steps=1", "train.epochs=1", "checkpoint.keep=1", "train.max_bad_steps=1"],
], ids=lambda o: " ".join(o))
def test_boundary_values_load(cfg_file, overrides):
    load_config(cfg_file, overrides)


def test_unset_prompt_budget_shrinks_to_the_context(cfg_file):
    """max_prompt_tokens left at the plugin's 256 is lowered to 256 - max_new_tokens in the
    run's plan (the collector is built with it; the config is not written), and unchanged where
    it fits."""
    from rlpipe.core.config.plan import plan_run

    def budget(*overrides):
        cfg = load_config(cfg_file, list(overrides))
        assert "max_prompt_tokens" not in cfg.collector.args or overrides
        plan = plan_run(cfg)
        assert plan.collector.args["max_prompt_tokens"] == plan.budgets.prompt_tokens
        return plan.sampling.max_prompt_tokens

    assert budget() == 256 - 24
    assert budget("collector.max_new_tokens=56") == 200
    assert budget("collector.max_prompt_tokens=100") == 100


def test_world_size_from_torchrun_counts(cfg_file, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    with pytest.raises(UserError, match="some of the 16 processes"):
        load_config(cfg_file)


def test_set_dotted_creates_missing_and_null_sections():
    raw = {"models": {"actor": {"lora": None}}, "rewards": [{"name": "a"}]}
    _set_dotted(raw, "models.actor.lora.r", 4)
    _set_dotted(raw, "train.lr", 0.1)
    _set_dotted(raw, "rewards.0.weight", 2)
    assert raw == {"models": {"actor": {"lora": {"r": 4}}}, "train": {"lr": 0.1},
                   "rewards": [{"name": "a", "weight": 2}]}


def test_ranges_apply_to_other_yaml_files_too(tmp_path):
    """`build_section` (used by `rlpipe train-rm`) checks the same field ranges."""
    with pytest.raises(UserError, match=r"^lora\.r: must be >= 1, got 0$"):
        build_section(LoraConfig, {"r": 0}, tmp_path, key="lora")
    with pytest.raises(UserError, match="model.lora.dropout: must be in"):
        load_rm_config(ROOT / "examples" / "reward_model" / "config.yaml",
                       ["model.lora.dropout=2.0"])


@pytest.mark.parametrize("text", [">= 1", "> 0", "< 5", "<= 5", "in [0, 1)", "in (0, 1]", "> 0.5"])
def test_range_text_round_trips(text):
    assert str(Range.parse(text)) == text


# ---- every key the brief names has a range (docs/config.md prints them) -------------------------------------------------

def _field(dotted: str):
    cls = Config
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls)
        f = {yaml_key(x): x for x in dataclasses.fields(cls)}[part]
        tp = hints[f.name]
        nested = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        cls = nested[0] if nested else None
    return f, tp, cls


def _ranges(cls=Config, prefix=""):
    """``{dotted key: "rule"}`` for every field with a range, walking the config tree."""
    out, hints = {}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = prefix + yaml_key(f), hints[f.name]
        nested = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        if nested:
            out.update(_ranges(nested[0], key + "."))
        elif rule_text(f, tp):
            out[key] = rule_text(f, tp)
    return out


def test_every_brief_key_has_a_range():
    ranged = _ranges()
    for key in ["train.lr", "train.critic_lr", "train.grad_accum", "train.minibatches",
                "train.forward_batch_size", "data.batch_size", "ptx.batch_size", "ptx.max_tokens",
                "train.epochs", "run.steps", "train.max_grad_norm", "checkpoint.every",
                "checkpoint.keep", "distributed.nproc", "distributed.nnodes",
                "distributed.timeout_s", "train.warmup_steps", "train.critic_warmup_steps",
                "train.max_bad_steps", "kl.coef", "kl.target", "kl.horizon", "train.weight_decay",
                "reward.clip", "ptx.coef", "models.actor.lora.r", "models.actor.lora.alpha",
                "models.actor.lora.dropout"]:
        assert key in ranged, key


# ---- the example configs still load -------------------------------------------------------------

def _load_or_skip_missing_package(loader, path, overrides=()):
    try:
        return loader(path, overrides)
    except UserError as exc:
        if "model package" in str(exc) and "is not installed" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.mark.parametrize("name, overrides", [
    ("tiny/config.yaml", []),
    ("gpu/config.yaml", ["models.actor.path={tiny}", "rewards.0.path={tmp}"]),
    ("quickstart/config.yaml", ["rewards.0.path={tmp}"]),
])
def test_example_configs_load(tmp_path, name, overrides):
    overrides = [o.format(tiny=TINY / "model", tmp=tmp_path) for o in overrides]
    cfg = _load_or_skip_missing_package(load_config, ROOT / "examples" / name, overrides)
    assert cfg.run.steps >= 1


@pytest.mark.parametrize("name", ["quickstart/reward_model.yaml", "reward_model/config.yaml"])
def test_example_reward_model_configs_load(name):
    cfg = _load_or_skip_missing_package(load_rm_config, ROOT / "examples" / name)
    assert cfg.train.epochs >= 1


# ---- the real process ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, fragments", [
    (["config", "{cfg}", "train.lr=-0.001"], ["error: train.lr: must be > 0 and finite, got -0.001"]),
    (["config", "{cfg}", "rewards.x.weight=2"], ["override rewards.x.weight: rewards is a list"]),
    (["config", "{dup}"], ["duplicate key train (line 3; first given on line 1)"]),
    # a plugin argument out of range: the plugin's constructor says so, after the model is built
    (["run", "{cfg}", "collector.max_new_tokens=-1", "run.steps=1", "run.output_dir=run"],
     ["hf collector: max_new_tokens must be an integer >= 1, got -1"]),
], ids=["range", "list-override", "duplicate", "plugin-constructor"])
def test_real_process_prints_one_line(harness, cfg_file, tmp_path, args, fragments):
    dup = tmp_path / "dup.yaml"
    dup.write_text("train: {lr: 1}\nrun: {steps: 1}\ntrain: {epochs: 1}\n")
    result = harness.run([a.format(cfg=cfg_file, dup=dup) for a in args], cwd=tmp_path)
    harness.error(result, *fragments)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    others = [line for line in lines if not line.startswith("rlpipe: ")]  # start-up status lines
    assert len(others) == 1, result.stderr  # then the error line alone


def test_debug_shows_the_traceback(harness, cfg_file, tmp_path):
    result = harness.run(["config", cfg_file, "train.lr=-1", "--debug"], cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" in result.stderr and "UserError" in result.stderr


@pytest.mark.parametrize("args, fragments", [
    (["run", "CFG", "--frob"], ["rlpipe run: No such option '--frob'", "(see rlpipe run --help)"]),
    (["run", "CFG", "--overwrit"], ["Did you mean '--overwrite'?"]),
    (["run"], ["rlpipe run: Missing argument 'CONFIG'"]),
    (["frobnicate"], ["rlpipe: No such command 'frobnicate'", "(see rlpipe --help)"]),
    (["export", "RUN", "OUT", "--step", "abc"], ["rlpipe export: Invalid value for '--step'"]),
    (["plugins", "extra"], ["rlpipe plugins: Got unexpected extra argument (extra)"]),
], ids=["unknown-option", "misspelt-option", "missing-argument", "unknown-command", "bad-type",
        "extra-argument"])
def test_command_line_usage_mistakes_are_one_error_line(cfg_file, args, fragments):
    """Click's own usage errors (usage, hint, blank line, ``Error: ...``) follow the same rule."""
    line = one_error([cfg_file if a == "CFG" else a for a in args])
    assert all(f in line for f in fragments), line


def test_bare_rlpipe_still_shows_the_help():
    result = CliRunner().invoke(main, [], prog_name="rlpipe")
    assert "Usage: rlpipe" in result.output and "Commands:" in result.output


def test_rlpipe_config_refuses_what_run_refuses(cfg_file):
    assert "list at least one reward plugin" in one_error(["config", cfg_file, "rewards=[]"])


def test_eval_settings_without_eval_prompts_warn(cfg_file):
    result = CliRunner().invoke(main, ["config", str(cfg_file), "eval.every=2", "eval.batch_size=8"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "warning: eval.every, eval.batch_size set without eval.prompts: no evaluation runs"]
    quiet = CliRunner().invoke(main, ["config", str(cfg_file)])
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_a_lora_target_the_model_lacks_names_the_key(cfg_file, tmp_path):
    result = CliRunner().invoke(main, ["run", str(cfg_file), f"run.output_dir={tmp_path / 'run'}",
                                       "models.critic.lora.r=2", "--no-progress",
                                       "models.critic.lora.target_modules=[nosuch]"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: models.critic.lora: Target modules")
    assert "nosuch" in errors[0]
