"""One-step off-policy rollouts (``rollout.staleness: 1``): the batch a step trains on was sampled
by the policy before the previous update, and the next batch is sampled while this step updates.

Step t of the loop (`rlpipe.core.run.pipeline.Pipeline.step`) starts with `OffPolicy.take`:

1. take the batch in flight, sampled by the actor as it was before step t-1's update (at the
   first step, or after a resume without one, sample it now);
2. sync the engine to the current actor: the step's one sync point, never while a generation is
   in flight (the batch in flight has been taken; `settle` waits for it);
3. submit the next batch's generation: in a thread where the collector's contract declares
   ``overlaps_update`` (the engine holds its own weights and computes apart, vllm: the thread
   waits on it with the GIL released while the update runs), else at once (hf: the engine is the
   actor itself, so a thread would sample from weights the update is changing, and would compete
   for the same cores; the semantics are the same, only nothing overlaps);

then stages 2-9 run on the taken batch: the old log-probs recomputed at the current weights (the
proximal policy), the engine's log-probs as the behaviour policy, and ``rollout_correction``'s
weights ``exp(old - engine)`` correct the staleness (config checks refuse ``mode: none`` unless
``rollout.accept_uncorrected``).

A checkpoint saves the batch in flight (`state_dict`): the weights that sampled it are gone after
the update, so it cannot be sampled again; a resumed run trains on it, as the uninterrupted run
does. Evaluation that samples from the training engine first calls `settle`, so that it sees the
current actor.

>>> from tensordict import TensorDict
>>> weights = {"version": 0}
>>> def collect(rows):   # a toy collector: tags each batch with the weights that sampled it
...     return TensorDict({"sampled_by": torch.full((len(rows),), weights["version"])}, [len(rows)])
>>> prompts = iter(range(100))
>>> ahead = OffPolicy(lambda: [next(prompts)], collect, sync=lambda: None, threaded=False)
>>> for step in (1, 2, 3):
...     batch, _, _ = ahead.take()
...     print(step, batch["sampled_by"].tolist(), weights["version"])
...     weights["version"] += 1   # the update
1 [0] 0
2 [0] 1
3 [1] 2
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
from tensordict import NonTensorStack, TensorDict, is_non_tensor

Collected = tuple  # (the collector's batch, its prompt rows, seconds its generation took)


class OffPolicy:
    """The batch in flight of a one-step off-policy run. ``rows()`` draws the next prompt rows
    (on the calling thread), ``collect(rows)`` samples them (stage 1), ``sync()`` pushes the
    actor's weights to the engine; ``threaded``: ``collect`` runs in a thread while the step
    goes on."""

    def __init__(self, rows: Callable[[], list], collect: Callable[[list], TensorDict],
                 sync: Callable[[], None], threaded: bool):
        self.rows, self.collect, self.sync = rows, collect, sync
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rlpipe-rollout") if threaded else None
        self.pending: Future | Collected | None = None
        self.current = False     # the engine holds the actor's weights (`settle` synced them)
        self.held = 0.0          # seconds the last `take` held the step

    def _sample(self, rows: list) -> Collected:
        t0 = time.perf_counter()
        batch = self.collect(rows)
        return batch, rows, time.perf_counter() - t0

    def wait(self) -> Collected | None:
        """The batch in flight once its generation has finished (it stays in flight), or None."""
        if isinstance(self.pending, Future):
            self.pending = self.pending.result()   # an error in the thread is raised here
        return self.pending

    def take(self) -> Collected:
        """Steps 1-3 above: this step's batch (the collector's, its rows, its generation's
        seconds), with the engine synced and the next batch submitted."""
        t0 = time.perf_counter()
        collected, self.pending = self.wait(), None
        if collected is None:
            collected = self._sample(self.rows())
        if not self.current:
            self.sync()
        self.current = False
        rows = self.rows()
        self.pending = self.pool.submit(self._sample, rows) if self.pool else self._sample(rows)
        self.held = time.perf_counter() - t0
        return collected

    def metrics(self) -> dict[str, float]:
        """``time/rollout_wait_s``: the seconds the last `take` held the step (waiting for the
        batch in flight, the weight sync, and without a thread the next batch's sampling)."""
        return {"time/rollout_wait_s": self.held}

    def settle(self) -> None:
        """Wait for the batch in flight and sync the engine to the actor (evaluation on the
        training engine calls it); the next `take` then skips its sync."""
        self.wait()
        self.sync()
        self.current = True

    def state_dict(self) -> dict:
        """The batch in flight as plain tensors, lists and numbers (``{}``: none), for a
        checkpoint's ``state.pt`` (read back with ``weights_only=True``)."""
        collected = self.wait()
        if collected is None:
            return {}
        batch, rows, seconds = collected
        entries = [[list(key) if isinstance(key, tuple) else [key],
                    value.tolist() if is_non_tensor(value) else value.detach().cpu()]
                   for key, value in batch.items(include_nested=True)
                   if is_non_tensor(value) or isinstance(value, torch.Tensor)]
        return {"batch": entries, "size": batch.batch_size[0], "rows": list(rows),
                "seconds": seconds}

    def load_state_dict(self, state: dict) -> None:
        """The inverse of `state_dict`: that batch is in flight again."""
        self.pending, self.current = None, False
        if not state:
            return
        batch = TensorDict({}, [state["size"]])
        for key, value in state["batch"]:
            batch[tuple(key)] = value if isinstance(value, torch.Tensor) else NonTensorStack(*value)
        self.pending = (batch, list(state["rows"]), float(state["seconds"]))

    def close(self) -> None:
        """Let a generation in flight end (an engine is never stopped under it); stop the thread."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
