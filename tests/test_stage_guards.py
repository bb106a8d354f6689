"""Stages may not corrupt the batch, and a failure names its real culprit (issue 39): a reward
that writes into the batch is refused on one line naming the key; ``mis`` masking more than
``rollout_correction.max_masked_frac`` of the tokens stops the run on one line; an engine's
non-finite log-probs are blamed on the engine, in every mode that uses them."""

from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlpipe.core.base import schema as S
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.contracts.reward_fn import wrap_reward_function
from rlpipe.core.step.rewards import RewardComposer
from rlpipe.plugins.collectors.hf import HFCollector
from rlpipe.plugins.losses.ppo import PPOLoss

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
FAST = ["run.steps=1", "data.batch_size=4", "collector.max_new_tokens=6", "train.epochs=1",
        "log.progress=false"]


def batch() -> TensorDict:
    return TensorDict({S.PROMPT_TEXT: NonTensorStack("a", "b"),
                       S.RESPONSE_TEXT: NonTensorStack("x", "y"),
                       S.RESPONSE_MASK: torch.ones(2, 3, dtype=torch.bool)}, batch_size=[2])


def masks_everything(prompts, responses, response_mask, **batch):
    response_mask[:] = False  # the red-team reward: training silently off
    return [1.0] * len(prompts)


class WritesAKey(torch.nn.Module):
    def forward(self, td):
        td["advantage"] = torch.zeros(td.batch_size[0], 3)
        return torch.ones(td.batch_size[0])


class ReplacesTheMask(torch.nn.Module):
    def forward(self, td):
        td[S.RESPONSE_MASK] = torch.zeros_like(td[S.RESPONSE_MASK])
        return torch.ones(td.batch_size[0])


@pytest.mark.parametrize("module, said", [
    (wrap_reward_function(masks_everything)(), "changed 'response_mask' in place"),
    (WritesAKey(), "wrote 'advantage'"),
    (ReplacesTheMask(), "replaced 'response_mask'"),
])
def test_a_reward_that_writes_into_the_batch_is_refused(module, said):
    td = batch()
    with pytest.raises(UserError, match=f"reward 'r' {said} in the batch"):
        RewardComposer([("r", 1.0, module)])(td)


def test_a_reward_that_only_reads_is_fine():
    td = RewardComposer([("r", 1.0, wrap_reward_function(
        lambda prompts, responses, **batch: [len(r) for r in responses])())])(batch())
    assert td[S.SCORE].tolist() == [1.0, 1.0] and bool(td[S.RESPONSE_MASK].all())


def shifted_engine(monkeypatch, change):
    """The hf collector with its engine log-probs changed by ``change`` (a broken engine)."""
    real = HFCollector.collect

    def collect(self, prompts):
        td = real(self, prompts)
        td[S.ENGINE_LOG_PROB] = change(td[S.ENGINE_LOG_PROB])
        return td
    monkeypatch.setattr(HFCollector, "collect", collect)


def test_mis_that_masks_most_tokens_stops_on_one_line(tmp_path, monkeypatch):
    """log w = 2 on every token: beyond log C (C = 2), mis would mask 100% and train nothing."""
    shifted_engine(monkeypatch, lambda x: x - 2.0)
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", *FAST,
                             "rollout_correction.mode=mis"])
    with pytest.raises(UserError, match=r"mode: mis masked (\d+) of \1 response tokens \(100% > "
                                        r"max_masked_frac 0.5\).*rlpipe check"):
        Pipeline(cfg, progress=False).train()
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run2'}", *FAST,
                             "rollout_correction.mode=mis", "rollout_correction.max_masked_frac=1"])
    Pipeline(cfg, progress=False).train()  # asked for: the user's call


@pytest.mark.parametrize("mode", ["bypass", "tis", "mis"])
def test_non_finite_engine_log_probs_blame_the_engine(mode, tmp_path, monkeypatch):
    shifted_engine(monkeypatch, lambda x: torch.where(torch.arange(x.shape[1], device=x.device) == 1,
                                                    torch.nan, x))
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", *FAST,
                             f"rollout_correction.mode={mode}"])
    with pytest.raises(UserError, match=r"the engine's log-probs \('engine_log_prob' of the "
                                        r"collector \(rlpipe.collectors:hf .*\) are NaN or inf on \d+ of \d+ "
                                        r"response tokens.*not the actor") as err:
        Pipeline(cfg, progress=False).train()
    assert "train.lr" not in str(err.value) and "old_log_prob" not in str(err.value)


class DetachedLoss(PPOLoss):
    """Its loss terms carry no gradient (computed from detached tensors)."""

    def forward(self, td):
        out = super().forward(td)
        for key in [k for k in out.keys() if isinstance(k, str) and k.startswith("loss_")]:
            out[key] = out[key].detach()
        return out


def test_a_loss_without_a_gradient_is_one_line_naming_it(tmp_path):
    """torch's "element 0 of tensors does not require grad" named neither the plugin nor why."""
    cfg = load_config(TINY, [f"run.output_dir={tmp_path / 'run'}", *FAST])
    with pytest.raises(UserError, match=r"DetachedLoss.*: none of its loss terms \(loss_.*\) has "
                                        r"a gradient, so nothing would train"):
        Pipeline(cfg, progress=False, loss=DetachedLoss()).train()


def test_a_data_column_named_like_a_reward_setting_reaches_it_unless_the_config_sets_it():
    """Issue 52: the column reaches the parameter of its name, as TRL passes every column (it was
    refused); a value the config sets wins, on one warning line."""
    def longer(prompts, responses, min_tokens=4, **batch):
        return [float(len(r) >= int(m)) for r, m in zip(responses, min_tokens)]
    td = batch()
    td["data", "min_tokens"] = NonTensorStack("1", "9")
    assert RewardComposer([("r", 1.0, wrap_reward_function(longer)())])(td)[S.SCORE].tolist() == [1, 0]
    with pytest.warns(UserWarning, match="the config sets min_tokens=\\['0', '0'\\], so the data "
                                         "column 'min_tokens' does not reach it"):
        composer = RewardComposer([("r", 1.0, wrap_reward_function(longer)(min_tokens=["0", "0"]))])
        assert composer(td)[S.SCORE].tolist() == [1, 1]
