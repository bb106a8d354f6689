"""What a plugin may receive at construction besides its config keys.

A plugin constructor that declares a parameter named ``ctx`` gets a `RunContext`; ``ctx`` is
never a config key. Everything else in the constructor signature is set from the config section.

>>> from rlpipe.core.base.context import RunContext
>>> RunContext(max_new_tokens=16).max_new_tokens
16
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class RunContext:
    tokenizer: Any = None               # the policy's Hugging Face tokenizer
    actor: Any = None                   # the trained policy (a transformers causal LM, maybe peft-wrapped)
    device: torch.device = torch.device("cpu")
    max_new_tokens: int = 0             # the collector's response budget (R)
    seed: int = 0
    run_dir: Path | None = None
    shared_prefix: bool = False         # models.shared_prefix: a collector may run shared prompt tokens once
