"""Data and model files: non-UTF-8 text, truncated or corrupt safetensors, a config.json of the wrong
shape, a folder that needs remote code. Each is one ``error:`` line naming the file, exit 2, at
every place rlpipe loads such a file (actor, critic, reward_model plugin, train-rm, prompts,
ptx, preference pairs); and no answer on stdin makes rlpipe run a model folder's own code."""

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from rlpipe.core.base.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny"
SMALL = ["run.steps=1", "data.batch_size=2", "collector.n=2", "collector.max_new_tokens=6",
         "train.epochs=1", "train.minibatches=1", "--no-progress"]
EVIL_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """The tiny model with saved weights (model.safetensors) and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("pretrained") / "model"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY / "model")).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / "model" / name, out / name)
    return out


def edit_json(name: str, change):
    def apply(folder: Path):
        data = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps(change(data)))
    return apply


def truncate(folder: Path):
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def bad_header(folder: Path):
    file = folder / "model.safetensors"
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + file.read_bytes()[24:])


def nan_weights(folder: Path):
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    name = sorted(tensors)[-1]
    tensors[name][0] = float("nan")
    save_file(tensors, str(file), metadata={"format": "pt"})


def write(name: str, data: bytes):
    return lambda folder: (folder / name).write_bytes(data)


AUTO_MAP = {"AutoConfig": "evil_code.EvilConfig", "AutoModelForCausalLM": "evil_code.EvilModel"}
BROKEN = {  # id: (change to the model folder, fragments of the error line)
    "truncated safetensors": (truncate, ["model.safetensors: truncated safetensors file"]),
    "corrupt safetensors header": (bad_header, ["model.safetensors: not a valid safetensors file"]),
    "tiny safetensors": (write("model.safetensors", b"\x00\x01"), ["not a valid safetensors file"]),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), ["cannot load the model"]),
    "NaN in the weights": (nan_weights, ["the weights hold NaN or inf (first in "]),
    "vocab_size edited": (edit_json("config.json", lambda d: {**d, "vocab_size": 2 * d["vocab_size"]}),
                          ["the weights' shapes differ from its config.json"]),
    "config.json is a list": (write("config.json", b"[1, 2]"),
                              ["config.json: expected a JSON object, got a list"]),
    "config.json without model_type": (edit_json("config.json", lambda d: {"hidden_size": 8}),
                                       ["config.json: no model_type"]),
    "config.json model_type unknown": (edit_json("config.json", lambda d: {**d, "model_type": "zz"}),
                                       ["cannot load the"]),
    "config.json not UTF-8": (write("config.json", b'{"model_type": "ll\xffama"}'),
                              ["config.json:1: not UTF-8"]),
    "config.json invalid JSON": (write("config.json", b'{"model_type": '), ["config.json: invalid JSON"]),
    "tokenizer.json corrupt": (write("tokenizer.json", b"{}"), ["cannot load the tokenizer"]),
    "tokenizer_config.json is a string": (write("tokenizer_config.json", b'"x"'),
                                          ["tokenizer_config.json: expected a JSON object"]),
    "auto_map in config.json": (edit_json("config.json", lambda d: {**d, "auto_map": AUTO_MAP}),
                                ["needs remote code (auto_map in config.json)",
                                 "set models.actor.trust_remote_code: true"]),
    "auto_map in tokenizer_config.json": (
        edit_json("tokenizer_config.json", lambda d: {**d, "auto_map": {"AutoTokenizer": ["a.B", None]}}),
        ["needs remote code (auto_map in tokenizer_config.json)"]),
}


def one_error(harness, result, *fragments) -> str:
    """`harness.error` for an in-process `CliRunner` result."""
    proc = SimpleNamespace(returncode=result.exit_code, stderr=result.stderr, stdout=result.stdout)
    return harness.error(proc, *fragments)


def broken_copy(pretrained: Path, tmp_path: Path, change) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(pretrained, folder)
    change(folder)
    return folder


def invoke(*args):
    from rlpipe.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("change, fragments", BROKEN.values(), ids=BROKEN.keys())
def test_broken_actor_folder_is_one_line(pretrained, tmp_path, harness, change, fragments):
    folder = broken_copy(pretrained, tmp_path, change)
    before = harness.snapshot(tmp_path)
    result = invoke("run", TINY / "config.yaml", f"run.output_dir={tmp_path / 'run'}",
                    f"models.actor.path={folder}", "models.actor.init=pretrained", *SMALL)
    one_error(harness, result, *fragments)
    after = {k: v for k, v in harness.snapshot(tmp_path).items() if not k.startswith("run/")}
    assert after == before


PLACES = {  # id: (arguments after the folder is made, change, fragments)
    "critic truncated": (lambda m, t: ["run", TINY / "config.yaml", f"models.critic.path={m}",
                                       f"run.output_dir={t / 'run'}", *SMALL],
                         truncate, ["model.safetensors: truncated"]),
    "critic remote code": (lambda m, t: ["run", TINY / "config.yaml", f"models.critic.path={m}",
                                         f"run.output_dir={t / 'run'}", *SMALL],
                           BROKEN["auto_map in config.json"][0],
                           ["needs remote code", "models.critic.trust_remote_code"]),
    "reward model config list": (
        lambda m, t: ["run", TINY / "config.yaml", f"rewards=[{{name: reward_model, path: {m}}}]",
                      f"run.output_dir={t / 'run'}", *SMALL],
        write("config.json", b"[]"), ["config.json: expected a JSON object, got a list"]),
    "reward model remote code": (
        lambda m, t: ["run", TINY / "config.yaml", f"rewards=[{{name: reward_model, path: {m}}}]",
                      f"run.output_dir={t / 'run'}", *SMALL],
        BROKEN["auto_map in config.json"][0], ["the reward_model argument trust_remote_code"]),
    "reward model is a causal LM": (
        lambda m, t: ["run", TINY / "config.yaml", f"rewards=[{{name: reward_model, path: {m}}}]",
                      f"run.output_dir={t / 'run'}", *SMALL],
        lambda folder: None, ["is a LlamaForCausalLM, not a sequence classifier"]),
    "train-rm truncated": (
        lambda m, t: ["train-rm", ROOT / "examples/reward_model/config.yaml", f"model.path={m}",
                      "model.init=pretrained", f"output_dir={t / 'rm'}", "--no-progress"],
        truncate, ["model.safetensors: truncated"]),
    "train-rm remote code": (
        lambda m, t: ["train-rm", ROOT / "examples/reward_model/config.yaml", f"model.path={m}",
                      f"output_dir={t / 'rm'}", "--no-progress"],
        BROKEN["auto_map in config.json"][0], ["set model.trust_remote_code: true"]),
}


@pytest.mark.parametrize("args, change, fragments", PLACES.values(), ids=PLACES.keys())
def test_every_loading_place_checks_the_folder(pretrained, tmp_path, harness, args, change,
                                               fragments):
    folder = broken_copy(pretrained, tmp_path, change)
    one_error(harness, invoke(*args(folder, tmp_path)), *fragments)


NOT_UTF8 = b"fine\n\xff\xfe broken\n"
DATA = {  # id: (file name, bytes, arguments, fragments)
    "prompts .txt": ("p.txt", NOT_UTF8, lambda f, t: [f"data.prompts={f}"], ["p.txt:2: not UTF-8"]),
    "prompts .jsonl": ("p.jsonl", b'{"prompt": "a"}\n{"prompt": "\xc3("}\n',
                       lambda f, t: [f"data.prompts={f}"], ["p.jsonl:2: not UTF-8", "column 13"]),
    "ptx": ("ptx.txt", NOT_UTF8, lambda f, t: ["ptx.coef=0.1", f"ptx.data={f}"], ["ptx.txt:2: not UTF-8"]),
    "prompts nesting too deep": ("deep.jsonl", b'{"prompt": ' + b"[" * 100000 + b"}\n",
                                 lambda f, t: [f"data.prompts={f}"], ["deep.jsonl:1: unreadable JSON"]),
    # valid JSON nested 20 000 deep: pyarrow's reader crashed the process (SIGSEGV) on it
    "valid JSON Lines nested too deep": (
        "deep2.jsonl", b'{"prompt": "x", "m": ' + b"[" * 20000 + b"]" * 20000 + b"}\n",
        lambda f, t: [f"data.prompts={f}"], ["deep2.jsonl:1: unreadable JSON"]),
    "valid .json nested too deep": (
        "deep.json", b'{"prompt": "x", "m": ' + b"[" * 20000 + b"]" * 20000 + b"}",
        lambda f, t: [f"eval.prompts={f}"], ["deep.json: JSON nested too deep"]),
}


@pytest.mark.parametrize("name, data, args, fragments", DATA.values(), ids=DATA.keys())
def test_bad_data_file_names_file_and_line(tmp_path, harness, name, data, args, fragments):
    file = tmp_path / name
    file.write_bytes(data)
    result = invoke("run", TINY / "config.yaml", f"run.output_dir={tmp_path / 'run'}",
                    *args(file, tmp_path), *SMALL)
    one_error(harness, result, *fragments)


def test_preference_pairs_not_utf8(tmp_path, harness):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes(b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n' * 3 + b'{"prompt": "\xa0"}\n')
    result = invoke("train-rm", ROOT / "examples/reward_model/config.yaml", f"data.pairs={pairs}",
                    f"output_dir={tmp_path / 'rm'}", "--no-progress")
    one_error(harness, result, "pairs.jsonl:4: not UTF-8")


def remote_code_folder(pretrained: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A model folder whose config.json points at its own evil_code.py, which writes a marker
    file if it is ever imported; no model_type, so only the folder's code could load it."""
    marker = tmp_path / "marker"
    folder = broken_copy(pretrained, tmp_path, edit_json(
        "config.json", lambda d: {**{k: v for k, v in d.items() if k != "model_type"},
                                  "auto_map": AUTO_MAP}))
    (folder / "evil_code.py").write_text(EVIL_CODE.format(marker=str(marker)))
    return folder, marker


def test_yes_on_stdin_does_not_run_the_folders_code(pretrained, tmp_path, harness):
    folder, marker = remote_code_folder(pretrained, tmp_path)
    cmd = [sys.executable, "-m", "rlpipe.cli", "run", str(TINY / "config.yaml"),
           f"models.actor.path={folder}", "models.actor.init=pretrained",
           f"run.output_dir={tmp_path / 'run'}", *SMALL]
    result = subprocess.run(cmd, input="y\ny\n", capture_output=True, text=True, timeout=300)
    harness.error(result, "needs remote code", str(folder))
    assert not marker.exists()


@pytest.mark.parametrize("init", ["pretrained", "random"])
def test_transformers_is_told_not_to_trust_remote_code(pretrained, tmp_path, monkeypatch, init):
    """With rlpipe's own check switched off, transformers still refuses: trust_remote_code=False
    is passed explicitly, so it neither asks nor runs the code."""
    from rlpipe.core.base import model_files
    from rlpipe.core.models import lm as models

    folder, marker = remote_code_folder(pretrained, tmp_path)
    monkeypatch.setattr(model_files, "check_remote_code", lambda *a, **k: None)
    monkeypatch.setattr(models, "check_remote_code", lambda *a, **k: None)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers asked on stdin"))
    with pytest.raises(UserError, match="cannot load the model"):
        models.load_causal_lm(folder, init)
    assert not marker.exists()
