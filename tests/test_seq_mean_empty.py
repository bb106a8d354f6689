"""seq-mean-* loss aggregation divides by the non-empty sequences (as verl and OpenRLHF do):
a hand computation, zero-length rows that change nothing, and the trainer's ``num_seqs``."""

import pytest
import torch
from tensordict import TensorDict

from rlpipe.core.base import schema as S
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.plugins.losses.ppo import PPOLoss, aggregate_loss

from tests.test_trainer import tiny

MASK = torch.tensor([[True, True, False], [True, False, False], [False, False, False],
                     [True, True, True]])
LOSS = torch.tensor([[1.0, 3.0, 7.0], [5.0, 7.0, 7.0], [9.0, 9.0, 9.0], [2.0, 4.0, 6.0]])


@pytest.mark.parametrize("mode,expected", [
    ("seq-mean-token-mean", (2.0 + 5.0 + 4.0) / 3),   # (1+3)/2, 5/1, (2+4+6)/3 over 3 rows
    ("seq-mean-token-sum", (4.0 + 5.0 + 12.0) / 3),
    ("token-mean", (1 + 3 + 5 + 2 + 4 + 6) / 6),
])
def test_hand_computation_with_an_empty_row(mode, expected):
    """The loss module's own fallback counts (no ``num_seqs`` in the batch): 3 non-empty rows of 4."""
    td = TensorDict({S.LOG_PROB: torch.zeros(4, 3), S.OLD_LOG_PROB: torch.zeros(4, 3),
                     S.ADVANTAGE: -LOSS, S.RESPONSE_MASK: MASK}, batch_size=[4])
    assert PPOLoss(agg=mode)(td)["loss_objective"].item() == pytest.approx(expected)
    assert aggregate_loss(LOSS, MASK, mode, num_tokens=6, num_seqs=3).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_empty_rows_do_not_dilute_the_loss(mode):
    keep = MASK.any(-1)
    td = TensorDict({S.LOG_PROB: torch.zeros(4, 3), S.OLD_LOG_PROB: torch.zeros(4, 3),
                     S.ADVANTAGE: -LOSS, S.RESPONSE_MASK: MASK}, batch_size=[4])
    with_empty = PPOLoss(agg=mode)(td)["loss_objective"]
    without = PPOLoss(agg=mode)(td[keep])["loss_objective"]
    assert with_empty.item() == pytest.approx(without.item(), rel=1e-6)


class Recording(torch.nn.Module):
    """Wraps a loss and records each micro-batch's ``num_seqs`` and the minibatch it came from."""

    def __init__(self, loss):
        super().__init__()
        self.loss, self.seen = loss, []

    def forward(self, td):
        self.seen.append((float(td[S.NUM_SEQS][0]), int(td[S.RESPONSE_MASK].any(-1).sum())))
        return self.loss(td)


def test_trainer_counts_non_empty_sequences(tmp_path, monkeypatch):
    """One minibatch per epoch, one micro-batch: num_seqs is the minibatch's non-empty rows,
    with two responses emptied after collection."""
    pipe = Pipeline(tiny(tmp_path, "run.steps=1", "train.minibatches=1", "train.epochs=1"),
                    progress=False)
    score = pipe._score_tokens

    def emptied(td):
        td[S.RESPONSE_MASK][:2] = False
        score(td)
    monkeypatch.setattr(pipe, "_score_tokens", emptied)
    pipe.updater.loss = Recording(pipe.updater.loss)
    batch, _ = pipe.step()
    n = batch.batch_size[0] - 2   # every call of the loss (two per micro-batch: `critic_terms`)
    assert pipe.updater.loss.seen and all(seen == (n, n) for seen in pipe.updater.loss.seen)
