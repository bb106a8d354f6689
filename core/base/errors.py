"""The one exception type for user mistakes (bad config, data, plugin or model files).

The CLI prints a `UserError` as one line and exits with status 2; anything else is a bug and
keeps its traceback.
"""

import contextvars

# Set by the command line around a command: an error names its flags there (``--overwrite``),
# the keyword arguments of the Python call everywhere else (``overwrite=True``).
ON_COMMAND_LINE = contextvars.ContextVar("rlpipe_on_command_line", default=False)

import contextlib
import errno

# The OS refusing a write: a full disk or quota, a read-only file system, no permission.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class UserError(Exception):
    """A problem the user can fix; the message names it (key, file, plugin)."""


def describe(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (``sys.exit(3)`` for a SystemExit), on one line.

    >>> describe(OSError("no such file\\nmore detail"))
    'OSError: no such file'
    """
    if isinstance(exc, SystemExit):
        return f"sys.exit({exc.code!r})"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def writing(path, what: str):
    """An OS refusal to write inside the block (`WRITE_ERRNOS`) becomes one `UserError` naming
    ``path`` and ``what`` was being written; other errors pass unchanged.

    >>> try:
    ...     with writing("/runs/a/metrics.jsonl", "the metrics row of step 3"):
    ...         raise OSError(errno.ENOSPC, "No space left on device")
    ... except UserError as exc:
    ...     print(str(exc)[:80])
    cannot write /runs/a/metrics.jsonl (the metrics row of step 3): No space left on
    """
    try:
        yield
    except OSError as exc:
        if exc.errno not in WRITE_ERRNOS:
            raise
        raise UserError(f"cannot write {path} ({what}): {exc.strerror or describe(exc)}; free "
                        f"space or fix permissions and run again (a run continues from its "
                        f"newest checkpoint with --resume)") from exc


def option(name: str) -> str:
    """How the user asks for ``name`` where the error will be read: ``--resume`` on the command
    line, ``resume=True`` from Python (`train`, `Pipeline`).

    >>> option("overwrite")
    'overwrite=True'
    >>> token = ON_COMMAND_LINE.set(True); option("overwrite"); ON_COMMAND_LINE.reset(token)
    '--overwrite'
    """
    return f"--{name}" if ON_COMMAND_LINE.get() else f"{name}=True"
