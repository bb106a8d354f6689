"""Text files read as UTF-8 with one-line errors that name ``file:line``: a bad byte, bad JSON.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "rows.jsonl"
>>> _ = p.write_text('{"a": 1}\\n\\n{"a": 2}\\n')
>>> list(read_jsonl(p))
[(1, {'a': 1}), (3, {'a': 2})]
"""

from __future__ import annotations

import json
from pathlib import Path

from rlpipe.core.base.errors import UserError

_BOM = b"\xef\xbb\xbf"


def _decode(data: bytes, path: Path, first_line: int = 1) -> str:
    """``data`` as UTF-8 (a leading BOM dropped); a `UserError` naming ``file:line`` if it is not."""
    if first_line == 1:
        data = data.removeprefix(_BOM)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + data.count(b"\n", 0, exc.start)
        column = exc.start - data.rfind(b"\n", 0, exc.start)
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column "
                        f"{column}); save the file as UTF-8") from None


def read_text(path: Path) -> str:
    """The whole file as UTF-8 text; unreadable or non-UTF-8 bytes are a one-line `UserError`."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return _decode(data, path)


def read_jsonl(path: Path):
    """``(line number, object)`` for each non-blank line; non-UTF-8 bytes, invalid JSON (also
    numbers too long or nesting too deep for Python) or a non-object is a `UserError` naming
    ``file:line``."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with f:
        for n, raw in enumerate(f, 1):
            line = _decode(raw, path, n)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{n}: invalid JSON: {exc.msg}") from None
            except (ValueError, RecursionError) as exc:  # int digit limit, deep nesting
                raise UserError(f"{path}:{n}: unreadable JSON: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:200]}") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{n}: expected a JSON object")
            yield n, row
