"""One owner at a time for a run directory: an OS lock (``flock``) on ``DIR/.rlpipe-lock``.

`rlpipe run` (also ``--resume`` and ``--overwrite``) holds it exclusively from before it looks
at the directory until it ends, `rlpipe export` holds it shared; the OS drops it when the
process ends, however it ends, so a killed run never leaves a stale lock (its file may stay: a
name `rlpipe.core.run.rundir` accepts as rlpipe's own). The lock belongs to the run: `train`
releases it when it returns or raises (a notebook's kernel that lives on holds nothing). A
second process is refused on one line naming the holder's pid. The lock file is never opened
through a symbolic link; a read-only folder is read (export) without a lock.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

from rlpipe.core.base.errors import WRITE_ERRNOS, UserError

LOCK = ".rlpipe-lock"


class Held:
    """An OS lock (``flock``) on ``DIR/.rlpipe-lock``, released by `release` (which deletes the
    file when no other process holds it) or when the process ends however it ends; the file
    records the exclusive holder's pid."""

    def __init__(self, file, path: Path):
        self.file, self.path = file, path

    def release(self) -> None:
        if self.file is None or self.file.closed:
            return
        try:  # the last holder (a shared one may not be) deletes the file, then unlocks
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.path.unlink(missing_ok=True)
        except OSError:  # another holder, or a read-only folder
            pass
        self.file.close()  # closing the descriptor drops the lock


def hold(out: Path, key: str, shared: bool = False) -> Held:
    """Lock run directory ``out`` (created if missing) for this process: exclusively to write
    it (run, --resume, --overwrite), ``shared`` to read it (export). A directory another rlpipe
    process holds is one `UserError` naming that process.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "run"
    >>> first = hold(d, "run.output_dir")
    >>> _HELD.clear()  # as if another process held it
    >>> hold(d, "run.output_dir")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    rlpipe.core.base.errors.UserError: run.output_dir: .../run is in use by another rlpipe process (pid ...
    >>> first.release(); hold(d, "run.output_dir").release(); sorted(d.iterdir())
    []
    """
    out.mkdir(parents=True, exist_ok=True)
    if out in _HELD:  # this process already holds it (a run that raised, then its --resume)
        _HELD.pop(out).release()
    path = out / LOCK
    while True:
        file = _open(path, key, shared)
        if file is None:  # a read-only folder, read by export: no run can write it meanwhile
            return Held(None, path)
        try:
            fcntl.flock(file, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip()
            file.close()
            pid = holder.split()[0] if holder else ""
            who = f"pid {holder}" if pid.isdigit() and _alive(int(pid)) else "an rlpipe export"
            raise UserError(f"{key}: {out} is in use by another rlpipe process ({who}); wait "
                            f"for it to end or choose another {key}") from None
        if _same_file(path, file):
            break
        file.close()  # its holder deleted the file while this process waited: lock the new one
    if not shared:
        file.truncate(0)
        file.write(f"{os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
        file.flush()
    _HELD[out] = Held(file, path)
    return _HELD[out]


def refuse_if_held(out: Path, key: str) -> None:
    """`hold`'s `UserError` if another process holds ``out``. Asked before ``out``'s files are
    judged: a running run changes them meanwhile (a checkpoint publishing)."""
    if out not in _HELD and (out / LOCK).is_file() and not (out / LOCK).is_symlink():
        hold(out, key, shared=True)
        _HELD.pop(out).release()


def _open(path: Path, key: str, shared: bool):
    """``path`` opened to lock, never through a symbolic link (a link there is one `UserError`:
    its target, a user's file, is never truncated); ``shared`` in a folder this process cannot
    write: read-only, or None where there is no lock file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if path.is_symlink():
            raise UserError(f"{key}: {path} is a symbolic link, not rlpipe's lock file; remove "
                            f"the link (its target is left alone)") from None
        if not shared or exc.errno not in WRITE_ERRNOS:
            raise
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{key}: {path} is not rlpipe's lock file; remove it")
    return os.fdopen(fd, "r" if shared else "r+", encoding="utf-8")


_HELD: dict[Path, Held] = {}


def release_all() -> None:
    """Release every run directory this process holds (a run that failed: its lock file goes)."""
    while _HELD:
        _HELD.popitem()[1].release()


def _same_file(path: Path, file) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(file.fileno())
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
