"""Several runs overlaid (``rlpipe report RUN_A RUN_B ...``): one figure per panel of
`rlpipe.tools.report`, each run in its own colour, written as ``compare-*.png`` into the first
run's ``report/`` folder, and a table of each run's final numbers.

>>> import json, shutil, tempfile
>>> runs = [Path(tempfile.mkdtemp()) / name for name in ("lr-high", "lr-low")]
>>> for run, end in zip(runs, (0.5, 0.9)):
...     run.mkdir()
...     rows = [{"step": 1, "reward/score": -1.0}, {"step": 2, "reward/score": end}]
...     _ = (run / "metrics.jsonl").write_text(chr(10).join(map(json.dumps, rows)))
>>> print(compare_summary(runs))
run      steps  reward/score  kl/ref  eval/score
lr-high      2           0.5       -           -
lr-low       2           0.9       -           -
>>> [p.name for p in write_comparison(runs)]       # needs matplotlib
['compare-overview.png', 'compare-reward.png']
>>> for run in runs: shutil.rmtree(run.parent)
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.core.base.errors import UserError
from rlpipe.tools.report import (PANELS, STYLES, _expand, _finite, _report_dir, _series,
                                        _text, draw_panels, load_metrics)

COLUMNS = ("reward/score", "kl/ref", "eval/score")  # the table's final values


def _names(run_dirs: list[Path]) -> list[str]:
    """Each run's shortest trailing part of its path that no other run ends with: its folder
    name, with as many parents as tell it apart.

    >>> _names([Path("/r/one/seed/run"), Path("/r/two/seed/run"), Path("/r/b")])
    ['one/seed/run', 'two/seed/run', 'b']
    """
    parts = [Path(p).resolve().parts for p in run_dirs]

    def name(i: int) -> str:
        for k in range(1, len(parts[i]) + 1):
            if not any(j != i and other[-k:] == parts[i][-k:] for j, other in enumerate(parts)):
                return str(Path(*parts[i][-k:]))
        return str(Path(*parts[i]))
    return [name(i) for i in range(len(parts))]


def compare_summary(run_dirs: list[Path]) -> str:
    """One line per run: its steps and the last finite value of `COLUMNS` (``-``: not logged)."""
    table = [("run", "steps", *COLUMNS)]
    for name, run in zip(_names(run_dirs), run_dirs):
        rows = load_metrics(run)
        last = [(_finite(rows, key) or [(0, None)])[-1][1] for key in COLUMNS]
        table.append((name, str(len(rows)), *("-" if v is None else f"{v:.4g}" for v in last)))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))) for row in table)


def _draw(ax, runs: list[tuple[str, list[dict]]], panel) -> None:
    """The panel's left-axis metrics of every run: colour per run, line style per metric."""
    from matplotlib.ticker import MaxNLocator

    for r, (name, rows) in enumerate(runs):
        for k, key in enumerate(_expand(panel.left, rows)[:len(STYLES)]):
            ax.plot([row["step"] for row in rows], _series(rows, key), color=f"C{r}",
                    linestyle=STYLES[k][0], label=_text(f"{name}: {key}"),
                    marker=STYLES[k][1] if len(rows) <= 60 else None, markersize=4)
    ax.set(title=panel.title, xlabel="PPO step", ylabel=panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False,
              ncol=min(len(runs), 3))


def write_comparison(run_dirs: list[Path]) -> list[Path]:
    """``compare-overview.png`` and one ``compare-<panel>.png`` per panel some run logged, in the
    first run's ``report/``; returns their paths."""
    run_dirs = [Path(p) for p in run_dirs]
    if len(set(p.resolve() for p in run_dirs)) < len(run_dirs):
        raise UserError("rlpipe report: the same run directory is named twice")
    runs = list(zip(_names(run_dirs), (load_metrics(p) for p in run_dirs)))
    panels = [p for p in PANELS if any(_expand(p.left, rows) for _, rows in runs)]
    if not panels:
        raise UserError("rlpipe report: none of the plotted metrics were logged by these runs")
    return draw_panels(_report_dir(run_dirs[0]),
                       " vs ".join(name for name, _ in runs), panels,
                       lambda ax, panel: _draw(ax, runs, panel), prefix="compare-")
