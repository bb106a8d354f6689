"""GPU-only tests (marked ``gpu``; skipped where torch sees no CUDA device, as on CI).

Run them on a GPU machine with the rest of the suite on CUDA::

    RLPIPE_TEST_DEVICE=cuda python -m pytest            # every test on the GPU
    python -m pytest -m gpu tests/test_gpu.py           # these alone

They cover what only a GPU shows: offload moving real device memory, bf16 activation
checkpointing, fused AdamW on CUDA, ``run.device: auto`` choosing CUDA, FSDP2 on NCCL with bf16
mixed precision, and a run that moves between GPU and CPU through its checkpoints.
"""

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from rlpipe.core.run import build
from rlpipe.core.step import optim
from rlpipe.core.config.settings import load_config
from rlpipe.core.run.pipeline import Pipeline
from tests.conftest import logged_metrics

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
FAST = ["run.steps=1", "train.epochs=1", "data.batch_size=4", "collector.max_new_tokens=8"]


def tiny(tmp_path, *overrides):
    return load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", "run.device=cuda", *FAST,
                              *overrides])


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_device_auto_picks_cuda(tmp_path):
    assert build.resolve_device("auto").type == "cuda"
    pipe = Pipeline(tiny(tmp_path, "run.device=auto"), progress=False)
    assert next(pipe.models.actor.parameters()).device.type == "cuda"
    assert next(pipe.models.critic.parameters()).device.type == "cuda"


def test_reference_offload_moves_real_memory(tmp_path):
    pipe = Pipeline(tiny(tmp_path, "models.reference.offload=true"), progress=False)
    ref_bytes = sum(p.numel() * p.element_size() for p in pipe.models.frozen_reference.parameters())
    torch.cuda.synchronize()
    idle = torch.cuda.memory_allocated()
    assert next(pipe.models.frozen_reference.parameters()).device.type == "cpu"
    with pipe.models.reference() as ref:
        assert next(ref.parameters()).device.type == "cuda"
        visiting = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert visiting - idle >= ref_bytes            # the weights really were on the GPU
    assert torch.cuda.memory_allocated() <= idle   # and really left it again
    pipe.train()                                   # and a step runs with it


def test_bf16_activation_checkpointing_trains(tmp_path):
    run_dir = Pipeline(tiny(tmp_path, "models.actor.dtype=bfloat16",
                            "models.actor.gradient_checkpointing=true",
                            "models.critic.gradient_checkpointing=true", "run.steps=2"),
                       progress=False).train()
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert all(v == v for k, v in row.items() if isinstance(v, float)), row  # no NaN


def test_adamw_is_fused_on_cuda():
    params = [torch.nn.Parameter(torch.randn(4, 4, device="cuda"))]
    assert optim.make_optimizer(params, 1e-3, 0.0).defaults["fused"] is True


def test_gpu_run_resumes_on_cpu_and_back(tmp_path):
    common = ["checkpoint.every=1"]
    Pipeline(tiny(tmp_path, *common), progress=False).train()                        # step 1: GPU
    Pipeline(tiny(tmp_path, *common, "run.device=cpu", "run.steps=2"), progress=False,
             resume=True).train()                                                   # step 2: CPU
    run_dir = Pipeline(tiny(tmp_path, *common, "run.steps=3"), progress=False,
                       resume=True).train()                                         # step 3: GPU
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    assert (run_dir / "final" / "config.json").is_file()


@pytest.fixture
def nccl_world_of_one():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=60))
    torch.cuda.set_device(0)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("bf16", [False, True])
def test_fsdp2_world_of_one_on_nccl(nccl_world_of_one, tiny_model, bf16):
    """``fully_shard`` on NCCL gives the unsharded model's loss and gradients (bf16 compute:
    within bf16 round-off, with fp32 parameters and gradients kept)."""
    import copy

    from rlpipe.core.models.distributed import shard

    plain = copy.deepcopy(tiny_model).cuda()
    sharded = shard(copy.deepcopy(tiny_model).cuda(), bf16=bf16)
    ids = torch.randint(4, plain.config.vocab_size, (2, 12), device="cuda")
    loss_plain = plain(input_ids=ids, labels=ids).loss
    loss_plain.backward()
    out = sharded(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.logits.dtype == (torch.bfloat16 if bf16 else torch.float32)
    tol = 5e-2 if bf16 else 1e-5
    torch.testing.assert_close(out.loss.float(), loss_plain, atol=tol, rtol=tol)
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
        grad = p.grad.full_tensor()
        assert grad.dtype == torch.float32, name
        torch.testing.assert_close(grad, q.grad, atol=tol, rtol=tol * 10)


def test_sampler_draws_the_same_tokens_on_cuda_as_on_cpu():
    """The sampler's uniforms come from the CPU generator on every device: the same seed and
    scores give the same tokens on the GPU as on the CPU (before the fix: CUDA's own stream)."""
    from rlpipe.plugins.collectors.hf import sample_from_scores

    scores = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3
    torch.manual_seed(5)
    on_cpu, logp_cpu = sample_from_scores(scores)
    torch.manual_seed(5)
    on_gpu, logp_gpu = sample_from_scores(scores.cuda())
    assert torch.equal(on_gpu.cpu(), on_cpu)
    torch.testing.assert_close(logp_gpu.cpu(), logp_cpu, atol=1e-5, rtol=0)


def test_checkpoint_carries_the_cuda_rng(tmp_path):
    """A checkpoint restores the CUDA generator too (what dropout or a plugin draws on the GPU)."""
    pipe = Pipeline(tiny(tmp_path), progress=False)
    torch.cuda.manual_seed(11)
    state = pipe.state_dict()
    want = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(12)
    pipe.load_state_dict(state)
    assert torch.equal(torch.rand(4, device="cuda"), want)


TRAJECTORY_TOL = 1e-3   # float32 on both; no TF32 (torch's default for matmuls)


def test_tiny_example_on_cuda_follows_the_cpu_trajectory(tmp_path):
    """The tiny example (all its steps) on CUDA and on CPU: the same sampled responses (the
    sampler's uniforms come from the CPU generator) and every logged metric within TRAJECTORY_TOL."""
    runs, steps = {}, load_config(TINY).run.steps
    for device in ("cuda", "cpu"):
        cfg = load_config(TINY, [f"run.output_dir={tmp_path / device}", f"run.device={device}"])
        runs[device] = logged_metrics(Pipeline(cfg, progress=False).train())
    assert len(runs["cuda"]) == len(runs["cpu"]) == steps
    for a, b in zip(runs["cuda"], runs["cpu"]):
        assert a.keys() == b.keys()
        for key, value in b.items():
            assert a[key] == pytest.approx(value, abs=TRAJECTORY_TOL), (a["step"], key)


def test_running_out_of_gpu_memory_is_one_line(tmp_path):
    """A real CUDA out-of-memory error (this process may use a millionth of the GPU, less than
    one 2 MiB block of the caching allocator) becomes one `UserError` naming the stage."""
    from rlpipe.core.base.errors import UserError

    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1e-6)
    try:
        with pytest.raises(UserError, match=r"^out of memory in .* GiB allocated \(") as e:
            Pipeline(tiny(tmp_path, "train.grad_accum=1"), progress=False).train()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)
    assert "; to fit, try " in str(e.value)


def test_a_static_cache_compiles_decoding_and_keeps_the_log_probs(tiny_model, tiny_tokenizer):
    """``cache: static`` on CUDA: transformers compiles the decoding step; the drawn tokens'
    log-probs still equal the trainer's forward, over prompt widths in two STATIC_WIDTH steps."""
    from rlpipe.core.base import schema
    from rlpipe.core.base.context import RunContext
    from rlpipe.core.models.lm import response_logprobs
    from rlpipe.plugins.collectors.hf import HFCollector

    model = tiny_model.to("cuda")
    collector = HFCollector(RunContext(tokenizer=tiny_tokenizer, actor=model,
                                       device=torch.device("cuda")),
                            max_new_tokens=16, temperature=1.0, cache="static")
    for prompts in (["the cat", "a dog sat"], ["big red dog " * 30, "one"], ["the cat sat"]):
        batch = collector.collect(prompts)
        keys = (schema.PROMPT_IDS, schema.PROMPT_MASK, schema.RESPONSE_IDS, schema.RESPONSE_MASK)
        trainer, _ = response_logprobs(model, *(batch[k] for k in keys), 1.0)
        gap = (batch[schema.ENGINE_LOG_PROB] - trainer)[batch[schema.RESPONSE_MASK]].abs()
        assert gap.max() < 1e-4, gap.max()
    assert getattr(model, "_compiled_call", None) is not None, "decoding was not compiled"
