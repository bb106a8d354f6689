"""Shared pieces of the PPO-step benchmarks (ppo_step.py, scaling.py, memory.py): random-init
model folders, generated rlpipe configs, the machine description and memory probes.

Models are Llama configs with fresh random weights (nothing is downloaded). The tokenizer is the
tiny example's byte-level BPE (``examples/tiny/model``) with added tokens up to the vocabulary
size of the chosen model, so every id the model can sample decodes.

>>> folder = make_assets(Path(tempfile.mkdtemp()), "small")      # doctest: +SKIP
>>> cfg = make_config(folder, batch=16, new_tokens=64)            # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny"
RESULTS = Path(__file__).resolve().parent / "results"

# name: (hidden, layers, heads, intermediate, vocab); kv heads = heads, head dim = hidden / heads
SIZES = {
    "small": (256, 4, 4, 688, 4096),        # ~5.3M parameters: the CPU benchmarks
    "medium": (512, 8, 8, 1376, 4096),      # ~29M: the CPU memory figure
    "300m": (1024, 20, 16, 2816, 32000),    # ~323M: the GPU benchmark
}


# The reward of both implementations: rlpipe's `length` plugin band, written out in plain_ppo.py.
LENGTH_REWARD = {"min_tokens": 4, "max_tokens": 48, "per_token": 0.05, "truncated_penalty": 1.0}


# Public architectures (config.json of the real checkpoints, random weights): the GPU benchmarks.
PUBLIC = {name: Path(__file__).resolve().parent / "gpu" / "configs" / f"{name}.json"
          for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b")}


def model_config(size: str, tokenizer):
    """The transformers config of ``size`` (a `SIZES` Llama or a `PUBLIC` architecture)."""
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if size in PUBLIC:
        raw = {k: v for k, v in json.loads(PUBLIC[size].read_text()).items()
               if not k.startswith("_")}
        return transformers.AutoConfig.for_model(**{**raw, **ids})
    hidden, layers, heads, inter, vocab = SIZES[size]
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
        tie_word_embeddings=False, **ids)


def make_assets(folder: Path, size: str, weights: str | None = None) -> Path:
    """Write ``folder/model`` (config.json + tokenizer) and ``folder/prompts.txt``; with
    ``weights`` (a dtype name) also random weights in that dtype, for ``init: pretrained``: built
    once and loaded by each process, where ``init: random`` builds them again in each."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TINY / "model"))
    config = model_config(size, tokenizer)
    tokenizer.add_tokens([f"<x{i}>" for i in range(config.vocab_size - len(tokenizer))])
    model_dir = folder / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    if weights is not None:
        transformers.AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, weights)).save_pretrained(model_dir)
    shutil.copy(TINY / "prompts.txt", folder / "prompts.txt")
    return folder


def make_reward_model(folder: Path, size: str, dtype: str = "float32") -> Path:
    """``folder/rm``: a sequence-classification model (one output) of ``size``'s architecture,
    random weights, and the tokenizer of ``folder/model`` (call `make_assets` first)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder / "model"))
    config = model_config(size, tokenizer)
    config.num_labels = 1
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, dtype=getattr(torch, dtype))
    model.save_pretrained(folder / "rm")
    tokenizer.save_pretrained(folder / "rm")
    return folder / "rm"


def make_config(folder: Path, *, batch: int, new_tokens: int, device: str = "cpu",
                dtype: str = "float32", lora: bool = False, critic: dict | None = None,
                actor: dict | None = None, epochs: int = 4, minibatches: int = 2,
                reference: dict | None = None, reward_model: dict | None = None,
                init: str = "random", collector: dict | None = None):
    """The rlpipe config of the benchmarks: ``init: random``, one length reward, GAE, PPO,
    temperature-1 sampling over the full vocabulary, no shuffling (every step sees the same
    prompts in the same order as the plain loop). ``lora``: ``models.actor.lora = {r: 8, alpha:
    16}``; ``critic``: the ``models.critic`` section; ``actor``: more ``models.actor`` keys;
    ``init``: ``models.actor.init`` (``pretrained`` needs `make_assets` with ``weights``);
    ``collector``: more ``collector`` keys."""
    from rlpipe.core.config.settings import load_config

    name = (f"{batch}x{new_tokens}{'_lora' if lora else ''}{'_critic' if critic else ''}"
            f"{'_actor' if actor else ''}")
    raw = {
        "run": {"steps": 1000, "seed": 0, "output_dir": str(folder / f"run_{name}"),
                "device": device},
        "models": {"actor": {"path": "model", "init": init, "dtype": dtype,
                             **({"lora": {"r": 8, "alpha": 16}} if lora else {}), **(actor or {})},
                   **({"critic": critic} if critic else {}),
                   **({"reference": reference} if reference else {})},
        "data": {"prompts": "prompts.txt", "batch_size": batch, "shuffle": False},
        "collector": {"name": "hf", "max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
                      "temperature": 1.0, "micro_batch_size": max(batch, 1), **(collector or {})},
        "rewards": [{"name": "length", **LENGTH_REWARD},
                    *([{"name": "reward_model", "path": "rm", **reward_model}]
                      if reward_model is not None else [])],
        "advantage": {"name": "gae", "gamma": 1.0, "lmbda": 0.95, "whiten": True},
        "loss": {"name": "ppo", "clip_low": 0.2, "vf_coef": 0.5, "value_clip": 0.2},
        "kl": {"coef": 0.05},
        "train": {"epochs": epochs, "minibatches": minibatches, "lr": 1e-5, "critic_lr": 5e-5,
                  "forward_batch_size": 16},
        "log": {"progress": False},
    }
    path = folder / f"config_{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_config(path)



def build_pipeline(cfg):
    """An rlpipe Pipeline; the configs above set ``min_new_tokens = max_new_tokens`` (EOS is
    masked until the budget), so both implementations process the same number of tokens."""
    from rlpipe.core.run.pipeline import Pipeline

    return Pipeline(cfg, overwrite=True, progress=False)


def count_params(module: torch.nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)


# ---- the machine and memory ---------------------------------------------------------------

def machine(device: str = "cpu") -> dict:
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
             .splitlines() if line.startswith("model name")] if Path("/proc/cpuinfo").is_file() else []
    info = {"cpu": names[0] if names else platform.processor(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def print_header(title: str, info: dict) -> None:
    gpu = f", {info['gpu']}" if "gpu" in info else ", no GPU"
    print(title)
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads, "
          f"torch {info['torch']}, transformers {info['transformers']}{gpu}; {now()}")
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak(device: str = "cpu") -> None:
    """Start a new peak-memory window: VmHWM := VmRSS (Linux clear_refs 5), CUDA peak stats."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")


def memory_mib(device: str = "cpu") -> tuple[float, float]:
    """(current, peak since `reset_peak`) in MiB: RSS on CPU, allocated tensor memory on CUDA."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / 2**20, torch.cuda.max_memory_allocated() / 2**20
    return _status_kib("VmRSS") / 1024, _status_kib("VmHWM") / 1024


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def write_json(path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": " ".join(["python", *sys.argv]), "date": now(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


def default_json(name: str, device: str) -> Path:
    return RESULTS / (f"{name}.json" if device == "cpu" else f"{name}_{device.replace(':', '')}.json")


def workdir() -> Path:
    """A temporary folder for model assets, configs and run directories, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="rlpipe-bench-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
