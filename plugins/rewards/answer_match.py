"""Verifiable reward: 1 when the response's final answer equals a dataset column, else 0.

The answer is extracted from the response (``extract``): ``boxed`` (the last ``\\boxed{...}``),
``hash`` (the text after the last ``####``, to the end of its line), ``number`` (the last number),
``regex`` (the last match of ``pattern``: its first group if it has one), or ``auto`` (boxed, else
hash, else the last number). Both sides are normalised: numbers (``1,234``, ``$5``, ``-0.50``,
``3/4``, ``12%``) compare as numbers within ``tolerance`` (relative, at least absolute; an answer
with words around a number, ``7 apples``, against a numeric reference: its last number), anything
else as trimmed, case-folded text with runs of spaces collapsed. A reference string holding
``####`` (GSM8K's solutions) is read after it. A response whose answer is present but wrong earns
``format_reward`` (default 0); one with no answer at all earns 0.

>>> extract_answer("So 3 + 4 = 7. The answer is \\\\boxed{7}.")
'7'
>>> extract_answer("12 apples, 5 eaten\\n#### 7 apples")
'7 apples'
>>> extract_answer("I ate 2, then 1,250.5 remained.")
'1,250.5'
>>> extract_answer("ANSWER: Paris!", "regex", r"ANSWER:\\s*(\\w+)")
'Paris'
>>> answers_match("1,250.50", 1250.5), answers_match(" paris ", "Paris"), answers_match("7", "8")
(True, True, False)
>>> answers_match("7 apples", "#### 7"), answers_match("3/4", 0.75)
(True, True)
>>> answer_scores(["#### 7", "#### 8", "no idea"], [7, 7, 7], format_reward=0.1)
[1.0, 0.1, 0.0]
"""

from __future__ import annotations

import math
import re
from typing import Literal

import torch
from torch import nn

from rlpipe.plugin import RewardContract, UserError, batch_texts, schema

Extract = Literal["auto", "boxed", "hash", "number", "regex"]
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")
_NUMERIC = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: no answer


def extract_answer(text: str, extract: str = "auto", pattern: str | re.Pattern | None = None
                   ) -> str | None:
    """The final answer in ``text`` by the rule ``extract`` (module docstring); None if absent."""
    if extract == "regex":
        matches = list(re.finditer(pattern, text))
        if not matches:
            return None
        last = matches[-1]
        return last.group(1) if last.re.groups else last.group(0)
    if extract in ("auto", "boxed"):
        boxed = _last_boxed(text)
        if boxed is not None or extract == "boxed":
            return boxed
    if extract in ("auto", "hash") and "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else None
    if extract == "hash":
        return None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    """``text`` as a number (thousands commas, ``$``, a trailing ``%`` or ``.``, ``a/b``), or None."""
    t = text.strip().replace("$", "").replace("\\%", "%").rstrip(".").strip()
    t = t[:-1].strip() if t.endswith("%") else t
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", t):
        t = t.replace(",", "")
    if _NUMERIC.fullmatch(t):
        return float(t)
    parts = t.split("/")
    if len(parts) == 2 and all(re.fullmatch(r"[-+]?\d+", p.strip()) for p in parts):
        den = int(parts[1])
        return int(parts[0]) / den if den else None
    return None


def _as_text(text: str) -> str:
    return " ".join(text.strip().rstrip(".").split()).casefold()


def answers_match(predicted: str, reference, tolerance: float = 1e-6) -> bool:
    """Whether an extracted answer equals the reference (a number, or text), after normalising."""
    if isinstance(reference, bool) or reference is None:
        reference = str(reference)
    if isinstance(reference, str) and "####" in reference:
        reference = reference.rsplit("####", 1)[1]
    ref = float(reference) if isinstance(reference, (int, float)) else _as_number(str(reference))
    pred = _as_number(predicted)
    if pred is None and ref is not None:  # "7 apples", "x = 7": its last number
        numbers = _NUMBER.findall(predicted)
        pred = _as_number(numbers[-1]) if numbers else None
    if ref is not None and pred is not None and math.isfinite(ref):
        return abs(pred - ref) <= tolerance * max(1.0, abs(ref))
    return _as_text(predicted) == _as_text(str(reference))


def answer_scores(responses: list[str], references: list, extract: str = "auto",
                  pattern: str | None = None, tolerance: float = 1e-6,
                  format_reward: float = 0.0) -> list[float]:
    """1.0 for a matching answer, ``format_reward`` for a wrong one, 0.0 for none (a plain loop)."""
    out = []
    for response, reference in zip(responses, references):
        answer = extract_answer(response, extract, pattern)
        if answer is None:
            out.append(0.0)
        else:
            out.append(1.0 if answers_match(answer, reference, tolerance) else float(format_reward))
    return out


def _unusable(value) -> str | None:
    """Why ``value`` cannot be a reference answer, or None when it can."""
    if value is None:
        return "missing (None)"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "infinite"
    if isinstance(value, str):
        return None if value.strip() else "empty"
    if isinstance(value, (int, float)):
        return None
    return f"a {type(value).__name__} {str(value)[:40]}"


class AnswerMatch(nn.Module):
    """Reward module: `answer_scores` of ``response_text`` against ``("data", column)``.

    Args:
        column: the dataset column holding the reference answer
        extract: auto (the last \\boxed{}, else the text after ####, else the last number), boxed, hash, number or regex
        pattern: with extract regex: a regular expression, its last match's first group
        tolerance: numbers match within this (relative beyond 1)
        format_reward: reward for an answer present but wrong (0: none); a match gets 1

    >>> contract = AnswerMatch.contract(column="solution")
    >>> contract.columns, contract.check_values == AnswerMatch.check_column
    (('solution',), True)
    """

    @classmethod
    def contract(cls, column: str = "answer", **args) -> RewardContract:
        """It reads the dataset column ``column`` (checked against the data before step 1)."""
        return RewardContract(columns=(column,), check_values=cls.check_column)

    @classmethod
    def check_column(cls, values: list, column: str = "answer", where: str = "data.prompts",
                     **args) -> None:
        """Every reference answer a string or a finite number (a GSM8K ``####`` solution
        included); a missing, empty, NaN or nested one (a dict, a list) scores 0 like a wrong
        answer, so the first is one `UserError` naming the row and how many there are. The plan
        calls it on the data as read, before any model loads; `forward` on each batch.

        >>> AnswerMatch.check_column(["7", 3, 2.5, "#### 12"])
        >>> AnswerMatch.check_column(["7", None, float("nan"), {"value": 4}])
        Traceback (most recent call last):
        rlpipe.core.base.errors.UserError: answer_match: column 'answer' of data.prompts: 3 of 4 rows have no usable reference answer (row 2: missing (None); row 3: NaN; row 4: a dict {'value': 4}); each must be a string or a finite number: fix or drop those rows (a missing answer would score 0, like a wrong one)
        """
        bad = [(i, why) for i, v in enumerate(values) if (why := _unusable(v))]
        if bad:
            shown = "; ".join(f"row {i + 1}: {why}" for i, why in bad[:3])
            raise UserError(f"answer_match: column {column!r} of {where}: {len(bad)} of "
                            f"{len(values)} rows have no usable reference answer ({shown}); each "
                            f"must be a string or a finite number: fix or drop those rows (a "
                            f"missing answer would score 0, like a wrong one)")

    def __init__(self, column: str = "answer", extract: Extract = "auto",
                 pattern: str | None = None, tolerance: float = 1e-6, format_reward: float = 0.0):
        super().__init__()
        if pattern is not None and extract not in ("auto", "regex"):
            raise UserError(f"answer_match: pattern is for extract: regex, not extract: {extract}")
        extract = "regex" if pattern is not None else extract
        if extract == "regex" and pattern is None:
            raise UserError("answer_match: extract: regex needs a pattern")
        try:
            self.pattern = re.compile(pattern) if pattern is not None else None
        except re.error as exc:
            raise UserError(f"answer_match: pattern {pattern!r} is not a regular expression: "
                            f"{exc}") from None
        if not (tolerance >= 0 and math.isfinite(tolerance)):
            raise UserError(f"answer_match: tolerance must be >= 0, got {tolerance!r}")
        self.column, self.extract = column, extract
        self.tolerance, self.format_reward = tolerance, format_reward

    def forward(self, td) -> torch.Tensor:
        references = batch_texts(td, (schema.DATA, self.column))
        self.check_column(references, self.column, "this step's batch")
        scores = answer_scores(batch_texts(td, schema.RESPONSE_TEXT), references, self.extract,
                               self.pattern, self.tolerance, self.format_reward)
        return torch.tensor(scores, dtype=torch.float32, device=td.device)
