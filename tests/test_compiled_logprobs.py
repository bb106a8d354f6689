"""``models.compile_logprobs``: `token_logprobs`' chunk kernels under ``torch.compile`` give the
eager kernels' numbers (float32 round-off apart) and the float64 oracle's, through a whole
training step too; a machine where they cannot compile gets one line at build time.

Also the eager path's ``set_materialize_grads(False)``: an entropy taken as a metric (no graph)
hands backward no gradient, so backward runs no entropy pass over the vocabulary.

Inductor compiles C++ on CPU (a few seconds a graph); every test here shares the kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlpipe.core.base import ops
from rlpipe.core.base.errors import UserError
from rlpipe.core.config.settings import load_config
from rlpipe.core.run import build
from rlpipe.core.run.pipeline import Pipeline
from tests.conftest import logged_metrics
from tests.test_fast_ops import autograd_reference, float64_oracle


def inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 9, 97, generator=gen) * 4).to(dtype)
    return logits, torch.randint(97, (3, 7), generator=gen)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compiled_kernels_match_eager_and_the_float64_oracle(monkeypatch, temperature):
    monkeypatch.setattr(ops, "CHUNK_ELEMENTS", 300)  # 3 positions of 97 a chunk, ragged
    logits, ids = inputs(torch.float32)
    gen = torch.Generator().manual_seed(1)
    g, h = torch.randn(ids.shape, generator=gen), torch.randn(ids.shape, generator=gen)
    grads = {}
    for compiled in (False, True):
        x = logits.clone().requires_grad_()
        logp, ent = ops.token_logprobs(x, ids, 1, temperature, with_entropy=True,
                                       entropy_grad=True, compiled=compiled)
        ((logp * g).sum() + (ent * h).sum()).backward()
        grads[compiled] = (logp.detach(), ent.detach(), x.grad)
    # the compiled kernels sum in another order: float32 round-off of the logits' size (~20
    # here) in the entropy's log Z - sum p x, as against the oracle; the rest well inside 1e-5
    for eager, comp, atol in zip(grads[False], grads[True], (1e-5, 1e-4, 1e-5)):
        torch.testing.assert_close(comp, eager, rtol=1e-6, atol=atol)
    oracle_logp, oracle_ent = float64_oracle(logits, ids, 1, temperature)
    torch.testing.assert_close(grads[True][0].double(), oracle_logp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grads[True][1].double(), oracle_ent, rtol=1e-6, atol=1e-4)
    ref = logits.double().requires_grad_()
    want_logp, want_ent = autograd_reference(ref, ids, 1, temperature, entropy_grad=True)
    ((want_logp * g).sum() + (want_ent * h).sum()).backward()
    torch.testing.assert_close(grads[True][2].double(), ref.grad, rtol=1e-5, atol=1e-5)


def test_compiled_bfloat16_gradient_is_bfloat16_and_matches_autograd():
    logits, ids = inputs(torch.bfloat16, seed=3)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    autograd_reference(a, ids, 0, 1.0, False)[0].sum().backward()
    logp, _ = ops.token_logprobs(b, ids, 0, compiled=True)
    logp.sum().backward()
    assert logp.dtype == torch.float32 and b.grad.dtype == torch.bfloat16
    # both round a float32 gradient of at most 1 to bf16 once: at most one bf16 step apart
    torch.testing.assert_close(b.grad.float(), a.grad.float(), rtol=0, atol=2 ** -8)


def test_an_entropy_without_a_graph_costs_backward_no_pass(monkeypatch):
    seen = []
    kernel = ops._chunk_backward

    def spy(x, ids, grad_logp, entropy, grad_entropy, temperature):
        seen.append(grad_entropy)
        return kernel(x, ids, grad_logp, entropy, grad_entropy, temperature)

    monkeypatch.setattr(ops, "_chunk_backward", spy)
    logits, ids = inputs(torch.float32)
    x = logits.clone().requires_grad_()
    logp, ent = ops.token_logprobs(x, ids, 1, with_entropy=True)  # entropy: a metric
    (logp.sum() + ent.sum()).backward()
    assert seen and all(g is None for g in seen)
    seen.clear()
    x.grad = None
    logp, ent = ops.token_logprobs(x, ids, 1, with_entropy=True, entropy_grad=True)
    (logp.sum() + ent.sum()).backward()
    assert seen and all(g is not None for g in seen)


def test_a_training_step_with_compiled_logprobs_matches_eager(tmp_path):
    """One step: the same rollout, then scoring and the update with either kernels."""
    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
    rows = {}
    for compiled in (False, True):
        cfg = load_config(tiny, [f"run.output_dir={tmp_path / str(compiled)}", "run.steps=1",
                                 "data.batch_size=4", "collector.max_new_tokens=8",
                                 f"models.compile_logprobs={str(compiled).lower()}"])
        Pipeline(cfg, overwrite=True, progress=False).train()
        [rows[compiled]] = logged_metrics(tmp_path / str(compiled))
    assert rows[True].keys() == rows[False].keys()
    for key in ("kl/ref", "policy/loss", "policy/approx_kl", "policy/entropy", "value/loss"):
        assert rows[True][key] == pytest.approx(rows[False][key], rel=1e-4, abs=1e-6), key


def test_a_machine_that_cannot_compile_gets_one_line(monkeypatch):
    def broken(device, dtype):
        raise RuntimeError("Cannot find a working triton installation.\nmore detail")

    monkeypatch.setattr(ops, "check_compiled", broken)
    with pytest.raises(UserError) as err:
        build._check_compile(torch.device("cpu"), torch.float32)
    message = str(err.value)
    assert "\n" not in message and "working triton" in message
    assert message.startswith("models.compile_logprobs:") and "false" in message


def test_a_recompile_that_cannot_write_its_cache_is_one_line(monkeypatch, tmp_path):
    """Issue 54: the kernels built at start, then a later recompile (here: a new dtype) finds
    TORCHINDUCTOR_CACHE_DIR unusable (a path under a file: even root cannot create it). Inductor's
    real failure comes back as one `UserError` line naming the setting, not its page."""
    torch._dynamo.reset()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    ops.check_compiled(torch.device("cpu"), torch.float32)
    (tmp_path / "file").write_text("")
    torch._dynamo.reset()   # whatever other tests compiled: this one recompiles
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(UserError) as err:
        ops.check_compiled(torch.device("cpu"), torch.float64)
    message = str(err.value)
    assert "\n" not in message and message.startswith("models.compile_logprobs: torch.compile "
                                                      "could not build the log-prob kernels (")
    assert "TORCHINDUCTOR_CACHE_DIR" in message and message.endswith("compile_logprobs: false")
