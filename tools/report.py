"""Plots and a short text summary of a run's ``metrics.jsonl`` (``rlpipe report RUN_DIR``).

matplotlib is an optional extra (``pip install rlpipe[report]``), imported only when plotting.
A resumed run may log a step twice; the last row for a step wins.

>>> import json, shutil, tempfile
>>> run = Path(tempfile.mkdtemp())
>>> rows = [{"step": 1, "reward/score": -1.0, "kl/ref": 0.0},
...         {"step": 2, "reward/score": 0.5, "kl/ref": 0.02}]
>>> with open(run / "metrics.jsonl", "w") as f:
...     print(*map(json.dumps, rows), sep=chr(10), file=f)
>>> print(summary(run).splitlines()[1])
reward/score       -1 -> 0.5  (best 0.5 at step 2)
>>> [p.name for p in write_report(run)]           # needs matplotlib
['overview.png', 'reward.png', 'kl.png']
>>> shutil.rmtree(run)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from rlpipe.core.base.errors import UserError
from rlpipe.core.observe.metrics import load_metrics
from rlpipe.core.observe.samples import first_vs_last
from rlpipe.tools.doctor import report_section


class Panel(NamedTuple):
    """One plot: metrics on the left axis (a key ending in ``/`` means every key with that prefix),
    optionally others on a second, right-hand axis."""

    name: str
    title: str
    left: tuple[str, ...]
    ylabel: str
    right: tuple[str, ...] = ()
    right_label: str = ""


PANELS = (
    Panel("reward", "Reward: total and per component (band: ±1 std over samples)",
          ("reward/score", "reward/"), "reward per sample"),
    Panel("kl", "KL to the reference and its coefficient", ("kl/ref", "kl/ref_max"),
          "KL per sample (nats)", ("kl/coef",), "kl/coef (β)"),
    Panel("policy", "Policy loss and approx-KL", ("policy/loss",), "loss per token",
          ("policy/approx_kl",), "approx KL (nats per token)"),
    Panel("clipfrac", "Clip fractions", ("policy/clipfrac", "policy/clipfrac_lower",
                                         "value/clipfrac"), "fraction of tokens"),
    Panel("value", "Value loss and explained variance", ("value/loss",), "loss per token",
          ("value/explained_var",), "explained variance (1 = perfect)"),
    Panel("length", "Response length", ("response/length", "response/length_p90"), "tokens",
          ("response/clipped_frac",), "fraction cut at max_new_tokens"),
    Panel("grad_norm", "Gradient norm before clipping", ("train/grad_norm",
                                                         "train/critic_grad_norm"), "L2 norm"),
    Panel("lr", "Learning rate (actor)", ("train/lr",), "learning rate"),
    Panel("entropy", "Policy entropy", ("policy/entropy",), "nats per token"),
    Panel("throughput", "Throughput", ("perf/tokens_per_s",), "response tokens / s"),
    Panel("eval", "Held-out evaluation", ("eval/score", "eval/reward/", "eval/response/length"),
          "mean score per sample"),
    Panel("tool_lift", "Tool lift: held-out score with tools minus without", ("eval/tool_lift",),
          "score with - without", ("eval/score", "eval/no_tools/score"), "mean score per sample"),
    Panel("tools", "Tool use (training conversations)", ("env/tool_calls", "env/tool_errors",
                                                         "env/timeouts", "env/turns"),
          "per conversation", ("env/obs_token_frac",), "observation share of tokens"),
)
SPREAD = ("/std", "/min", "/max")  # a metric's spread: drawn as a band, never as its own line
STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))  # line style, marker per series


def _series(rows: list[dict], key: str) -> list[float]:
    """One metric per row; NaN where absent, null (non-finite when logged) or not a number."""
    return [row.get(key, math.nan) for row in rows]


def _text(name: str) -> str:
    """``name`` for a matplotlib label: a ``$`` is a dollar sign, never the start of mathtext."""
    return name.replace("$", r"\$")


def _finite(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` for the rows where ``key`` has a finite value."""
    return [(row["step"], v) for row, v in zip(rows, _series(rows, key)) if math.isfinite(v)]


def _expand(patterns: tuple[str, ...], rows: list[dict]) -> list[str]:
    """Metric names matching ``patterns`` (``"reward/"`` = every ``reward/...``) with a finite value."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    out = []
    for pattern in patterns:
        matches = ([c for c in columns if c.startswith(pattern) and not c.endswith(SPREAD)]
                   if pattern.endswith("/") else [pattern])
        out += [c for c in matches if c not in out and _finite(rows, c)]
    return out


def _plot(ax, rows: list[dict], keys: list[str], first: int, dashed: bool = False) -> list:
    """One line per key, each with its own colour, style and marker; earlier lines wider, so
    that a line equal to another stays visible around it; a ``KEY/std`` band where logged."""
    steps = [row["step"] for row in rows]
    lines = []
    for i, key in enumerate(keys):
        n = first + i
        style, marker = STYLES[n % len(STYLES)]
        values = _series(rows, key)
        line = ax.plot(steps, values, color=f"C{n}", label=_text(key),
                       linestyle="--" if dashed else style, linewidth=max(3.2 - 0.8 * i, 1.2),
                       marker=marker if len(rows) <= 60 else None,
                       markersize=max(7 - 1.5 * i, 3), zorder=2 + i)[0]
        lines.append(line)
        std = _series(rows, key + "/std")
        if any(math.isfinite(x) for x in std):
            ax.fill_between(steps, [v - d for v, d in zip(values, std)],
                            [v + d for v, d in zip(values, std)], color=f"C{n}", alpha=0.15,
                            linewidth=0, zorder=1)
    return lines


def _draw(ax, rows: list[dict], panel: Panel) -> None:
    """Plot ``panel`` on the matplotlib axes ``ax``: left series solid or styled, right series
    dashed on a second axis; whole steps on the x-axis."""
    from matplotlib.ticker import MaxNLocator

    shown = _expand(panel.left + panel.right, rows)  # rows that log none (evaluation's) left out
    rows = [r for r in rows if any(math.isfinite(r.get(k, math.nan)) for k in shown)]
    left, right = _expand(panel.left, rows), _expand(panel.right, rows)
    lines = _plot(ax, rows, left, 0)
    if right:
        twin = ax.twinx()
        lines += _plot(twin, rows, right, len(left), dashed=True)
        twin.set_ylabel(panel.right_label)
    ax.set(title=panel.title, xlabel="PPO step", ylabel=panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if len(lines) > 1:  # below the axes: a legend inside could cover a line
        ax.legend(handles=lines, fontsize="small", loc="upper center", ncol=min(len(lines), 3),
                  bbox_to_anchor=(0.5, -0.22), frameon=False)


def _figure_class():
    """matplotlib's `Figure` (Agg canvas, no pyplot global state), or a UserError naming the extra."""
    try:
        import matplotlib.figure
    except ImportError:
        raise UserError("rlpipe report needs matplotlib: pip install matplotlib (or rlpipe[report])") from None
    return matplotlib.figure.Figure


def write_report(run_dir: Path) -> list[Path]:
    """Write ``run_dir/report/overview.png`` (every panel), one PNG per panel and, when the run
    wrote samples, ``samples.md`` (first vs last step); returns their paths.

    Panels whose metrics the run did not log (``value/*`` for critic-free runs) are left out.
    """
    run_dir = Path(run_dir)
    rows = load_metrics(run_dir)
    panels = [p for p in PANELS if _expand(p.left, rows)]
    if not panels:
        raise UserError(f"{run_dir / 'metrics.jsonl'}: none of the plotted metrics were logged")
    out = _report_dir(run_dir)
    paths = draw_panels(out, f"{run_dir.name}: {len(rows)} steps", panels,
                        lambda ax, panel: _draw(ax, rows, panel))
    page = first_vs_last(run_dir)
    if page is not None:
        try:
            (out / "samples.md").write_text(page, encoding="utf-8")
        except OSError as exc:
            raise UserError(f"cannot write {out / 'samples.md'}: {exc.strerror or exc}") from None
        paths.append(out / "samples.md")
    return paths


def draw_panels(out: Path, title: str, panels: list, draw, prefix: str = "") -> list[Path]:
    """``{prefix}overview.png`` (every panel, two a row, under ``title``) and one
    ``{prefix}<panel>.png`` per panel in ``out``, each axis drawn by ``draw(ax, panel)``."""
    Figure = _figure_class()
    import matplotlib

    nrows = math.ceil(len(panels) / 2)
    with matplotlib.rc_context({"text.usetex": False}):  # whatever the user's matplotlibrc says
        fig = Figure(figsize=(12, 3.8 * nrows), layout="constrained")
        fig.suptitle(_text(title))
        grid = fig.subplots(nrows, 2, squeeze=False).flat
        for ax, panel in zip(grid, panels):
            draw(ax, panel)
        for ax in list(grid):                    # the empty cell of an odd panel count
            ax.set_visible(False)
        paths = [_save(fig, out / f"{prefix}overview.png")]
        for panel in panels:
            fig = Figure(figsize=(6.4, 4.0), layout="constrained")
            draw(fig.subplots(), panel)
            paths.append(_save(fig, out / f"{prefix}{panel.name}.png"))
    return paths


def _report_dir(run_dir: Path) -> Path:
    """``run_dir/report``, created; a file in its place or an unwritable run dir is one line."""
    out = run_dir / "report"
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a directory; move it away to write the report")
    try:
        out.mkdir(exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {out}: {exc.strerror or exc}") from None
    return out


def _save(fig, path: Path) -> Path:
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def summary(run_dir: Path) -> str:
    """A few lines: steps, reward/score first -> last and best, final kl/ref, mean tokens/s, time."""
    rows = load_metrics(run_dir)
    lines = [f"{run_dir}: {len(rows)} steps ({rows[0]['step']}-{rows[-1]['step']})"]
    if score := _finite(rows, "reward/score"):
        best = max(score, key=lambda p: p[1])
        lines.append(f"reward/score       {score[0][1]:.4g} -> {score[-1][1]:.4g}"
                     f"  (best {best[1]:.4g} at step {best[0]})")
    if held := _finite(rows, "eval/score"):
        lines.append(f"eval/score         {held[0][1]:.4g} -> {held[-1][1]:.4g}  (held-out)")
    if lift := _finite(rows, "eval/tool_lift"):
        lines.append(f"eval/tool_lift     {lift[0][1]:.4g} -> {lift[-1][1]:.4g}  (score with tools "
                     f"- without)")
    if kl := _finite(rows, "kl/ref"):
        lines.append(f"kl/ref             {kl[-1][1]:.4g} (final)")
    if tps := _finite(rows, "perf/tokens_per_s"):
        lines.append(f"perf/tokens_per_s  {sum(v for _, v in tps) / len(tps):.4g} (mean)")
    if times := _finite(rows, "time/step_s"):
        total = sum(v for _, v in times)
        lines.append(f"time               {total:.1f} s ({total / 60:.1f} min) over {len(times)} steps")
    lines.append(report_section(run_dir))  # the health rules that fired (rlpipe.tools.doctor)
    return "\n".join(lines)
