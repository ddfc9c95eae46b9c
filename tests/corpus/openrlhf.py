"""OpenRLHF: the actor's log-probs (an in-place temperature and a logsumexp buffer loop), its
entropy, and PolicyLoss.

Restated from openrlhf/models/utils.py (log_probs_from_logits: `logits.div_(temperature)`, the
fp32 branch without flash-attn: gather + _logsumexp_by_chunk, a zeros buffer filled by slices;
the branch for other dtypes: log_softmax + gather per row of the batch, stacked;
compute_entropy; compute_approx_kl; masked_mean), openrlhf/models/actor.py (Actor.forward: logits
`.to(torch.float32)`, `torch.roll` labels, `[:, :-1]`, the action slice times action_mask) and
openrlhf/models/loss.py (aggregate_loss; PolicyLoss: PPO with dual clip, GSPO), with the entropy
bonus of openrlhf/trainer/ray/ppo_actor.py.
"""

from __future__ import annotations

import torch

from . import (Case, choices, gen, head_logits, lm_head, lp_and_entropy, n_chunks, near_logp, one_or_each, randn,
               response_mask, seq_offset, tokens)

TEMP = 0.7
LSE_CHUNK = 8  # _logsumexp_by_chunk's chunk_size (1024 in the library), small here


def _logsumexp_by_chunk(logits, chunk_size=LSE_CHUNK):
    rows = logits.shape[0]
    out = torch.zeros(rows, device=logits.device, dtype=logits.dtype)
    for s in range(0, rows, chunk_size):
        e = min(s + chunk_size, rows)
        out[s:e] = torch.logsumexp(logits[s:e], dim=-1)
    return out


def log_probs_from_logits(logits, labels, temperature=1.0):
    if temperature != 1.0:
        logits.div_(temperature)
    if logits.dtype not in (torch.float32, torch.float64):  # one row of the batch at a time
        rows = [torch.log_softmax(row_logits, dim=-1).gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1)
                for row_logits, row_labels in zip(logits, labels)]
        return torch.stack(rows)
    lead, V = logits.shape[:-1], logits.shape[-1]
    picked = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    lse = _logsumexp_by_chunk(logits.reshape(-1, V)).view(*lead)
    return picked - lse


def compute_entropy(logits):
    p = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(p * logits, dim=-1)


def compute_approx_kl(log_probs, log_probs_base, estimator="k3"):
    log_ratio = log_probs.float() - log_probs_base.float()
    if estimator == "k2":
        log_ratio = log_ratio ** 2 / 2.0
    elif estimator == "k3":
        log_ratio = (-log_ratio).exp() - 1 + log_ratio
    return log_ratio.clamp(min=-10, max=10)


def masked_mean(t, mask, dim=None):
    return (t * mask).sum(dim=dim) / mask.sum(dim=dim)


def aggregate_loss(loss, mask, token_level_loss=True):
    if token_level_loss:
        return masked_mean(loss, mask)
    counts = mask.sum(dim=-1)
    seq_loss = (loss * mask).sum(dim=-1) / (counts + 1e-8)
    return masked_mean(seq_loss, (counts > 0).float())


def policy_loss(log_probs, old_log_probs, advantages, action_mask, kind="ppo", clip_low=0.2,
                clip_high=0.2, dual_clip=None):
    raw_log_ratio = log_probs - old_log_probs
    if kind == "ppo":
        ratio = raw_log_ratio.clamp(min=-20.0, max=20.0).exp()
    else:  # gspo: one ratio per sequence, masked back onto its tokens
        ratio = (raw_log_ratio * action_mask).sum(dim=-1) / action_mask.sum(dim=-1).clamp(min=1)
        ratio = ratio.exp().unsqueeze(-1) * action_mask
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    if dual_clip is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        clip2 = torch.max(clip1, dual_clip * advantages)
        loss = -torch.where(advantages < 0, clip2, clip1)
    loss = aggregate_loss(loss, action_mask, token_level_loss=(kind == "ppo"))
    clip_ratio = masked_mean(torch.lt(surr2, surr1).float(), action_mask)
    ppo_kl = masked_mean(-raw_log_ratio.detach(), action_mask)
    return loss, clip_ratio, ppo_kl


B, S, A, H, V = 2, 12, 7, 16, 47  # sequences [B, S], the last A tokens are actions


def actor_ppo_kl(hidden, weight, sequences, action_mask, old_log_probs, advantages, base_log_probs,
                 temperature=TEMP, kl_coef=0.01):
    # Actor.forward: logits upcast, labels rolled, log-probs with the in-place temperature.
    logits = (hidden @ weight.T).to(torch.float32)
    rolled = torch.roll(sequences, shifts=-1, dims=1)
    log_probs = log_probs_from_logits(logits, rolled, temperature=temperature)[:, :-1]
    action_log_probs = log_probs[:, -action_mask.shape[1]:] * action_mask.float()
    loss, clip_ratio, ppo_kl = policy_loss(action_log_probs, old_log_probs, advantages, action_mask,
                                           dual_clip=3.0)
    kl = compute_approx_kl(action_log_probs, base_log_probs, "k3")
    kl_loss = masked_mean(kl, action_mask)
    return loss + kl_coef * kl_loss, clip_ratio, ppo_kl.detach(), kl_loss.detach()


def _action_logp(x, sequences, g, temperature, noise=None):
    logits = head_logits(x)[:, :-1][:, -A:]
    return near_logp(logits, sequences[:, 1:][:, -A:], g, temperature, noise)


def actor_inputs(seed, temperature, gspo=False):
    def make(dtype):
        g = gen(seed)
        x = lm_head((B, S), H, V, dtype, g)
        sequences = tokens((B, S), V, g)
        mask = response_mask(B, A, g)
        old = (seq_offset(_action_logp(x, sequences, g, temperature, 0.0), g) if gspo
               else _action_logp(x, sequences, g, temperature))
        return {**x, "sequences": sequences, "action_mask": mask,
                "old_log_probs": old * mask,
                "advantages": randn((B, A), g),
                "base_log_probs": _action_logp(x, sequences, g, temperature, noise=0.3) * mask}
    return make


def actor_gspo_entropy(hidden, weight, sequences, action_mask, old_log_probs, advantages,
                       base_log_probs, entropy_coef=0.01):
    # ppo_actor with return_entropy (entropy_coef set) and policy_loss_type="gspo"; temperature
    # 1.0, so log_probs_from_logits skips the in-place division.
    logits = (hidden @ weight.T).to(torch.float32)
    entropy = compute_entropy(logits)[:, :-1]
    rolled = torch.roll(sequences, shifts=-1, dims=1)
    log_probs = log_probs_from_logits(logits, rolled)[:, :-1]
    action_log_probs = log_probs[:, -A:] * action_mask.float()
    loss, clip_ratio, ppo_kl = policy_loss(action_log_probs, old_log_probs, advantages, action_mask,
                                           kind="gspo", clip_low=3e-4, clip_high=4e-4)
    entropy_loss = aggregate_loss(entropy[:, -A:], action_mask, token_level_loss=False)
    return loss - entropy_loss * entropy_coef, entropy_loss.detach(), clip_ratio, ppo_kl


def actor_model_dtype(hidden, weight, sequences, action_mask, old_log_probs, advantages, base_log_probs):
    # An actor that passes the model's logits as they are (`output["logits"][:, :-1, :]`, no
    # upcast, as OpenRLHF's Actor.forward did before it cast to fp32): a bf16 model takes the
    # per-row loop.
    logits = hidden @ weight.T
    log_probs = log_probs_from_logits(logits[:, :-1, :], sequences[:, 1:])
    action_log_probs = log_probs[:, -A:] * action_mask.float()
    loss, clip_ratio, ppo_kl = policy_loss(action_log_probs, old_log_probs, advantages, action_mask)
    return loss, clip_ratio, ppo_kl



CASES = [
    Case("openrlhf_actor_ppo_kl", "OpenRLHF",
         "openrlhf/models/utils.py:log_probs_from_logits (div_, _logsumexp_by_chunk), compute_approx_kl(k3); "
         "openrlhf/models/actor.py:Actor.forward; openrlhf/models/loss.py:PolicyLoss (dual_clip)",
         actor_ppo_kl, actor_inputs(21, TEMP), (("logprob",),), temperature="/ 0.7"),
    Case("openrlhf_gspo_entropy", "OpenRLHF",
         "openrlhf/models/utils.py:compute_entropy, log_probs_from_logits (T=1, buffer loop); "
         "openrlhf/models/loss.py:PolicyLoss(policy_loss_type='gspo'), aggregate_loss(token_level_loss=False); "
         "openrlhf/trainer/ray/ppo_actor.py entropy bonus",
         actor_gspo_entropy, actor_inputs(22, 1.0, gspo=True),
         lp_and_entropy([("logprob",)], [("entropy",)]),
         grad_kinds=("logprob", "entropy"), temperature=None),
    Case("openrlhf_actor_model_dtype", "OpenRLHF",
         "openrlhf/models/utils.py:log_probs_from_logits (the per-row loop for bf16, the fp32 branch); "
         "an actor passing output['logits'][:, :-1, :] uncast; openrlhf/models/loss.py:PolicyLoss",
         actor_model_dtype, actor_inputs(23, 1.0),
         {"fp32": choices([("logprob",), ("rowwise",) * n_chunks(B * (S - 1), LSE_CHUNK)]),
          "bf16": (("logprob",),)}, temperature=None),
]
