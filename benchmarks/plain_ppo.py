"""A reference PPO step written plainly, as a user would with transformers and torch alone.

The same algorithm as one rlpipe step (``rlpipe.core.run.pipeline.Pipeline.step``), with the same
models (actor, frozen reference copy, critic = a copy of the actor's backbone + a linear value
head), reward, KL shaping, GAE, PPO loss, K epochs x minibatches and AdamW optimizers, written the
straightforward way:

- rollout: one ``model.generate`` call per prompt (no padding to think about);
- scoring: per sample, three separate full forwards (policy, reference, critic) over
  prompt + response, full-sequence logits, ``log_softmax`` over the vocabulary;
- rewards and KL shaping per sample, then a TRL-style Python loop over T for GAE;
- update: K epochs over shuffled minibatches; each minibatch right-padded to one tensor, one
  actor and one critic forward/backward, clipped-surrogate + clipped value loss, token means.

It does the same work as rlpipe's step: one generation per sample, three no-grad forwards per
sample, and K x minibatches actor and critic forward/backward passes. ``python
benchmarks/plain_ppo.py`` checks it against rlpipe: given the same weights and samples, its
log-probs, values, advantages and value targets equal rlpipe's (to 1e-4), and the first update
forward gives ratio 1.

>>> plain = PlainPPO("model_dir", "cpu", batch_size=16, max_new_tokens=64)   # doctest: +SKIP
>>> metrics = plain.step(prompts)                                            # doctest: +SKIP
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


class PlainPPO:
    def __init__(self, model_dir, device="cpu", dtype=torch.float32, *, batch_size=16,
                 max_new_tokens=64, epochs=4, minibatches=2, lr=1e-5, critic_lr=5e-5,
                 kl_coef=0.05, gamma=1.0, lam=0.95, clip=0.2, vf_coef=0.5, value_clip=0.2,
                 max_grad_norm=1.0, reward=None, seed=0):
        torch.manual_seed(seed)
        self.device, self.batch_size, self.max_new_tokens = device, batch_size, max_new_tokens
        self.epochs, self.minibatches, self.kl_coef = epochs, minibatches, kl_coef
        self.gamma, self.lam, self.clip, self.vf_coef = gamma, lam, clip, vf_coef
        self.value_clip, self.max_grad_norm = value_clip, max_grad_norm
        self.reward = reward or {"min_tokens": 4, "max_tokens": 48, "per_token": 0.05,
                                 "truncated_penalty": 1.0}
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        self.policy = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
        self.ref = copy.deepcopy(self.policy).requires_grad_(False)
        self.critic_body = copy.deepcopy(self.policy.model)
        self.value_head = torch.nn.Linear(config.hidden_size, 1).to(device=device, dtype=dtype)
        self.critic_params = [*self.critic_body.parameters(), *self.value_head.parameters()]
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=lr, weight_decay=0.0)
        self.critic_opt = torch.optim.AdamW(self.critic_params, lr=critic_lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)

    def load_weights(self, state_dict) -> None:
        """Start from given actor weights (the benchmark gives both implementations the same)."""
        self.policy.load_state_dict(state_dict)
        self.ref.load_state_dict(state_dict)
        self.critic_body.load_state_dict(self.policy.model.state_dict())

    def values(self, ids, attention_mask=None):
        hidden = self.critic_body(input_ids=ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()

    def length_reward(self, n_tokens: int, finished: bool) -> float:
        r = self.reward
        outside = max(0, r["min_tokens"] - n_tokens) + max(0, n_tokens - r["max_tokens"])
        cost = r["per_token"] * outside
        return -cost - (0.0 if finished else r["truncated_penalty"])

    # ---- 1. rollout --------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, prompts):
        samples, eos = [], self.tokenizer.eos_token_id
        for prompt in prompts:
            query = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.device)
            out = self.policy.generate(
                input_ids=query, attention_mask=torch.ones_like(query), do_sample=True,
                temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=self.max_new_tokens,
                min_new_tokens=self.max_new_tokens, pad_token_id=self.tokenizer.pad_token_id)
            response = out[0, query.shape[1]:]
            ends = (response == eos).nonzero()
            finished = len(ends) > 0
            if finished:  # keep the EOS, drop what follows
                response = response[: int(ends[0]) + 1]
            samples.append({"query": query[0], "response": response, "finished": finished})
        return samples

    # ---- 2. log-probs, values, rewards, KL, GAE ----------------------------------------------
    @torch.no_grad()
    def score(self, samples):
        for s in samples:
            ids = torch.cat([s["query"], s["response"]])[None]
            start, end = len(s["query"]) - 1, ids.shape[1] - 1
            logits = self.policy(input_ids=ids).logits[0, start:end].float()
            s["logprob"] = F.log_softmax(logits, -1).gather(-1, s["response"][:, None])[:, 0]
            ref_logits = self.ref(input_ids=ids).logits[0, start:end].float()
            s["ref_logprob"] = F.log_softmax(ref_logits, -1).gather(-1, s["response"][:, None])[:, 0]
            s["value"] = self.values(ids)[0, start:end]
            text = self.tokenizer.decode(s["response"], skip_special_tokens=True)
            s["text"], s["score"] = text, self.length_reward(len(s["response"]), s["finished"])
            kl = s["logprob"] - s["ref_logprob"]
            s["reward"] = -self.kl_coef * kl
            if len(s["response"]):
                s["reward"][-1] += s["score"]
        # pad to [B, T] and run GAE the TRL way: a reversed Python loop over T
        T = max(len(s["response"]) for s in samples)
        pad = lambda key: torch.stack([F.pad(s[key], (0, T - len(s[key]))) for s in samples])  # noqa: E731
        mask = torch.stack([torch.arange(T, device=self.device) < len(s["response"]) for s in samples])
        values, rewards = pad("value") * mask, pad("reward") * mask
        lastgaelam, advantages_reversed = 0.0, []
        for t in reversed(range(T)):
            nextvalues = values[:, t + 1] if t < T - 1 else 0.0
            delta = rewards[:, t] + self.gamma * nextvalues - values[:, t]
            lastgaelam = delta + self.gamma * self.lam * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1) * mask
        returns = advantages + values
        mean = advantages[mask].mean()
        std = advantages[mask].var(unbiased=False).add(1e-8).rsqrt()
        advantages = torch.where(mask, (advantages - mean) * std, 0.0)
        return {"logprob": pad("logprob"), "value": values, "advantage": advantages,
                "return": returns, "mask": mask}

    # ---- 3. PPO epochs -----------------------------------------------------------------------
    def minibatch_forward(self, samples, idx):
        """Right-pad query + response of the chosen samples; per-token log-prob, entropy and
        value at each response position, [b, T] in the batch's response layout."""
        seqs = [torch.cat([samples[i]["query"], samples[i]["response"]]) for i in idx]
        L = max(len(s) for s in seqs)
        ids = torch.stack([F.pad(s, (0, L - len(s)), value=self.tokenizer.pad_token_id) for s in seqs])
        attn = torch.stack([torch.arange(L, device=self.device) < len(s) for s in seqs]).long()
        T = self.max_new_tokens
        starts = torch.tensor([len(samples[i]["query"]) - 1 for i in idx], device=self.device)
        pos = (starts[:, None] + torch.arange(T, device=self.device)).clamp(max=L - 2)
        logits = self.policy(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp_all = F.log_softmax(logits, -1)
        logp = logp_all.gather(-1, ids[:, 1:, None])[..., 0].gather(1, pos)
        entropy = -(logp_all.exp() * logp_all).sum(-1).gather(1, pos)
        value = self.values(ids, attn)[:, :-1].gather(1, pos)
        return logp, entropy, value

    def update(self, samples, batch):
        B, stats = len(samples), []
        for _ in range(self.epochs):
            perm = torch.randperm(B, generator=self.gen)
            for idx in perm.split(B // self.minibatches):
                mask = batch["mask"][idx]
                n = mask.sum().clamp(min=1)
                logp, entropy, vpred = self.minibatch_forward(samples, idx.tolist())
                T = mask.shape[1]
                logp, entropy, vpred = logp[:, :T], entropy[:, :T], vpred[:, :T]
                ratio = torch.exp(logp - batch["logprob"][idx])
                adv = batch["advantage"][idx]
                pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - self.clip, 1 + self.clip))
                pg_loss = torch.where(mask, pg, 0.0).sum() / n
                old_v, ret = batch["value"][idx], batch["return"][idx]
                v_clipped = old_v + (vpred - old_v).clamp(-self.value_clip, self.value_clip)
                vf = 0.5 * torch.max((vpred - ret) ** 2, (v_clipped - ret) ** 2)
                vf_loss = torch.where(mask, vf, 0.0).sum() / n
                loss = pg_loss + self.vf_coef * vf_loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
                torch.nn.utils.clip_grad_norm_(self.critic_params, self.max_grad_norm)
                self.opt.step()
                self.critic_opt.step()
                self.opt.zero_grad(set_to_none=True)
                self.critic_opt.zero_grad(set_to_none=True)
                ent = torch.where(mask, entropy, 0.0).sum() / n
                stats.append([pg_loss.item(), vf_loss.item(), ent.item()])
        return torch.tensor(stats).mean(0).tolist()

    def step(self, prompts, sync=lambda: None) -> dict:
        """One PPO step on ``prompts``; wall times per phase and the response token count."""
        sync()
        t0 = time.perf_counter()
        samples = self.rollout(prompts)
        sync()
        t1 = time.perf_counter()
        batch = self.score(samples)
        sync()
        t2 = time.perf_counter()
        pg_loss, vf_loss, entropy = self.update(samples, batch)
        sync()
        t3 = time.perf_counter()
        tokens = int(batch["mask"].sum())
        return {"time/rollout_s": t1 - t0, "time/score_s": t2 - t1, "time/update_s": t3 - t2,
                "time/step_s": t3 - t0, "tokens": tokens, "perf/tokens_per_s": tokens / (t3 - t0),
                "policy/loss": pg_loss, "value/loss": vf_loss, "policy/entropy": entropy,
                "reward/score": sum(s["score"] for s in samples) / len(samples)}


def check(batch_size: int = 4, new_tokens: int = 16) -> None:
    """Same weights and samples as one rlpipe step: log-probs, values, advantages and value
    targets agree, and the first update forward reproduces the old log-probs (ratio 1)."""
    from common import LENGTH_REWARD, build_pipeline, make_assets, make_config, workdir

    folder = make_assets(workdir(), "small")
    pipe = build_pipeline(make_config(folder, batch=batch_size, new_tokens=new_tokens))
    plain = PlainPPO(str(folder / "model"), batch_size=batch_size, max_new_tokens=new_tokens,
                     reward=LENGTH_REWARD)
    plain.load_weights(pipe.models.actor.state_dict())
    plain.critic_body.load_state_dict(pipe.models.critic.backbone.state_dict())
    plain.value_head.load_state_dict(pipe.models.critic.head.state_dict())
    batch, _ = pipe.step()  # the batch is scored before the update changes the weights
    samples = [{"query": p[pm], "response": r[rm], "finished": bool(f)} for p, pm, r, rm, f in
               zip(batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
                   batch["response_mask"], batch["finished"])]
    ours = plain.score(samples)
    pairs = {"old_log_prob": "logprob", "value": "value", "advantage": "advantage",
             "value_target": "return"}
    for theirs, mine in pairs.items():
        err = (batch[theirs] - ours[mine]).abs()[batch["response_mask"]].max().item()
        print(f"{theirs:<13} max |rlpipe - plain| = {err:.2e}")
        assert err < 1e-4, theirs
    logp, _, _ = plain.minibatch_forward(samples, [0, 1])
    ratio = torch.exp(logp - ours["logprob"][:2])[ours["mask"][:2]]
    print(f"first-minibatch ratio: max |ratio - 1| = {(ratio - 1).abs().max().item():.2e}")
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-4)


if __name__ == "__main__":
    check()
