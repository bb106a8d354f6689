"""Data-parallel training with PyTorch's own engine: torchrun processes, FSDP2 ``fully_shard``.

Each rank generates and scores its share of the step's prompts; the scored rollout is gathered so
every rank holds the same global batch (KL shaping, advantages and whitening are then global and
identical everywhere); in the update each rank takes its slice of every global minibatch, and
losses are normalised by the global token count (divided by the world size, since FSDP averages
gradients over ranks). Rank 0 writes
metrics, checkpoints and the final policy. NCCL on GPU, gloo on CPU.

    rlpipe run CONFIG distributed.nproc=2          # launches torchrun itself
    torchrun --nproc_per_node=2 -m rlpipe.cli run CONFIG   # or by hand (multi-node: usual flags)

>>> Dist().world, Dist().is_main
(1, True)
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rlpipe.core import schema as S

_PROMPT_KEYS = (S.PROMPT_IDS, S.PROMPT_MASK)


def launched() -> bool:
    """True inside a torchrun worker."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(argv: list[str], nproc: int) -> int:
    """Re-run this command under torchrun with ``nproc`` processes on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "rlpipe.cli", *argv]
    return subprocess.call(cmd)


@dataclass
class Dist:
    """This process's place in the job; a single process is ``Dist()`` (rank 0 of 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        """Average scalar metrics over ranks (same keys on every rank)."""
        if not self.enabled or not metrics:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        values = values.to(_collective_device())
        dist.all_reduce(values)
        return dict(zip(keys, (values / self.world).tolist()))

    def gather(self, td: TensorDict) -> TensorDict:
        """Concatenate every rank's rollout in rank order (prompts re-left-padded, responses
        re-right-padded to the longest, group ids offset to stay unique)."""
        if not self.enabled:
            return td
        parts: list = [None] * self.world
        dist.all_gather_object(parts, td.cpu())
        width_p = max(p[S.PROMPT_IDS].shape[1] for p in parts)
        width_r = max(p[S.RESPONSE_IDS].shape[1] for p in parts)
        offset, padded = 0, []
        for part in parts:
            part = _pad(part, width_p, width_r)
            part[S.GROUP_ID] = part[S.GROUP_ID] + offset
            offset = int(part[S.GROUP_ID].max()) + 1 if part.batch_size[0] else offset
            padded.append(part)
        return torch.cat(padded).to(td.device)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order (a plain ``[obj]`` in a single process)."""
        if not self.enabled:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def _pad(td: TensorDict, width_p: int, width_r: int) -> TensorDict:
    r = td[S.RESPONSE_IDS].shape[1]
    for key, value in td.items():
        if not isinstance(value, torch.Tensor) or value.ndim < 2:
            continue
        if key in _PROMPT_KEYS:
            td[key] = torch.nn.functional.pad(value, (width_p - value.shape[1], 0))
        elif value.shape[1] == r:
            td[key] = torch.nn.functional.pad(value, (0, width_r - r))
    return td


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")


def init(device_name: str) -> tuple[Dist, str]:
    """Join the torchrun job if this process is in one; returns (Dist, device name to use)."""
    if not launched() or int(os.environ["WORLD_SIZE"]) == 1:
        return Dist(), device_name
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = device_name != "cpu" and torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device_name = f"cuda:{local_rank}"
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank), device_name


def shutdown(wait: bool = True) -> None:
    """Leave the job cleanly (a process group left alive aborts the process at exit); ``wait``
    for the other ranks first, except after an error, when they may never arrive."""
    if dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Transformer blocks: the classes a Hugging Face model declares in ``_no_split_modules``."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def shard(model: torch.nn.Module, bf16: bool = False) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each transformer block, then the root; bf16 compute with fp32
    gradient reduction when ``bf16``. FSDP averages gradients over ranks, so the trainer gives
    the loss ``global count / world`` as its normaliser (the sum over all ranks' tokens / count)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for module in [*_blocks(model), model]:
        fully_shard(module, mp_policy=mp)
    return model


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's full (unsharded) state dict on CPU; a collective under FSDP (call on all ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))


def load_full_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (possibly a subset: LoRA adapters) into a plain or sharded module."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=False))
