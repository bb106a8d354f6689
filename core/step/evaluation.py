"""Held-out evaluation: the policy answers the ``eval.prompts`` (greedy by default) at step 0,
every ``eval.every`` steps and after the last step; the reward plugins score the answers.

Metrics join that step's row of ``metrics.jsonl``: ``eval/score`` (weighted sum of the parts,
clipped by ``reward.clip``, never normalised), ``eval/reward/<label>`` (each part's mean),
``eval/response/length`` and ``time/eval_s``. Each evaluation's samples go to
``RUN_DIR/samples/eval-step-N.jsonl`` (prompt, response, score, parts, data columns, in row order).
With several held-out sets (``eval.prompts`` a mapping name -> source) each is evaluated in turn
on the same weights and RNG seed: the first as above, each other one as ``eval/<name>/*`` and
``samples/eval-step-N.<name>.jsonl`` (the tool lift runs on the first only).

With an environment (``environment``), evaluation runs the same multi-turn conversations as
training (`rlpipe.core.step.multiturn.MultiTurn` over the evaluation's sampler, so greedy by
default): the score is the tool-using policy's, each sample carries its conversation, turns, stop
reason and receipt (`rlpipe.core.observe.samples.turn_fields`), and the metrics add
``eval/env/*``: training's ``env/*`` (`rlpipe.core.step.multiturn.env_metrics`) over the
held-out conversations. Each held-out row's environment is reset with seed ``run.seed + row``.
Where the environment has tools (``eval.tool_lift``), each evaluation runs a second time on the
same rows, seeds and weights with the tools disabled (`rlpipe.core.step.tool_lift`): that pass's
metrics are ``eval/no_tools/*`` (the same names under ``eval/no_tools/``) and ``eval/tool_lift``
is ``eval/score`` minus ``eval/no_tools/score`` (docs/tool-lift.md).

Evaluation never touches the training state: it samples at ``temperature: eval.temperature``,
one answer per prompt, from the training collector's ``sampling_view`` where the collector offers
one (``vllm``: the same engine, no second one), else from its own collector instance (the
training collector's arguments with those two changed), under a forked torch RNG (seeded
``run.seed + step``) and a restored Python RNG, and the reward statistics of ``reward.normalize``
do not see it. A run with evaluation logs the same training metrics as one without (with
``hf``; a ``vllm`` engine's draws depend on its history, so its runs do not repeat anyway).

>>> Evaluator.due(every=0, step=3, last=10), Evaluator.due(every=5, step=5, last=12)
(False, True)
>>> [s for s in range(13) if Evaluator.due(every=5, step=s, last=12)]
[0, 5, 10, 12]
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from rlpipe.core.contracts import guards, registry
from rlpipe.core.base import schema as S
from rlpipe.core.contracts.collector import sampling_view
from rlpipe.core.config.checks import resolve_plugin
from rlpipe.core.base.errors import UserError, option
from rlpipe.core.data.prompts import PromptData
from rlpipe.core.contracts.reward_fn import batch_texts
from rlpipe.core.observe.samples import turn_fields
from rlpipe.core.step.multiturn import env_metrics
from rlpipe.core.step.tool_lift import without_tools

SAMPLES_DIR = "samples"


def eval_collector(cfg, ctx, training=None):
    """``(collector, own_engine)``: the training collector's ``sampling_view(eval.temperature,
    1)`` where it offers one (``own_engine`` False: the pipeline keeps that engine's weights
    current); else its plugin and arguments with ``temperature: eval.temperature`` and ``n: 1``,
    a second instance, so the training collector's state is never touched."""
    view = None if training is None else sampling_view(training, cfg.eval.temperature, 1)
    if view is not None:
        return view, False
    plugin = resolve_plugin(cfg.collector, "collectors")
    params = registry.init_params(plugin.obj)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [k for k in ("temperature", "n") if k not in params and not takes_any]
    if missing:
        raise UserError(f"eval: collector {plugin.spec.label} takes no {' or '.join(missing)} "
                        f"argument, which evaluation sets; remove the eval section")
    args = {**cfg.collector.args, "temperature": cfg.eval.temperature, "n": 1}
    return registry.instantiate(plugin.obj, args, ctx, f"eval collector ({plugin.spec.label})"), True


def _chunks(rows: list[int], count: int) -> list[list[int]]:
    """``rows`` in ``count`` contiguous, non-empty parts of near-equal size."""
    size, extra = divmod(len(rows), count)
    out, start = [], 0
    for i in range(count):
        end = start + size + (i < extra)
        out.append(rows[start:end])
        start = end
    return out


def _env_metrics(samples: list[dict]) -> dict[str, float]:
    """``eval/env/*``: `env_metrics` (training's definitions) over the gathered samples, whose
    per-sample fields (`turn_fields`) are put back as the batch entries it reads."""
    length = torch.tensor([s["length"] for s in samples])
    actions = torch.tensor([s["action_tokens"] for s in samples])
    at = torch.arange(max(1, int(length.max())))
    batch = TensorDict({
        S.RESPONSE_MASK: at < length[:, None], S.ACTION_MASK: at < actions[:, None],
        S.NUM_TURNS: torch.tensor([s["turns"] for s in samples]),
        S.STOP_REASON: torch.tensor([S.STOP_REASONS.index(s["stop_reason"]) for s in samples]),
        S.ENV: {"receipt": torch.tensor([S.RECEIPTS.index(s["receipt"]) for s in samples]),
                **{k: torch.tensor([s["env"][k] for s in samples]) for k in samples[0]["env"]}},
    }, batch_size=[len(samples)])
    return {f"eval/{name}": value for name, value in env_metrics(batch).items()}


class Evaluator:
    """Runs the evaluation of one run: `run` at the steps `due` names."""

    def __init__(self, cfg, data: dict[str, PromptData] | PromptData, collector, rewards, dist,
                 device, run_dir: Path, compute=contextlib.nullcontext, own_engine: bool = True,
                 turns=None):
        self.cfg, self.collector, self.rewards = cfg.eval, collector, rewards
        self.sets = {name: (d, self._parts(d, cfg.eval, dist)) for name, d in
                     (data if isinstance(data, dict) else {"": data}).items()}
        self.turns = turns  # a `MultiTurn` over ``collector`` with an environment, else None
        self.no_tools = (without_tools(turns) if turns is not None and turns.contract.tools
                         and cfg.eval.tool_lift else None)  # the same conversations, tools off
        self.own_engine = own_engine  # False: a sampling view, whose weights the pipeline syncs
        self.compute = compute  # the context the actor's forwards run in (`Models.compute`)
        self.dist, self.device, self.seed = dist, device, cfg.run.seed
        self.samples_dir = Path(run_dir) / SAMPLES_DIR

    @staticmethod
    def _parts(data: PromptData, cfg, dist) -> list[list[int]]:
        """This rank's rows of ``data``, in collect() calls of at most ``cfg.batch_size``."""
        n = len(data) if cfg.max_prompts is None else min(len(data), cfg.max_prompts)
        if n < dist.world:
            raise UserError(f"eval.prompts: {n} prompt(s) for {dist.world} processes; give at "
                            f"least one per process")
        share = list(range(n))[dist.rank::dist.world]
        biggest, smallest = -(-n // dist.world), n // dist.world
        count = min(-(-biggest // cfg.batch_size), smallest)  # same count on every rank
        return _chunks(share, count)

    @staticmethod
    def due(every: int, step: int, last: int) -> bool:
        """Step 0, every ``every`` steps (0: none between), and the last step."""
        return step == 0 or step == last or (every > 0 and step % every == 0)

    def run(self, step: int, actor) -> dict[str, float]:
        """Evaluate the current ``actor``; the metrics (same on every rank), and the samples file
        written by rank 0."""
        t0, metrics = time.perf_counter(), {}
        for i, (name, held) in enumerate(self.sets.items()):  # the engine synced once, first
            samples = self._gathered(step, self.turns, held, None if i else actor)
            if self.dist.is_main:
                self._write(step, samples, f".{name}" if i else "")
            prefix = f"eval/{name}/" if i else "eval/"
            metrics.update({k.replace("eval/", prefix, 1): v
                            for k, v in self._metrics(samples).items()})
        if self.no_tools is not None:  # same rows, seeds, weights and RNG: only the tools differ
            first = next(iter(self.sets.values()))
            bare = self._metrics(self._gathered(step, self.no_tools, first))
            metrics.update({k.replace("eval/", "eval/no_tools/", 1): v for k, v in bare.items()},
                           **{"eval/tool_lift": metrics["eval/score"] - bare["eval/score"]})
        return {**metrics, "time/eval_s": time.perf_counter() - t0}

    def _gathered(self, step: int, turns, held: tuple, actor=None) -> list[dict]:
        """Every rank's samples of ``held`` in row order, drawn under the RNG seeded for ``step``
        (after syncing the engine to ``actor`` when given)."""
        devices = [self.device] if self.device.type == "cuda" else []
        python_rng = random.getstate()
        try:
            with torch.random.fork_rng(devices=devices), self.compute():
                torch.manual_seed(self.seed + step)
                if actor is not None and self.own_engine:
                    registry.call(self.collector.sync_weights, actor)
                data, parts = held  # a set of `sets`: its PromptData, this rank's chunks
                local = [s for rows in parts for s in self._samples(data, rows, turns)]
        finally:
            random.setstate(python_rng)
        return sorted((s for part in self.dist.gather_object(local) for s in part),
                      key=lambda s: s["row"])

    def _samples(self, data: PromptData, rows: list[int], turns) -> list[dict]:
        """Generate and score one chunk of ``data``; one plain dict per sample."""
        collector = self.collector
        if turns is not None:  # seeds by row: the same environments at every evaluation
            batch = turns.collect(data.records(rows), self.seed + rows[0])
        else:
            batch = guards.check_output(registry.call(collector.collect, data.texts(rows)),
                                        collector, required=(S.RESPONSE_IDS, S.RESPONSE_MASK,
                                                             S.GROUP_ID, S.FINISHED))
        batch = batch.to(self.device)
        data.attach(batch, rows)
        self.rewards.evaluate(batch)
        labels = self.rewards.labels
        columns = {c: batch_texts(batch, (S.DATA, c)) for c in data.columns}
        groups = batch[S.GROUP_ID].tolist()
        score, length = batch[S.SCORE].tolist(), batch[S.RESPONSE_MASK].sum(-1).tolist()
        parts = {k: batch[S.SCORE_PARTS, k].tolist() for k in labels}
        prompts, responses = batch_texts(batch, S.PROMPT_TEXT), batch_texts(batch, S.RESPONSE_TEXT)
        turns = turn_fields(batch)
        return [{"row": rows[g], "prompt": prompts[i], "response": responses[i],
                 "score": score[i], "rewards": {k: parts[k][i] for k in labels},
                 "length": length[i], "finished": bool(batch[S.FINISHED][i]),
                 "data": {c: v[i] for c, v in columns.items()}, **turns[i]}
                for i, g in enumerate(groups)]

    def _metrics(self, samples: list[dict]) -> dict[str, float]:
        def mean(values):
            values = list(values)
            return sum(values) / len(values) if values else math.nan

        return {"eval/score": mean(s["score"] for s in samples),
                **{f"eval/reward/{k}": mean(s["rewards"][k] for s in samples)
                   for k in self.rewards.labels},
                "eval/response/length": mean(s["length"] for s in samples),
                **(_env_metrics(samples) if samples and "turns" in samples[0] else {})}

    def close(self) -> None:
        """The environments' worker threads (the sampler is closed apart: ``collector``)."""
        for turns in (self.turns, self.no_tools):
            if turns is not None:
                turns.close()

    def _write(self, step: int, samples: list[dict], suffix: str = "") -> None:
        self.samples_dir.mkdir(exist_ok=True)
        path = self.samples_dir / f"eval-step-{step}{suffix}.jsonl"
        try:
            with open(path, "w", encoding="utf-8") as f:
                for s in samples:
                    f.write(json.dumps({"step": step, **s}, default=str) + "\n")
        except OSError as exc:
            raise UserError(f"cannot write {path} ({exc}); continue with {option('resume')} once there "
                            f"is space") from exc
