"""``rlpipe check CONFIG``: build the whole run in one process and compare the engine's log-probs
with the trainer's (`rlpipe.core.run.preflight`), printing the run's plan first."""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

from rlpipe.core.contracts.collector import close_collector
from rlpipe.core.run import oom, preflight
from rlpipe.core.run.pipeline import Pipeline


def check_config(cfg, echo=print) -> preflight.Mismatch:
    """``rlpipe check``: build the whole run of ``cfg`` in one process (a distributed config's
    ``nproc`` and ``nnodes`` set to 1, with a warning), in a temporary run directory (removed
    after), and `rlpipe.core.run.preflight.check` it."""
    world = cfg.distributed.nproc * cfg.distributed.nnodes
    if world > 1:   # the check is one process; the sharded run's own is run.preflight
        print(f"warning: rlpipe check builds the run in one process and leaves out "
              f"distributed.nproc={cfg.distributed.nproc}, nnodes={cfg.distributed.nnodes}; for "
              f"the preflight of the sharded run, use rlpipe run CONFIG run.preflight=true",
              file=sys.stderr)
        cfg = replace(cfg, distributed=replace(cfg.distributed, nproc=1, nnodes=1))
    folder = Path(tempfile.mkdtemp(prefix="rlpipe-check-"))
    cfg = replace(cfg, run=replace(cfg.run, output_dir=str(folder / "run"), resume="never"))
    try:
        pipe = Pipeline(cfg, progress=False)
        echo("plan (derived from the config; the run directory records it as plan.json):\n"
             + yaml.safe_dump(pipe.plan.to_dict(), sort_keys=False).rstrip())
        try:
            with oom.explained(cfg):   # running out of memory is one line, as in `rlpipe run`
                return preflight.check(pipe, echo)
        finally:
            close_collector(pipe.plugins.collector)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
