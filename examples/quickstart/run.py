"""The quickstart: RLHF on a laptop CPU, end to end, with real text and no internet.

1. trains a reward model (MiniLM-L6, Bradley–Terry) on 300 preference pairs about movie reviews,
2. trains SmolLM2-135M-Instruct with PPO (LoRA actor and critic) to complete review openings
   so that the reward model likes them: positive, on topic, one sentence, no loops,
3. prints greedy before/after completions of the same prompts with their reward-model scores,
   writes plots of the run, and says where everything is.

    python examples/quickstart/run.py          # about 6 minutes on 2 CPU cores
    python examples/quickstart/run.py run.steps=2 data.batch_size=4 collector.max_new_tokens=8 \
        train.critic_pretrain_rollouts=8 --rm train.epochs=1          # a one-minute smoke test

Extra ``KEY=VALUE`` arguments override ``config.yaml`` (the PPO run); ``--rm KEY=VALUE`` overrides
``reward_model.yaml``. Everything lands under ``--output-dir`` (default ``runs/quickstart``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model is local: never reach for the hub

from rlpipe import load_config  # noqa: E402
from rlpipe.core.base import schema  # noqa: E402
from rlpipe.core.base.errors import UserError  # noqa: E402
from rlpipe.core.run.pipeline import Pipeline  # noqa: E402
from rlpipe.tools.report import write_report  # noqa: E402
from rlpipe.plugins.collectors.hf import HFCollector  # noqa: E402
from rlpipe.plugins.rewards.reward_model import (  # noqa: E402
    load_classifier, load_rm_tokenizer, score_texts)
from rlpipe.tools.train_rm import load_rm_config, train_reward_model  # noqa: E402

HERE = Path(__file__).resolve().parent
SAMPLE_OPENINGS = ["I watched this film last night and", "The plot of this movie",
                   "The cinematography in this film", "I put this on for family movie night and"]
PROMPT = 'Complete this movie review in one sentence: "{}"'


class RecordingPipeline(Pipeline):
    """A `Pipeline` that also keeps every sample's reward-model score, step by step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rm_scores: list[list[float]] = []

    def step(self):
        batch, metrics = super().step()
        self.rm_scores.append(batch[schema.SCORE_PARTS, "reward_model"].tolist())
        return batch, metrics


def greedy(pipe: Pipeline, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy completions of ``prompts`` by the pipeline's current policy (chat template on)."""
    collector = HFCollector(pipe.ctx, max_new_tokens=max_new_tokens, temperature=0.0,
                            chat_template=True)
    return list(collector.collect(prompts)[schema.RESPONSE_TEXT])


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of config.yaml")
    parser.add_argument("--rm", action="append", default=[], metavar="KEY=VALUE",
                        help="override of reward_model.yaml (repeatable)")
    parser.add_argument("--output-dir", default="runs/quickstart")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    out, progress, t0 = Path(args.output_dir).resolve(), not args.no_progress, time.perf_counter()

    print("== 1/3  reward model: MiniLM-L6 learns which review completions people prefer")
    rm_cfg = load_rm_config(HERE / "reward_model.yaml",
                            [f"output_dir={out / 'reward_model'}", *args.rm])
    rm_dir = train_reward_model(rm_cfg, overwrite=True, progress=progress)

    print("== 2/3  PPO: SmolLM2-135M-Instruct learns to please the reward model")
    cfg = load_config(HERE / "config.yaml", [f"run.output_dir={out / 'ppo'}",
                                             f"rewards.0.path={rm_dir}", *args.overrides])
    for extra in ("samples.txt", "rm_scores.json"):  # ours: --overwrite deletes only rlpipe's files
        (out / "ppo" / extra).unlink(missing_ok=True)
    pipe = RecordingPipeline(cfg, overwrite=True, progress=progress)
    prompts = [PROMPT.format(o) for o in SAMPLE_OPENINGS]
    max_new = int(cfg.collector.args.get("max_new_tokens", 64))
    before = greedy(pipe, prompts, max_new)
    run_dir = pipe.train()
    after = greedy(pipe, prompts, max_new)

    print("== 3/3  before and after (greedy), scored by the reward model")
    rm, rm_tok = load_classifier(rm_dir), load_rm_tokenizer(rm_dir)
    scores = score_texts(rm, rm_tok, prompts * 2, before + after).tolist()
    lines = []
    for i, prompt in enumerate(prompts):
        lines += [f"\n{prompt}",
                  f"  before [{scores[i]:+.2f}] {before[i].strip()}",
                  f"  after  [{scores[len(prompts) + i]:+.2f}] {after[i].strip()}"]
    summary = curve_summary(pipe.rm_scores)
    text = "\n".join(lines + ["", summary])
    print(text)
    (run_dir / "samples.txt").write_text(text + "\n")
    (run_dir / "rm_scores.json").write_text(json.dumps(pipe.rm_scores))
    plots = write_report(run_dir)
    print(f"\nreward model: {rm_dir}\nPPO run:      {run_dir}  (metrics.jsonl, final/, samples.txt)"
          f"\nplots:        {plots[0]}\n              {plots[0].parent}/reward.png, kl.png, ..."
          f"\ntotal time:   {(time.perf_counter() - t0) / 60:.1f} min")
    return run_dir


def curve_summary(rm_scores: list[list[float]]) -> str:
    """The reward-model score per step, and the first-5 vs last-5 comparison of the README."""
    means = [statistics.fmean(s) for s in rm_scores]
    k = min(5, len(means) // 2) or 1
    first, last = statistics.fmean(means[:k]), statistics.fmean(means[-k:])
    spread = statistics.pstdev(rm_scores[0]) if len(rm_scores[0]) > 1 else float("nan")
    return (f"reward/reward_model per step: {' '.join(f'{m:+.2f}' for m in means)}\n"
            f"mean of the first {k} steps {first:+.2f}, of the last {k} steps {last:+.2f} "
            f"({last - first:+.2f} = {(last - first) / spread:+.1f} x the step-1 std {spread:.2f})")


if __name__ == "__main__":
    try:
        main()
    except UserError as exc:
        sys.exit(f"error: {exc}")
