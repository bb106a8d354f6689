"""The lookup example's tool: the code of a name, from table.json (which the model never sees)."""

import json
from pathlib import Path

TABLE = json.loads((Path(__file__).resolve().parent / "table.json").read_text())


def lookup(key: str) -> str:
    """The code on file for a name.

    Args:
        key: the name to look up, as written in the question
    """
    code = TABLE.get(key.strip()) or TABLE.get(key.strip().capitalize())
    return code if code is not None else f"no code on file for {key!r}"
