"""Prompt data: a .txt file (one prompt per line) or .jsonl (a ``prompt`` field per line), served
in seeded, reshuffled passes.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "p.txt"
>>> _ = p.write_text("a\\nb\\nc\\n")
>>> stream = PromptStream(load_prompts(p), batch_size=2, shuffle=False)
>>> stream.next_batch(), stream.next_batch()
(['a', 'b'], ['c', 'a'])
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlpipe.core.base.errors import UserError
from rlpipe.core.base.files import read_jsonl, read_text


def load_prompts(path: Path, field: str = "prompt") -> list[str]:
    """Texts of a .txt file (one per non-empty line) or a .jsonl file (``field`` of each line)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file not found: {path}")
    if path.suffix not in (".txt", ".jsonl"):   # a .csv read as lines would train on its header
        raise UserError(f"{path}: unsupported file type {path.suffix or '(none)'!r}; use .txt "
                        f"(one text per line) or .jsonl (a {field!r} field per line)")
    if path.suffix == ".jsonl":
        prompts = []
        for n, row in read_jsonl(path):
            if not isinstance(row.get(field), str):
                raise UserError(f"{path}:{n}: expected an object with a string field {field!r}")
            prompts.append(row[field])
    else:
        prompts = [line for line in read_text(path).splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"{path}: no texts found")
    return prompts


class PromptStream:
    """Endless batches of prompts: each pass over the data is a fresh seeded permutation."""

    def __init__(self, prompts: list[str], batch_size: int, shuffle: bool = True, seed: int = 0):
        if batch_size < 1:
            raise UserError(f"data.batch_size must be >= 1, got {batch_size}")
        self.prompts, self.batch_size, self.shuffle = prompts, batch_size, shuffle
        self.generator = torch.Generator().manual_seed(seed)
        self.order: list[int] = []
        self.position = 0   # prompts served so far (for logging and resume)

    def next_batch(self) -> list[str]:
        batch = []
        while len(batch) < self.batch_size:
            if not self.order:
                n = len(self.prompts)
                perm = torch.randperm(n, generator=self.generator) if self.shuffle else torch.arange(n)
                self.order = perm.tolist()
            batch.append(self.prompts[self.order.pop(0)])
            self.position += 1
        return batch


class PtxStream:
    """Batches of pretraining/SFT text for the PPO-ptx language-modelling loss (InstructGPT's
    remedy for the alignment tax); each process reads its own share."""

    def __init__(self, cfg, tokenizer, dist):
        texts = load_prompts(cfg.data, field="text")
        self.stream = PromptStream(texts, cfg.batch_size * dist.world, shuffle=True, seed=1)
        self.tokenizer, self.max_tokens, self.dist = tokenizer, cfg.max_tokens, dist
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id

    def next_batch(self, device) -> dict[str, torch.Tensor]:
        texts = self.stream.next_batch()[self.dist.rank::self.dist.world]
        rows = [self.tokenizer(t, truncation=True, max_length=self.max_tokens)["input_ids"]
                for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
                "labels": labels.to(device)}
