"""This round's CPU speed-ups change no result beyond float32 round-off:

- `flush_denormals` (``run.flush_denormals``): denormals flushed on every torch thread, not only
  the calling one (what `torch.set_flush_denormal` alone does); the gradient of the chunked
  log-softmax differs from IEEE arithmetic by less than the smallest normal float, and a fused
  AdamW step from it leaves bit-identical parameters.
- `merged_weights` (``models.*.lora.merged_passes``): a LoRA model's no-grad forward on
  ``W + s B A`` equals the adapters' forward within round-off (float64 here), the frozen base is
  restored bit for bit, and the HF collector's rollout with merged weights is the unmerged one.
- `keep_freed_memory` (``run.keep_freed_memory``): a large block freed and allocated again costs
  no page faults (glibc's default maps fresh pages each time), and a run gives the same metrics
  and weights with it as without it (a read of uninitialised memory would show up here: fresh
  pages are zeros, a reused block holds old values).
"""

from __future__ import annotations

import copy
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from rlpipe.core.models.denormals import flush_denormals
from rlpipe.core.models.lora import allow_merging, merged_weights
from rlpipe.core.base.ops import token_logprobs
from rlpipe.plugins.collectors.hf import HFCollector
from tests.conftest import final_weights, logged_metrics, run_cli

TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32, 1.18e-38


@pytest.fixture
def flush_off():
    yield
    flush_denormals(False)  # leave the process as IEEE as other tests expect


def denormals_left(threads: int) -> int:
    """How many products of denormals stayed denormal (nonzero) with ``threads`` torch threads;
    4 Mi elements, so every thread of the team gets a share."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return int((torch.full((1 << 22,), 1e-39) * 0.5).count_nonzero())
    finally:
        torch.set_num_threads(before)


def test_flush_denormals_reaches_every_thread(flush_off):
    flush_denormals(False)  # a Pipeline built by an earlier test turned it on
    assert denormals_left(2) > 0  # IEEE: 5e-40 is representable
    if not flush_denormals(True):
        pytest.fail("this x86/ARM CPU has no flush-to-zero control")
    assert denormals_left(1) == 0 and denormals_left(2) == 0
    torch.set_flush_denormal(False)        # the calling thread alone...
    torch.set_flush_denormal(True)
    flush_denormals(False)
    assert denormals_left(2) > 0            # ...and off again everywhere


def test_flush_denormals_changes_the_update_below_the_smallest_normal(flush_off):
    """Logits with a wide spread make the log-softmax backward produce denormals (p ~ e^-90);
    flushed, they are 0: every gradient entry moves by less than 1.2e-38 / temperature (a
    denormal that the backward's final division by the temperature would have scaled), and one
    fused AdamW
    step from either gradient gives the same parameters, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 9, 512, generator=gen) * 30
    ids = torch.randint(512, (4, 8), generator=gen)

    def grad_and_step():
        x = logits.clone().requires_grad_(True)
        logp, _ = token_logprobs(x, ids, 1, temperature=0.7)
        logp.sum().backward()
        param = torch.nn.Parameter(torch.randn(x.shape, generator=torch.Generator().manual_seed(1)))
        param.grad = x.grad.clone()
        torch.optim.AdamW([param], lr=1e-3, fused=True).step()
        return x.grad, param.detach()

    flush_denormals(False)
    ieee_grad, ieee_param = grad_and_step()
    denormal = (ieee_grad != 0) & (ieee_grad.abs() < TINY)
    assert denormal.sum() > 100  # the case exists: IEEE arithmetic made denormals
    flush_denormals(True)
    flushed_grad, flushed_param = grad_and_step()
    assert not ((flushed_grad != 0) & (flushed_grad.abs() < TINY)).any()
    assert (flushed_grad - ieee_grad).abs().max() < TINY / 0.7
    assert torch.equal(flushed_param, ieee_param)


def lora_llama(tiny_model, allow: bool = True):
    """A float64 copy of the tiny Llama with non-zero LoRA adapters on every linear layer."""
    torch.manual_seed(1)
    model = get_peft_model(copy.deepcopy(tiny_model).double(), LoraConfig(r=4, lora_alpha=8,
                           target_modules="all-linear", init_lora_weights=False)).eval()
    return allow_merging(model) if allow else model


def test_merged_forward_equals_the_adapters_and_restores_the_base(tiny_model):
    model = lora_llama(tiny_model)
    ids = torch.randint(model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(2))
    ids = ids.to(model.device)
    bases = {n: p.clone() for n, p in model.named_parameters() if "base_layer" in n}
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with merged_weights(model) as merged:
            fused = model(input_ids=ids).logits
        again = model(input_ids=ids).logits  # after the block: the adapters' own path
    assert merged == 14  # 7 linear layers x 2 blocks
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-10)
    assert torch.equal(again, plain)
    assert all(torch.equal(p, bases[n]) for n, p in model.named_parameters() if n in bases)
    with merged_weights(model) as with_grad:  # gradients on: the adapters must train
        assert with_grad == 0
    with torch.no_grad(), merged_weights(lora_llama(tiny_model, allow=False)) as not_allowed:
        assert not_allowed == 0


def test_collector_rollout_on_merged_weights_is_the_unmerged_one(ctx, tiny_model):
    """Greedy rollouts of the same LoRA actor with and without merging: the same tokens, and
    engine log-probs within float64 round-off."""
    prompts = ["the cat sat on the mat", "hello", "big red dog"]
    ctx.actor = lora_llama(tiny_model, allow=False)
    plain = HFCollector(ctx, max_new_tokens=6, temperature=0).collect(prompts)
    allow_merging(ctx.actor)
    merged = HFCollector(ctx, max_new_tokens=6, temperature=0).collect(prompts)
    assert torch.equal(merged["response_ids"], plain["response_ids"])
    torch.testing.assert_close(merged["engine_log_prob"], plain["engine_log_prob"], rtol=0,
                               atol=1e-9)


# ---- keep_freed_memory ------------------------------------------------------------------------

FAULTS = """
import resource, sys, torch
from rlpipe.core.models.cpu_memory import keep_freed_memory
assert keep_freed_memory(sys.argv[1] == "on")
for step in range(30):                     # a 64 MiB tensor made and freed at every step
    if step == 20:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(1 << 24)
    del x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_reuses_large_blocks_without_page_faults():
    """The last 10 of 30 steps: every page faulted anew by glibc's default (a fresh mapping each
    time), almost none with the setting (a freed heap block, already resident, is reused; glibc
    needs a few steps to coalesce torch's 64-byte-aligned blocks before it can)."""
    pages = 10 * (1 << 26) // 4096
    faults = {mode: int(subprocess.run([sys.executable, "-c", FAULTS, mode], check=True,
                                       capture_output=True, text=True).stdout)
              for mode in ("off", "on")}
    assert faults["off"] > 0.9 * pages
    assert faults["on"] < 0.05 * pages


def test_a_run_is_the_same_with_and_without_kept_memory(tmp_path):
    """The tiny example (its logits, 78 MiB, are above glibc's mmap limit) with the setting on
    and off: identical metrics and final weights."""
    config = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
    runs = {}
    for on in (True, False):
        out = tmp_path / str(on)
        result = run_cli(["run", config, f"run.output_dir={out}", "run.steps=2", "--no-progress",
                          f"run.keep_freed_memory={str(on).lower()}"])
        assert result.returncode == 0, result.stderr[-2000:]
        runs[on] = (logged_metrics(out), final_weights(out))
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 2
    assert all(torch.equal(runs[True][1][k], runs[False][1][k]) for k in runs[False][1])
