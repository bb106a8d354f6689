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
from rlpipe.core.contracts.reward_fn import wrap_reward_function
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
    assert Score()(td).tolist() == [1.0, 0.0]
    # verl's parquet layout: ground_truth inside the reward_model column
    td = batch(["#### 7", "#### 8"], {"reward_model": [{"ground_truth": "8"}] * 2})
    assert Score()(td).tolist() == [0.0, 1.0]
    with pytest.raises(UserError, match="needs a dataset column ground_truth"):
        Score()(batch(["#### 7"]))


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
