"""Build the tiny example model folder: a byte-level BPE tokenizer, a 2-layer Llama config and
its warm-started weights.

The weights: the seeded random model, trained for ``WARM_STEPS`` supervised steps (about 30 s on
one CPU core) to answer each prompt of prompts.txt with random words and a full stop, then EOS:
12-20 words after a question or an instruction (a prompt ending with ``?`` or ``.``), 1-6 words
after any other prompt. So the model starts out ending its answers (a random model draws EOS about
once in 1000 tokens and is cut at ``max_new_tokens``), and its answers to questions are too long
for the example's length reward, which is what PPO then teaches it. Saved in bfloat16 (400 KB;
rlpipe loads them as float32). Deterministic on one machine: the same files from the same
prompts.txt, torch and transformers.

    python examples/tiny/build_assets.py          # writes examples/tiny/model/

>>> sorted(p.name for p in (HERE / "model").iterdir())  # doctest: +SKIP
['config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
"""

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 1000
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
WARM_STEPS, WARM_BATCH, WARM_LR = 500, 32, 3e-3

# Common English words beyond the prompts, so that responses have tokens to be built from.
EXTRA_WORDS = """
the of and to in is was it for on with as he she they we you i at be this have from or one had
by word but not what all were when your can said there use an each which do how their if will up
other about out many then them these so some her would make like him into time has look two more
write go see number no way could people my than first water been call who its now find long down
day did get come made may part over new sound take only little work know place year live me back
give most very after thing our just name good sentence man think say great where help through
much before line right too mean old any same tell boy follow came want show also around form three
small set put end does another well large must big even such because turn here why ask went men
read need land different home us move try kind hand picture again change off play spell air away
animal house point page letter mother answer found study still learn should world high every near
add food between own below country plant last school father keep tree never start city earth eye
light thought head under story saw left few while along might close something seem next hard
open example begin life always those both paper together got group often run important until
children side feet car mile night walk white sea began grow took river four carry state once book
hear stop without second later miss idea enough eat face watch far really almost let above girl
sometimes mountain cut young talk soon list song being leave family happy sad yes okay thanks
please sorry hello today tomorrow morning evening because friend warm cold rain sun snow wind
"""


def corpus() -> list[str]:
    """Training text: every prompt, then the extra words a line of twelve at a time.

    >>> corpus()[0]
    'The weather today is'
    """
    prompts = (HERE / "prompts.txt").read_text().splitlines()
    words = EXTRA_WORDS.split()
    lines = [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]
    return prompts + lines + [line.capitalize() + "." for line in lines]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (``VOCAB_SIZE`` tokens) that prepends ``<s>`` to every text.

    >>> build_tokenizer().decode([1, 2])  # doctest: +SKIP
    '<s></s>'
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, clean_up_tokenization_spaces=False,
                                   model_max_length=256)


def build_config(tokenizer) -> LlamaConfig:
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads) over ``tokenizer``'s vocabulary.

    >>> build_config(build_tokenizer()).num_hidden_layers  # doctest: +SKIP
    2
    """
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)


def answer_words(prompt: str, rng: random.Random) -> list[str]:
    """A warm-start answer: 12-20 random words after a question or instruction, else 1-6.

    >>> len(answer_words("Why is the sky blue?", random.Random(0))) >= 12
    True
    """
    words = EXTRA_WORDS.split()
    count = rng.randint(12, 20) if prompt.endswith(("?", ".")) else rng.randint(1, 6)
    return [rng.choice(words) for _ in range(count)]


def warm_batch(tokenizer, prompts: list[str], rng: random.Random) -> dict:
    """``WARM_BATCH`` prompts with answers: input ids, attention mask, labels on the answers only
    (their words, a full stop, EOS), right-padded.

    >>> batch = warm_batch(build_tokenizer(), ["Hi there"], random.Random(0))  # doctest: +SKIP
    >>> batch["labels"].shape[0]  # doctest: +SKIP
    32
    """
    rows = []
    for prompt in (rng.choice(prompts) for _ in range(WARM_BATCH)):
        answer = " " + " ".join(answer_words(prompt, rng)) + "."
        prompt_ids = tokenizer(prompt)["input_ids"]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt_ids, answer_ids))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels, mask = torch.full_like(ids, -100), torch.zeros_like(ids)
    for i, (p, a) in enumerate(rows):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, :len(p) + len(a)] = 1
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def warm_start(tokenizer, config: LlamaConfig) -> LlamaForCausalLM:
    """The seeded random model after ``WARM_STEPS`` AdamW steps on `warm_batch` (one thread:
    the same weights run to run).

    >>> warm_start(build_tokenizer(), build_config(build_tokenizer()))  # doctest: +SKIP
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = random.Random(0)
    prompts = (HERE / "prompts.txt").read_text().splitlines()
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_LR)
    for step in range(WARM_STEPS):
        loss = model(**warm_batch(tokenizer, prompts, rng)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == WARM_STEPS - 1:
            print(f"warm start: step {step + 1}/{WARM_STEPS}, loss {loss.item():.3f}")
    torch.set_num_threads(threads)
    return model.eval()


if __name__ == "__main__":
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(HERE / "model")
    config = build_config(tokenizer)
    config.save_pretrained(HERE / "model")
    weights = {k: v.detach().to(torch.bfloat16).contiguous()
               for k, v in warm_start(tokenizer, config).state_dict().items()}
    save_file(weights, str(HERE / "model" / "model.safetensors"), metadata={"format": "pt"})
    # transformers 5 names its class TokenizersBackend; this name also loads on 4.x
    tokenizer_config = HERE / "model" / "tokenizer_config.json"
    fields = json.loads(tokenizer_config.read_text())
    fields["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    print(f"wrote {HERE / 'model'}: vocab {len(tokenizer)}")
