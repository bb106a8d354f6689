"""What a run does around its steps, as callbacks: the preflight, evaluation, health checks,
``metrics.jsonl`` and samples, checkpoints. `Pipeline.train` is the step loop plus
`default_callbacks`; a loop of your own gets the same files by calling the same hooks.

A callback overrides any of three hooks; ``pipe`` is the running `rlpipe.Pipeline`:

- ``on_train_start(pipe)``: before the first step of this process (after ``--resume`` restored);
- ``on_step_end(pipe, batch, metrics)``: after each step, ``metrics`` holding ``"step"`` and
  the step's numbers; a callback may add entries, which the callbacks after it see (evaluation
  adds ``eval/*``, health adds ``health/<rule>``, then the metrics writer writes the row). Step 0
  (``batch`` None) is the row before any update, where evaluation runs;
- ``on_train_end(pipe)``: always, also after an error (a writer closes its files).

A callback stops the run by setting ``pipe.stopped_by`` to a reason (health does, for
``health.stop_on``); the checkpoint callback then writes a checkpoint.

Your own loop, with rlpipe's files (a sketch; the tests run it on the tiny example):

>>> from rlpipe import Pipeline, load_config                      # doctest: +SKIP
>>> pipe = Pipeline(load_config("examples/tiny/config.yaml"))     # doctest: +SKIP
>>> with Hooks(pipe, default_callbacks(pipe)) as hooks:           # doctest: +SKIP
...     while pipe.step_count < 10:
...         batch, metrics = pipe.step()
...         hooks.step_end(batch, {"step": pipe.step_count, **metrics})
"""

from __future__ import annotations

import contextlib

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError, option
from rlpipe.core.observe import samples
from rlpipe.core.observe.health import monitor_for
from rlpipe.core.observe.metrics import MetricsWriter
from rlpipe.core.run import preflight
from rlpipe.core.step.evaluation import Evaluator


class Callback:
    """The three hooks of the loop, each doing nothing; subclass and override what you need."""

    def on_train_start(self, pipe) -> None:
        pass

    def on_step_end(self, pipe, batch, metrics: dict) -> None:
        pass

    def on_train_end(self, pipe) -> None:
        pass


class Hooks:
    """``callbacks`` around a loop over ``pipe``'s steps: ``with Hooks(pipe, callbacks) as hooks``
    calls each ``on_train_start`` in order, `step_end` each ``on_step_end`` in order, and leaving
    the block each ``on_train_end`` in reverse order, whatever happened."""

    def __init__(self, pipe, callbacks: list):
        self.pipe, self.callbacks = pipe, list(callbacks)

    def __enter__(self) -> Hooks:
        self._stack = contextlib.ExitStack()
        with self._stack as stack:
            for callback in self.callbacks:
                callback.on_train_start(self.pipe)
                stack.callback(callback.on_train_end, self.pipe)
            self._stack = stack.pop_all()
        return self

    def step_end(self, batch, metrics: dict) -> dict:
        """Every callback's ``on_step_end``; the row as the last one left it."""
        for callback in self.callbacks:
            callback.on_step_end(self.pipe, batch, metrics)
        return metrics

    def __exit__(self, *exc) -> None:
        self._stack.close()


class Preflight(Callback):
    """``run.preflight``: one batch, the engine's log-probs against the trainer's, before step 1
    (`rlpipe.core.run.preflight`)."""

    def on_train_start(self, pipe) -> None:
        if pipe.step_count < pipe.cfg.run.steps:
            preflight.check(pipe)


class Evaluation(Callback):
    """``eval``: the held-out prompts at step 0 and every ``eval.every`` steps (``eval/*``)."""

    def __init__(self, evaluator: Evaluator):
        self.evaluator = evaluator

    def on_step_end(self, pipe, batch, metrics: dict) -> None:
        step, cfg = metrics["step"], pipe.cfg
        if step == 0 or Evaluator.due(cfg.eval.every, step, cfg.run.steps):
            if pipe.offpolicy is not None and not self.evaluator.own_engine:
                pipe.offpolicy.settle()   # the training engine: the batch in flight, then a sync
            metrics.update(self.evaluator.run(step, pipe.models.actor))


class Health(Callback):
    """``health``: the rules judged after each step on the main process (``health/<rule>``);
    a rule of ``health.stop_on`` that fires, agreed by every process, stops the run."""

    def on_train_start(self, pipe) -> None:
        main = pipe.dist.is_main
        history = pipe.run_dir / "metrics.jsonl" if pipe.resume and main else None
        self.monitor = monitor_for(pipe.cfg.health, history, echo=main)

    def on_step_end(self, pipe, batch, metrics: dict) -> None:
        if batch is None:
            return
        if pipe.dist.is_main:
            self.monitor.observe(metrics)  # adds health/<rule> = 1 for the rules that hold
        stop_on = sorted(pipe.cfg.health.stop_on)
        if not stop_on:
            return
        stop = self.monitor.stop if pipe.dist.is_main else None
        if pipe.dist.enabled:  # one small collective per step, only with stop_on set
            votes = pipe.dist.mean({n: float(n == stop) for n in stop_on})
            stop = next((n for n in stop_on if votes[n] > 0), None)
        pipe.stopped_by = pipe.stopped_by or stop


class MetricsLog(Callback):
    """``metrics.jsonl`` (one row per step; a step-0 row only with evaluation), the progress bar,
    TensorBoard and W&B (``log.*``), and ``samples/step-N.jsonl`` every ``log.samples_every``
    steps; on the main process only. A write error is one line."""

    def on_train_start(self, pipe) -> None:
        log, self.writer = pipe.cfg.log, None
        if pipe.dist.is_main:
            self.writer = MetricsWriter(
                pipe.run_dir / "metrics.jsonl", pipe.cfg.run.steps, pipe.progress,
                initial=pipe.step_count, tensorboard=log.tensorboard, wandb=log.wandb,
                wandb_project=log.wandb_project, run_name=pipe.run_dir.name,
                config=pipe.cfg.to_dict())

    def on_step_end(self, pipe, batch, metrics: dict) -> None:
        if self.writer is None or (batch is None and len(metrics) == 1):
            return
        try:
            self.writer.write(metrics)
            if batch is not None:
                self._samples(pipe, batch, metrics["step"])
        except OSError as exc:
            raise UserError(f"cannot write {pipe.run_dir / 'metrics.jsonl'} ({exc}); continue "
                            f"with {option('resume')} once there is space") from exc

    def _samples(self, pipe, batch, step: int) -> None:
        every = pipe.cfg.log.samples_every
        if not every or step % every:
            return
        kl_tok = pipe.kl.per_token(batch[S.OLD_LOG_PROB], batch[S.REF_LOG_PROB],
                                   batch[S.RESPONSE_MASK])
        rows = samples.sample_rows(batch, kl_tok, pipe.cfg.log.samples)
        samples.write_samples(pipe.run_dir, step, rows)
        self.writer.log_samples(rows, step)

    def on_train_end(self, pipe) -> None:
        if self.writer is not None:
            self.writer.close()


class Checkpoints(Callback):
    """``checkpoint.every``: a checkpoint every N steps and at the last step, and one when a
    callback stopped the run (`Pipeline.save_checkpoint`)."""

    def on_step_end(self, pipe, batch, metrics: dict) -> None:
        every, step = pipe.cfg.checkpoint.every, metrics["step"]
        if batch is not None and (pipe.stopped_by or (every and (
                step % every == 0 or step == pipe.cfg.run.steps))):
            pipe.save_checkpoint()


def default_callbacks(pipe, extra: list | tuple = ()) -> list[Callback]:
    """What `Pipeline.train` runs, in order: the preflight (``run.preflight``), evaluation (with
    ``eval.prompts``), health, then ``extra`` (your callbacks: a metric they add is written, a stop
    they set is checkpointed), the metrics and samples writer, checkpoints."""
    return [*([Preflight()] if pipe.cfg.run.preflight else []),
            *([Evaluation(pipe.evaluator)] if pipe.evaluator is not None else []),
            Health(), *extra, MetricsLog(), Checkpoints()]
