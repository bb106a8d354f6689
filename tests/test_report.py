"""`rlpipe report` on a real tiny run (readable, non-blank PNGs; a summary), its errors, and the
optional TensorBoard / Weights & Biases sinks of `MetricsWriter` (faked or hidden via sys.modules,
so these tests run whether or not tensorboard and wandb are installed)."""

import json
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlpipe.cli import main
from rlpipe.core.base.errors import UserError
from rlpipe.core.observe.metrics import MetricsWriter
from rlpipe.tools.report import summary, write_report

ROOT = Path(__file__).resolve().parents[1]
ALL_PANELS = {"overview", "reward", "kl", "policy", "clipfrac", "value", "length", "grad_norm",
              "lr", "entropy", "throughput"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 3-step run of the tiny example (GAE, so with a critic)."""
    from rlpipe.core.config.settings import load_config
    from rlpipe.core.run.pipeline import train

    out = tmp_path_factory.mktemp("report") / "run"
    return train(load_config(ROOT / "examples/tiny/config.yaml",
                             [f"run.output_dir={out}", "run.steps=3"]), progress=False)


def write_rows(path: Path, rows: list) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cli_error(*args) -> str:
    result = CliRunner().invoke(main, ["report", *map(str, args)])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_report_of_a_tiny_run_writes_readable_pngs_and_a_summary(run_dir):
    from matplotlib.image import imread

    result = CliRunner().invoke(main, ["report", str(run_dir)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "3 steps" in result.output and "reward/score" in result.output
    paths = [Path(line) for line in result.output.splitlines() if line.endswith(".png")]
    assert {p.stem for p in paths} == ALL_PANELS
    for path in paths:
        assert path.parent == run_dir / "report" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = imread(path)
        assert pixels.shape[0] >= 300 and pixels.shape[1] >= 600, (path, pixels.shape)
        assert pixels[..., :3].var() > 0, f"{path} is blank"


def test_critic_free_run_with_nulls_and_a_repeated_step(tmp_path):
    rows = [{"step": 1, "reward/score": -1.0, "reward/length": -1.0, "kl/ref": None, "kl/coef": 0.05,
             "perf/tokens_per_s": 100.0, "time/step_s": 2.0},
            {"step": 2, "reward/score": 9.0, "kl/ref": 0.1, "time/step_s": 2.0},   # replaced below
            {"step": 2, "reward/score": 0.5, "kl/ref": 0.2, "perf/tokens_per_s": 300.0, "time/step_s": 3.0}]
    run = write_rows(tmp_path / "run", rows)
    names = {p.stem for p in write_report(run)}
    assert names == {"overview", "reward", "kl", "throughput"}          # no value/*, no policy/*
    text = summary(run)
    assert "2 steps" in text and "-1 -> 0.5" in text and "best 0.5 at step 2" in text
    assert "0.2 (final)" in text and "200 (mean)" in text and "5.0 s" in text


def test_report_errors_are_one_line(tmp_path):
    assert "run directory not found" in cli_error(tmp_path / "nope")
    assert "no metrics.jsonl" in cli_error(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    assert "is empty" in cli_error(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kl/ref": 0.1}\n{"step": 2, "kl/r')
    assert "metrics.jsonl:2: invalid JSON" in cli_error(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"kl/ref": 0.1}\n')
    assert "metrics.jsonl:1: expected a JSON object with an integer 'step'" in cli_error(tmp_path)


def test_report_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    run = write_rows(tmp_path / "run", [{"step": 1, "reward/score": 0.0}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UserError, match=r"pip install matplotlib \(or rlpipe\[report\]\)"):
        write_report(run)


class FakeSummaryWriter:
    instances = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.closed = log_dir, [], False
        FakeSummaryWriter.instances.append(self)

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_tensorboard_sink_writes_scalars_per_step(tmp_path, monkeypatch):
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    with MetricsWriter(tmp_path / "metrics.jsonl", 2, progress=False, tensorboard=True) as w:
        w.write({"step": 4, "reward/score": 0.5, "kl/ref": float("nan"), "note": "x"})
    tb = FakeSummaryWriter.instances[-1]
    assert tb.log_dir == str(tmp_path / "tensorboard") and tb.closed
    assert tb.scalars == [("reward/score", 0.5, 4)]                    # no step, NaN or text
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["kl/ref"] is None


def test_tensorboard_not_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(UserError, match=r"pip install 'rlpipe\[tensorboard\]'"):
        MetricsWriter(tmp_path / "metrics.jsonl", 1, progress=False, tensorboard=True)
    assert not (tmp_path / "metrics.jsonl").exists()


def fake_wandb(monkeypatch) -> list:
    """Install a fake `wandb` module; returns the list of (init kwargs, run) it records."""
    calls = []

    def init(**kwargs):
        run = types.SimpleNamespace(logged=[], finished=False)
        run.log = lambda data, step: run.logged.append((data, step))
        run.finish = lambda: setattr(run, "finished", True)
        calls.append((kwargs, run))
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return calls


def test_wandb_sink_is_offline_without_an_api_key(tmp_path, monkeypatch):
    calls = fake_wandb(monkeypatch)
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with MetricsWriter(tmp_path / "metrics.jsonl", 1, progress=False, wandb=True) as w:
        w.write({"step": 1, "reward/score": 0.5})
    kwargs, run = calls[-1]
    assert kwargs == {"project": "rlpipe", "name": tmp_path.name, "dir": str(tmp_path), "mode": "offline"}
    assert run.logged == [({"reward/score": 0.5}, 1)] and run.finished

    monkeypatch.setenv("WANDB_MODE", "disabled")
    MetricsWriter(tmp_path / "metrics.jsonl", 1, progress=False, wandb=True, wandb_project="p",
                  run_name="r").close()
    assert calls[-1][0] == {"project": "p", "name": "r", "dir": str(tmp_path), "mode": "disabled"}


def test_wandb_not_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match=r"pip install 'rlpipe\[wandb\]'"):
        MetricsWriter(tmp_path / "metrics.jsonl", 1, progress=False, wandb=True)


# ---- a hostile metrics.jsonl: one error line, or the bad values left out with a warning line ----

def line(row) -> bytes:
    return json.dumps(row).encode() + b"\n"


GOOD = line({"step": 1, "reward/score": 0.5, "kl/ref": 0.1})
HOSTILE_ERRORS = {  # id: (metrics.jsonl bytes, fragment of the one error line)
    "not UTF-8": (GOOD + b'{"step": 2, "reward/score": "\xff"}\n', "metrics.jsonl:2: not UTF-8"),
    "deep nesting": (GOOD + b'{"step": 2, "x": ' + b"[" * 100000 + b"}\n",
                     "metrics.jsonl:2: unreadable JSON: RecursionError"),
    "5000-digit number": (GOOD + b'{"step": 2, "x": ' + b"9" * 5000 + b"}\n",
                          "metrics.jsonl:2: unreadable JSON: ValueError"),
    "step is a bool": (GOOD + line({"step": True}), "metrics.jsonl:2: expected a JSON object with an integer"),
    "step too large": (GOOD + line({"step": 10 ** 400}), "metrics.jsonl:2: expected a JSON object"),
    "a list, not an object": (GOOD + b"[1, 2]\n", "metrics.jsonl:2: expected a JSON object"),
}


@pytest.mark.parametrize("data, fragment", HOSTILE_ERRORS.values(), ids=HOSTILE_ERRORS.keys())
def test_hostile_metrics_give_one_line(tmp_path, data, fragment):
    (tmp_path / "metrics.jsonl").write_bytes(data)
    assert fragment in cli_error(tmp_path)
    assert not (tmp_path / "report").exists()


TEX = ["reward/$\\frac{a}{b}$", "reward/$x^$", "reward/$x^2$", "reward/a$b", "reward/\\$"]
HOSTILE_OK = {  # id: (rows, fragment of the one warning line or None, panels expected)
    "huge numbers": ([{"step": 1, "reward/score": 1e308, "kl/ref": 10 ** 400, "reward/a": 1.0},
                      {"step": 2, "reward/score": -1e308, "kl/ref": 0.1, "reward/a": 2.0}],
                     "2 values beyond +-1e+300 left out (reward/score)", {"reward", "kl"}),
    "1e400 and 1e308*10 are inf": ([b'{"step": 1, "reward/score": 1e400, "reward/a": 1}',
                                    b'{"step": 2, "reward/score": -1e309, "reward/a": 2}'],
                                   None, {"reward"}),
    "non-numeric values": ([{"step": 1, "reward/score": "x", "reward/a": {"b": [1, {"c": 2}]},
                             "kl/ref": [1.0], "response/length": True, "policy/entropy": None,
                             "reward/b": 1.0}], None, {"reward"}),
    "TeX metric names": ([{"step": s, "reward/score": 1.0, **{k: float(s) for k in TEX}}
                          for s in (1, 2)], None, {"reward"}),
}


@pytest.mark.parametrize("rows, warning, panels", HOSTILE_OK.values(), ids=HOSTILE_OK.keys())
def test_hostile_values_are_left_out(tmp_path, rows, warning, panels):
    (tmp_path / "metrics.jsonl").write_bytes(b"".join(r + b"\n" if isinstance(r, bytes) else line(r)
                                                     for r in rows))
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 0, (result.output, result.exception)
    warnings = [x for x in result.stderr.splitlines() if x]
    assert all(x.startswith("warning: ") for x in warnings), result.stderr
    assert (warning is None) == (not warnings) and all(warning in x for x in warnings), warnings
    assert {Path(p).stem for p in result.stdout.splitlines() if p.endswith(".png")} == {"overview", *panels}


def test_metric_names_are_never_mathtext(tmp_path, monkeypatch):
    """A user's matplotlibrc asking for usetex is overridden; labels keep their dollar signs."""
    import matplotlib
    from matplotlib.figure import Figure

    from rlpipe.tools.report import PANELS, _draw, load_metrics

    monkeypatch.setitem(matplotlib.rcParams, "text.usetex", True)  # no LaTeX here: would fail
    run = write_rows(tmp_path / "r$x^$", [{"step": s, "reward/score": 1.0, **{k: 1.0 for k in TEX}}
                                          for s in (1, 2)])
    assert {p.stem for p in write_report(run)} == {"overview", "reward"}
    monkeypatch.setitem(matplotlib.rcParams, "text.usetex", False)
    ax = Figure().subplots()
    _draw(ax, load_metrics(run), PANELS[0])
    texts = [t for t in ax.get_legend().get_texts() if "$" in t.get_text()]
    assert len(texts) == len(TEX)
    for text in texts:  # every dollar escaped: matplotlib renders it as a plain "$"
        assert "$" not in text.get_text().replace("\\$", "") and not text._preprocess_math(
            text.get_text())[1]


def test_report_file_in_place_of_the_report_dir(tmp_path):
    run = write_rows(tmp_path / "run", [{"step": 1, "reward/score": 0.0}])
    (run / "report").write_text("mine")
    assert "report exists and is not a directory" in cli_error(run)
    assert (run / "report").read_text() == "mine"


def test_samples_page_puts_first_and_last_step_side_by_side(run_dir):
    paths = write_report(run_dir)
    page = (run_dir / "report" / "samples.md").read_text()
    assert run_dir / "report" / "samples.md" in paths
    assert "## Training samples: step 1 vs step 3" in page
    first = [json.loads(x) for x in (run_dir / "samples" / "step-1.jsonl").read_text().splitlines()]
    last = [json.loads(x) for x in (run_dir / "samples" / "step-3.jsonl").read_text().splitlines()]
    table = [line for line in page.splitlines() if line.startswith("| 1 |")]
    assert len(table) == 1
    assert first[0]["prompt"].strip() in table[0] and last[0]["prompt"].strip() in table[0]
    assert "Held-out" not in page


def test_eval_samples_and_metrics_are_shown_when_present(tmp_path):
    run = write_rows(tmp_path / "run", [{"step": s, "reward/score": 0.1 * s, "eval/score": 0.2 * s}
                                        for s in (1, 2, 3)])
    (run / "samples").mkdir()
    for step in (1, 3):
        (run / "samples" / f"eval-step-{step}.jsonl").write_text(
            json.dumps({"prompt": "2+2=", "response": f"answer {step}", "score": step}) + "\n")
    paths = write_report(run)
    assert {p.stem for p in paths if p.suffix == ".png"} == {"overview", "reward", "eval"}
    assert "eval/score         0.2 -> 0.6  (held-out)" in summary(run)
    page = (run / "report" / "samples.md").read_text()
    assert "## Held-out samples: step 1 vs step 3" in page and "| 1 | 2+2= | answer 1 | 1 | 2+2= | answer 3 | 3 |" in page


def test_whole_steps_and_no_line_hidden_under_an_equal_one(tmp_path):
    """Equal series (the score of a single reward) differ in style and width; ticks are steps."""
    from matplotlib.figure import Figure

    from rlpipe.tools.report import PANELS, _draw, load_metrics

    run = write_rows(tmp_path / "run", [{"step": s, "reward/score": 1.0 * s, "reward/a": 1.0 * s,
                                         "reward/score/std": 0.5, "reward/a/std": 0.5}
                                        for s in (1, 2, 3, 4)])
    ax = Figure().subplots()
    _draw(ax, load_metrics(run), PANELS[0])
    score, part = ax.get_lines()
    assert [score.get_label(), part.get_label()] == ["reward/score", "reward/a"]  # no std lines
    assert score.get_linewidth() > part.get_linewidth() and score.get_zorder() < part.get_zorder()
    assert score.get_linestyle() != part.get_linestyle() and score.get_marker() != part.get_marker()
    assert len(ax.collections) == 2  # the two std bands
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 4]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert ax.get_xlabel() == "PPO step" and ax.get_ylabel()
