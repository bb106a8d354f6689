"""Data-parallel training with PyTorch's own engine: torchrun processes, FSDP2 ``fully_shard``.

Each rank generates and scores its share of the step's prompts; the scored rollout is gathered so
every rank holds the same global batch (KL shaping, advantages and whitening are then global and
identical everywhere); in the update each rank takes its slice of every global minibatch, and
losses are normalised by the global token count (divided by the world size, since FSDP averages
gradients over ranks). Rank 0 writes metrics, checkpoints and the final policy. NCCL on GPU, gloo
on CPU.

    rlpipe run CONFIG distributed.nproc=2          # launches torchrun itself (rlpipe/tools/launch.py)
    torchrun --nproc_per_node=2 -m rlpipe.cli run CONFIG   # or by hand / a scheduler: joins it

>>> Dist().world, Dist().is_main
(1, True)
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from tensordict import NonTensorStack, TensorDict, is_leaf_nontensor

from rlpipe.core.base import schema as S
from rlpipe.core.base.errors import UserError

_PROMPT_KEYS = (S.PROMPT_IDS, S.PROMPT_MASK)


def launched() -> bool:
    """True inside a torchrun worker."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass
class Dist:
    """This process's place in the job; a single process is ``Dist()`` (rank 0 of 1)."""

    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def share(self, items: list) -> list:
        """This rank's contiguous share of ``items`` (the shares gathered in rank order restore
        them).

        >>> Dist(rank=1, world=2).share([0, 1, 2, 3, 4])
        [3, 4]
        """
        size = -(-len(items) // self.world)
        return items[self.rank * size:(self.rank + 1) * size]

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
        re-right-padded to the longest, group ids offset to stay unique).

        Tensor collectives: each tensor is padded to the largest batch and width of any rank,
        the tensors of one dtype travel as one flat buffer (on the GPU under NCCL), and the texts
        as one pickled object: five collectives in all. The previous `all_gather_object` of
        whole TensorDicts pickled every tensor through host memory (BENCHMARKS.md, "Collectives")."""
        if not self.enabled:
            return td
        r = td[S.RESPONSE_IDS].shape[1]
        shape = torch.tensor([td.batch_size[0], td[S.PROMPT_IDS].shape[1], r],
                             device=_collective_device())
        rows, width_p, width_r = _all_gather(shape, self.world).T.tolist()
        width_p, width_r = max(width_p), max(width_r)
        tensors, texts = {}, {}
        # is_leaf_nontensor: the texts and non-tensor data columns too (tensordict's default
        # leaves_only=True skips non-tensor entries, which then vanished from the gathered batch)
        for key in td.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor):
            value = td.get(key)
            if isinstance(value, torch.Tensor):
                tensors[key] = _pad_rows(_pad(value, key, width_p, width_r, r), max(rows))
            else:
                texts[key] = list(value.tolist())
        out = TensorDict({}, batch_size=[sum(rows)], device=td.device)
        for key, parts in _all_gather_packed(tensors, self.world).items():
            out.set(key, torch.cat([p[:n] for p, n in zip(parts, rows)]).to(td.device))
        text_parts = self.gather_object(texts)
        for key in texts:
            out.set(key, NonTensorStack(*(x for part in text_parts for x in part[key])))
        ids, start, offset = out[S.GROUP_ID], 0, 0
        for n in rows:  # rank k's groups follow rank k-1's
            ids[start:start + n] += offset
            offset = int(ids[start:start + n].max()) + 1 if n else offset
            start += n
        return out

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


def _pad(value: torch.Tensor, key, width_p: int, width_r: int, r: int) -> torch.Tensor:
    """Prompt-shaped tensors left-padded to ``width_p``, response-shaped ones (width ``r``)
    right-padded to ``width_r``; [B] tensors as they are."""
    if value.ndim < 2:
        return value
    if key in _PROMPT_KEYS:
        return torch.nn.functional.pad(value, (width_p - value.shape[1], 0))
    if value.shape[1] == r:
        return torch.nn.functional.pad(value, (0, width_r - r))
    return value


def _pad_rows(value: torch.Tensor, rows: int) -> torch.Tensor:
    extra = value.new_zeros((rows - value.shape[0], *value.shape[1:]))
    return torch.cat([value, extra])


def _all_gather_packed(tensors: dict, world: int) -> dict:
    """``{key: [world, *shape]}`` for tensors of the same shapes on every rank: one all-gather
    per dtype, of the tensors flattened into one buffer."""
    by_dtype: dict = {}
    for key, value in tensors.items():
        by_dtype.setdefault(value.dtype, []).append(key)
    out = {}
    for keys in by_dtype.values():
        flat = torch.cat([tensors[k].reshape(-1) for k in keys]).to(_collective_device())
        parts, offset = _all_gather(flat, world), 0
        for key in keys:
            n = tensors[key].numel()
            out[key] = parts[:, offset:offset + n].reshape(world, *tensors[key].shape)
            offset += n
    return out


def _all_gather(value: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's ``value`` (same shape on all ranks), stacked in rank order: [world, ...];
    bool travels as uint8 (gloo has no bool all-gather)."""
    send = value.to(torch.uint8) if value.dtype == torch.bool else value.contiguous()
    parts = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(parts, send)
    out = torch.stack(parts)
    return out.to(torch.bool) if value.dtype == torch.bool else out


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")


def init(device_name: str, timeout_s: float = 600.0) -> tuple[Dist, str]:
    """Join the torchrun job if this process is in one; returns (Dist, device name to use).
    A collective that waits more than ``timeout_s`` (a rank died or hangs) raises instead of
    blocking forever."""
    if not launched() or _job_env()[1] == 1:
        return Dist(), device_name
    rank, world, local_rank = _job_env()
    use_cuda = device_name != "cpu" and torch.cuda.is_available()
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if use_cuda else "gloo",
                                    timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError, dist.DistError) as exc:  # the store never answered
            at = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            raise UserError(f"rank {rank} of {world} could not join the job at {at} within "
                            f"distributed.timeout_s={timeout_s:g} s "
                            f"({' '.join(str(exc).split())[:200]})") from exc
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device_name = f"cuda:{local_rank}"
    return Dist(dist.get_rank(), dist.get_world_size()), device_name


def _job_env() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) of a torchrun worker; a half-set environment (a variable
    missing or not a number, RANK outside the world) is one `UserError` naming it."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        raise UserError(f"this process looks like a torchrun worker (LOCAL_RANK and WORLD_SIZE "
                        f"are set) but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
                        f" not: start it with torchrun (or distributed.nproc / nnodes), or unset "
                        f"LOCAL_RANK and WORLD_SIZE")
    try:
        rank, world, local = (int(os.environ[n]) for n in names[:3])
        int(os.environ["MASTER_PORT"])
    except ValueError:
        raise UserError(f"torchrun variables must be integers: "
                        f"{', '.join(f'{n}={os.environ[n]!r}' for n in names[:3])}, "
                        f"MASTER_PORT={os.environ['MASTER_PORT']!r}") from None
    if not (0 <= rank < world and 0 <= local <= rank):
        raise UserError(f"torchrun variables disagree: RANK={rank}, WORLD_SIZE={world}, "
                        f"LOCAL_RANK={local} (0 <= LOCAL_RANK <= RANK < WORLD_SIZE)")
    return rank, world, local


LAUNCHER_ENV = "RLPIPE_LAUNCHED"   # set by rlpipe.tools.launch for its workers
LOST_PEER_EXIT = 3                 # a worker that stopped because another one failed
_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|[Tt]imed out|timeout|"
                   r"NCCL communicator was aborted|ProcessGroup.*(aborted|shut ?down)")


def lost_peer(exc: BaseException) -> str | None:
    """For a collective that failed because another process died or hung, one line saying so;
    None for any other error (which keeps its traceback)."""
    if not (dist.is_available() and isinstance(exc, (RuntimeError, dist.DistError))):
        return None
    text = str(exc).strip()
    if not launched() or not _LOST.search(text):
        return None
    return (f"a collective failed because another process of the job died or hung (waited at "
            f"most distributed.timeout_s): {text.splitlines()[0][:200]}")


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
    the loss ``global count / world`` as its normaliser (the sum over all ranks' tokens / count).
    The mesh is on the process group's device: FSDP's default mesh is CUDA wherever a GPU is
    visible, which breaks a gloo (CPU) job on a machine with fewer GPUs than processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    mesh = init_device_mesh(_collective_device().type, (dist.get_world_size(),))
    for module in [*_blocks(model), model]:
        fully_shard(module, mesh=mesh, mp_policy=mp)
    return model


@contextmanager
def unsharded(model: torch.nn.Module):
    """Inside the block, an FSDP2-sharded ``model`` holds its full parameters and runs with no
    collective: for generation, where ranks call the model a different number of times (rows end
    at different tokens), which would deadlock FSDP's per-forward all-gathers. A plain model
    passes through. Costs one full copy of the weights per rank for the block's duration.

    Enter it outside ``torch.inference_mode()``: parameters gathered there would be inference
    tensors, which FSDP's next all-gather (in the trainer's scoring pass) cannot write into."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        yield model
        return
    root = modules[0]
    # FSDP2 takes the first FSDP module to run forward as the root; peft's generate enters the
    # base model, below the root, so settle the root here first (torch has no public call).
    root._get_fsdp_state()._lazy_init()
    for m in modules:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for m in modules:  # FSDP2's defaults: blocks reshard after forward, the root does not
            m.set_reshard_after_forward(m is not root, recurse=False)
            m.reshard()


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's full (unsharded) state dict on CPU; a collective under FSDP (call on all ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))


def load_full_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (possibly a subset: LoRA adapters) into a plain or sharded module."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=False))


def sharded_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict as it lies: each rank's DTensor shards under FSDP (no gather)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module)


def load_sharded_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a `sharded_state` (possibly a subset: LoRA adapters) back into ``module``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(strict=False))
