"""The TRL side of benchmarks/vs_trl_grpo.py: TRL 1.12's GRPOTrainer on the GRPO workload there,
timed per rollout. It runs in TRL's own virtual environment and imports nothing from rlpipe
(``pip install peft`` there too; vs_trl_grpo.py starts it):

    .venv-trl/bin/python benchmarks/vs_trl_grpo_worker.py --policy DIR --data train.jsonl \
        --iters 3 --out trl.json

One iteration is one generation batch (prompts x ``--samples``) and the ``--minibatches``
optimizer steps TRL takes on it (``steps_per_generation``). Settings that would break a fair
float32 CPU comparison are set: ``bf16=False``, no gradient checkpointing, a constant learning
rate, ``gradient_accumulation_steps=1``. The reward is the last number of the completion against
the ``answer`` column (rlpipe's ``answer_match`` rule for plain numbers), written here.

Phases are timed by wrapping the trainer's own methods: ``_generate`` (rollout),
``_generate_and_score_completions`` minus ``_generate`` (scoring: old log-probs, reference,
rewards, advantages), and the rest of the iteration's steps (update). Writes one JSON object:
per-iteration times, phases, reward and KL.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def answer_reward(completions, answer, **_) -> list[float]:
    """1.0 where the completion's last number equals the answer, else 0.0."""
    out = []
    for completion, want in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = NUMBER.findall(text)
        out.append(float(bool(numbers) and abs(float(numbers[-1]) - float(want)) < 1e-6))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True)
    p.add_argument("--data", required=True, help="jsonl with chat-message 'prompt' and 'answer'")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt")
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
