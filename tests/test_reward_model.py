"""Neural reward: `rlpipe train-rm` learns a keyword rule, the `reward_model` plugin scores with the
saved folder (also inside a PPO run), LoRA saves a merged folder, and the composer's clip and
running normalisation match a float64 oracle."""

import json
import random
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tensordict import TensorDict
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (AutoModelForSequenceClassification, LlamaConfig,
                          LlamaForSequenceClassification, PreTrainedTokenizerFast)

from rlpipe.cli import main
from rlpipe.core.base import schema as S
from rlpipe.core.config.settings import load_config
from rlpipe.core.base.errors import UserError
from rlpipe.core.run.pipeline import Pipeline
from rlpipe.core.step.rewards import RewardComposer
from rlpipe.plugins.rewards.reward_model import RewardModel, score_texts
from rlpipe.tools.train_rm import RewardModelTrainer, load_rm_config

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
KEYWORD = "great"
FILLER = ("the a movie food day was is it and very so quite really felt seemed place service "
          "music plot ok fine long short").split()
PROMPTS = ["how was the movie", "tell me about the food", "how was your day", "describe the place"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"


def word_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the test vocabulary; ``<s>`` prepended, ``<pad>`` != ``</s>``."""
    words = sorted({*FILLER, KEYWORD, *" ".join(PROMPTS).split(), "user", "assistant", ":"})
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE if chat_template else None
    return tokenizer


def model_folder(folder: Path, chat_template: bool = True, num_labels: int | None = None) -> Path:
    """A tiny Llama config + tokenizer; with ``num_labels``, seeded classifier weights as well."""
    tokenizer = word_tokenizer(chat_template)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if num_labels is None:
        config.save_pretrained(folder)
    else:
        torch.manual_seed(0)
        config.num_labels = num_labels
        LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_pairs(path: Path, n: int = 200, seed: int = 0) -> Path:
    """Chosen responses contain the keyword somewhere, rejected ones never; fillers vary."""
    rng = random.Random(seed)
    filler = lambda: [rng.choice(FILLER) for _ in range(rng.randint(4, 9))]  # noqa: E731
    with open(path, "w") as f:
        for _ in range(n):
            chosen = filler()
            chosen.insert(rng.randint(0, len(chosen)), KEYWORD)
            f.write(json.dumps({"prompt": rng.choice(PROMPTS), "chosen": " ".join(chosen),
                                "rejected": " ".join(filler())}) + "\n")
    return path


def rm_config(folder: Path, output_dir: Path, epochs: int = 4, extra: str = "") -> Path:
    """A train-rm YAML in ``folder`` (which holds ``model/`` and ``pairs.jsonl``)."""
    path = folder / "rm.yaml"
    path.write_text(f"model: {{path: model, init: random{extra}}}\n"
                    "data: {pairs: pairs.jsonl, eval_fraction: 0.2, max_length: 64}\n"
                    f"train: {{epochs: {epochs}, batch_size: 16, lr: 3.0e-3, seed: 0, device: cpu}}\n"
                    f"output_dir: {output_dir}\n")
    return path


def texts_batch(prompts, responses) -> TensorDict:
    return TensorDict({S.PROMPT_TEXT: prompts, S.RESPONSE_TEXT: responses}, batch_size=[len(prompts)])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Train once through the CLI; returns the CLI result and the saved folder."""
    root = tmp_path_factory.mktemp("rm")
    model_folder(root / "model")
    write_pairs(root / "pairs.jsonl")
    result = CliRunner().invoke(main, ["train-rm", str(rm_config(root, root / "out")), "--no-progress"])
    return result, root / "out"


def test_train_rm_learns_keyword_rule(trained):
    result, out = trained
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["eval/accuracy"] >= 0.9
    assert "held-out accuracy" in result.output
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1 and model.config.pad_token_id == 0


@pytest.mark.parametrize("chat", [True, False])
def test_plugin_matches_direct_forward(trained, tmp_path, chat):
    """Batched, padded plugin scores == one unpadded forward per sample on the formatted text."""
    folder = trained[1] if chat else model_folder(tmp_path, chat_template=False, num_labels=1)
    prompts = ["how was the movie", "describe the place", "tell me about the food", ""]
    responses = [f"it was {KEYWORD}", "quite long and very long and so long", "fine", "ok"]
    scores = RewardModel(folder, batch_size=3)(texts_batch(prompts, responses))
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    tokenizer = word_tokenizer()
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    for prompt, response, score in zip(prompts, responses, scores):
        text = f"user : {prompt} assistant : {response} " if chat else prompt + response
        ids = torch.tensor([tokenizer(text).input_ids])
        with torch.no_grad():
            expected = model(input_ids=ids).logits[0, 0]
        assert score.item() == pytest.approx(expected.item(), abs=1e-5)
    if chat:
        assert scores[0] > scores[1:3].max()  # the trained rule: the keyword wins


def test_plugin_bfloat16_offload_and_checkpoint_state(trained):
    """bf16 scores track fp32; the frozen classifier stays out of the composer's state_dict and .to()."""
    batch = texts_batch(["how was the movie"] * 3, [f"it was {KEYWORD}", "it was fine", "ok"])
    reference = RewardModel(trained[1])(batch)
    plugin = RewardModel(trained[1], dtype="bfloat16", offload=True)
    torch.testing.assert_close(plugin(batch), reference, atol=0.1, rtol=0.05)
    assert next(plugin.classifier.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in plugin.classifier.parameters())
    composer = RewardComposer([("rm", 1.0, plugin)], normalize=True).to(torch.float64)
    assert set(composer.state_dict()) == {"score_count", "score_mean", "score_m2"}
    assert next(plugin.classifier.parameters()).dtype == torch.bfloat16


def test_reward_model_in_ppo_run(trained, tmp_path):
    """[reward_model, length, loop] logs every part and score == the weighted sum of the parts."""
    rewards = (f"rewards=[{{name: reward_model, path: {trained[1]}, weight: 0.5}}, "
               "{name: length, weight: 1.0}, {name: loop, weight: 2.0}]")
    run = CliRunner().invoke(main, ["run", str(TINY), rewards, "run.steps=1", "--no-progress",
                                    f"run.output_dir={tmp_path / 'cli'}"])
    assert run.exit_code == 0, run.output
    row = json.loads((tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()[0])
    for name in ("reward/reward_model", "reward/length", "reward/loop", "reward/score"):
        assert isinstance(row[name], float), name
    pipe = Pipeline(load_config(TINY, [rewards, f"run.output_dir={tmp_path / 'step'}"]), progress=False)
    batch, metrics = pipe.step()
    parts = batch[S.SCORE_PARTS]
    expected = 0.5 * parts["reward_model"] + parts["length"] + 2.0 * parts["loop"]
    torch.testing.assert_close(batch[S.SCORE], expected)
    assert parts["reward_model"].std() > 0  # really scored, not a constant
    assert metrics["reward/reward_model"] == pytest.approx(parts["reward_model"].mean().item())


class Fixed(torch.nn.Module):
    """A reward component that returns the next tensor of a list on each call."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs = iter(outputs)

    def forward(self, td):
        return next(self.outputs)


@pytest.mark.parametrize("clip, normalize", [(None, True), (0.8, True), (0.8, False)])
def test_composer_clip_normalize_match_float64_oracle(clip, normalize):
    g = torch.Generator().manual_seed(0)
    sizes = [5, 1, 8, 3, 6]
    a = [torch.randn(n, generator=g) * 3 + 2 for n in sizes]
    b = [torch.rand(n, generator=g) - 1 for n in sizes]
    composer = RewardComposer([("a", 0.5, Fixed(a)), ("b", 2.0, Fixed(b))], clip, normalize)
    seen = []
    for i, n in enumerate(sizes):
        if i == 3:  # a checkpoint round trip in the middle changes nothing
            state = composer.state_dict()
            composer = RewardComposer([("a", 0.5, Fixed(a[3:])), ("b", 2.0, Fixed(b[3:]))],
                                      clip, normalize)
            composer.load_state_dict(state)
        td = composer(TensorDict({}, batch_size=[n]))
        raw = 0.5 * a[i].double() + 2.0 * b[i].double()
        seen.append(raw)
        history = torch.cat(seen)
        expected = raw
        if normalize:
            mean, var = history.mean(), history.var(unbiased=False)
            expected = (raw - mean) / torch.sqrt(var + RewardComposer.EPS)
        if clip is not None:
            expected = expected.clamp(-clip, clip)
        torch.testing.assert_close(td[S.SCORE].double(), expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(td[S.SCORE_PARTS, "a"], a[i]) and torch.equal(td[S.SCORE_PARTS, "b"], b[i])
    if normalize:
        assert composer.score_count.item() == sum(sizes)
        assert composer.score_mean.item() == pytest.approx(history.mean().item())


def test_composer_errors_name_the_reward():
    with pytest.raises(UserError, match="reward 'bad' returned NaN"):
        RewardComposer([("bad", 1.0, Fixed([torch.tensor([0.0, float("nan")])]))])(
            TensorDict({}, batch_size=[2]))
    with pytest.raises(UserError, match=r"reward 'big' returned values beyond float32's range .* "
                                        r"for 1 of 2"):   # finite in float64, inf in float32
        RewardComposer([("big", 1.0, Fixed([torch.tensor([0.0, 1e300], dtype=torch.float64)]))])(
            TensorDict({}, batch_size=[2]))
    with pytest.raises(UserError, match=r"reward 'short' returned \(1,\)"):
        RewardComposer([("short", 1.0, Fixed([torch.zeros(1)]))])(TensorDict({}, batch_size=[2]))
    with pytest.raises(UserError, match="reward.clip must be > 0"):
        RewardComposer([], clip=0.0)


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_bad_inputs(tmp_path):
    with pytest.raises(UserError, match="model folder not found"):
        RewardModel(tmp_path / "missing")
    with pytest.raises(UserError, match="num_labels=2"):
        RewardModel(model_folder(tmp_path / "two", num_labels=2))
    with pytest.raises(UserError, match="no config.json"):
        RewardModel(tmp_path)
    runner = CliRunner()
    missing = runner.invoke(main, ["run", str(TINY), "rewards=[{name: reward_model, path: nowhere}]"])
    assert "file not found" in one_line_error(missing)
    model_folder(tmp_path / "model")
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n\n'
                                          '{"prompt": "a", "chosen": 3, "rejected": "c"}\n')
    config = str(rm_config(tmp_path, tmp_path / "out"))
    assert "pairs.jsonl:3: field 'chosen'" in one_line_error(runner.invoke(main, ["train-rm", config]))
    (tmp_path / "pairs.jsonl").write_text("{not json\n")
    assert "pairs.jsonl:1: invalid JSON" in one_line_error(runner.invoke(main, ["train-rm", config]))
    assert "model.path: file not found" in one_line_error(
        runner.invoke(main, ["train-rm", config, "model.path=nowhere"]))
    if not torch.cuda.is_available():  # the setting train-rm reads, not `run.device`
        assert "train.device: 'cuda' requested but CUDA is not available" in one_line_error(
            runner.invoke(main, ["train-rm", config, "train.device=cuda"]))
    assert not (tmp_path / "out").exists()


def test_train_rm_that_diverges_saves_nothing(tmp_path):
    """At a learning rate of 1e30 the first step makes every weight inf or NaN: the next loss is
    not finite and train-rm stops on one line, without saving a NaN model as a reward model."""
    model_folder(tmp_path / "model")
    write_pairs(tmp_path / "pairs.jsonl", n=64)
    config = str(rm_config(tmp_path, tmp_path / "out", epochs=1))
    line = one_line_error(CliRunner().invoke(main, ["train-rm", config, "train.lr=1e30",
                                                    "--no-progress"]))
    assert "train-rm: training diverged" in line and "lower train.lr (now 1e+30)" in line
    assert not (tmp_path / "out" / "config.json").exists()


def test_lora_train_rm_saves_merged_folder(tmp_path):
    """LoRA adapters + trained head are merged into a copy; the folder scores like the trained model."""
    model_folder(tmp_path / "model")
    write_pairs(tmp_path / "pairs.jsonl", n=64)
    extra = ", lora: {r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"
    cfg = load_rm_config(rm_config(tmp_path, tmp_path / "out", epochs=2, extra=extra))
    trainer = RewardModelTrainer(cfg, progress=False)
    head = trainer.model.base_model.model.score.modules_to_save["default"].weight.detach().clone()
    out = trainer.train()
    trained_head = trainer.model.base_model.model.score.modules_to_save["default"].weight
    assert not torch.equal(head, trained_head)  # the head is trained, not frozen
    assert any("lora_B" in n for n, _ in trainer.model.named_parameters())  # not merged in place
    loaded = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    torch.testing.assert_close(loaded.score.weight, trained_head)
    trainer.model.eval()
    prompts, chosen, rejected = (list(x) for x in zip(*trainer.eval_pairs))
    for responses in (chosen, rejected):
        torch.testing.assert_close(score_texts(loaded, trainer.tokenizer, prompts, responses),
                                   score_texts(trainer.model, trainer.tokenizer, prompts, responses),
                                   atol=1e-5, rtol=1e-5)
