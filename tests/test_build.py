"""core/run/build.py: devices, seeds, models, plugins (resolved once, by `load_config`), optimizers and
learning-rate schedules, each against what the README's config reference promises."""

import math
import random
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from rlpipe.core.config.plan import plan_run
from rlpipe.core.run import build
from rlpipe.core.step import optim
from rlpipe.core.contracts import registry
from rlpipe.core.contracts.kinds import UNDECLARED, AdvantageContract, advantage_contract
from rlpipe.core.config.settings import PluginConfig, load_config
from rlpipe.core.base.errors import UserError

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
DIST = f"rlpipe {version('rlpipe')}"


def tiny(*overrides):
    return load_config(TINY, list(overrides))


def test_seed_everything_repeats_torch_and_python_draws():
    draws = []
    for _ in range(2):
        build.seed_everything(123)
        draws.append((torch.rand(3).tolist(), random.random()))
    assert draws[0] == draws[1]
    build.seed_everything(124)
    assert (torch.rand(3).tolist(), random.random()) != draws[0]


def test_resolve_device():
    cuda = torch.cuda.is_available()
    assert build.resolve_device("auto") == torch.device("cuda" if cuda else "cpu")
    assert build.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match=r"^run\.device: "):
        build.resolve_device("banana")
    if not cuda:
        with pytest.raises(UserError, match=r"run\.device: 'cuda:1' requested but CUDA is not available"):
            build.resolve_device("cuda:1")


def test_load_config_resolves_every_plugin_and_build_does_not_again(monkeypatch, ctx):
    cfg = tiny()
    sections = {"collectors": [cfg.collector], "rewards": cfg.rewards,
                "advantages": [cfg.advantage], "losses": [cfg.loss]}
    for group, group_sections in sections.items():
        for section in group_sections:
            assert isinstance(section.resolved, registry.Plugin)
            assert (section.resolved.spec.group, section.resolved.spec.name) == (group, section.name)

    def no_lookup(*args):
        raise AssertionError(f"plugin looked up again: {args}")

    for name in ("get", "load", "resolve", "find"):
        monkeypatch.setattr(registry, name, no_lookup)
    assert build.needs_critic(cfg) is True
    plan = plan_run(cfg)
    plugins = build.build_plugins(cfg, ctx, plan)
    assert plan.budgets.new_tokens == 24  # build_run's RunContext hands it to every plugin
    assert registry.label_of(plugins.collector) == f"collector (rlpipe.collectors:hf ({DIST}))"
    assert [registry.label_of(part) for part in plugins.rewards.parts] == [
        f"rewards.0 (rlpipe.rewards:length ({DIST}))", f"rewards.1 (rlpipe.rewards:loop ({DIST}))"]
    assert plugins.rewards.labels == ["length", "loop"] and plugins.rewards.weights == [1.0, 1.0]
    assert type(plugins.advantage).__name__ == "GAE" and type(plugins.loss).__name__ == "PPOLoss"


def test_a_section_built_or_renamed_by_hand_is_resolved_afresh():
    cfg = tiny()
    cfg.advantage.name = "grpo"  # still holds gae's resolution
    assert build.needs_critic(cfg) is False
    assert cfg.advantage.resolved.spec.name == "grpo"
    cfg.advantage = PluginConfig("gae")  # never seen by load_config
    assert cfg.advantage.resolved is None and build.needs_critic(cfg) is True


def test_needs_critic_follows_the_contract_and_an_undeclared_advantage_gets_a_critic():
    class NoCritic(torch.nn.Module):
        @classmethod
        def contract(cls, **args):
            return AdvantageContract(needs_critic=False)

    class Legacy(torch.nn.Module):  # loose attribute: read for one release, with a warning
        needs_critic = False

    class Undeclared(torch.nn.Module):
        pass

    class Quoted(torch.nn.Module):  # issue 54: a string is not False
        needs_critic = "False"

    cfg = tiny()
    spec = cfg.advantage.resolved.spec

    def critic(cls):
        cfg.advantage.resolved = registry.Plugin(spec, cls)
        return build.needs_critic(cfg)

    assert critic(NoCritic) is False and critic(Undeclared) is True
    assert advantage_contract(Undeclared) == UNDECLARED and not UNDECLARED.declared
    with pytest.warns(DeprecationWarning, match="needs_critic are deprecated"):
        assert critic(Legacy) is False
    with pytest.warns(DeprecationWarning), pytest.raises(
            UserError, match=r"^advantage \(rlpipe.advantages:gae .*\): AdvantageContract: "
                             r"needs_critic must be True or False, got 'False'$"):
        critic(Quoted)


def test_frozen_reference_is_a_detached_copy_and_critic_follows_need():
    cfg = tiny()
    models = build.build_models(cfg, torch.device("cpu"), need_critic=False)
    assert models.critic is None and models.offload_to is None
    ref, actor = models.frozen_reference, models.actor
    assert ref is not actor and not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in actor.parameters())
    for (name, a), (_, r) in zip(actor.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, r) and a.data_ptr() != r.data_ptr(), name
    with models.reference() as used:
        assert used is ref
    with_critic = build.build_models(cfg, torch.device("cpu"), need_critic=True)
    assert with_critic.critic is not None and not with_critic.critic.shared


def test_shared_backbone_refuses_a_critic_path_or_lora(tmp_path):
    model = TINY.parent / "model"
    for extra in (f"models.critic.path={model}", "models.critic.lora={r: 2}"):
        cfg = tiny("models.critic.shared_backbone=true", extra)
        with pytest.raises(UserError, match="models.critic.shared_backbone: the critic is the actor's"):
            build.build_models(cfg, torch.device("cpu"), need_critic=True)
    cfg = tiny("models.critic.shared_backbone=true")
    assert build.build_models(cfg, torch.device("cpu"), need_critic=False).critic is None


def test_merged_lora_copy_computes_what_the_lora_actor_computes():
    cfg = tiny("models.actor.lora={r: 4, alpha: 8}")
    models = build.build_models(cfg, torch.device("cpu"), need_critic=False)
    assert models.frozen_reference is None  # the reference is the actor without its adapters
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in models.actor.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)  # lora_B starts at zero: make the adapters change something
    ids = torch.randint(4, 30, (2, 7))
    with torch.no_grad():
        expected = models.actor(input_ids=ids).logits
        with models.reference() as base:
            plain = base(input_ids=ids).logits
        merged = build.merged_lora_copy(cfg.models.actor, models.actor.state_dict())
        got = merged(input_ids=ids).logits
    assert not hasattr(merged, "disable_adapter") and not merged.training
    assert not torch.allclose(expected, plain, atol=1e-3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_trainable_skips_frozen_and_excluded_parameters():
    shared = torch.nn.Linear(2, 2)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    head = torch.nn.Linear(2, 1)
    module = torch.nn.ModuleDict({"shared": shared, "frozen": frozen, "head": head})
    got = optim.trainable(module, exclude=torch.nn.ModuleDict({"s": shared}))
    assert [id(p) for p in got] == [id(head.weight), id(head.bias)]
    assert len(optim.trainable(module)) == 4


def test_make_optimizer_is_adamw_with_the_configured_rates():
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = optim.make_optimizer(params, lr=0.01, weight_decay=0.1)
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["fused"]) == (0.01, 0.1, True)


def lrs(cfg, n: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = optim.make_scheduler(opt, cfg.train, cfg.run.steps)
    out = []
    for _ in range(n):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_constant_schedule_warms_up_linearly():
    cfg = tiny("train.warmup_steps=3")
    assert lrs(cfg, 6) == pytest.approx([1 / 4, 2 / 4, 3 / 4, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("warmup", [0, 2])
def test_cosine_schedule_reaches_zero_after_the_last_optimizer_step(warmup):
    cfg = tiny("train.schedule=cosine", f"train.warmup_steps={warmup}", "run.steps=3",
               "train.epochs=2", "train.minibatches=2")
    total = 3 * 2 * 2  # run.steps x epochs x minibatches optimizer steps
    expected = [(i + 1) / (warmup + 1) if i < warmup else
                0.5 * (1 + math.cos(math.pi * (i - warmup) / (total - warmup)))
                for i in range(total + 1)]
    got = lrs(cfg, total + 1)
    assert got == pytest.approx(expected, abs=1e-12)
    assert got[-1] == pytest.approx(0.0, abs=1e-12) and min(got[:-1]) > 0


def test_cosine_schedule_ends_at_min_lr_ratio():
    cfg = tiny("train.schedule=cosine", "train.min_lr_ratio=0.25", "train.warmup_steps=0",
               "run.steps=2", "train.epochs=1", "train.minibatches=2")
    total = 2 * 1 * 2
    # verl's cosine with min_lr_ratio: floor + (1 - floor) * (1 + cos(pi t / T)) / 2
    expected = [0.25 + 0.75 * 0.5 * (1 + math.cos(math.pi * i / total)) for i in range(total + 1)]
    got = lrs(cfg, total + 1)
    assert got == pytest.approx(expected, abs=1e-12)
    assert got[0] == pytest.approx(1.0) and got[-1] == pytest.approx(0.25)
