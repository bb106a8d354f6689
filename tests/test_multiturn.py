"""Multi-turn rollouts (`rlpipe.core.step.multiturn`): token in, token out, two masks, stop reasons,
receipts. A scripted engine (labelled: it replays fixed replies so that tool turns happen; the real
HF collector runs the same loop below) over a byte-level BPE tokenizer with a ChatML template."""

import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlpipe.core.base import schema as S
from rlpipe.core.base.context import RunContext
from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.environment import EnvironmentContract
from rlpipe.core.step.multiturn import RECEIPTS, MultiTurn, Renderer, env_metrics, receipt
from rlpipe.plugins.collectors.hf import HFCollector
from rlpipe.plugins.environments.tools import ToolsEnvironment

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def chatml_tokenizer(template: str = CHATML) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (as GPT-2, Qwen, SmolLM use) trained here on a few lines."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [CALL, "What is 2 + 3? It is 5.", "user assistant tool system", "error: boom"] * 20
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = template
    return tok


class ScriptedEngine:
    """Stand-in engine: returns each row's next scripted reply (+ EOS) and records the token ids it
    was prompted with. The collector attributes core reads are the base `Collector`'s."""

    def __init__(self, tok, replies: list[list[str]], n: int = 1, max_new_tokens: int = 64):
        self.tok, self.replies, self.n, self.max_new_tokens = tok, replies, n, max_new_tokens
        self.pad_id, self.eos_ids, self.device = tok.pad_token_id, [tok.eos_token_id], torch.device("cpu")
        self.prompts, self.turn = [], 0

    def generate(self, rows, prompt_ids, prompt_mask):
        self.prompts.append([list(r) for r in rows])
        outs = []
        for r in rows:
            row = next(i for i, p in enumerate(self.starts) if r[:len(p)] == p)
            said = sum(1 for turn in self.prompts for q in turn if q[:len(self.starts[row])] == self.starts[row])
            ids = self.tok(self.replies[row][said - 1], add_special_tokens=False)["input_ids"]
            outs.append((ids + [self.eos_ids[0]])[:self.max_new_tokens])
        width = max(map(len, outs))
        return {S.RESPONSE_IDS: torch.tensor([o + [self.pad_id] * (width - len(o)) for o in outs]),
                S.RESPONSE_MASK: torch.tensor([[True] * len(o) + [False] * (width - len(o)) for o in outs]),
                S.FINISHED: torch.tensor([o[-1] == self.eos_ids[0] for o in outs]),
                S.ENGINE_LOG_PROB: -torch.ones(len(outs), width)}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def boom(a: int) -> int:
    """Always fails.

    Args:
        a: anything
    """
    raise RuntimeError("boom")


def run(replies, env=lambda: ToolsEnvironment([add, boom]), contract=EnvironmentContract(max_turns=4),
        budget=200, tok=None, prompts=("What is 2 + 3?",), max_new_tokens=64):
    tok = tok or chatml_tokenizer()
    engine = ScriptedEngine(tok, replies, max_new_tokens=max_new_tokens)
    rows = [{"prompt": p} for p in prompts]
    engine.starts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for p in prompts]
    batch = MultiTurn(engine, env, contract, tok, budget).collect(rows)
    return batch, engine, tok


def test_a_tool_turn_keeps_the_sampled_ids_and_the_template_separator():
    batch, engine, tok = run([[CALL, "It is 5."]])
    action, response = batch[S.ACTION_MASK][0], batch[S.RESPONSE_MASK][0]
    ids = batch[S.RESPONSE_IDS][0][response].tolist()
    first = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids[:len(first)] == first and action[:len(first)].all()       # the sampled ids, as is
    n_obs = int((response & ~action).sum())
    observation = tok.decode(ids[len(first):len(first) + n_obs])
    assert observation == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"  # "\n" kept
    # the engine's second prompt is exactly the row built so far
    prompt = batch[S.PROMPT_IDS][0][batch[S.PROMPT_MASK][0]].tolist()
    assert engine.prompts[1][0] == prompt + ids[:len(first) + n_obs]
    assert RECEIPTS[int(batch["env", "receipt"][0])] == "exact"
    assert S.STOP_REASONS[int(batch[S.STOP_REASON][0])] == "done"
    assert batch[S.NUM_TURNS].tolist() == [2] and batch[S.FINISHED].tolist() == [True]
    assert batch[S.RESPONSE_TEXT][0] == "It is 5."
    assert (batch[S.ENGINE_LOG_PROB][0][~action] == 0).all()
    assert set(batch[S.TURN_ID][0][response].tolist()) == {0, 1}
    metrics = env_metrics(batch)
    assert metrics["env/tool_calls"] == 1 and metrics["env/receipt/exact"] == 1.0
    assert 0 < metrics["env/obs_token_frac"] < 1


def test_a_tool_that_raises_comes_back_as_a_message_and_is_counted():
    batch, _, _ = run([['<tool_call>{"name": "boom", "arguments": {"a": 1}}</tool_call>', "Sorry."]])
    tool = [m for m in batch[S.CONVERSATION][0] if m["role"] == "tool"]
    assert tool[0]["content"].startswith("error:") and "boom" in tool[0]["content"]
    assert int(batch["env", "tool_errors"][0]) == 1
    assert S.STOP_REASONS[int(batch[S.STOP_REASON][0])] == "done"


def test_a_malformed_call_is_an_error_message_not_a_crash():
    batch, _, _ = run([['<tool_call>{"name": "add", "arguments": {a: 2}</tool_call>', "Hm."]])
    tool = [m for m in batch[S.CONVERSATION][0] if m["role"] == "tool"]
    assert tool and tool[0]["content"].startswith("error:")


def test_max_turns_and_the_row_budget_stop_with_their_own_reasons():
    batch, _, _ = run([[CALL] * 5], contract=EnvironmentContract(max_turns=2))
    assert S.STOP_REASONS[int(batch[S.STOP_REASON][0])] == "max_turns"
    assert batch[S.NUM_TURNS].tolist() == [2]
    batch, _, _ = run([[CALL] * 5], budget=40)
    assert S.STOP_REASONS[int(batch[S.STOP_REASON][0])] == "length"
    assert int(batch[S.RESPONSE_MASK].sum()) <= 40
    batch, _, _ = run([[CALL] * 5], max_new_tokens=5)   # one turn's budget, not the row's
    assert S.STOP_REASONS[int(batch[S.STOP_REASON][0])] == "turn_length"
    assert batch[S.NUM_TURNS].tolist() == [1] and int(batch[S.RESPONSE_MASK].sum()) == 5


class Hangs:
    def reset(self, row, seed):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        time.sleep(5)
        return [], 0.0, True, {}


class Raises(Hangs):
    def step(self, action):
        raise ValueError("the environment broke")


def test_an_environment_that_hangs_or_raises_ends_its_row_not_the_run():
    start = time.perf_counter()
    batch, _, _ = run([[CALL]], env=Hangs, contract=EnvironmentContract(max_turns=3, timeout_s=0.3))
    assert S.STOP_REASONS[int(batch[S.STOP_REASON][0])] == "timeout"
    assert time.perf_counter() - start < 4.5   # cut at the timeout, not after the 5 s sleep
    batch, _, _ = run([[CALL]], env=Raises)
    assert S.STOP_REASONS[int(batch[S.STOP_REASON][0])] == "tool_error"


def sleeps(s: float) -> str:
    """Sleeps.

    Args:
        s: seconds
    """
    time.sleep(s)
    return "awake"


def test_a_hung_tool_comes_back_to_the_model_and_the_conversation_goes_on():
    """The tools environment cuts a tool at its timeout_s and declares core's limit on the whole
    step a grace above it: the model reads the timeout and answers (was: the row ended)."""
    env = lambda: ToolsEnvironment([sleeps], timeout_s=0.3)  # noqa: E731
    call = '<tool_call>{"name": "sleeps", "arguments": {"s": 5}}</tool_call>'
    batch, _, _ = run([[call, "It timed out."]], env=env, contract=ToolsEnvironment.contract(
        [sleeps], timeout_s=0.3))
    tool = [m for m in batch[S.CONVERSATION][0] if m["role"] == "tool"]
    assert tool[0]["content"] == "error: timed out after 0.3 s"
    assert S.STOP_REASONS[int(batch[S.STOP_REASON][0])] == "done"
    assert int(batch["env", "timeouts"][0]) == 1 and batch[S.NUM_TURNS].tolist() == [2]


def flood(n: int) -> str:
    """Says a lot.

    Args:
        n: how many words
    """
    return " ".join(f"word{i}" for i in range(n))


@pytest.mark.parametrize("cap", [7, None])
def test_a_long_tool_answer_is_cut_in_the_runs_tokens_with_a_marker(cap):
    """The tools environment declares ``max_output_tokens``; core cuts each answer in the run's
    tokenizer's tokens (the environment has none), with a marker that says how many went."""
    call = '<tool_call>{"name": "flood", "arguments": {"n": 200}}</tool_call>'
    env = lambda: ToolsEnvironment([flood], max_output_tokens=cap)  # noqa: E731
    batch, _, tok = run([[call, "Done."]], env=env,
                        contract=ToolsEnvironment.contract([flood], max_output_tokens=cap))
    content = [m for m in batch[S.CONVERSATION][0] if m["role"] == "tool"][0]["content"]
    full = tok(flood(200), add_special_tokens=False)["input_ids"]
    if cap is None:
        assert content == flood(200)
        return
    assert content == f"{tok.decode(full[:cap])}\n[... {len(full) - cap} more tokens cut]"
    assert S.STOP_REASONS[int(batch[S.STOP_REASON][0])] == "done"


def test_a_cap_that_is_no_count_is_one_line():
    with pytest.raises(UserError, match="max_observation_tokens must be an integer >= 1 or null, got 0"):
        ToolsEnvironment.contract([flood], max_output_tokens=0)


class Silent(Hangs):
    def reset(self, row, seed):
        return []


def test_an_environment_without_messages_is_one_line():
    with pytest.raises(UserError, match="no messages"):
        run([[CALL]], env=Silent)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    strips = ("{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and "
              "not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
              "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(UserError, match="rewrites earlier turns"):
        run([[CALL]], tok=chatml_tokenizer(strips))


def test_the_hf_collector_runs_turns_as_a_shrinking_batch(ctx):
    """The real engine (HF generate on the tiny model): masks and budgets hold whatever it samples."""
    class Echo(Hangs):
        def step(self, action):
            return [{"role": "user", "content": "the cat"}], 0.5, False, {}

    collector = HFCollector(ctx, max_new_tokens=6, n=2)
    mt = MultiTurn(collector, Echo, EnvironmentContract(max_turns=3), ctx.tokenizer, 40)
    batch = mt.collect([{"prompt": "the cat sat"}, {"prompt": "a dog ran"}])
    action, response = batch[S.ACTION_MASK], batch[S.RESPONSE_MASK]
    assert batch.batch_size[0] == 4 and (action <= response).all()
    assert (batch[S.ENGINE_LOG_PROB][~action] == 0).all()
    assert (batch[S.ENGINE_LOG_PROB][action] < 0).all()
    assert (response.sum(-1) <= 40).all() and (batch[S.NUM_TURNS] >= 1).all()
    assert batch[S.GROUP_ID].tolist() == [0, 0, 1, 1]


def test_a_receipt_walks_the_row_past_worked_examples_in_the_prompt():
    """Worked conversations in the prompt hold assistant messages too (the tool_lookup example):
    the receipt pairs the row's actions with the rendering in order, not with the first
    assistant messages of the conversation (that paired them with the examples: 100% boundary
    drift on SmolLM2)."""
    tok = chatml_tokenizer()
    render = Renderer(tok)
    shot = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": CALL},
            {"role": "tool", "content": "5"}, {"role": "assistant", "content": "It is 5."}]
    messages = shot + shot
    prompt = render(messages[:5], True)
    obs = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    row = [("text", prompt), ("action", CALL, True, True), ("text", obs),
           ("action", "It is 5.", True, True)]
    assert receipt(render, messages, row, "<|im_end|>") == "exact"
    dropped = [row[0], row[1], ("text", obs.lstrip("\n")), row[3]]   # the separator lost
    assert receipt(render, messages, dropped, "<|im_end|>") == "boundary_drift"
    assert receipt(render, messages, row[:3] + [("action", "It is 5.", True, False)],
                   "<|im_end|>") == "assistant_drift"
