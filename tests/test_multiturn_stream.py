"""Streamed multi-turn rollouts (`MultiTurn` over a collector whose contract ``streams``): each row
at its own turn, through the collector's ``converse``. Here a stand-in engine (`Streams`) samples
one request at a time in an order of its choosing (rows at different turns interleave, unlike the
turn-batched loop) and hands each to ``on_done`` in a pool of threads, so core's part is covered
where vLLM is absent; tests/test_vllm_collector.py runs the real engine."""

from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import pytest
import torch

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.core.contracts.environment import EnvironmentContract
from rlpipe.core.contracts.registry import PluginError
from rlpipe.core.step.journal import Journal, read
from rlpipe.core.step.multiturn import MultiTurn, env_metrics
from rlpipe.core.step.tool_lift import without_tools
from rlpipe.plugins.collectors.hf import HFCollector
from rlpipe.plugins.collectors.vllm import VLLMCollector
from rlpipe.plugins.environments.tools import ToolsEnvironment
from tests.test_multiturn import CALL, Hangs, ScriptedEngine, add, boom, chatml_tokenizer

PROMPTS = ("What is 2 + 3?", "2 + 3?", "What is it?", "It is 5.")
BOOM = '<tool_call>{"name": "boom", "arguments": {"a": 1}}</tool_call>'
REPLIES = [[CALL, "It is 5."], [CALL, CALL, CALL, CALL], [BOOM, "Sorry."], ["It is 5."]]
SAME = (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK, S.ACTION_MASK, S.TURN_ID,
        S.ENGINE_LOG_PROB, S.TURN_REWARD, S.NUM_TURNS, S.STOP_REASON, S.GROUP_ID, S.FINISHED)


class Streams:
    """A stand-in streaming engine over ``inner.generate``: it samples one waiting request at a
    time, the one ``order`` picks, and runs ``on_done`` in a pool of ``workers`` threads; a
    returned request waits again. ``order`` 0: the oldest (rows overlap in the pool); -1: the
    newest, each ``on_done`` awaited (each row runs to its end before the next starts, the last
    row first). ``seeded``: torch's RNG seeded from each request's seed. Records each request's
    (turn, seed)."""

    def __init__(self, inner, order: int = -1, workers: int = 3, seeded: bool = False):
        self.inner, self.order, self.workers, self.seeded, self.seeds = inner, order, workers, seeded, []

    def __getattr__(self, name):     # n, max_new_tokens, pad_id, eos_ids, device, generate
        return getattr(self.inner, name)

    def converse(self, requests, on_done):
        waiting, running = list(requests), set()
        with ThreadPoolExecutor(self.workers) as pool:
            while waiting or running:
                for future in [f for f in running if f.done()]:
                    running.discard(future)
                    if (request := future.result()) is not None:
                        waiting.append(request)
                if waiting:
                    key, ids, cap, seed = waiting.pop(self.order)
                    self.seeds.append((key[1], seed))
                    running.add(pool.submit(on_done, key, *self.sample(ids, cap, seed)))
                    if self.order == -1:
                        wait(running)
                elif running:
                    wait(running, return_when=FIRST_COMPLETED)

    def sample(self, ids, cap, seed):
        if self.seeded:
            torch.manual_seed(seed)
        saved, (self.inner.n, self.inner.max_new_tokens) = (self.inner.n, self.inner.max_new_tokens), (1, cap)
        try:
            out = self.inner.generate([ids], torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))
        finally:
            self.inner.n, self.inner.max_new_tokens = saved
        mask = out[S.RESPONSE_MASK][0].bool()
        return (out[S.RESPONSE_IDS][0][mask].tolist(), out[S.ENGINE_LOG_PROB][0][mask].tolist(),
                bool(out[S.FINISHED][0]))


def scripted(tok, max_new_tokens=64):
    engine = ScriptedEngine(tok, REPLIES, max_new_tokens=max_new_tokens)
    engine.starts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for p in PROMPTS]
    return engine


def both(env, contract, budget=200, max_new_tokens=64, **streams):
    """The same conversations turn-batched and streamed: (batched, streamed, stand-in engine)."""
    tok, rows = chatml_tokenizer(), [{"prompt": p} for p in PROMPTS]
    batched = MultiTurn(scripted(tok, max_new_tokens), env, contract, tok, budget).collect(rows, 7)
    engine = Streams(scripted(tok, max_new_tokens), **streams)
    return batched, MultiTurn(engine, env, contract, tok, budget, streams=True).collect(rows, 7), engine


def assert_same(a, b):
    for key in SAME:
        assert torch.equal(a[key], b[key]), key
    for key in ("tool_calls", "tool_errors", "timeouts", "receipt"):
        assert torch.equal(a[S.ENV, key], b[S.ENV, key]), key
    assert a[S.CONVERSATION] == b[S.CONVERSATION] and a[S.ENV, "error"] == b[S.ENV, "error"]
    assert a[S.RESPONSE_TEXT] == b[S.RESPONSE_TEXT] and env_metrics(a) == env_metrics(b)


@pytest.mark.parametrize("order", [0, -1])
def test_streamed_rows_equal_the_turn_batched_rows(order):
    """Tool calls, a failing tool, the row budget, max_turns and a one-turn answer: every row, its
    masks, receipts, stop reasons and metrics are the turn-batched loop's, in either order."""
    env = lambda: ToolsEnvironment([add, boom])  # noqa: E731
    batched, streamed, engine = both(env, EnvironmentContract(max_turns=3), order=order)
    assert_same(batched, streamed)
    stops = [S.STOP_REASONS[int(i)] for i in streamed[S.STOP_REASON]]
    assert stops == ["done", "max_turns", "done", "done"]
    assert int(streamed[S.ENV, "tool_errors"][2]) == 1
    turns = [turn for turn, _ in engine.seeds]
    assert sorted(turns) == sorted(t for n in streamed[S.NUM_TURNS].tolist() for t in range(n))
    if order == -1:    # each row to its end, the last first: rows at different turns
        assert turns == [0, 0, 1, 0, 1, 2, 0, 1]


@pytest.mark.parametrize("budget, max_new_tokens, stop", [(40, 64, "length"), (200, 5, "turn_length")])
def test_the_budgets_stop_streamed_rows_as_they_stop_batched_ones(budget, max_new_tokens, stop):
    env = lambda: ToolsEnvironment([add, boom])  # noqa: E731
    batched, streamed, _ = both(env, EnvironmentContract(max_turns=4), budget, max_new_tokens)
    assert_same(batched, streamed)
    assert stop in [S.STOP_REASONS[int(i)] for i in streamed[S.STOP_REASON]]


def test_each_request_has_its_own_seed_whatever_the_order():
    """A request's seed depends on its row's seed and its turn only: distinct within a step and
    the same whichever row finishes first."""
    env = lambda: ToolsEnvironment([add, boom])  # noqa: E731
    _, _, first = both(env, EnvironmentContract(max_turns=3), order=0)
    _, _, last = both(env, EnvironmentContract(max_turns=3), order=-1)
    assert sorted(first.seeds) == sorted(last.seeds)
    assert len({seed for _, seed in first.seeds}) == len(first.seeds)
    assert sorted(seed for turn, seed in first.seeds if turn == 0) == [(7 + k) * 4099 for k in range(4)]


def test_sampled_rows_do_not_depend_on_the_order_on_a_seeded_engine(ctx):
    """The HF collector at temperature 1 behind the stand-in, seeded per request: the same batch
    whichever order the rows run in (what vLLM's per-request seeds give)."""
    class Echo(Hangs):
        def step(self, action):
            return [{"role": "user", "content": "the cat"}], 0.5, False, {}

    rows = [{"prompt": "the cat sat"}, {"prompt": "a dog ran"}]
    batches = []
    for order in (0, -1):
        engine = Streams(HFCollector(ctx, max_new_tokens=4, n=2), order=order, seeded=True)
        batches.append(MultiTurn(engine, Echo, EnvironmentContract(max_turns=3), ctx.tokenizer, 40,
                                 streams=True).collect(rows, 3))
    assert_same(*batches)
    assert (batches[0][S.ENGINE_LOG_PROB][batches[0][S.ACTION_MASK]] < 0).all()


def test_a_hung_step_times_out_its_own_row_only():
    class SlowFirst(Hangs):
        def reset(self, row, seed):
            self.slow = row["prompt"] == PROMPTS[0]
            return super().reset(row, seed)

        def step(self, action):
            if self.slow:
                return super().step(action)    # 5 s, cut at 0.3 s
            return [], 1.0, True, {}

    batched, streamed, _ = both(SlowFirst, EnvironmentContract(max_turns=2, timeout_s=0.3))
    assert_same(batched, streamed)
    assert [S.STOP_REASONS[int(i)] for i in streamed[S.STOP_REASON]] == ["timeout"] + ["done"] * 3


def test_an_environment_that_breaks_its_contract_is_one_line():
    class Garbage(Hangs):
        def step(self, action):
            return "no tuple"

    with pytest.raises(UserError, match=r"must return \(messages, reward, done, info\)"):
        both(Garbage, EnvironmentContract(max_turns=2))


def test_the_journal_holds_the_same_calls_and_a_streamed_step_replays_them(tmp_path):
    tok, rows = chatml_tokenizer(), [{"prompt": p} for p in PROMPTS]
    env = lambda: ToolsEnvironment([add, boom])  # noqa: E731
    entries, batches = [], []
    for folder, streams in ((tmp_path / "a", False), (tmp_path / "b", True), (tmp_path / "b", True)):
        engine = Streams(scripted(tok)) if streams else scripted(tok)
        turns = MultiTurn(engine, env, EnvironmentContract(max_turns=3), tok, 200, streams=streams)
        turns.journal = Journal(folder)
        batches.append(turns.collect(rows, 7, step=1))
        turns.close()
        entries.append({key: {k: e[k] for k in ("method", "args", "status", "result")}
                        for key, e in read(turns.journal.path(1)).items()})
        counts = turns.journal.counts
    assert entries[0] == entries[1] == entries[2] and len(entries[0]) == 4 + 8   # resets + steps
    assert counts == {"replayed": 12, "diverged": 0}     # the third run: all replayed
    assert_same(batches[0], batches[1])
    assert_same(batches[0], batches[2])


def test_the_contract_says_who_streams_and_a_false_claim_is_one_line(ctx):
    assert VLLMCollector.contract().streams and not HFCollector.contract().streams
    tok = chatml_tokenizer()
    turns = MultiTurn(Streams(scripted(tok)), Hangs, EnvironmentContract(), tok, 64, streams=True)
    assert without_tools(turns).streams
    with pytest.raises(PluginError, match="declares streams but has no converse"):
        MultiTurn(scripted(tok), Hangs, EnvironmentContract(), tok, 64, "env", streams=True)
