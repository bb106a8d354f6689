"""The ``rlpipe`` command line: run, config, plugins.

A user mistake (bad YAML, unknown key or plugin, missing file) prints one line, ``error: ...``,
and exits with status 2; ``--debug`` shows the Python traceback instead.

    rlpipe run examples/tiny/config.yaml run.steps=20
"""

from __future__ import annotations

import functools
import os
import sys

import click


def _user_errors(command):
    """Turn `UserError` into one line on stderr and exit status 2 (unless --debug)."""

    @functools.wraps(command)
    def wrapper(*args, debug: bool = False, **kwargs):
        from rlpipe.core.errors import UserError

        try:
            return command(*args, **kwargs)
        except UserError as exc:
            if debug:
                raise
            rank = os.environ.get("RANK", "0")
            click.echo(f"error: {exc}" if rank == "0" else f"error (rank {rank}): {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")(wrapper)


_config_arg = click.argument("config_path", metavar="CONFIG")
_overrides_arg = click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rlpipe")
def main():
    """rlpipe: PPO for language models from a reward signal (RLHF)."""


@main.command()
@_config_arg
@_overrides_arg
@click.option("--overwrite", is_flag=True, help="Replace an existing, non-empty run.output_dir.")
@click.option("--no-progress", is_flag=True, help="No progress bar (metrics still go to metrics.jsonl).")
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint in run.output_dir.")
@_user_errors
def run(config_path, overrides, overwrite, no_progress, resume):
    """Train with CONFIG (YAML); KEY=VALUE pairs override it, e.g. run.steps=20."""
    from rlpipe.core import distributed
    from rlpipe.core.build import check_run_dir
    from rlpipe.core.config import load_config
    from rlpipe.core.pipeline import train

    cfg = load_config(config_path, overrides)
    if cfg.distributed.nproc > 1 and not distributed.launched():
        check_run_dir(cfg, overwrite, resume)  # user errors here, before any process starts
        flags = [f for f, on in (("--overwrite", overwrite), ("--no-progress", no_progress),
                                 ("--resume", resume)) if on]
        sys.exit(distributed.launch(["run", config_path, *overrides, *flags], cfg.distributed.nproc))
    try:
        run_dir = train(cfg, overwrite=overwrite, progress=not no_progress, resume=resume)
    except BaseException:
        distributed.shutdown(wait=False)
        raise
    distributed.shutdown()
    if not distributed.launched() or os.environ.get("RANK") == "0":
        click.echo(f"run finished: {run_dir}  (metrics.jsonl, config.yaml, final/)")


@main.command("config")
@_config_arg
@_overrides_arg
@_user_errors
def config_cmd(config_path, overrides):
    """Check CONFIG and print it resolved: defaults filled in, overrides applied, paths absolute."""
    import yaml

    from rlpipe.core.config import load_config

    click.echo(yaml.safe_dump(load_config(config_path, overrides).to_dict(), sort_keys=False), nl=False)


@main.command()
@_user_errors
def plugins():
    """List installed plugins: group, name, distribution, version and status."""
    from rlpipe.core.registry import status_table

    rows = [(s.group, s.name, s.dist, s.version, status) for s, status in status_table()]
    header = ("group", "name", "distribution", "version", "status")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        click.echo("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + row[4])


@main.command()
@click.argument("run_dir", metavar="RUN_DIR")
@_user_errors
def report(run_dir):
    """Plot RUN_DIR's metrics.jsonl as PNGs in RUN_DIR/report/ and print a short summary."""
    from rlpipe.core.report import summary, write_report

    click.echo(summary(run_dir))
    for path in write_report(run_dir):
        click.echo(path)


@main.command("train-rm")
@_config_arg
@_overrides_arg
@click.option("--overwrite", is_flag=True, help="Replace an existing, non-empty output_dir.")
@click.option("--no-progress", is_flag=True, help="No progress bar (metrics still go to metrics.jsonl).")
@_user_errors
def train_rm(config_path, overrides, overwrite, no_progress):
    """Train a Bradley–Terry reward model on preference pairs (JSONL: prompt, chosen, rejected)."""
    from rlpipe.core.reward_training import load_rm_config, train_reward_model

    out = train_reward_model(load_rm_config(config_path, overrides), overwrite=overwrite,
                             progress=not no_progress)
    click.echo(f"reward model saved: {out}  (rewards: [{{name: reward_model, path: {out}}}])")


if __name__ == "__main__":
    main()
