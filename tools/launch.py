"""Start the processes of a distributed run: torchrun's own launcher, run in this process.

``rlpipe run CONFIG distributed.nproc=N`` starts N workers on this machine (``--standalone``);
with ``distributed.nnodes=M`` and ``distributed.rdzv_endpoint=HOST:PORT`` it joins an M-machine
job through a c10d rendezvous instead (run the same command on every machine). Inside a job that
torchrun or a scheduler already started (``LOCAL_RANK`` and ``WORLD_SIZE`` set), rlpipe launches
nothing and joins it.

Local rank 0 prints to this console; the other local ranks write to log files, so a failure
that every rank hits is reported once. When a worker fails, the launcher prints that worker's
own ``error:`` line (unless local rank 0 already printed one) instead of torchrun's page-long
report, and exits with the worker's status: 2 for a user mistake.

>>> from rlpipe.core.config.settings import DistributedConfig
>>> torchrun_args(DistributedConfig(nproc=2), "/tmp/logs")[:2]
['--standalone', '--nproc-per-node=2']
>>> torchrun_args(DistributedConfig(nnodes=2, rdzv_endpoint="10.0.0.1:29500"), "/tmp/logs")[:4]
['--nnodes=2', '--rdzv-backend=c10d', '--rdzv-endpoint=10.0.0.1:29500', '--rdzv-id=rlpipe']
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path

import click

from rlpipe.core.models.distributed import LAUNCHER_ENV
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.build import resolve_device


def torchrun_args(d, log_dir: str) -> list[str]:
    """torchrun's flags for the ``distributed`` config section ``d``."""
    if d.nnodes > 1:
        where = [f"--nnodes={d.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={d.rdzv_endpoint}",
                 f"--rdzv-id={d.rdzv_id}", f"--rdzv-conf=join_timeout={math.ceil(d.timeout_s)}"]
    else:
        where = ["--standalone"]
    quiet = ",".join(f"{i}:3" for i in range(1, d.nproc))  # local ranks > 0: stdout+stderr to files
    return [*where, f"--nproc-per-node={d.nproc}", f"--log-dir={log_dir}",
            *([f"--redirects={quiet}"] if quiet else [])]


def launch(argv: list[str], d) -> int:
    """Run ``rlpipe ARGV`` under torchrun as the ``distributed`` section ``d`` says; returns the
    exit status (0, 2 for a user mistake in any worker, else the first failure's)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    log_dir = tempfile.mkdtemp(prefix="rlpipe-workers-")
    args = parse_args([*torchrun_args(d, log_dir), "-m", "rlpipe.cli", *argv])
    os.environ[LAUNCHER_ENV] = "1"  # workers that lose a peer exit quietly: the cause is printed
    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)  # its failure report is a page
    if d.nnodes > 1:
        click.echo(f"rlpipe: waiting up to distributed.timeout_s={d.timeout_s:g} s for "
                   f"{d.nnodes} nodes to join at {d.rdzv_endpoint} (Ctrl-C stops)", err=True)
    try:
        run(args)
        return 0
    except ChildFailedError as exc:
        return _report(exc.failures, Path(log_dir))
    except Exception as exc:  # noqa: BLE001 - rendezvous and launch problems: port, host, timeout
        if type(exc).__name__ == "RendezvousTimeoutError":
            raise UserError(f"distributed.nnodes={d.nnodes}: not every node joined at "
                            f"{d.rdzv_endpoint} within distributed.timeout_s={d.timeout_s:g} s; "
                            f"start rlpipe on each node with the same distributed.rdzv_endpoint "
                            f"and rdzv_id") from exc
        raise UserError(f"distributed launch failed ({_where(d)}): {type(exc).__name__}: "
                        f"{_first_line(exc)}") from exc
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def _report(failures: dict, log_dir: Path) -> int:
    """Print the failed workers' own error line once; the exit status to return."""
    codes = {rank: f.exitcode for rank, f in failures.items()}
    printed = any(f.local_rank == 0 and f.exitcode == 2 for f in failures.values())
    # The cause: a worker that reported a user error (it may have been stopped while exiting),
    # else one that exited by itself, the earliest; the launcher then stops the others.
    errors = {f.local_rank: [x for x in _stderr(log_dir, f.local_rank) if x.startswith("error")]
              for f in failures.values()}
    rank, cause = min(failures.items(), key=lambda kv: (not errors[kv[1].local_rank],
                                                        kv[1].exitcode < 0, kv[1].timestamp))
    if not printed:  # local rank 0 did not print an error line itself
        mine = errors[cause.local_rank]
        crash = _stderr(log_dir, cause.local_rank)[-40:]
        if not mine and crash:  # a crash, not a user mistake: keep its traceback
            click.echo("\n".join(crash), err=True)
        click.echo(mine[0] if mine else f"error: worker rank {rank} {_signal(cause.exitcode)}",
                   err=True)
    if 2 in codes.values() or any(errors.values()):
        return 2
    return 128 - cause.exitcode if cause.exitcode < 0 else cause.exitcode


def _stderr(log_dir: Path, local_rank: int) -> list[str]:
    """The lines a redirected worker wrote to its stderr log (none for local rank 0)."""
    for log in log_dir.rglob("stderr.log"):
        if log.parent.name == str(local_rank):
            return log.read_text(errors="replace").splitlines()
    return []


def _signal(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exited with status {exitcode}"


def _where(d) -> str:
    return f"{d.nnodes} nodes via {d.rdzv_endpoint}" if d.nnodes > 1 else f"{d.nproc} processes"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or repr(exc)
    return text.splitlines()[0]


def check_before_launch(cfg) -> None:
    """Distributed mistakes that show in the config alone, before any process starts."""
    d = cfg.distributed
    world = d.nproc * d.nnodes
    if cfg.data.batch_size < world:
        raise UserError(f"data.batch_size={cfg.data.batch_size} gives some of the {world} processes "
                        f"(distributed.nproc x nnodes) no prompt; raise it to at least {world}")
    _check_gpus(cfg.run.device, d.nproc)
    if d.nnodes > 1 and not d.rdzv_endpoint:
        raise UserError("distributed.nnodes > 1 needs distributed.rdzv_endpoint=HOST:PORT, the "
                        "same on every machine")
    if d.nnodes > 1:
        _check_endpoint(d.rdzv_endpoint, min(10.0, d.timeout_s))


def _check_gpus(device_name: str, nproc: int) -> None:
    """One CUDA device per process on a node: NCCL cannot put two ranks on one GPU."""
    import torch

    if resolve_device(device_name).type == "cuda" and nproc > torch.cuda.device_count():
        raise UserError(f"distributed.nproc={nproc} needs one CUDA device per process, but torch "
                        f"sees {torch.cuda.device_count()}: lower distributed.nproc, or set "
                        f"run.device=cpu to train on CPU with gloo")


def _check_endpoint(endpoint: str, timeout: float) -> None:
    """Refuse an endpoint where something other than a torch rendezvous store listens (torchrun
    would wait minutes on it). Nothing listening is fine: this node will host the store."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    if not port.isdigit() or not host:
        raise UserError(f"distributed.rdzv_endpoint={endpoint}: expected HOST:PORT")
    try:
        socket.getaddrinfo(host, int(port))
    except OSError as exc:  # torchrun would retry the name until long after timeout_s
        raise UserError(f"distributed.rdzv_endpoint={endpoint}: host {host!r} does not resolve "
                        f"({exc.strerror or exc}); give the first node's address") from exc
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError):
        return
    answered = threading.Event()

    def probe():  # a store answers at once; a foreign listener leaves the client waiting
        with contextlib.suppress(Exception):
            TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
            answered.set()

    threading.Thread(target=probe, daemon=True).start()
    if not answered.wait(timeout):
        raise UserError(f"distributed.rdzv_endpoint={endpoint}: another program holds this port "
                        f"(no torch rendezvous answers there); choose a free port")
