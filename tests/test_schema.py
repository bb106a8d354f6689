"""core/base/schema.py: the batch keys are the ones DESIGN.md documents, and `validate` names the key and
the stage for every kind of bad entry."""

import re
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
B, P, R = 3, 4, 5


def full_batch() -> TensorDict:
    """A well-formed batch holding every documented key."""
    td = TensorDict({
        S.PROMPT_IDS: torch.ones(B, P, dtype=torch.long), S.PROMPT_MASK: torch.ones(B, P, dtype=torch.bool),
        S.RESPONSE_IDS: torch.ones(B, R, dtype=torch.long),
        S.RESPONSE_MASK: torch.ones(B, R, dtype=torch.bool),
        S.GROUP_ID: torch.arange(B), S.FINISHED: torch.ones(B, dtype=torch.bool),
        S.SCORE: torch.zeros(B), (S.SCORE_PARTS, "length"): torch.zeros(B),
        **{k: torch.zeros(B, R) for k in (S.OLD_LOG_PROB, S.REF_LOG_PROB, S.VALUE, S.REWARD,
                                          S.ADVANTAGE, S.VALUE_TARGET)},
    }, batch_size=[B])
    td[S.PROMPT_TEXT] = ["p"] * B
    td[S.RESPONSE_TEXT] = ["r"] * B
    return td


def documented_keys() -> set[str]:
    """The first column of DESIGN.md's batch table (``("score_parts", NAME)`` as its first part)."""
    design = (ROOT / "DESIGN.md").read_text()
    table = design.split("## The batch", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for row in re.findall(r"^\| (.+?) \|", table, re.M):
        keys |= set(re.findall(r'`\(?"?([a-z_]+)', row))
    return keys - {"key"}


def test_every_documented_batch_key_is_a_constant():
    constants = {v for k, v in vars(S).items() if k.isupper() and isinstance(v, str)}
    documented = documented_keys()
    assert {"prompt_ids", "response_mask", "score_parts", "value_target"} <= documented
    assert documented <= constants, documented - constants


def test_constants_are_distinct():
    values = [v for k, v in vars(S).items() if k.isupper() and isinstance(v, str)]
    assert len(values) == len(set(values))


def test_a_well_formed_batch_passes():
    td = full_batch()
    S.validate(td, list(td.keys()) + [(S.SCORE_PARTS, "length")], "collector")


@pytest.mark.parametrize("key, value, fragment", [
    (S.RESPONSE_MASK, torch.ones(B, R, dtype=torch.long), "'response_mask' should be 2-d bool"),
    (S.PROMPT_IDS, torch.ones(B, P), "'prompt_ids' should be 2-d int"),
    (S.SCORE, torch.zeros(B, 1), "'score' should be 1-d float"),
    (S.ADVANTAGE, torch.zeros(B, R, dtype=torch.long), "'advantage' should be 2-d float"),
    (S.VALUE, torch.full((B, R), float("nan")), "'value' holds NaN or inf"),
    (S.REWARD, torch.full((B, R), float("inf")), "'reward' holds NaN or inf"),
    (S.REF_LOG_PROB, torch.zeros(B, R + 1), "'ref_log_prob' has shape (3, 6), expected (3, 5)"),
])
def test_bad_entries_name_the_key_and_the_stage(key, value, fragment):
    td = full_batch()
    td.set(key, value)
    with pytest.raises(UserError) as err:
        S.validate(td, [key], where="advantage")
    assert str(err.value).startswith("advantage: ") and fragment in str(err.value)


def test_missing_keys_are_named_nested_ones_too():
    td = full_batch()
    with pytest.raises(UserError, match=r"^rewards: missing key 'score'$"):
        S.validate(td.exclude(S.SCORE), [S.SCORE], "rewards")
    with pytest.raises(UserError, match=r"missing key \('score_parts', 'loop'\)"):
        S.validate(td, [(S.SCORE_PARTS, "loop")], "rewards")


def test_only_the_listed_keys_are_checked():
    td = full_batch()
    td.set(S.VALUE, torch.full((B, R), float("nan")))
    S.validate(td, [S.SCORE, S.RESPONSE_IDS])  # the NaN value is not asked about
    td.set(S.ENGINE_LOG_PROB, torch.zeros(B, R))  # optional key, checked when listed
    S.validate(td, [S.ENGINE_LOG_PROB])
