"""Prompt data on Hugging Face `datasets`: a file, a ``save_to_disk`` folder, a Hub name from the
local cache, or a `datasets.Dataset`; chat prompts; the columns that travel with each sample.

`load_prompt_data` reads ``.txt`` (one prompt a line), ``.jsonl``/``.json``, ``.parquet``,
``.csv``, a ``save_to_disk`` folder (or a folder of data files), or a Hub dataset name
(``owner/name``, resolved from the Hugging Face cache). The prompt column (``prompt_key``) holds
strings, or chat ``messages`` (a list of ``{role, content}``), never both. Every other column
travels with the samples of its row under ``("data", COLUMN)`` (`PromptData.attach`).

>>> import datasets
>>> rows = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+2="], "answer": [2, 4]})
>>> data = load_prompt_data(rows)
>>> len(data), data.chat, data.columns["answer"], data.kinds["answer"]
(2, False, [2, 4], 'int')
>>> data.texts([1, 0])
['2+2=', '1+1=']
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensordict import NonTensorStack

from rlpipe.core.base import schema
from rlpipe.core.base.errors import UserError, describe
from rlpipe.core.base.files import read_jsonl, read_text
from rlpipe.core.contracts.reward_fn import column_values

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def data_source(value, conv, key: str):
    """The ``data.prompts`` / ``eval.prompts`` value of a config: an existing path (resolved by
    the converter), a Hub dataset name (kept as a string), or None; a string that is neither
    is a one-line "file not found" naming the path it looked for."""
    if value is None or isinstance(value, Path):
        return value
    text = str(value)
    if _HUB_NAME.fullmatch(text) and Path(text).suffix.lower() not in {*FORMATS, ".txt"}:
        return text
    from_cli = any(key == k or key.startswith(k + ".") for k in conv.cli_keys)
    base = Path.cwd() if from_cli else conv.base_dir
    raise UserError(f"{key}: file not found: {(base / Path(text).expanduser()).resolve()}")


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars or warnings from `datasets` while it loads (errors become one line)."""
    import datasets

    level = datasets.logging.get_verbosity()
    bars = datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its reader errors: ours say it
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        datasets.logging.set_verbosity(level)
        if not bars:
            datasets.enable_progress_bars()


def read_dataset(source, split: str = "train", key: str = "data.prompts"):
    """``source`` (a path, a Hub name or a `datasets.Dataset`/``DatasetDict``) as one
    `datasets.Dataset` split; unreadable input is a one-line `UserError` naming it."""
    with _quiet_datasets() as datasets:
        if isinstance(source, datasets.Dataset):
            return source
        if isinstance(source, datasets.DatasetDict):
            return _pick_split(source, split, key, "the DatasetDict")
        if isinstance(source, Path) or Path(str(source)).exists():
            return _read_local(Path(source), split, key, datasets)
        return _read_hub(str(source), split, key, datasets)


def _pick_split(found, split: str, key: str, where: str):
    if split not in found:
        raise UserError(f"{key}: {where} has no split {split!r}; splits: {', '.join(found)} "
                        f"(set the split key)")
    return found[split]


def _read_local(path: Path, split: str, key: str, datasets):
    path = path.expanduser().resolve()
    if path.is_dir():
        try:
            if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
                found = datasets.load_from_disk(str(path))
            else:
                found = datasets.load_dataset(str(path))
        except Exception as exc:  # noqa: BLE001 - any reader failure is the user's folder
            raise UserError(f"{key}: cannot read the dataset folder {path}: {describe(exc)}") from None
        return found if isinstance(found, datasets.Dataset) else _pick_split(found, split, key, str(path))
    suffix = path.suffix.lower()
    if suffix == ".txt":
        lines = [line for line in read_text(path).splitlines() if line.strip()]
        return datasets.Dataset.from_dict({"prompt": lines})
    if suffix not in FORMATS:
        raise UserError(f"{key}: {path}: unsupported file type {suffix or '(none)'!r}; use .txt, "
                        f"{', '.join(FORMATS)}, a save_to_disk folder or a Hub dataset name")
    if path.stat().st_size == 0:
        raise UserError(f"{key}: {path} is empty (no rows)")
    if suffix != ".parquet":  # pyarrow reads bad UTF-8 lazily and fails later, without a line
        try:
            _check_text(path, suffix)
        except UserError as exc:
            raise UserError(f"{key}: {exc}") from None
    try:
        return datasets.load_dataset(FORMATS[suffix], data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - pyarrow/pandas errors: name the file (and line)
        raise UserError(f"{key}: {_where_broken(path, exc)}") from None


def _check_text(path: Path, suffix: str) -> None:
    """Read ``path`` once in Python first: bad UTF-8, and JSON that Python cannot parse (pyarrow's
    reader crashes the process on JSON nested some 20 000 deep), are a `UserError` naming the
    file (and line)."""
    import json

    if suffix == ".jsonl":   # the line reader decodes too, naming a bad byte's line
        for _ in read_jsonl(path):
            pass
        return
    text = read_text(path)
    if suffix == ".json":
        try:
            json.loads(text)
        except RecursionError:
            raise UserError(f"{path}: JSON nested too deep to read") from None
        except ValueError:   # JSON Lines in a .json file, or broken: the line reader says which
            for _ in read_jsonl(path):
                pass


def _where_broken(path: Path, exc: Exception) -> str:
    """``file:line: reason`` for a JSON Lines file (our own reader finds the line), else the
    file and the reader's first line of error."""
    if path.suffix.lower() == ".jsonl":
        try:
            for _ in read_jsonl(path):
                pass
        except UserError as found:
            return str(found)
    cause = exc.__cause__ or exc.__context__ or exc
    return f"{path}: cannot read as {FORMATS[path.suffix.lower()]}: {describe(cause)}"


def _read_hub(name: str, split: str, key: str, datasets):
    from datasets import config as ds_config

    try:
        return datasets.load_dataset(name, split=split)
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise UserError(f"{key}: Hub dataset {name!r} has no split {split!r}: "
                            f"{describe(exc)}") from None
        raise UserError(f"{key}: Hub dataset {name!r}: {describe(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - not cached and no Hub: say what and where
        raise UserError(f"{key}: {name!r} is not a file or folder, and the Hugging Face dataset "
                        f"{name!r} is not in the local cache ({ds_config.HF_DATASETS_CACHE}) "
                        f"nor reachable ({describe(exc, 160)}); download it once with "
                        f"datasets.load_dataset({name!r}) while online, or give a local file") from None


def _prompt_kind(value) -> str | None:
    """``"text"`` for a string, ``"chat"`` for a list of ``{role, content}`` messages, else None."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return "chat"
    return None


def _json_messages(text: str) -> bool:
    """Whether ``text`` is a JSON list of ``{role, content}`` messages."""
    if not text.lstrip().startswith("["):
        return False
    try:
        return _prompt_kind(json.loads(text)) == "chat"
    except ValueError:
        return False


def _column_kind(values: list) -> str:
    """How a column travels: ``bool``, ``int`` or ``float`` tensors, or ``object`` entries."""
    kinds = {type(v) for v in values}
    if kinds == {bool}:
        return "bool"
    if kinds == {int}:
        return "int"
    if kinds and kinds <= {int, float}:
        return "float"
    return "object"


@dataclass
class PromptData:
    """Prompts (strings, or chat message lists with ``chat``) and the other columns, by row."""

    prompts: list
    columns: dict[str, list] = field(default_factory=dict)
    chat: bool = False
    source: str = "data.prompts"
    kinds: dict[str, str] = field(default_factory=dict)
    _tokenizer: object = None
    _chat_texts: list | None = None  # each chat row through the template (`use_tokenizer`)

    def __len__(self) -> int:
        return len(self.prompts)

    def use_tokenizer(self, tokenizer) -> None:
        """The actor's tokenizer, which turns chat prompts into text; a chat dataset with a
        tokenizer that has no chat template is a one-line error."""
        if self.chat and not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{self.source}: the prompts are chat messages but the actor's "
                            f"tokenizer has no chat template; give plain-string prompts or a "
                            f"tokenizer with a chat template")
        self._tokenizer, self._chat_texts = tokenizer, None
        if self.chat:  # every row now: a template that fails on a row fails before training
            self._chat_texts = [chat_text(tokenizer, messages, f"{self.source} row {i + 1}")
                                for i, messages in enumerate(self.prompts)]

    def texts(self, rows: list[int]) -> list[str]:
        """The prompt text of each row: chat messages through the chat template, with the
        generation prompt (`chat_text`)."""
        if not self.chat:
            return [self.prompts[i] for i in rows]
        if self._tokenizer is None:
            raise RuntimeError("PromptData.use_tokenizer(tokenizer) must come before texts()")
        return [self._chat_texts[i] for i in rows]

    def records(self, rows: list[int]) -> list[dict]:
        """Each row as a dict: ``prompt`` (a string, or chat messages) and the other columns (what
        an environment's ``reset(row, seed)`` receives)."""
        return [{"prompt": self.prompts[i], **{k: v[i] for k, v in self.columns.items()}}
                for i in rows]

    def attach(self, batch, rows: list[int]) -> None:
        """Write each column of ``rows[group_id]`` into ``batch`` under ``("data", COLUMN)``:
        bool/int/float columns as tensors (int64, float64), the rest as non-tensor entries; chat
        prompts' messages under ``prompt_messages``."""
        if not self.columns and not self.chat:
            return
        groups = batch[schema.GROUP_ID].tolist()
        if groups and not (0 <= min(groups) and max(groups) < len(rows)):
            raise UserError(f"the collector returned group_id {max(groups)} for {len(rows)} "
                            f"prompts; group_id must index the prompts of the collect() call")
        picked = [rows[g] for g in groups]
        if self.chat:  # the messages, for reward functions that read conversations (TRL's)
            batch.set(schema.PROMPT_MESSAGES, NonTensorStack(*[self.prompts[i] for i in picked]))
        for name, values in self.columns.items():
            batch.set((schema.DATA, name), column_entry([values[i] for i in picked],
                                                     self.kinds[name], batch.device))


def column_entry(values: list, kind: str, device=None):
    """A column's values for a batch: a tensor for ``bool``/``int``/``float``, else a
    `NonTensorStack` (strings, None, lists, dicts)."""
    dtypes = {"bool": torch.bool, "int": torch.int64, "float": torch.float64}
    if kind in dtypes:
        return torch.tensor(values, dtype=dtypes[kind], device=device)
    return NonTensorStack(*values)


def chat_text(tokenizer, messages: list[dict], where: str = "prompt") -> str:
    """``messages`` through the tokenizer's chat template with the generation prompt, as text.
    When the tokenizer adds BOS itself and the template wrote it too, the template's BOS is
    dropped, so that the collector's encoding holds one BOS, not two."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template error names the row
        raise UserError(f"{where}: the chat template failed: {describe(exc)}") from None
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and _adds_bos(tokenizer):
        text = text[len(bos):]
    return text


def _adds_bos(tokenizer) -> bool:
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def load_prompt_data(source, split: str = "train", prompt_key: str = "prompt",
                     key: str = "data.prompts") -> PromptData:
    """Read ``source`` (see `read_dataset`) and check it: the prompt column exists, the split has
    rows, every prompt is a string or every prompt is a message list."""
    table = read_dataset(source, split, key)
    names = list(table.column_names)
    if prompt_key not in names:
        raise UserError(f"{key}: no column {prompt_key!r}; columns: {', '.join(names) or 'none'} "
                        f"(set {key.split('.')[0]}.prompt_key)")
    if len(table) == 0:
        raise UserError(f"{key}: split {split!r} has no rows")
    prompts = table[prompt_key]
    kinds = [_prompt_kind(p) for p in prompts]
    for i, kind in enumerate(kinds):
        if kind is None:
            raise UserError(f"{key}: row {i + 1}: {prompt_key!r} must be a string or a list of "
                            f"{{role, content}} messages, got {type(prompts[i]).__name__} "
                            f"{str(prompts[i])[:60]!r}")
        if kind == "text" and _json_messages(prompts[i]):  # e.g. a CSV cell: text, not a list
            raise UserError(f"{key}: row {i + 1}: {prompt_key!r} is chat messages written as "
                            f"JSON text ({prompts[i][:40]!r}...), which would be trained on as "
                            f"the literal string; store the data as .jsonl, .json or .parquet, "
                            f"or json.loads the column into message lists")
        if kind != kinds[0]:
            raise UserError(f"{key}: mixed prompt types: row 1 is {_KIND_NAMES[kinds[0]]}, row "
                            f"{i + 1} is {_KIND_NAMES[kind]}; use one kind for every row")
    columns = {name: list(table[name]) for name in names if name != prompt_key}
    return PromptData(list(prompts), columns, chat=kinds[0] == "chat", source=key,
                      kinds={name: _column_kind(v) for name, v in columns.items()})


_KIND_NAMES = {"text": "a string", "chat": "a list of chat messages"}


def check_reward_columns(contracts: dict, data: PromptData, where: str) -> None:
    """The ``columns`` of each reward's contract (``contracts``: label -> its
    `rlpipe.core.contracts.kinds.RewardContract`) exist in ``data``: checked on the data as read,
    before any model is built.

    >>> from rlpipe.core.contracts.kinds import RewardContract
    >>> data = PromptData(["1+1="], {"answer": [2]})
    >>> check_reward_columns({"match": RewardContract(columns=("answer",))}, data, "data.prompts")
    >>> check_reward_columns({"match": RewardContract(columns=("solution",))}, data, "data.prompts")
    Traceback (most recent call last):
    ...
    rlpipe.core.base.errors.UserError: reward 'match' reads column 'solution', which data.prompts does not have; columns: answer
    """
    for label, contract in contracts.items():
        for column in contract.columns:
            values = column_values(data.columns, column)  # COLUMN.KEY: a dict column's key
            if values is None:
                raise UserError(f"reward {label!r} reads column {column!r}, which {where} does "
                                f"not have; columns: {', '.join(data.columns) or 'none'}")
            if contract.check_values is not None:  # the reward's own check of its labels
                contract.check_values(values, column, where)
