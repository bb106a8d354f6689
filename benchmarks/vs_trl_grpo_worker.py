"""The TRL side of benchmarks/vs_trl_grpo.py and benchmarks/race_trl_grpo.py: TRL 1.12's
GRPOTrainer. It runs in TRL's own virtual environment and imports nothing from rlpipe (``pip
install peft`` there too; those scripts start it). Two modes:

    .venv-trl/bin/python benchmarks/vs_trl_grpo_worker.py --policy DIR --data train.jsonl \
        --iters 3 --out trl.json                           # timed iterations (vs_trl_grpo.py)
    .venv-trl/bin/python benchmarks/vs_trl_grpo_worker.py --policy DIR --data train.jsonl \
        --race RACE.json --out trl.json                    # a wall-clock race (race_trl_grpo.py)

Timed: one iteration is one generation batch (prompts x ``--samples``) and the ``--minibatches``
optimizer steps TRL takes on it (``steps_per_generation``). Settings that would break a fair
float32 CPU comparison are set: ``bf16=False``, no gradient checkpointing, a constant learning
rate, ``gradient_accumulation_steps=1``. The reward is the last number of the completion against
the ``answer`` column. Phases are timed by wrapping the trainer's own methods: ``_generate``
(rollout), ``_generate_and_score_completions`` minus ``_generate`` (scoring: old log-probs,
reference, rewards, advantages), and the rest of the iteration's steps (update). Writes per-
iteration times, phases, reward and KL.

Race: ``RACE.json`` holds the GRPOConfig settings, the LoRA, the rewards (rlpipe's
``answer_match``, ``length`` and ``loop`` rules, written out here in plain Python: `answer_score`,
`length_penalty`, `loop_penalty`), the
stop strings and the clock (``minutes``, ``every``, ``seed``, ``snapshots``). Training runs until
``minutes`` of training time; at its start and at the first generation-batch boundary past each
``every`` minutes the LoRA adapter is saved (``save_pretrained``) and the time the save took is
taken off the clock. Stop strings end a completion as rlpipe's HF collector ends one (`EndRule`).

>>> answer_score("So 4 + 3 = 7.", 7), answer_score("1,250 apples", 1250), answer_score("no", 3)
(1.0, 1.0, 0.0)
>>> loop_penalty([7, 8, 7, 8, 7, 8]), length_penalty(14, False, max_tokens=12, per_token=0.5)
(-1.0, -2.0)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import StoppingCriteria, StoppingCriteriaList  # noqa: E402

# rlpipe's answer_match number pattern (thousands commas, decimals, exponents)
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


def answer_score(text: str, want) -> float:
    """1.0 when the last number of ``text`` equals ``want`` (relative 1e-6 beyond 1), else 0.0:
    rlpipe's ``answer_match`` on a response without ``\\boxed{}`` or ``####``."""
    numbers = NUMBER.findall(text)
    if not numbers:
        return 0.0
    got, want = float(numbers[-1].replace(",", "")), float(want)
    return float(abs(got - want) <= 1e-6 * max(1.0, abs(want)))


def answer_reward(completions, answer, **_) -> list[float]:
    """`answer_score` of each completion (a string, or TRL's conversational message list)."""
    return [answer_score(c[-1]["content"] if isinstance(c, list) else c, want)
            for c, want in zip(completions, answer)]


def length_penalty(length: int, finished: bool, *, min_tokens: int = 0,
                   max_tokens: int | None = None, per_token: float = 0.01,
                   truncated_penalty: float = 1.0) -> float:
    """rlpipe's ``length`` rule (band and missing-end terms): ``-per_token`` per token outside
    ``[min_tokens, max_tokens]``, ``-truncated_penalty`` for a response that did not end."""
    upper = float("inf") if max_tokens is None else max_tokens
    cost = per_token * (max(min_tokens - length, 0) + max(length - upper, 0))
    return 0.0 - (cost + truncated_penalty * (not finished))


def loop_penalty(tokens: list[int], *, n: int = 3, penalty: float = 1.0, tail: bool = True,
                 max_period: int = 64, min_repeats: int = 3) -> float:
    """rlpipe's ``loop`` rule: ``-penalty`` x the larger of the share of n-grams that repeat an
    earlier one and the share of the response covered by a periodic tail."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    fraction = 1.0 - len(set(grams)) / len(grams) if grams else 0.0
    length = len(tokens)
    if tail and length:
        back = tokens[::-1]
        for p in range(1, min(max_period, length // min_repeats) + 1):
            run = next(j for j in range(length + 1) if j + p >= length or back[j] != back[j + p])
            if run + p >= min_repeats * p:
                fraction = max(fraction, (run + p) / length)
    return 0.0 - penalty * fraction


class EndRule:
    """Where a response ends, as rlpipe's HF collector decides: at its first EOS token, or at the
    first token after which the decoded text of the last 4 x (longest stop string) tokens
    (special tokens skipped) ends with a stop string; that token is the response's last. With
    ``eos_after_stop`` (the collector's setting) a response ended by a stop string gets EOS after
    it when fewer than ``max_new_tokens`` were drawn: the EOS is trained like a drawn token."""

    def __init__(self, tokenizer, stops: list[str], eos_after_stop: bool = False,
                 max_new_tokens: int | None = None):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.eos_id = tokenizer.eos_token_id
        self.window = 4 * max(map(len, stops), default=0)
        self.eos_after_stop, self.max_new_tokens = eos_after_stop, max_new_tokens

    def ends(self, ids: list[int]) -> bool:
        """Whether the response ``ids`` ends at its last token."""
        if not ids or ids[-1] == self.eos_id:
            return bool(ids)
        text = self.tokenizer.decode(ids[-self.window:], skip_special_tokens=True) \
            if self.stops else ""
        return bool(self.stops) and text.endswith(self.stops)

    def cut(self, ids: list[int]) -> list[int]:
        """``ids`` up to the token it ends at (all of it when it does not end), and the EOS that
        ``eos_after_stop`` adds."""
        end = next((i for i in range(1, len(ids) + 1) if self.ends(ids[:i])), None)
        if end is None:
            return ids
        room = self.max_new_tokens is None or end < self.max_new_tokens
        add = self.eos_after_stop and ids[end - 1] != self.eos_id and room
        return ids[:end] + [self.eos_id] * add


class StopAtEnd(StoppingCriteria):
    """``generate``'s stopping criterion of `EndRule` on the tokens after ``prompt_width``."""

    def __init__(self, rule: EndRule, prompt_width: int):
        self.rule, self.width = rule, prompt_width

    def __call__(self, input_ids, scores, **kwargs):
        import torch
        rows = input_ids[:, self.width:].tolist()
        return torch.tensor([self.rule.ends(r) for r in rows], device=input_ids.device)


def make_rewards(spec: list[dict], rule: EndRule):
    """TRL reward functions for rlpipe's reward list ``spec`` (name, weight, args)."""
    def answer_match(column="answer"):
        return lambda completions, **kw: answer_reward(completions, kw[column])

    def length(**args):
        return lambda completion_ids, **_: [length_penalty(len(ids), rule.ends(ids), **args)
                                            for ids in completion_ids]

    def loop(**args):
        return lambda completion_ids, **_: [loop_penalty(ids, **args) for ids in completion_ids]
    funcs = []
    for reward in spec:
        make = {"answer_match": answer_match, "length": length, "loop": loop}[reward["name"]]
        funcs.append(make(**reward["args"]))
        funcs[-1].__name__ = reward["name"]
    return funcs


def race(args) -> None:
    """Train under TRL until the race's clock runs out, saving the adapter on its schedule."""
    import torch
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    import trl
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(args.race).read_text())
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32)
    config = GRPOConfig(output_dir=str(Path(args.out).parent / "trl_race_out"),
                        seed=spec["seed"], reward_weights=[r["weight"] for r in spec["rewards"]],
                        **spec["grpo"])
    rule = EndRule(tokenizer, spec["stop_strings"], spec["eos_after_stop"],
                   config.max_completion_length)
    funcs = make_rewards(spec["rewards"], rule)
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=LoraConfig(**spec["lora"]))
    if spec["stop_strings"]:
        add_stop_rule(trainer, rule)
    clock = RaceClock(trainer, spec, config.steps_per_generation, config.generation_batch_size)
    trainer.add_callback(type("Clock", (TrainerCallback,), {
        "on_train_begin": clock.begin, "on_step_end": clock.step_end, "on_log": clock.log}))
    load_s = time.perf_counter() - t_load
    trainer.train()
    Path(args.out).write_text(json.dumps({
        "snapshots": clock.snapshots, "logs": clock.logs, "load_s": load_s,
        "generation_batch_size": config.generation_batch_size,
        "steps_per_generation": config.steps_per_generation,
        "trl": trl.__version__, "transformers": transformers.__version__,
        "torch": torch.__version__, "optimizer": type(trainer.optimizer).__name__}, indent=1))


def add_stop_rule(trainer, rule: EndRule) -> None:
    """Make TRL's transformers generation stop each completion at `rule` (TRL ends one only at
    EOS): a stopping criterion for ``generate``, and completions cut where they end, with the EOS
    of ``eos_after_stop`` only (``generate`` pads a stopped row with EOS, which TRL would always
    keep as the completion's last token)."""
    model, generate, single = trainer.model, trainer.model.generate, trainer._generate_single_turn

    def stopping_generate(*a, **k):
        criteria = StoppingCriteriaList([StopAtEnd(rule, k["input_ids"].shape[1])])
        return generate(*a, stopping_criteria=criteria, **k)

    def cut_single_turn(*a, **k):
        completion_ids, logprobs = single(*a, **k)
        return [rule.cut(ids) for ids in completion_ids], logprobs
    model.generate, trainer._generate_single_turn = stopping_generate, cut_single_turn


class RaceClock:
    """The race's training clock (callbacks of a transformers Trainer): snapshots of the adapter
    at 0 and past each ``every`` minutes at generation-batch boundaries (save time off the clock),
    the stop at ``minutes``, and each logged row with its clock time."""

    def __init__(self, trainer, spec: dict, steps_per_generation: int, generation_batch: int):
        self.trainer, self.folder = trainer, Path(spec["snapshots"])
        self.every, self.budget = spec["every"] * 60, spec["minutes"] * 60
        self.per_gen, self.gen_batch = steps_per_generation, generation_batch
        self.snapshots, self.logs, self.next_at = [], [], self.every

    def now(self) -> float:
        return time.perf_counter() - self.t0 - self.paused

    def snapshot(self, step: int) -> None:
        t = time.perf_counter()
        train_s = self.now() if self.snapshots else 0.0
        folder = self.folder / f"{len(self.snapshots):02d}"
        self.trainer.model.save_pretrained(folder)
        save_s = time.perf_counter() - t
        self.paused += save_s
        batches = step // self.per_gen
        self.snapshots.append({"dir": str(folder), "train_s": train_s, "steps": step,
                               "generation_batches": batches,
                               "samples": batches * self.gen_batch, "save_s": save_s})
        print(f"snapshot {folder.name}: {train_s / 60:.2f} min, {batches} generation batches",
              flush=True)

    def begin(self, targs, state, control, **kw):
        self.t0, self.paused = time.perf_counter(), 0.0
        self.snapshot(0)

    def step_end(self, targs, state, control, **kw):
        if state.global_step % self.per_gen:
            return
        clock = self.now()
        if clock >= self.next_at or clock >= self.budget:
            self.snapshot(state.global_step)
            self.next_at += self.every
        if clock >= self.budget:
            control.should_training_stop = True

    def log(self, targs, state, control, logs=None, **kw):
        keep = ("reward", "kl", "completions/mean_length", "completions/clipped_ratio", "loss",
                "learning_rate")
        row = {k: v for k, v in (logs or {}).items() if k in keep}
        if row:  # not the summary row at the end of training
            self.logs.append({"step": state.global_step, "clock_s": self.now(), **row})


def timed(args) -> None:
    import torch
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    import trl
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32)
    batch = args.prompts * args.samples
    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl_grpo_out"), report_to=[], save_strategy="no",
        per_device_train_batch_size=batch // args.minibatches, gradient_accumulation_steps=1,
        steps_per_generation=args.minibatches, num_generations=args.samples, num_iterations=1,
        max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": args.new_tokens},  # every completion the same length
        beta=0.02, epsilon=0.2, loss_type="bnpo", learning_rate=5e-4, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=args.minibatches * (1 + args.iters), logging_steps=1, seed=0, bf16=False,
        use_cpu=True, gradient_checkpointing=False, disable_dropout=True, log_completions=False)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=answer_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, peft_config=lora)

    spent = {"rollout": 0.0, "generate_and_score": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper
    trainer._generate = timed("rollout", trainer._generate)
    trainer._generate_and_score_completions = timed("generate_and_score",
                                                    trainer._generate_and_score_completions)
    iters, logged = [], {}

    class Clock(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            if state.global_step % args.minibatches == 0:  # the first step of a generation batch
                self.t0 = time.perf_counter()
                spent.update(rollout=0.0, generate_and_score=0.0)

        def on_step_end(self, targs, state, control, **kw):
            if state.global_step % args.minibatches == 0:  # its last step
                step = time.perf_counter() - self.t0
                iters.append({"step_s": step, "rollout_s": spent["rollout"],
                              "score_s": spent["generate_and_score"] - spent["rollout"],
                              "update_s": step - spent["generate_and_score"]})

        def on_log(self, targs, state, control, logs=None, **kw):
            logs_at = logs or {}
            for key in ("reward", "kl"):
                if key in logs_at:
                    logged.setdefault(key, {}).setdefault(
                        (state.global_step - 1) // args.minibatches, []).append(logs_at[key])

    trainer.add_callback(Clock())
    trainer.train()
    for i, it in enumerate(iters):  # the generation batch's reward, its steps' mean KL
        for key, seen in logged.items():
            values = seen.get(i, [])
            it[key] = sum(values) / len(values) if values else None
    Path(args.out).write_text(json.dumps({
        "iters": iters, "trl": trl.__version__, "transformers": transformers.__version__,
        "torch": torch.__version__, "optimizer": type(trainer.optimizer).__name__}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True)
    p.add_argument("--data", required=True, help="jsonl with chat-message 'prompt' and 'answer'")
    p.add_argument("--race", help="a race's settings (JSON, written by race_trl_grpo.py)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt")
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    race(args) if args.race else timed(args)


if __name__ == "__main__":
    main()
