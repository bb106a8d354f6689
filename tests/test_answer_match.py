"""plugins/rewards/answer_match.py: each extraction rule on crafted responses, normalisation,
the module against ("data", column), and its argument checks."""

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlpipe.core.contracts import registry
from rlpipe.core.contracts.kinds import reward_contract
from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.plugins.rewards.answer_match import (AnswerMatch, answer_scores, answers_match,
                                                 extract_answer)


@pytest.mark.parametrize("text, rule, expected", [
    ("so \\boxed{42}", "boxed", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{3}{4}}", "boxed", "\\frac{3}{4}"),  # last, nested
    ("unclosed \\boxed{7", "boxed", None),
    ("no box, 5", "boxed", None),
    ("work\n#### 1,234\nthanks", "hash", "1,234"),  # the rest of the line only
    ("#### 1 then #### 2", "hash", "2"),
    ("####   ", "hash", None),
    ("I had 3 apples and -2.5 pears", "number", "-2.5"),
    ("total 1,250,000.75 dollars.", "number", "1,250,000.75"),
    ("value .5 and 1e3", "number", "1e3"),
    ("nothing here", "number", None),
    ("\\boxed{9} but #### 8 and 7", "auto", "9"),  # boxed first
    ("#### 8 and 7", "auto", "8 and 7"),            # then hash
    ("just 7 and 8", "auto", "8"),                  # then the last number
])
def test_each_extraction_rule(text, rule, expected):
    assert extract_answer(text, rule) == expected


def test_regex_takes_the_last_match_and_its_first_group():
    assert extract_answer("Answer: 3. Answer: 4.", "regex", r"Answer: (\d+)") == "4"
    assert extract_answer("x=1 y=22", "regex", r"\d+") == "22"  # no group: the whole match
    assert extract_answer("none", "regex", r"Answer: (\d+)") is None


@pytest.mark.parametrize("predicted, reference, expected", [
    ("42", 42, True), ("42.0", "42", True), ("1,000", 1000, True), ("$5", "5", True),
    ("50%", 50, True), ("3/4", 0.75, True), ("-7", -7, True), ("7.", 7, True),
    ("41", 42, False), ("0.3333333", 1 / 3, True), ("0.33", 1 / 3, False),
    ("7 apples", 7, True), ("x = 12", "#### 12", True),
    (" Paris ", "paris", True), ("New  York", "new york", True), ("Lyon", "Paris", False),
    ("1e3", 1000.0, True), ("1/0", "inf", False),
])
def test_normalised_comparison(predicted, reference, expected):
    assert answers_match(predicted, reference) is expected


def test_tolerance_is_relative_beyond_one():
    assert answers_match("1000000.5", 1_000_000, tolerance=1e-6)
    assert not answers_match("1000002", 1_000_000, tolerance=1e-6)
    assert answers_match("0.1000001", 0.1, tolerance=1e-6)  # absolute below 1
    assert not answers_match("0.101", 0.1, tolerance=1e-6)


def test_scores_and_format_reward():
    responses = ["#### 7", "#### 6", "no number at all", "\\boxed{7}"]
    assert answer_scores(responses, [7, 7, 7, "7"]) == [1.0, 0.0, 0.0, 1.0]
    assert answer_scores(responses, [7, 7, 7, 7], format_reward=0.2) == [1.0, 0.2, 0.0, 1.0]


def test_module_reads_the_named_column_and_declares_it():
    td = TensorDict({(S.DATA, "solution"): torch.tensor([4, 5, 6])}, batch_size=[3])
    td[S.RESPONSE_TEXT] = NonTensorStack("it is 4", "\\boxed{5}", "maybe 7")
    reward = AnswerMatch(column="solution", format_reward=0.1)
    assert reward(td).tolist() == pytest.approx([1.0, 1.0, 0.1])
    assert reward_contract(reward).columns == ("solution",)
    strings = TensorDict({}, batch_size=[2])
    strings[S.DATA, "answer"] = NonTensorStack("Paris", "#### 12")
    strings[S.RESPONSE_TEXT] = NonTensorStack("ANSWER: paris", "ANSWER: 12")
    regex = AnswerMatch(pattern=r"ANSWER: (\w+)")
    assert regex.extract == "regex" and regex(strings).tolist() == [1.0, 1.0]


def test_registered_as_a_builtin_and_bad_arguments_are_one_line():
    assert registry.load("rewards", "answer_match") is AnswerMatch
    with pytest.raises(UserError, match="needs a pattern"):
        AnswerMatch(extract="regex")
    with pytest.raises(UserError, match="pattern is for extract: regex"):
        AnswerMatch(extract="boxed", pattern="x")
    with pytest.raises(UserError, match="not a regular expression"):
        AnswerMatch(pattern="(")
    with pytest.raises(UserError, match="tolerance must be >= 0"):
        AnswerMatch(tolerance=-1.0)
