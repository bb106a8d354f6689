"""The ``rlpipe`` command line: run, config, check, plugins, train-rm, report, doctor, replay.

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
    """Turn `UserError` into one line on stderr (line breaks folded) and exit status 2, unless
    --debug; a plugin's own exception adds the hint that --debug shows its traceback."""

    @functools.wraps(command)
    def wrapper(*args, debug: bool = False, **kwargs):
        from rlpipe.core.base.errors import ON_COMMAND_LINE, UserError

        token = ON_COMMAND_LINE.set(True)  # errors name flags (--resume), not resume=True
        try:
            return command(*args, **kwargs)
        except UserError as exc:
            if debug:
                raise
            from rlpipe.core.contracts.registry import PluginError

            rank = os.environ.get("RANK", "0")
            message = " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            if isinstance(exc, PluginError) and exc.__cause__ is not None:
                message += " (--debug shows the traceback)"  # raised by the plugin's own code
            click.echo(f"error: {message}" if rank == "0" else f"error (rank {rank}): {message}",
                       err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except OSError as exc:  # a write the OS refused where rlpipe did not expect one
            from rlpipe.core.base.errors import WRITE_ERRNOS

            if debug or exc.errno not in WRITE_ERRNOS:
                raise
            click.echo(f"error: cannot write {exc.filename or 'a file'}: {exc.strerror}; free "
                       f"space or fix permissions and run again", err=True)
            sys.exit(2)
        finally:
            ON_COMMAND_LINE.reset(token)

    return click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")(wrapper)


class _UsageLine(click.ClickException):
    """A command-line usage mistake (unknown option or command, missing argument) as one
    ``error:`` line, exit status 2, like every other user mistake."""
    exit_code = 2

    def show(self, file=None):
        click.echo(f"error: {self.format_message()}", err=True)


def _one_line(error: click.UsageError) -> _UsageLine:
    where = error.ctx.command_path if error.ctx is not None else "rlpipe"
    message = " ".join(error.format_message().split()).rstrip(".")
    return _UsageLine(f"{where}: {message} (see {where} --help)")


_HELP_ONLY = getattr(click.exceptions, "NoArgsIsHelpError", ())   # bare `rlpipe`: the help


class _OneLineUsage:
    """Mixed into rlpipe's commands: their usage errors are `_UsageLine`s."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except _HELP_ONLY:
            raise
        except click.UsageError as exc:
            raise _one_line(exc) from None


class _Command(_OneLineUsage, click.Command):
    pass


class _Group(_OneLineUsage, click.Group):
    command_class = _Command

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            raise _one_line(exc) from None


_config_arg = click.argument("config_path", metavar="CONFIG")
_overrides_arg = click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rlpipe")
def main():
    """rlpipe: PPO for language models from a reward signal (RLHF)."""


@main.command()
@_config_arg
@_overrides_arg
@click.option("--overwrite", is_flag=True,
              help="Replace an earlier rlpipe run in run.output_dir (never other files).")
@click.option("--no-progress", is_flag=True, help="No progress bar: one line per step instead.")
@click.option("--resume", is_flag=True, help="Continue from the newest complete checkpoint in run.output_dir.")
@_user_errors
def run(config_path, overrides, overwrite, no_progress, resume):
    """Train with CONFIG (YAML); KEY=VALUE pairs override it, e.g. run.steps=20."""
    from rlpipe.core.models import distributed
    from rlpipe.core.run.build import check_run_dir, finished_message
    from rlpipe.core.config.settings import load_config
    from rlpipe.core.run.pipeline import Pipeline
    from rlpipe.core.run import runlock

    cfg = load_config(config_path, overrides)
    if os.environ.get("RANK", "0") == "0":  # rank 0 alone looks: the others would race its writes
        check_run_dir(cfg, overwrite, resume, reads=[config_path])  # before any model loads
    done = finished_message(cfg, resume)
    if done:  # --resume on a finished run: say so, train nothing (every rank exits alike)
        if os.environ.get("RANK", "0") == "0":
            click.echo(done)
        return
    if cfg.distributed.nproc * cfg.distributed.nnodes > 1 and not distributed.launched():
        from rlpipe.tools.launch import check_before_launch, launch

        check_before_launch(cfg)
        check_run_dir(cfg, overwrite, resume)  # user errors here, before any process starts
        flags = [f for f, on in (("--overwrite", overwrite), ("--no-progress", no_progress),
                                 ("--resume", resume)) if on]
        sys.exit(launch(["run", config_path, *overrides, *flags], cfg.distributed))
    try:
        pipeline = Pipeline(cfg, overwrite=overwrite, progress=not no_progress, resume=resume)
        run_dir = pipeline.train()
    except Exception as exc:
        runlock.release_all()
        distributed.shutdown(wait=False)
        lost = distributed.lost_peer(exc)
        if lost is None:
            raise
        # Another process failed first: rlpipe's launcher prints that process's own error.
        if not os.environ.get(distributed.LAUNCHER_ENV):
            click.echo(f"error (rank {os.environ.get('RANK', '?')}): {lost}", err=True)
        sys.exit(distributed.LOST_PEER_EXIT)
    except BaseException:
        runlock.release_all()
        distributed.shutdown(wait=False)
        raise
    distributed.shutdown()
    if pipeline.stopped_by is None and (not distributed.launched() or os.environ.get("RANK") == "0"):
        from rlpipe.core.observe.console import final_summary
        from rlpipe.core.run.checkpoint import latest

        click.echo("\n".join(final_summary(run_dir, latest(run_dir))))
    if distributed.launched():
        # Every file is written and the process group is gone. A worker still aborted now and
        # then in the interpreter's teardown ("terminate called without an active exception":
        # a C++ thread of torch.distributed destroyed while joinable) and failed a finished job,
        # so a worker leaves without the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@main.command("config")
@click.argument("config_path", metavar="[CONFIG]", required=False)
@_overrides_arg
@click.option("--defaults", is_flag=True,
              help="Print every setting with its default, range and help, as a YAML file.")
@click.option("--explain", "explain_key", metavar="KEY",
              help="Print one setting's type, default, range and help (with CONFIG: for the "
                   "plugins it names; a plugin name lists its arguments).")
@_user_errors
def config_cmd(config_path, overrides, defaults, explain_key):
    """Check CONFIG and print it resolved: defaults filled in (plugin arguments included),
    overrides applied, paths absolute."""
    import yaml

    from rlpipe.core.base.errors import UserError
    from rlpipe.core.config import compose
    from rlpipe.tools import explain
    from rlpipe.core.config.plan import plan_run
    from rlpipe.core.config.settings import load_config
    from rlpipe.core.run.build import load_run_data

    if defaults:
        click.echo(explain.defaults_yaml(), nl=False)
        return
    if config_path is None:
        if explain_key is None:
            raise UserError("rlpipe config: give CONFIG, --defaults or --explain KEY")
        click.echo(explain.explain(explain_key))
        return
    cfg = compose.apply(load_config(config_path, overrides))  # what `rlpipe run` would refuse too
    plan = plan_run(cfg)
    if cfg.data.prompts is not None:  # the data's columns, as `rlpipe run` checks them first
        load_run_data(cfg, plan)
    if explain_key is not None:
        click.echo(explain.explain(explain_key, cfg))
        return
    resolved = explain.with_plugin_defaults(cfg)
    resolved["collector"].update(plan.collector.args)  # a default prompt budget lowered to fit
    click.echo(yaml.safe_dump(resolved, sort_keys=False), nl=False)


@main.command()
@_config_arg
@_overrides_arg
@_user_errors
def check(config_path, overrides):
    """Mismatch preflight: build CONFIG's run, sample one batch, compare the engine's log-probs
    with the trainer's. Exit status 1 when they differ beyond run.preflight_max_kl or
    run.preflight_max_gap, 2 for a bad config (as every command)."""
    from rlpipe.core.config.settings import load_config
    from rlpipe.tools.check import check_config
    from rlpipe.core.run.preflight import PreflightFailed

    cfg = load_config(config_path, overrides)
    try:
        check_config(cfg, echo=click.echo)
    except PreflightFailed as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


@main.command()
@_user_errors
def plugins():
    """List installed plugins: group, name, distribution, version and status."""
    from rlpipe.core.contracts.registry import status_table

    rows = [(s.group, s.name, s.dist, s.version, status) for s, status in status_table()]
    header = ("group", "name", "distribution", "version", "status")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        click.echo("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + row[4])


@main.command()
@click.argument("run_dirs", metavar="RUN_DIR [RUN_DIR]...", nargs=-1, required=True)
@_user_errors
def report(run_dirs):
    """Plot RUN_DIR's metrics.jsonl as PNGs in RUN_DIR/report/ and print a short summary.
    Several runs: each one's summary, a table of their final numbers, and the runs overlaid in
    compare-*.png in the first run's report/."""
    import warnings
    from pathlib import Path

    from rlpipe.tools.report import summary, write_report

    with warnings.catch_warnings(record=True) as caught:  # each on one line, once
        warnings.simplefilter("always")
        if len(run_dirs) == 1:
            text, paths = summary(run_dirs[0]), write_report(run_dirs[0])
        else:
            from rlpipe.tools.compare import compare_summary, write_comparison

            runs = [Path(r) for r in run_dirs]
            text = "\n\n".join([*map(summary, runs), compare_summary(runs)])
            paths = write_comparison(runs)
    for message in dict.fromkeys(" ".join(str(w.message).split()) for w in caught):
        click.echo(f"warning: {message}", err=True)
    click.echo(text)
    for path in paths:
        click.echo(path)


@main.command()
@click.argument("run_dir", metavar="RUN_DIR")
@_user_errors
def doctor(run_dir):
    """Check RUN_DIR's metrics against the health rules; exit 1 when one fired, 0 when none did."""
    from pathlib import Path

    from rlpipe.tools.doctor import doctor as examine_run

    text, status = examine_run(Path(run_dir))
    click.echo(text)
    sys.exit(status)


@main.command()
@click.argument("run_dir", metavar="RUN_DIR")
@click.option("--step", type=int, required=True, help="The step whose journal holds the conversation.")
@click.option("--sample", type=int, required=True, help="The conversation's index in that step.")
@_user_errors
def replay(run_dir, step, sample):
    """Run conversation SAMPLE of step STEP again live from RUN_DIR's tool-call journal; exit 1
    when a live result differs from the recorded one."""
    from pathlib import Path

    from rlpipe.tools.replay import replay as replay_conversation

    lines, difference = replay_conversation(Path(run_dir), step, sample)
    for line in lines:
        click.echo(line)
    if difference:
        click.echo(f"differs: {difference}", err=True)
        sys.exit(1)
    click.echo("same: every call matches the journal")


@main.command()
@click.argument("run_dir", metavar="RUN_DIR")
@click.argument("out", metavar="OUT")
@click.option("--step", type=int, default=None, help="Checkpoint step (default: the newest).")
@click.option("--adapter", is_flag=True, help="A LoRA actor as its adapter alone (default: merged).")
@_user_errors
def export(run_dir, out, step, adapter):
    """Write a checkpoint's policy to OUT as a save_pretrained folder (from_pretrained, or peft)."""
    from rlpipe.core.observe.console import quiet_libraries
    from rlpipe.tools.export import export as export_policy

    with quiet_libraries():
        path = export_policy(run_dir, out, step=step, merge=not adapter)
    click.echo(f"exported: {path}")


@main.command("train-rm")
@_config_arg
@_overrides_arg
@click.option("--overwrite", is_flag=True,
              help="Replace an earlier train-rm output in output_dir (never other files).")
@click.option("--no-progress", is_flag=True, help="No progress bar (metrics still go to metrics.jsonl).")
@_user_errors
def train_rm(config_path, overrides, overwrite, no_progress):
    """Train a Bradley–Terry reward model on preference pairs (JSONL: prompt, chosen, rejected)."""
    from rlpipe.tools.train_rm import load_rm_config, train_reward_model

    out = train_reward_model(load_rm_config(config_path, overrides), overwrite=overwrite,
                             progress=not no_progress)
    click.echo(f"reward model saved: {out}  (rewards: [{{name: reward_model, path: {out}}}])")


if __name__ == "__main__":
    main()
