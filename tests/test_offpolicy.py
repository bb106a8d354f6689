"""One-step off-policy rollouts (``rollout.staleness: 1``, `rlpipe.core.run.offpolicy`) on the
tiny example: the config rules, the loop's order, importance weights against the policies that
sampled and that train, checkpoint and resume, and a collector that samples in a thread."""

import copy
import dataclasses
import functools
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError
from rlpipe.core.config.settings import load_config
from rlpipe.core.models.lm import response_logprobs
from rlpipe.core.run import checkpoint
from rlpipe.core.run.callbacks import Callback
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.plugins.collectors.hf import HFCollector

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
STALE = ["rollout.staleness=1", "rollout_correction.mode=tis"]
_INPUTS = (S.PROMPT_IDS, S.PROMPT_MASK, S.RESPONSE_IDS, S.RESPONSE_MASK)


def tiny(run_dir, *overrides):
    return load_config(TINY, [f"run.output_dir={run_dir}", "run.steps=3", *overrides])


def rows(run_dir) -> list[dict]:
    """metrics.jsonl without wall-clock entries."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "perf/"))}
            for x in lines]


class Record(Callback):
    """Each step's batch, and the actor's weights after each step (step 0: before any)."""

    def __init__(self):
        self.batches, self.weights = {}, {}

    def on_step_end(self, pipe, batch, metrics):
        step = metrics["step"]
        self.weights[step] = copy.deepcopy(pipe.models.actor.state_dict())
        if batch is not None:
            self.batches[step] = batch.clone()


def logprobs_at(pipe, weights, batch) -> torch.Tensor:
    """The trainer's log-probs of ``batch``'s responses under the actor with ``weights``."""
    model = copy.deepcopy(pipe.models.actor)
    model.load_state_dict(weights)
    with torch.no_grad():
        return response_logprobs(model, *[batch[k] for k in _INPUTS], pipe.temperature)[0]


@pytest.mark.parametrize("overrides, fragment", [
    (["rollout.staleness=1"], "rollout_correction.mode: none leaves that uncorrected"),
    ([*STALE, "rollout_correction.old_log_prob=sampling"], "old_log_prob: sampling"),
    ([*STALE, "data.dynamic_sampling.enabled=true"], "data.dynamic_sampling collects again"),
    (["rollout.staleness=2"], "rollout.staleness"),
])
def test_staleness_settings_that_are_refused(overrides, fragment, tmp_path):
    with pytest.raises(UserError, match=fragment):
        tiny(tmp_path, *overrides)


def test_uncorrected_staleness_is_accepted_when_acknowledged(tmp_path):
    cfg = tiny(tmp_path, "rollout.staleness=1", "rollout.accept_uncorrected=true")
    assert cfg.rollout.staleness == 1 and cfg.rollout_correction.mode == "none"
    for mode in ("tis", "mis", "bypass"):
        assert tiny(tmp_path, "rollout.staleness=1", f"rollout_correction.mode={mode}")


def order_of_calls(pipe) -> list[str]:
    """Record the collector's collect and sync_weights and the update, in call order."""
    events, collector, updater = [], pipe.plugins.collector, pipe.updater
    for owner, name, tag in ((collector, "collect", "collect"), (collector, "sync_weights", "sync"),
                             (updater, "update", "update")):
        def wrapped(*args, _f=getattr(owner, name), _tag=tag, **kwargs):
            events.append(_tag)
            return _f(*args, **kwargs)
        setattr(owner, name, wrapped)
    return events


def test_the_loop_at_staleness_zero_and_one(tmp_path):
    """Staleness 0 is the synchronous loop (collect, update, sync per step); staleness 1 samples
    the next batch after the step's one sync and before its update. Step 1 is the same
    computation at both (sampled and trained at the initial weights): identical metrics and
    weights; from step 2 on the batch is one update old, which the engine's log-probs show."""
    runs = {}
    for staleness in (0, 1):
        record = Record()
        pipe = Pipeline(tiny(tmp_path / str(staleness), "rollout_correction.mode=tis",
                             f"rollout.staleness={staleness}"), progress=False)
        events = order_of_calls(pipe)
        pipe.train([record])
        runs[staleness] = (rows(tmp_path / str(staleness)), record.weights, events)
    (sync_rows, sync_weights, sync_events), (stale_rows, stale_weights, stale_events) = (
        runs.values())
    assert sync_events == ["collect", "update", "sync"] * 3
    ahead = ["sync", "collect", "update"]   # the batch in flight taken, synced, next submitted
    assert stale_events == ["collect", *ahead, *ahead, *ahead]
    assert sync_rows[0] == stale_rows[0]
    assert all(torch.equal(sync_weights[1][k], stale_weights[1][k]) for k in sync_weights[1])
    assert all(r["collector/logprob_gap"] < 1e-5 for r in sync_rows)
    assert all(r["collector/logprob_gap"] > 1e-3 for r in stale_rows[1:])   # one update behind


def test_importance_weights_are_against_the_sampling_and_the_current_policy(tmp_path):
    """At staleness 1, step t trains on a batch whose engine log-probs are those of the actor
    after step t-2 (before step t-1's update), its old log-probs are those of the actor after
    step t-1 (the current one), and the tis weights are min(exp(old - engine), C)."""
    record = Record()
    threshold = 1.1
    pipe = Pipeline(tiny(tmp_path, *STALE, f"rollout_correction.threshold={threshold}"),
                    progress=False)
    pipe.train([record])
    clipped = 0
    for step in (2, 3):
        batch, mask = record.batches[step], record.batches[step][S.RESPONSE_MASK]
        sampler = logprobs_at(pipe, record.weights[step - 2], batch)
        current = logprobs_at(pipe, record.weights[step - 1], batch)
        engine, old = batch[S.ENGINE_LOG_PROB], batch[S.OLD_LOG_PROB]
        assert (engine - sampler)[mask].abs().max() < 1e-5
        assert (engine - current)[mask].abs().max() > 1e-2      # not the current policy's
        assert (old - current)[mask].abs().max() < 1e-5
        oracle = torch.exp(old.double() - engine.double()).clamp(max=threshold)
        weight = batch[S.ROLLOUT_IS_WEIGHT]
        torch.testing.assert_close(weight[mask].double(), oracle[mask], rtol=1e-6, atol=0)
        assert (weight[~mask] == 0).all()
        clipped += int((oracle[mask] == threshold).sum())
    assert clipped > 0   # the truncation was exercised


def test_a_resumed_run_continues_identically(tmp_path):
    """The checkpoint saves the batch in flight (the weights that sampled it are gone); a run
    cut at step 2 and resumed trains on it, as the uninterrupted run does: same metrics and
    final weights."""
    common = [*STALE, "checkpoint.every=1"]
    full = Pipeline(tiny(tmp_path / "full", *common, "run.steps=4"), progress=False).train()
    Pipeline(tiny(tmp_path / "cut", *common, "run.steps=2"), progress=False).train()
    state = torch.load(checkpoint.latest(tmp_path / "cut") / "state.pt", weights_only=True)
    (flight,) = state["in_flight"]
    cfg = tiny(tmp_path / "unused", *common)
    prompts = cfg.data.batch_size
    assert len(flight["rows"]) == prompts and flight["size"] == prompts * cfg.collector.args["n"]
    Pipeline(tiny(tmp_path / "cut", *common, "run.steps=4"), progress=False, resume=True).train()
    assert rows(tmp_path / "cut") == rows(full)
    a, b = (load_file(str(d / "final" / "model.safetensors")) for d in (full, tmp_path / "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)


class SnapshotHF(HFCollector):
    """``hf`` on its own copy of the actor that only `sync_weights` changes: an engine apart, so
    it declares ``overlaps_update`` and samples in a thread. Records where and when it ran."""

    @classmethod
    def contract(cls, **args):
        return dataclasses.replace(super().contract(**args), overlaps_update=True)

    @functools.wraps(HFCollector.__init__)   # its signature: the arguments it takes
    def __init__(self, ctx, **args):
        super().__init__(ctx, **args)
        self.actor, self.model = ctx.actor, copy.deepcopy(ctx.actor)
        self.busy, self.spans, self.threads, self.syncs = [], [], set(), []  # shared with views

    def collect(self, prompts):
        self.busy.append(1)
        start = time.perf_counter()
        self.threads.add(threading.current_thread() is threading.main_thread())
        try:
            return super().collect(prompts)
        finally:
            self.busy.pop()
            self.spans.append((start, time.perf_counter()))

    def sync_weights(self, model):
        assert not self.busy, "weights synced while a generation was in flight"
        self.syncs.append(1)
        self.model.load_state_dict(model.state_dict())


class SnapshotHFInline(SnapshotHF):
    """The same collector without ``overlaps_update``: sampled at once, on the main thread."""

    @classmethod
    def contract(cls, **args):
        return HFCollector.contract(**args)


def test_a_collector_that_overlaps_the_update_samples_in_a_thread(tmp_path):
    """A collector declaring ``overlaps_update`` samples the next batch in a thread while the
    update runs, is never synced during a generation, and gives the run of the same collector
    sampling on the main thread (within float32 round-off: the thread's own kernels)."""
    args = dict(max_new_tokens=24, temperature=1.0, n=2)
    results = {}
    for cls in (SnapshotHF, SnapshotHFInline):
        pipe = Pipeline(tiny(tmp_path / cls.__name__, *STALE), progress=False,
                        collector=functools.partial(cls, **args))
        updates = []
        update = pipe.updater.update

        def timed_update(*a, **k):
            start = time.perf_counter()
            try:
                return update(*a, **k)
            finally:
                updates.append((start, time.perf_counter()))
        pipe.updater.update = timed_update
        pipe.train()
        results[cls] = rows(tmp_path / cls.__name__), pipe.plugins.collector, updates
    (threaded, collector, updates), (inline, inline_collector, _) = results.values()
    assert collector.threads == {True, False}    # the first batch on the main thread, then ahead
    assert inline_collector.threads == {True}
    # the batch of step t+1 was sampled while step t updated
    assert any(g0 < u1 and u0 < g1 for (g0, g1), (u0, u1) in zip(collector.spans[1:], updates))
    for a, b in zip(threaded, inline):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key


class SnapshotHFWithView(SnapshotHF):
    """`SnapshotHF` that offers ``sampling_view``, as ``vllm`` does: evaluation samples from the
    same copy of the actor. A view records whether that copy was the actor's current weights."""

    fresh: list = []

    def sampling_view(self, temperature, n):
        view = copy.copy(self)
        view.temperature, view.n, view.is_view = temperature, n, True
        return view

    def collect(self, prompts):
        if getattr(self, "is_view", False):
            self.fresh.append(all(torch.equal(a, b) for a, b in
                                  zip(self.model.parameters(), self.actor.parameters())))
        return super().collect(prompts)


def test_evaluation_on_the_training_engine_waits_and_sees_the_current_actor(tmp_path):
    """Evaluation sampling from the training engine (``sampling_view``) first waits for the batch
    in flight and syncs it (`OffPolicy.settle`), so it samples from the actor just updated, and
    the next step skips its own sync: one sync per evaluation, none during a generation."""
    prompts = TINY.parent / "prompts.txt"
    pipe = Pipeline(tiny(tmp_path, *STALE, "run.steps=2", f"eval.prompts={prompts}",
                         "eval.every=1", "eval.max_prompts=4"), progress=False,
                    collector=functools.partial(SnapshotHFWithView, max_new_tokens=24, n=2))
    pipe.train()
    collector = pipe.plugins.collector
    assert pipe.evaluator.own_engine is False
    assert collector.fresh == [True, True, True]          # evaluations at steps 0, 1, 2
    assert len(collector.syncs) == 3 and collector.threads == {True, False}
