"""What a step's rollout looked like: the batch statistics people watch, and sample files.

`step_stats` turns the scored batch into metrics (reward spread per component, the response-length
distribution, the largest per-sequence KL, value and return means). `sample_rows` picks
``log.samples`` samples of a step (evenly spaced over the batch: no random draw, so the training
RNG is untouched) and `write_samples` writes them to ``RUN_DIR/samples/step-N.jsonl``, one JSON
object per sample: prompt, response, score, each reward part, length, finished flag, KL; a
multi-turn sample also its conversation, turns, stop reason and receipt (`turn_fields`), which
``samples.md`` shows one message a line (`conversation_lines`).

>>> import torch
>>> from tensordict import TensorDict
>>> mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
>>> td = TensorDict({"response_mask": mask, "score": torch.tensor([0.0, 1.0]),
...                  "finished": torch.tensor([True, False])}, batch_size=[2])
>>> kl_tok = torch.tensor([[0.1, 0.1, 0.0], [0.2, 0.2, 0.2]])
>>> stats = step_stats(td, kl_tok, max_new_tokens=3)
>>> stats["response/length_max"], stats["response/clipped_frac"], round(stats["kl/ref_max"], 3)
(3.0, 0.5, 0.6)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from rlpipe.core.base import schema as S
from rlpipe.core.base.ops import masked_mean
from rlpipe.core.base.errors import writing

SAMPLES_DIR = "samples"


def spread(name: str, values: torch.Tensor) -> dict[str, float]:
    """``NAME/std`` (population: over the step's samples, 0 for one sample), ``/min``, ``/max``.

    >>> spread("reward/score", torch.tensor([1.0, 3.0]))
    {'reward/score/std': 1.0, 'reward/score/min': 1.0, 'reward/score/max': 3.0}
    """
    values = values.detach().double()
    return {f"{name}/std": float(values.std(correction=0)), f"{name}/min": float(values.min()),
            f"{name}/max": float(values.max())}


def flat_groups(score: torch.Tensor, group_id: torch.Tensor,
                tol: float = 1e-6) -> tuple[torch.Tensor, int]:
    """``(flat, groups)``: per sample, whether its group (samples sharing ``group_id``, at least
    two) scored every sample the same (max - min <= ``tol``), so a group-relative advantage is 0
    for all of them; and how many groups of two or more samples there are.

    >>> flat_groups(torch.tensor([1.0, 1.0, 0.0, 2.0, 5.0]), torch.tensor([0, 0, 1, 1, 2]))
    (tensor([ True,  True, False, False, False]), 2)
    """
    groups, member = torch.unique(group_id, return_inverse=True)
    score = score.detach().double()
    high = score.new_full((len(groups),), -math.inf).scatter_reduce(0, member, score, "amax")
    low = score.new_full((len(groups),), math.inf).scatter_reduce(0, member, score, "amin")
    size = torch.bincount(member, minlength=len(groups))
    flat = (high - low <= tol) & (size >= 2)
    return flat[member], int((size >= 2).sum())


def zero_std_frac(score: torch.Tensor, group_id: torch.Tensor) -> dict[str, float]:
    """``{"reward/zero_std_frac": f}``: the fraction of groups (of two or more samples) whose
    scores are all equal (TRL's ``frac_reward_zero_std``); empty with no such group (n = 1).

    >>> zero_std_frac(torch.tensor([1.0, 1.0, 0.0, 2.0]), torch.tensor([0, 0, 1, 1]))
    {'reward/zero_std_frac': 0.5}
    >>> zero_std_frac(torch.tensor([1.0, 2.0]), torch.tensor([0, 1]))
    {}
    """
    flat, groups = flat_groups(score, group_id)
    if not groups:
        return {}
    ids, member = torch.unique(group_id, return_inverse=True)
    per_group = torch.zeros(len(ids), dtype=torch.bool).index_put_((member.cpu(),), flat.cpu())
    return {"reward/zero_std_frac": float(per_group.sum()) / groups}


def step_stats(batch, kl_tok: torch.Tensor, max_new_tokens: int = 0,
               has_critic: bool = False) -> dict[str, float]:
    """The rollout's statistics beyond the means: ``reward/score`` and ``reward/<label>``
    spread, response length maximum and 90th percentile (linear interpolation, as numpy's
    default), the fraction cut at ``max_new_tokens`` (when known, else: not finished), the largest
    per-sequence KL, the fraction of groups whose scores are all equal, and with a critic the
    masked means of the values and of the returns."""
    mask = batch[S.RESPONSE_MASK]
    lengths = mask.sum(-1).double()
    out = spread("reward/score", batch[S.SCORE])
    if S.GROUP_ID in batch.keys():
        out.update(zero_std_frac(batch[S.SCORE], batch[S.GROUP_ID]))
    if S.SCORE_PARTS in batch.keys():
        for label, part in batch[S.SCORE_PARTS].items():
            out.update(spread(f"reward/{label}", part))
    clipped = (lengths >= max_new_tokens) & ~batch[S.FINISHED] if max_new_tokens else ~batch[S.FINISHED]
    out.update({"response/length_max": float(lengths.max()),
                "response/length_p90": float(torch.quantile(lengths, 0.9)),
                "response/clipped_frac": float(clipped.double().mean()),
                "kl/ref_max": float(kl_tok.sum(-1).max())})
    if has_critic:
        out["value/mean"] = float(masked_mean(batch[S.VALUE].double(), mask))
        if S.VALUE_TARGET in batch.keys():
            out["returns/mean"] = float(masked_mean(batch[S.VALUE_TARGET].double(), mask))
    return out


def _pick(size: int, k: int) -> list[int]:
    """``k`` indices evenly spaced over ``range(size)`` (all of them when ``k >= size``).

    >>> _pick(16, 4), _pick(3, 4)
    ([0, 5, 10, 15], [0, 1, 2])
    """
    if k >= size:
        return list(range(size))
    if k == 1:
        return [0]
    return [round(i * (size - 1) / (k - 1)) for i in range(k)]


def _number(x: float) -> float | None:
    return x if math.isfinite(x) else None


def sample_rows(batch, kl_tok: torch.Tensor, k: int) -> list[dict]:
    """``k`` samples of the scored batch as JSON-ready dicts."""
    mask = batch[S.RESPONSE_MASK]
    parts = batch[S.SCORE_PARTS] if S.SCORE_PARTS in batch.keys() else {}
    keys = batch.keys()
    prompts = batch[S.PROMPT_TEXT] if S.PROMPT_TEXT in keys else None  # lists of str
    responses = batch[S.RESPONSE_TEXT] if S.RESPONSE_TEXT in keys else None
    kl_seq = kl_tok.sum(-1)
    turns = turn_fields(batch)
    rows = []
    for i in _pick(batch.batch_size[0], k):
        rows.append({
            "index": i,
            "prompt": prompts[i] if prompts is not None else None,
            "response": responses[i] if responses is not None else None,
            "score": _number(float(batch[S.SCORE][i])),
            "rewards": {label: _number(float(v[i])) for label, v in parts.items()},
            "length": int(mask[i].sum()),
            "finished": bool(batch[S.FINISHED][i]),
            "kl": _number(float(kl_seq[i])),
            **turns[i],
        })
    return rows


def turn_fields(batch) -> list[dict]:
    """Per sample of a multi-turn batch (one with ``conversation``): its chat messages, the
    policy's turns and tokens, why it stopped, its receipt, the environment's counts (and its
    error, if one ended the row); ``{}`` per sample of a single-turn batch.

    >>> from tensordict import NonTensorStack, TensorDict
    >>> td = TensorDict({"num_turns": torch.tensor([2]), "stop_reason": torch.tensor([0]),
    ...                  "action_mask": torch.tensor([[True, False, True]]),
    ...                  "env": {"tool_calls": torch.tensor([1]), "receipt": torch.tensor([0])}},
    ...                 batch_size=[1])
    >>> td["conversation"] = NonTensorStack([{"role": "user", "content": "hi"}])
    >>> td["env", "error"] = NonTensorStack("")
    >>> turn_fields(td)[0]
    {'conversation': [{'role': 'user', 'content': 'hi'}], 'turns': 2, 'action_tokens': 2, 'stop_reason': 'done', 'receipt': 'exact', 'env': {'tool_calls': 1}}
    >>> turn_fields(TensorDict({}, batch_size=[2]))
    [{}, {}]
    """
    size = batch.batch_size[0]
    if S.CONVERSATION not in batch.keys():
        return [{} for _ in range(size)]
    env = batch[S.ENV]
    counts = {k: env[k].tolist() for k in env.keys()
              if k != "receipt" and isinstance(env[k], torch.Tensor)}
    errors = env["error"] if "error" in env.keys() else [""] * size
    conversations, turns = batch[S.CONVERSATION], batch[S.NUM_TURNS].tolist()
    actions = S.action_mask(batch).sum(-1).tolist()
    out = []
    for i in range(size):
        row = {"conversation": list(conversations[i]), "turns": turns[i],
               "action_tokens": actions[i],
               "stop_reason": S.STOP_REASONS[int(batch[S.STOP_REASON][i])],
               "receipt": S.RECEIPTS[int(env["receipt"][i])],
               "env": {k: v[i] for k, v in counts.items()}}
        out.append({**row, "error": errors[i]} if errors[i] else row)
    return out


def write_samples(run_dir: Path, step: int, rows: list[dict]) -> Path:
    """``run_dir/samples/step-N.jsonl`` (replaced whole, so a resumed step rewrites its file)."""
    folder = Path(run_dir) / SAMPLES_DIR
    path = folder / f"step-{step}.jsonl"
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, f"the samples of step {step}"):
        folder.mkdir(exist_ok=True)
        tmp.write_text("".join(json.dumps({"step": step, **row}) + "\n" for row in rows),
                       encoding="utf-8")
        os.replace(tmp, path)
    return path


def sample_files(run_dir: Path, prefix: str = "step-") -> list[tuple[int, Path]]:
    """``(step, path)`` of the run's ``samples/PREFIX<N>.jsonl`` files, by step."""
    folder = Path(run_dir) / SAMPLES_DIR
    found = []
    for path in folder.glob(f"{prefix}*.jsonl") if folder.is_dir() else []:
        number = path.stem[len(prefix):]
        if number.isdigit():
            found.append((int(number), path))
    return sorted(found)


def markdown_table(rows: list[dict]) -> str:
    """Samples as a Markdown table (TensorBoard's text plugin renders Markdown)."""
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    head = "| prompt | response | score | length | finished | kl |\n|---|---|---|---|---|---|\n"
    return head + "".join(f"| {cell(r['prompt'])} | {cell(r['response'])} | {r['score']} | "
                          f"{r['length']} | {r['finished']} | {r['kl']} |\n" for r in rows)


def _cut(text, limit: int = 300) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit] + " …"


def _side_by_side(first: tuple[int, Path], last: tuple[int, Path], what: str) -> list[str]:
    a, b = ([json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]
            for _, p in (first, last))
    lines = [f"## {what}: step {first[0]} vs step {last[0]}", "",
             f"| # | step {first[0]} prompt | response | score | step {last[0]} prompt | response "
             f"| score |", "|---|---|---|---|---|---|---|"]
    for i in range(max(len(a), len(b))):
        cells = []
        for side in (a, b):
            row = side[i] if i < len(side) else {}
            score = row.get("score")
            cells += [_cut(row.get("prompt", "")), _cut(row.get("response", "")),
                      f"{score:.3g}" if isinstance(score, (int, float)) else ""]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines.append("")
    for (step, _), side in zip((first, last), (a, b)):
        talks = [(i, row) for i, row in enumerate(side) if row.get("conversation")]
        if talks:
            lines += [f"### Conversations, step {step}", ""]
            for i, row in talks:
                lines += conversation_lines(row, i + 1) + [""]
    return lines


def conversation_lines(row: dict, number: int) -> list[str]:
    """A multi-turn sample as Markdown: a header (turns, stop reason, receipt, score), then one
    message a line, its role first, the environment's answers marked (``tool`` results with the
    tool's name), each message cut at 300 characters.

    >>> row = {"turns": 2, "stop_reason": "done", "receipt": "exact", "score": 1.0,
    ...        "conversation": [{"role": "user", "content": "2+3?"},
    ...                         {"role": "assistant", "content": "<call>add</call>"},
    ...                         {"role": "tool", "name": "add", "content": "5"},
    ...                         {"role": "assistant", "content": "5"}]}
    >>> print("\\n".join(conversation_lines(row, 1)))
    **#1** · 2 turns · stop `done` · receipt `exact` · score 1
    <BLANKLINE>
    - **user:** 2+3?
    - **assistant, turn 1:** <call>add</call>
    - ⟶ **tool result** (add): 5
    - **assistant, turn 2:** 5
    """
    score = row.get("score")
    head = (f"**#{number}** · {row.get('turns')} turns · stop `{row.get('stop_reason')}` · "
            f"receipt `{row.get('receipt')}`" +
            (f" · score {score:.3g}" if isinstance(score, (int, float)) else ""))
    lines, turn = [head, ""], 0
    for message in row["conversation"]:
        role, text = message.get("role", "?"), _cut(message.get("content", ""))
        if role == "assistant":
            turn += 1
            lines.append(f"- **assistant, turn {turn}:** {text}")
        elif role == "tool":
            name = f" ({message['name']})" if message.get("name") else ""
            lines.append(f"- ⟶ **tool result**{name}: {text}")
        else:
            lines.append(f"- **{role}:** {text}")
    if row.get("error"):
        lines.append(f"- ⚠ environment error: {_cut(row['error'])}")
    return lines


def first_vs_last(run_dir: Path) -> str | None:
    """Markdown: the first and the last step's samples side by side (training samples, and held-out
    ``eval-step-N`` samples when the run wrote them); None without sample files."""
    sections = []
    for prefix, what in (("step-", "Training samples"), ("eval-step-", "Held-out samples")):
        found = sample_files(run_dir, prefix)
        if found:
            sections += _side_by_side(found[0], found[-1], what)
    if not sections:
        return None
    return "\n".join([f"# Samples of {Path(run_dir).name}", "",
                      "Responses cut at 300 characters; full text in `samples/`.", "", *sections])
