"""``rlpipe train-rm``: a Bradley–Terry reward model from preference pairs, for the
``reward_model`` plugin (`rlpipe.plugins.rewards.reward_model`), whose text formatting it shares.

Each JSONL line holds ``prompt``, ``chosen`` and ``rejected``; the loss is
``-log sigmoid(r(prompt, chosen) - r(prompt, rejected) - margin)``. A seeded share of the pairs is
held out, and its pairwise accuracy (how often ``r_chosen > r_rejected``) is printed after every
epoch. The output folder is a ``save_pretrained`` sequence classifier with one output plus its
tokenizer (LoRA adapters merged into a copy), which the ``reward_model`` plugin loads as it is,
and ``metrics.jsonl`` (one JSON object per epoch). Texts are formatted exactly as the plugin
formats them (`rlpipe.plugins.rewards.reward_model.rm_inputs`). Not an entry point itself: the
CLI (``rlpipe train-rm``) and the quickstart call it; core does not import it.

The demo config trains the tiny example's random 2-layer Llama on 40 pairs (a few seconds):

>>> import tempfile
>>> from pathlib import Path
>>> config = Path(__file__).resolve().parents[1] / "examples" / "reward_model" / "config.yaml"
>>> out = Path(tempfile.mkdtemp()) / "rm"
>>> cfg = load_rm_config(config, ["train.epochs=1", "train.device=cpu", f"output_dir={out}"])
>>> trainer = RewardModelTrainer(cfg, progress=False)
>>> len(trainer.train_pairs), len(trainer.eval_pairs)
(32, 8)
>>> trainer.train() == out  # doctest: +ELLIPSIS
epoch 1/1: train loss ..., held-out accuracy ...
True
>>> sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".jsonl", ".safetensors"))[:3]
['config.json', 'metrics.jsonl', 'model.safetensors']
>>> import shutil; shutil.rmtree(out.parent)
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from rlpipe.core.run.build import apply_lora, resolve_device, seed_everything
from rlpipe.core.step.optim import make_optimizer, trainable
from rlpipe.core.run import rundir
from rlpipe.core.base.yamlconf import build_section, read_config_file
from rlpipe.core.config.settings import LoraConfig
from rlpipe.core.observe.console import quiet_libraries
from rlpipe.core.base.files import read_jsonl
from rlpipe.core.base.errors import UserError
from rlpipe.core.base.hub import ModelPath
from rlpipe.core.base.model_files import check_model_dir, check_weights, loading
from rlpipe.plugins.rewards.reward_model import load_rm_tokenizer, rm_inputs, score_texts

FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class RMModelConfig:
    path: ModelPath                                 # a Hugging Face folder or Hub ID: classifier or backbone
    init: Literal["pretrained", "random"] = "pretrained"  # random: fresh weights from config.json
    lora: LoraConfig | None = None                  # None: full fine-tuning; set: LoRA + trained head
    trust_remote_code: bool = False                 # true: allow a folder's own code (auto_map)


@dataclass
class PairsConfig:
    pairs: Path                  # JSONL: {"prompt": ..., "chosen": ..., "rejected": ...} per line
    eval_fraction: float = 0.1   # held-out share of the pairs (seeded split), 0 for none
    max_length: int = 512        # tokens per prompt+response


@dataclass
class RMTrainConfig:
    epochs: int = 1
    batch_size: int = 8          # pairs per optimizer step
    lr: float = 1e-5
    weight_decay: float = 0.0
    margin: float = 0.0          # r_chosen must beat r_rejected by this much
    max_grad_norm: float | None = 1.0
    seed: int = 0
    device: str = "auto"         # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...


@dataclass
class RMConfig:
    model: RMModelConfig
    data: PairsConfig
    train: RMTrainConfig = field(default_factory=RMTrainConfig)
    output_dir: str = "runs/reward_model"  # relative to the working directory


def load_rm_config(path, overrides=()) -> RMConfig:
    """Read a ``train-rm`` YAML file with ``KEY=VALUE`` overrides; check keys, types and values."""
    path = Path(path)
    raw, cli_keys = read_config_file(path, overrides)
    cfg = build_section(RMConfig, raw, path.resolve().parent, cli_keys)
    t, d = cfg.train, cfg.data
    rules = [(t.epochs >= 1, f"train.epochs must be >= 1, got {t.epochs}"),
             (t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}"),
             (t.lr > 0, f"train.lr must be > 0, got {t.lr}"),
             (d.max_length >= 1, f"data.max_length must be >= 1, got {d.max_length}"),
             (0 <= d.eval_fraction < 1, f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")]
    errors = [message for ok, message in rules if not ok]
    if errors:
        raise UserError("; ".join(errors))
    return cfg


def load_pairs(path: Path) -> list[tuple[str, str, str]]:
    """``(prompt, chosen, rejected)`` per non-blank JSONL line; a bad line is an error naming it."""
    pairs = []
    for lineno, row in read_jsonl(path):
        bad = [k for k in FIELDS if not isinstance(row.get(k), str)]
        if bad:
            raise UserError(f"{path}:{lineno}: field {bad[0]!r} is missing or not a string "
                            f"(each line needs string fields {', '.join(FIELDS)})")
        pairs.append((row["prompt"], row["chosen"], row["rejected"]))
    if not pairs:
        raise UserError(f"{path}: no preference pairs")
    return pairs


def split_pairs(pairs: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded ``(train, held_out)`` split; ``ceil(n * eval_fraction)`` pairs are held out.

    >>> split_pairs(list("abcd"), 0.25, seed=0)
    (['b', 'd', 'c'], ['a'])
    """
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = math.ceil(len(pairs) * eval_fraction)
    if n_eval >= len(pairs):
        raise UserError(f"data: {len(pairs)} pairs leave none to train on with "
                        f"eval_fraction={eval_fraction}")
    return [pairs[i] for i in order[n_eval:]], [pairs[i] for i in order[:n_eval]]


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0):
    """Mean of ``-log sigmoid(chosen - rejected - margin)``.

    >>> round(bradley_terry_loss(torch.tensor([1.0]), torch.tensor([1.0])).item(), 4)  # log 2
    0.6931
    """
    return -F.logsigmoid(chosen - rejected - margin).mean()


def build_reward_model(cfg: RMModelConfig, device: torch.device):
    """Tokenizer and one-output classifier (LoRA-wrapped if configured, head kept trainable)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    setting, remote = "model.trust_remote_code", {"trust_remote_code": cfg.trust_remote_code}
    check_model_dir(cfg.path, cfg.trust_remote_code, setting)
    tokenizer = load_rm_tokenizer(cfg.path, cfg.trust_remote_code, setting)
    with loading(cfg.path, "a sequence classifier (model.path)"):
        if cfg.init == "random":
            config = AutoConfig.from_pretrained(str(cfg.path), num_labels=1, **remote)
            model = AutoModelForSequenceClassification.from_config(config, **remote)
        else:
            check_weights(cfg.path)
            model = AutoModelForSequenceClassification.from_pretrained(  # other heads: a fresh one
                str(cfg.path), num_labels=1, ignore_mismatched_sizes=True, **remote)
    model.config.pad_token_id = tokenizer.pad_token_id  # the classifier reads the last non-pad token
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora, "SEQ_CLS", "model.lora")  # peft keeps the head in modules_to_save
    return tokenizer, model.to(device)


def _check_output(cfg: RMConfig, overwrite: bool) -> tuple[Path, str]:
    """The output folder and its `rundir.state`, if it may be used (the same rules as a run
    directory: ``--overwrite`` replaces only an earlier ``train-rm`` output)."""
    out = rundir.output_path(cfg.output_dir, "output_dir")
    return out, rundir.check_output(out, rundir.RM_LAYOUT, overwrite, False, "output_dir",
                                    rundir.input_paths(cfg))


class RewardModelTrainer:
    """Builds data, model and optimizer from an `RMConfig`; `train()` fits, evaluates and saves."""

    def __init__(self, cfg: RMConfig, overwrite: bool = False, progress: bool = True):
        self.cfg, self.progress = cfg, progress
        out, found = _check_output(cfg, overwrite)  # before anything is loaded
        seed_everything(cfg.train.seed)
        self.device = resolve_device(cfg.train.device, "train.device")
        pairs = load_pairs(cfg.data.pairs)
        self.train_pairs, self.eval_pairs = split_pairs(pairs, cfg.data.eval_fraction, cfg.train.seed)
        self.tokenizer, self.model = build_reward_model(cfg.model, self.device)
        self.optimizer = make_optimizer(trainable(self.model), cfg.train.lr, cfg.train.weight_decay)
        self.shuffle = torch.Generator().manual_seed(cfg.train.seed)
        rundir.prepare(out, rundir.RM_LAYOUT, found)
        self.out_dir = out

    def rewards(self, pairs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(r_chosen, r_rejected)`` for a list of pairs, in one forward (with grad)."""
        prompts, chosen, rejected = zip(*pairs)
        enc = rm_inputs(self.tokenizer, [*prompts, *prompts], [*chosen, *rejected],
                        self.cfg.data.max_length)
        scores = self.model(**enc.to(self.device)).logits[:, 0].float()
        return scores[:len(pairs)], scores[len(pairs):]

    def _step(self, pairs) -> tuple[float, float]:
        """One optimizer step on a batch of pairs; returns its loss and pairwise accuracy."""
        t = self.cfg.train
        chosen, rejected = self.rewards(pairs)
        loss = bradley_terry_loss(chosen, rejected, t.margin)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm or math.inf)
        if not (torch.isfinite(loss) and torch.isfinite(norm)):   # never save a NaN model
            raise UserError(f"train-rm: training diverged (loss {loss.item():.4g}, gradient norm "
                            f"{norm.item():.4g}); lower train.lr (now {t.lr:g})"
                            f"{'' if t.max_grad_norm else ' or set train.max_grad_norm'}; "
                            f"no model was saved")
        self.optimizer.step()
        return loss.item(), (chosen > rejected).float().mean().item()

    def _epoch(self, bar) -> dict[str, float]:
        """One shuffled pass over the training pairs: mean loss and accuracy of its steps."""
        self.model.train()
        n, size = len(self.train_pairs), self.cfg.train.batch_size
        results = []
        for idx in torch.randperm(n, generator=self.shuffle).split(size):
            results.append(self._step([self.train_pairs[i] for i in idx]))
            bar.set_postfix(loss=f"{results[-1][0]:.3f}", refresh=False)
            bar.update(1)
        losses, accuracies = zip(*results)
        return {"train/loss": sum(losses) / len(losses),
                "train/accuracy": sum(accuracies) / len(accuracies)}

    def evaluate(self) -> dict[str, float]:
        """Bradley–Terry loss and pairwise accuracy on the held-out pairs (eval mode, no grad)."""
        self.model.eval()
        prompts, chosen, rejected = zip(*self.eval_pairs)
        scores = score_texts(self.model, self.tokenizer, [*prompts, *prompts], [*chosen, *rejected],
                             2 * self.cfg.train.batch_size, self.cfg.data.max_length)
        r_chosen, r_rejected = scores[:len(prompts)], scores[len(prompts):]
        return {"eval/loss": bradley_terry_loss(r_chosen, r_rejected, self.cfg.train.margin).item(),
                "eval/accuracy": (r_chosen > r_rejected).float().mean().item()}

    def train(self) -> Path:
        """Run the epochs (held-out accuracy printed after each), save; returns the folder."""
        from tqdm.auto import tqdm

        t = self.cfg.train
        steps_per_epoch = math.ceil(len(self.train_pairs) / t.batch_size)
        bar = tqdm(total=t.epochs * steps_per_epoch, desc="train-rm", unit="step",
                   disable=not self.progress, dynamic_ncols=True)
        with bar, open(self.out_dir / "metrics.jsonl", "w", encoding="utf-8") as log:
            for epoch in range(1, t.epochs + 1):
                row = {"epoch": epoch, **self._epoch(bar), "step": epoch * steps_per_epoch,
                       **(self.evaluate() if self.eval_pairs else {})}
                log.write(json.dumps(row) + "\n")
                log.flush()
                split = "held-out" if self.eval_pairs else "train"
                accuracy = row.get("eval/accuracy", row["train/accuracy"])
                tqdm.write(f"epoch {epoch}/{t.epochs}: train loss {row['train/loss']:.4f}, "
                           f"{split} accuracy {accuracy:.3f}")
        self.save()
        return self.out_dir

    def save(self) -> None:
        """``save_pretrained`` model and tokenizer; LoRA is merged into a copy, never in place."""
        model = self.model
        if hasattr(model, "merge_and_unload"):
            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(self.out_dir)
        self.tokenizer.save_pretrained(self.out_dir)


@quiet_libraries()  # transformers' own bars would cut through the train-rm bar
def train_reward_model(cfg: RMConfig, overwrite: bool = False, progress: bool = True) -> Path:
    """Train and save a reward model as ``cfg`` says; returns the output folder."""
    return RewardModelTrainer(cfg, overwrite=overwrite, progress=progress).train()
