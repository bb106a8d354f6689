"""The Python API takes what the README shows (issue 39): `rlpipe.train` and
`rlpipe.load_config` accept a `Config`, a dict shaped like the YAML, or a YAML path; anything else
is one `UserError`."""

from pathlib import Path

import pytest
import yaml

import rlpipe
from rlpipe.core.base.errors import UserError
from tests.conftest import logged_metrics

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
FAST = {"run": {"steps": 1}, "data": {"batch_size": 2}, "collector": {"max_new_tokens": 4},
        "train": {"epochs": 1, "minibatches": 1}, "log": {"progress": False}}


def tiny_dict(out: Path) -> dict:
    """The tiny example as a dict, its relative paths made absolute, made fast."""
    raw = yaml.safe_load(TINY.read_text())
    raw["models"]["actor"]["path"] = str(TINY.parent / raw["models"]["actor"]["path"])
    raw["data"]["prompts"] = str(TINY.parent / raw["data"]["prompts"])
    for section, values in FAST.items():
        raw.setdefault(section, {}).update(values)
    raw["run"]["output_dir"] = str(out)
    return raw


def test_load_config_takes_a_path_a_dict_or_a_config_alike(tmp_path):
    from_path = rlpipe.load_config(str(TINY), [f"run.output_dir={tmp_path}", "run.steps=1"])
    from_dict = rlpipe.load_config(tiny_dict(tmp_path), ["train.epochs=2", "train.minibatches=2",
                                                         "log.progress=true", "data.batch_size=16",
                                                         "collector.max_new_tokens=24"])
    assert from_dict.to_dict() == from_path.to_dict()
    assert rlpipe.load_config(from_path).to_dict() == from_path.to_dict()
    assert rlpipe.load_config(from_path, ["run.steps=4"]).run.steps == 4 and from_path.run.steps == 1
    with pytest.raises(UserError, match="a config is a Config, a dict or the path"):
        rlpipe.load_config(42)
    with pytest.raises(UserError, match="run.stepz"):
        rlpipe.load_config({**tiny_dict(tmp_path), "run": {"stepz": 1}})


@pytest.mark.parametrize("kind", ["dict", "path"])
def test_train_takes_a_dict_or_a_path(kind, tmp_path):
    out = tmp_path / "run"
    raw = tiny_dict(out)
    if kind == "path":
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    run_dir = rlpipe.train(raw if kind == "dict" else str(tmp_path / "c.yaml"))
    assert run_dir == out and [r["step"] for r in logged_metrics(out)] == [1]
