"""The TRL side of benchmarks/vs_trl.py: TRL 1.12's PPOTrainer (``trl.experimental.ppo``) on the
workload of vs_trl.py, timed phase by phase. It runs in TRL's own virtual environment and imports
nothing from rlpipe (vs_trl.py starts it; see there for how to make ``.venv-trl``):

    .venv-trl/bin/python benchmarks/vs_trl_worker.py --policy DIR --reward DIR \
        --prompts prompts.txt --iters 3 --out trl.json

TRL's defaults that would break a fair float32 CPU comparison are overridden: ``bf16=False``,
no gradient checkpointing, a constant learning rate (not linear decay), and
``gradient_accumulation_steps=1`` (with GA > 1 and several minibatches TRL 1.12 silently drops
optimizer steps). The value model and the reward model are two copies of the same
sequence-classification checkpoint. Sampling suppresses EOS for all ``--new-tokens`` steps (the
``min_new_tokens`` rlpipe's side sets), so every response has exactly that many tokens.

Phases are timed by wrapping the trainer module's own functions: ``batch_generation``
(generate), ``forward`` without grad (reference), ``get_reward`` on the value model (value) and on
the reward model (RM); "update" is the rest of the iteration up to TRL's log call (advantages,
then the PPO epochs). Writes one JSON object: per-iteration times, phases, reward and KL.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True)
    p.add_argument("--reward", required=True, help="sequence-classification folder (one output)")
    p.add_argument("--prompts", required=True)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--chat-template", action="store_true", help="prompts as one user turn")
    args = p.parse_args()

    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,
                              AutoTokenizer, TrainerCallback)

    import trl
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as mod

    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    tokenizer.padding_side = "left"
    prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = prompts[:args.batch]
    if args.chat_template:  # as rlpipe's HF collector (and benchmarks/vs_trl.py) encode them
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                 add_generation_prompt=True, tokenize=False)
                   for t in prompts]
    special = not args.chat_template  # a template writes its own special tokens
    dataset = Dataset.from_dict({"input_ids": [tokenizer(t, add_special_tokens=special).input_ids
                                               for t in prompts]})

    f32 = torch.float32
    policy = AutoModelForCausalLM.from_pretrained(args.policy, dtype=f32)
    ref = AutoModelForCausalLM.from_pretrained(args.policy, dtype=f32)
    value = AutoModelForSequenceClassification.from_pretrained(args.reward, dtype=f32, num_labels=1)
    reward = AutoModelForSequenceClassification.from_pretrained(args.reward, dtype=f32, num_labels=1)

    config = PPOConfig(
        output_dir=str(Path(args.out).parent / "trl_out"), report_to=[], save_strategy="no",
        seed=args.seed, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        lr_scheduler_type="constant", learning_rate=1e-5, optim="adamw_torch_fused",
        weight_decay=0.0, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        num_mini_batches=2, num_ppo_epochs=2, total_episodes=args.batch * args.iters,
        local_rollout_forward_batch_size=args.batch, response_length=args.new_tokens,
        temperature=0.7, stop_token=None, missing_eos_penalty=None, kl_coef=0.05,
        kl_estimator="k1", gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1,
        whiten_rewards=False, num_sample_generations=0, logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0)

    clock = {"gen": 0.0, "ref": 0.0, "value": 0.0, "rm": 0.0, "last_score_end": None,
             "iter_start": None}
    rows: list[dict] = []

    def timed(fn, name_of):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            name = name_of(a)
            if name is not None:
                t1 = time.perf_counter()
                clock[name] += t1 - t0
                if name == "gen" and clock["iter_start"] is None:
                    clock["iter_start"] = t0
                if name in ("ref", "value", "rm"):
                    clock["last_score_end"] = t1
            return out
        return wrapper

    eos = tokenizer.eos_token_id

    class ExactLength(transformers.GenerationConfig):
        """TRL's generation config plus rlpipe's ``min_new_tokens = max_new_tokens``."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs, min_new_tokens=kwargs["max_new_tokens"], eos_token_id=eos)

    mod.GenerationConfig = ExactLength
    mod.batch_generation = timed(mod.batch_generation, lambda a: "gen")
    mod.forward = timed(mod.forward, lambda a: None if torch.is_grad_enabled() else "ref")
    mod.get_reward = timed(mod.get_reward, lambda a: "rm" if a[0] is trainer.reward_model
                           else "value")

    class Recorder(TrainerCallback):
        def on_log(self, args_, state, control, logs=None, **kw):
            now = time.perf_counter()
            start = clock["iter_start"]
            rows.append({
                "step_s": now - start, "rollout_s": clock["gen"],
                "score_s": clock["ref"] + clock["value"] + clock["rm"],
                "ref_s": clock["ref"], "value_s": clock["value"], "rm_s": clock["rm"],
                "update_s": now - clock["last_score_end"],
                "reward": logs.get("objective/scores"), "kl": logs.get("objective/kl")})
            clock.update(gen=0.0, ref=0.0, value=0.0, rm=0.0, iter_start=None)

    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref,
                         reward_model=reward, value_model=value, train_dataset=dataset,
                         callbacks=[Recorder()])
    trainer.train()
    Path(args.out).write_text(json.dumps({
        "iters": rows, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "trl": trl.__version__, "transformers": transformers.__version__,
        "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                          else trainer.optimizer).__name__}, indent=1))


if __name__ == "__main__":
    main()
