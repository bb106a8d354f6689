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
``health.stop_on``); the checkpoint callback then writes a checkpoint. A callback adds entries
and never changes or removes one already in the row (``step`` included) nor ``pipe.step_count``;
a value it adds is a number, a string, a bool or a one-element tensor (made a number). Each of
these, an exception inside a hook, or a callback object without the three hooks, is one
`UserError` naming the callback; the run directory's lock is released and its newest checkpoint
stays usable with ``--resume``.

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
import inspect

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError, option
from rlpipe.core.contracts.registry import calling
from rlpipe.core.observe import samples
from rlpipe.core.observe.health import monitor_for
from rlpipe.core.observe.health.groups import identical_frac
from rlpipe.core.observe.metrics import MetricsWriter, metric_value
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


HOOKS = {"on_train_start": 1, "on_step_end": 3, "on_train_end": 1}  # positional arguments


def check_callbacks(callbacks) -> list:
    """``callbacks`` as a list, each an object with the three hooks taking `HOOKS`' arguments;
    anything else (a function, a class, one object not in a list, transformers' callbacks) is
    one `UserError`.

    >>> len(check_callbacks([Callback()]))
    1
    >>> check_callbacks(Callback())
    Traceback (most recent call last):
    rlpipe.core.base.errors.UserError: callbacks=Callback: expected a list of Callback objects, e.g. callbacks=[Callback()]
    """
    if not isinstance(callbacks, (list, tuple)):
        raise UserError(f"callbacks={_name(callbacks)}: expected a list of Callback objects, "
                        f"e.g. callbacks=[{_name(callbacks)}()]")
    for callback in callbacks:
        _check_one(callback)
    return list(callbacks)


def _name(obj) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__


def _check_one(callback) -> None:
    name, kind = _name(callback), callback if inspect.isclass(callback) else type(callback)
    if any(c.__module__.startswith("transformers") for c in inspect.getmro(kind)):
        raise UserError(f"callback {name} is a transformers TrainerCallback, whose hooks rlpipe "
                        f"does not call; subclass rlpipe.core.run.callbacks.Callback instead "
                        f"(on_train_start(pipe), on_step_end(pipe, batch, metrics), "
                        f"on_train_end(pipe))")
    if inspect.isclass(callback) or inspect.isroutine(callback):
        what = "a class" if inspect.isclass(callback) else "a function"
        raise UserError(f"callback {name} is {what}; give an object: a Callback subclass's "
                        f"instance, e.g. callbacks=[{name}()]" if what == "a class" else
                        f"callback {name} is {what}; give an object with on_train_start(pipe), "
                        f"on_step_end(pipe, batch, metrics), on_train_end(pipe) (subclass "
                        f"rlpipe.core.run.callbacks.Callback)")
    for hook, count in HOOKS.items():
        method = getattr(callback, hook, None)
        try:
            inspect.signature(method).bind(*range(count))
        except (TypeError, ValueError):
            raise UserError(f"callback {name}: {hook} must take {count} argument(s) "
                            f"({'pipe, batch, metrics' if count == 3 else 'pipe'}); subclass "
                            f"rlpipe.core.run.callbacks.Callback") from None


class Hooks:
    """``callbacks`` around a loop over ``pipe``'s steps: ``with Hooks(pipe, callbacks) as hooks``
    calls each ``on_train_start`` in order, `step_end` each ``on_step_end`` in order, and leaving
    the block each ``on_train_end`` in reverse order, whatever happened; leaving it on an error
    releases the run directory's lock (``pipe.lock``). Each hook runs as plugin code (an
    exception in it is one `UserError` naming the callback), and `step_end` keeps the rules of
    the module's docstring."""

    def __init__(self, pipe, callbacks: list):
        self.pipe, self.callbacks = pipe, check_callbacks(callbacks)

    def __enter__(self) -> Hooks:
        self._stack = contextlib.ExitStack()
        with self._stack as stack:
            stack.push(self._release_on_error)
            for callback in self.callbacks:
                self._call(callback, "on_train_start")
                stack.callback(self._call, callback, "on_train_end")
            self._stack = stack.pop_all()
        return self

    def _call(self, callback, hook: str, *args) -> None:
        """``callback.hook(pipe, *args)``; yours as plugin code (rlpipe's own keep their errors)."""
        own = type(callback).__module__ == __name__
        with contextlib.nullcontext() if own else calling(f"callback {_name(callback)}", hook):
            getattr(callback, hook)(self.pipe, *args)

    def step_end(self, batch, metrics: dict) -> dict:
        """Every callback's ``on_step_end``; the row as the last one left it."""
        for callback in self.callbacks:
            before, count = dict(metrics), self.pipe.step_count
            self._call(callback, "on_step_end", batch, metrics)
            _check_row(_name(callback), before, metrics)
            if self.pipe.step_count != count:
                raise UserError(f"callback {_name(callback)} changed pipe.step_count ({count} -> "
                                f"{self.pipe.step_count}); a callback stops a run by setting "
                                f"pipe.stopped_by")
        return metrics

    def _release_on_error(self, exc_type, *exc) -> bool:
        """An error leaving the block (a hook's included): the run is not in use any more."""
        lock = getattr(self.pipe, "lock", None)
        if exc_type is not None and lock is not None:
            lock.release()
        return False

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)


def _check_row(name: str, before: dict, metrics: dict) -> None:
    """The row after callback ``name``: ``before``'s entries unchanged, each new value a number
    (`metric_value`), else one `UserError` naming the callback."""
    changed = [k for k in before if k not in metrics or metrics[k] is not before[k]]
    if changed:
        raise UserError(f"callback {name} changed or removed metrics[{changed[0]!r}]; a callback "
                        f"adds entries under new names (e.g. 'custom/...')")
    for key in [k for k in metrics if k not in before]:
        try:
            if not isinstance(key, str):
                raise TypeError(f"the name {key!r} is not a string")
            metrics[key] = metric_value(metrics[key])
        except (TypeError, ValueError) as exc:
            raise UserError(f"callback {name} added metrics[{key!r}]: {exc}") from None


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
        if S.GROUP_ID in batch.keys():  # one response n times: flat_groups says so at once
            metrics.update(identical_frac(batch[S.RESPONSE_IDS], batch[S.RESPONSE_MASK],
                                          batch[S.GROUP_ID]))
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
    try:
        extra = check_callbacks(extra)
    except UserError:
        if getattr(pipe, "lock", None) is not None:  # `train` ends here: the run is not in use
            pipe.lock.release()
        raise
    return [*([Preflight()] if pipe.cfg.run.preflight else []),
            *([Evaluation(pipe.evaluator)] if pipe.evaluator is not None else []),
            Health(), *extra, MetricsLog(), Checkpoints()]
