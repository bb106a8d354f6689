"""Reward functions written for TRL and for verl run unchanged: the convention is read from the
signature when the function is loaded (before any model), and a function that fits none is one
line naming the accepted signatures."""

import json
import re
import textwrap

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.contracts.reward_fn import describe_reward, wrap_reward_function
from rlpipe.core.step.rewards import RewardComposer
from tests.test_trainer import tiny


# --- written for TRL (GRPOTrainer's reward_funcs), unchanged -----------------------------------
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def accuracy_reward(completions, ground_truth, **kwargs):
    return [1.0 if c.strip() == gt else 0.0 for c, gt in zip(completions, ground_truth)]


def token_count(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


# --- written for verl (custom_reward_function), unchanged --------------------------------------
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    match = re.search(r"#### (\-?[0-9\.\,]+)", solution_str)
    answer = match.group(1).replace(",", "") if match else None
    return {"score": 1.0 if answer == ground_truth else 0.0, "acc": answer == ground_truth}


def batch(responses, columns=None, messages=None):
    n = len(responses)
    ids = torch.tensor([[5, 6, 2], [7, 2, 0]][:n])
    td = TensorDict({S.PROMPT_TEXT: NonTensorStack(*["q"] * n),
                     S.RESPONSE_TEXT: NonTensorStack(*responses),
                     S.RESPONSE_IDS: ids, S.RESPONSE_MASK: ids != 0}, batch_size=[n])
    for name, values in (columns or {}).items():
        td.set((S.DATA, name), NonTensorStack(*values))
    if messages is not None:
        td.set(S.PROMPT_MESSAGES, NonTensorStack(*messages))
    return td


def test_trl_functions_get_trl_keywords():
    assert wrap_reward_function(reward_len)()(batch(["a" * 18, "b" * 25])).tolist() == [-2.0, -5.0]
    assert wrap_reward_function(token_count)()(batch(["x", "y"])).tolist() == [3.0, 2.0]
    Accuracy = wrap_reward_function(accuracy_reward)
    assert Accuracy.columns == ("ground_truth",)
    got = Accuracy()(batch([" 4", "5"], {"ground_truth": ["4", "4"]}))
    assert got.tolist() == [1.0, 0.0]


def test_trl_conversational_completions_are_message_lists():
    chat = [[{"role": "user", "content": "q"}]] * 2
    td = batch(["<think>x</think><answer>4</answer>", "4"], messages=chat)
    assert wrap_reward_function(format_reward_func)()(td).tolist() == [1.0, 0.0]


def test_verl_compute_score_runs_per_sample():
    Score = wrap_reward_function(compute_score)
    td = batch(["so #### 42", "#### 41"], {"ground_truth": ["42", "42"],
                                           "data_source": ["gsm8k", "gsm8k"]})
    assert Score()(td)["score"].tolist() == [1.0, 0.0]
    # verl's parquet layout: ground_truth inside the reward_model column
    td = batch(["#### 7", "#### 8"], {"reward_model": [{"ground_truth": "8"}] * 2})
    assert Score()(td)["score"].tolist() == [0.0, 1.0]
    with pytest.raises(UserError, match="needs a dataset column ground_truth"):
        Score()(batch(["#### 7"]))
    # the composer takes the dicts' score (their acc: test_verl_dicts_keep_score_...)


def test_a_function_of_no_convention_is_one_line_at_load(tmp_path):
    file = tmp_path / "r.py"
    file.write_text("def score(text):\n    return [0.0]\n")
    with pytest.raises(UserError, match=r"^reward function score\(text\) fits no accepted "
                                        r"signature: f\(prompts, responses, \*\*batch\) \(rlpipe\), "
                                        r"f\(completions, \*\*kwargs\) .* \(verl\)$"):
        tiny(tmp_path, f"rewards=[{{path: {file}, function: score}}]")


def test_peer_functions_run_unchanged_in_a_real_step(tmp_path):
    """A TRL and a verl function from a Python file, through load_config and one PPO step of the
    tiny example on a dataset with a ground_truth column."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"the cat {i}", "ground_truth": "4",
                                        "data_source": "toy"}) + "\n" for i in range(8)))
    file = tmp_path / "peers.py"
    file.write_text(textwrap.dedent('''
        import re

        def reward_len(completions, **kwargs):
            return [-abs(20 - len(completion)) for completion in completions]

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(ground_truth in solution_str)
    '''))
    cfg = tiny(tmp_path / "run", f"data.prompts={data}", "data.batch_size=4", "run.steps=1",
               f"rewards=[{{path: {file}, function: reward_len}}, "
               f"{{path: {file}, function: compute_score}}]")
    pipe = Pipeline(cfg, progress=False)
    td, metrics = pipe.step()
    expected = [-abs(20 - len(r)) for r in td[S.RESPONSE_TEXT]]
    assert td[S.SCORE_PARTS, "reward_len"].tolist() == expected
    assert td[S.SCORE_PARTS, "compute_score"].tolist() == [float("4" in r) for r in td[S.RESPONSE_TEXT]]


# --- what the run says, columns into parameters, near misses (issue 52) -------------------------
def composed(*components, td):
    """The composer's score and parts for ``(label, weight, function or module)`` components."""
    parts = [(label, w, f if isinstance(f, torch.nn.Module) else wrap_reward_function(f)())
             for label, w, f in components]
    return RewardComposer(parts)(td)


def test_one_line_per_reward_names_its_convention_and_columns():
    lines = [describe_reward("len", wrap_reward_function(reward_len)()),
             describe_reward("acc", wrap_reward_function(accuracy_reward)()),
             describe_reward("verl", wrap_reward_function(compute_score)()),
             describe_reward("verl", wrap_reward_function(compute_score)(
                 columns={"ground_truth": "answer"}))]
    assert lines == [
        "reward 'len': reward_len, TRL's f(completions, **kwargs); reads no column",
        "reward 'acc': accuracy_reward, TRL's f(completions, **kwargs); reads columns ground_truth",
        "reward 'verl': compute_score, verl's compute_score(data_source, solution_str, "
        "ground_truth, extra_info); reads columns reward_model.ground_truth",
        "reward 'verl': compute_score, verl's compute_score(data_source, solution_str, "
        "ground_truth, extra_info); reads columns answer (as ground_truth)"]


def answer_aligned(prompts, responses, answer=None, **batch):
    """The issue's plugin: ``answer`` is the column (a list) or a config value (one string)."""
    answers = answer if isinstance(answer, list) else [answer] * len(responses)
    return [float(r.strip() == str(a)) for r, a in zip(responses, answers)]


def test_a_setting_named_like_a_column_receives_the_column_unless_the_config_sets_it():
    td = batch(["4", "5"], {"answer": ["4", "4"]})
    assert wrap_reward_function(answer_aligned)()(td).tolist() == [1.0, 0.0]
    reward = wrap_reward_function(answer_aligned)(answer="5")
    with pytest.warns(UserWarning, match=r"^reward function answer_aligned: the config sets "
                                         r"answer='5', so the data column 'answer' does not reach "
                                         r"it \(the config wins\)$") as said:
        assert reward(td).tolist() == [0.0, 1.0]
        assert reward(td).tolist() == [0.0, 1.0]
    assert len(said) == 1  # one line, not one per step


def test_columns_points_a_parameter_at_a_column_of_another_name():
    Score = wrap_reward_function(compute_score)
    assert Score.columns == ("reward_model.ground_truth",)  # verl's layout, checked before models
    score = Score(columns={"ground_truth": "answer"})
    assert score.columns == ("answer",)
    td = batch(["#### 4", "#### 5"], {"answer": ["4", "4"]})
    assert score(td)["score"].tolist() == [1.0, 0.0]
    Acc = wrap_reward_function(accuracy_reward)
    assert Acc(columns={"ground_truth": "answer"})(td.clone()).tolist() == [0.0, 0.0]
    with pytest.raises(UserError, match=r"^reward function answer_aligned: the config sets answer "
                                        r"and columns maps it to the column 'solution'; keep one$"):
        wrap_reward_function(answer_aligned)(answer="4", columns={"answer": "solution"})
    with pytest.raises(UserError, match=r"^reward function compute_score: columns maps "
                                        r"solution_str, which is not a parameter it reads a "
                                        r"column into; parameters: data_source, ground_truth, "
                                        r"extra_info$"):
        Score(columns={"solution_str": "answer"})
    with pytest.raises(UserError, match=r"columns maps ground_truth to the column 'answer', which "
                                        r"the data does not have; columns: none$"):
        Score(columns={"ground_truth": "answer"})(batch(["#### 4"]))
    with pytest.raises(UserError, match=r"columns maps parameters to column names"):
        Score(columns="answer")


def test_verl_dicts_keep_score_and_log_the_other_numeric_keys():
    td = batch(["so #### 42", "#### 41"], {"ground_truth": ["42", "42"]})
    td = composed(("math", 2.0, compute_score), td=td)
    assert td[S.SCORE].tolist() == [2.0, 0.0]
    assert td[S.SCORE_PARTS, "math"].tolist() == [1.0, 0.0]
    assert td[S.SCORE_PARTS, "math/acc"].tolist() == [1.0, 0.0]  # metric reward/math/acc

    def mixed(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "acc": 1.0} if "42" in solution_str else {"score": 0.0}
    with pytest.raises(UserError, match=r"^reward function mixed returned dicts with different "
                                        r"numeric keys: acc before sample 1, none there$"):
        wrap_reward_function(mixed)()(batch(["42", "41"], {"ground_truth": ["42", "42"]}))


def sometimes(completions, **kwargs):
    """TRL's "not applicable": None for completions without a digit."""
    return [float(c.count("4")) if any(ch.isdigit() for ch in c) else None for c in completions]


def test_none_is_not_applicable_as_trl_sums_with_nansum():
    responses = ["44", "xyz"]
    td = composed(("some", 0.5, sometimes), ("len", 2.0, reward_len), td=batch(responses))
    # oracle: TRL's (rewards_per_func * weights).nansum(dim=1), a None being NaN, in float64
    rows = [[sometimes([r])[0], reward_len([r])[0]] for r in responses]
    expected = [sum(w * v for w, v in zip((0.5, 2.0), row) if v is not None) for row in rows]
    assert td[S.SCORE].tolist() == expected == [-35.0, -34.0]
    assert td[S.SCORE_PARTS, "some"].tolist() == [2.0, 0.0]
    assert td[S.SCORE_PARTS, "some/applies"].tolist() == [1.0, 0.0]
    with pytest.raises(UserError, match=r"^sample 1: every reward returned None \(not applicable\) "
                                        r"for it \(some\); at least one must score each sample$"):
        composed(("some", 1.0, sometimes), td=batch(responses))


@pytest.mark.parametrize("out, said", [
    ({0: 1.0, 1: 0.0}, r"returned a dict; expected a list of 2 numbers, one per sample"),
    ("11", r"returned a str; expected a list of 2 numbers, one per sample"),
    ([1.0], r"returned 1 values for 2 samples; expected one number per sample"),
    (["1", "0"], r"returned '1' for sample 0; expected a number \(None: not applicable\)"),
])
def test_anything_but_one_number_per_sample_is_one_line(out, said):
    def bad(prompts, responses, **batch):
        return out
    with pytest.raises(UserError, match=f"^reward function bad {said}"):
        wrap_reward_function(bad)()(batch(["a", "b"]))


def test_nan_is_refused_not_skipped():
    def nan(completions, **kwargs):
        return [float("nan"), 1.0]
    with pytest.raises(UserError, match=r"^reward 'nan' returned NaN or inf for 1 of 2 samples"):
        composed(("nan", 1.0, nan), td=batch(["a", "b"]))
