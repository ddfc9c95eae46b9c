"""alibaba/ROLL: the RLVR actor's log-probs and entropy (two strategies, two shift conventions)
and its PPO/GRPO loss.

Restated from roll/utils/functionals.py (log_probs_from_logits and entropy_from_logits, both
`.float()` first; compute_approx_kl k3/mse/kl with the action mask; agg_loss with sample weights;
masked_mean), roll/distributed/strategy/fsdp2_strategy.py (op_compute_log_probs: labels cloned,
masked positions zeroed in place, a zero column appended, log-probs of the full logits sliced
`[:, :-1]`; op_compute_entropy on the full logits), roll/distributed/strategy/strategy.py
(op_compute_log_probs on `logits[:, :-1]`) and roll/pipeline/rlvr/actor_worker.py (loss_func:
token or sequence importance sampling, dual clip, KL loss, entropy loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, gen, logits_leaf, lp_and_entropy, near_logp, randn, seq_offset

B, S, V = 3, 11, 71


def log_probs_from_logits(logits, labels):
    logits = logits.float()
    return F.log_softmax(logits, dim=-1).gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits):
    logits = logits.float()
    p = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(p * logits, dim=-1)


def compute_approx_kl(log_probs, log_probs_base, action_mask, kind):
    if kind == "kl":
        out = log_probs - log_probs_base
    elif kind == "mse":
        out = 0.5 * (log_probs - log_probs_base).square()
    else:  # k3
        kl = log_probs_base - log_probs
        out = torch.clamp((torch.exp(kl) - kl - 1).contiguous(), min=-10, max=10)
    return out * action_mask


def masked_mean(t, mask, dim=None):
    if dim is None:
        return (t * mask).sum() / (mask.sum() + 1e-8)
    mask_sum = mask.sum(dim=dim)
    return torch.where(mask_sum > 0, (t * mask).sum(dim=dim) / (mask_sum + 1e-8), torch.zeros_like(mask_sum))


def agg_loss(loss_mat, loss_mask, mode, weights=None):
    n_samples = loss_mat.size(0)
    if weights is None:
        weights = torch.ones(loss_mask.shape[0], device=loss_mask.device)
    if mode == "token-mean":
        return (loss_mat * weights.unsqueeze(-1)).sum() / loss_mask.sum()
    seq = masked_mean(loss_mat, loss_mask, dim=-1)
    valid = torch.any(loss_mask > 0, dim=-1).float()
    return (seq * weights * valid).sum() / (n_samples + 1e-8)


def _labels(input_ids, response_mask):
    labels = input_ids[:, 1:].clone()
    labels[response_mask[:, 1:] == 0] = 0
    return labels


def _loss(log_probs, old_log_probs, ref_log_probs, advantages, mask, mode, importance, sample_weights,
          kl_coef=0.001, clip_low=0.2, clip_high=0.28, pg_clip=0.2):
    kl_loss = agg_loss(compute_approx_kl(log_probs, ref_log_probs, mask, "k3"), mask, mode)
    approxkl = compute_approx_kl(log_probs, old_log_probs, mask, "mse")
    if importance == "token":
        ratio = (log_probs - old_log_probs).exp()
    else:
        log_ratio = log_probs - old_log_probs
        ratio = masked_mean(log_ratio, mask, dim=-1).exp().unsqueeze(-1).expand_as(log_ratio)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    loss = -torch.min(surr1, surr2)
    dual = -torch.max(-loss, (1 + pg_clip * 2) * advantages)
    loss = torch.where(advantages < 0, dual, loss)
    pg_loss = agg_loss(loss, mask, mode, weights=sample_weights)
    return pg_loss + kl_loss * kl_coef, masked_mean(approxkl, mask).detach()


def fsdp2_actor(logits, input_ids, response_mask, old_log_probs, ref_log_probs, advantages, sample_weights,
                entropy_loss_coef=0.01):
    # FSDP2 strategy op_compute_log_probs / op_compute_entropy; ActorWorker.loss_func with
    # loss_agg_mode="seq-mean-token-mean", token importance sampling, dual clip, entropy loss.
    labels = _labels(input_ids, response_mask)
    labels = torch.cat([labels, torch.zeros_like(labels[:, :1])], dim=1)
    log_probs = log_probs_from_logits(logits, labels)
    log_probs = log_probs[:, :-1] * response_mask[:, 1:]
    mask = response_mask[:, 1:].long()
    total, approxkl = _loss(log_probs, old_log_probs, ref_log_probs, advantages, mask,
                            "seq-mean-token-mean", "token", sample_weights)
    entropy = entropy_from_logits(logits)
    entropy = entropy[:, :-1] * response_mask[:, 1:]
    entropy_loss = agg_loss(entropy, response_mask[:, 1:], "seq-mean-token-mean")
    return total - entropy_loss * entropy_loss_coef, entropy_loss.detach(), approxkl


def base_strategy_seq_is(logits, input_ids, response_mask, old_log_probs, ref_log_probs, advantages,
                         sample_weights):
    # Strategy.op_compute_log_probs (log-probs of logits[:, :-1]); loss_func with token-mean
    # aggregation, sequence importance sampling, no entropy loss.
    labels = _labels(input_ids, response_mask)
    log_probs = log_probs_from_logits(logits[:, :-1], labels)
    log_probs = log_probs * response_mask[:, 1:]
    mask = response_mask[:, 1:].long()
    return _loss(log_probs, old_log_probs, ref_log_probs, advantages, mask, "token-mean", "seq",
                 sample_weights, clip_low=3e-4, clip_high=4e-4)


def roll_inputs(seed, gspo):
    def make(dtype):
        g = gen(seed)
        logits = logits_leaf((B, S, V), dtype, g)
        ids = torch.randint(0, V, (B, S), generator=g)
        mask = torch.zeros(B, S, dtype=torch.long)
        mask[0, 3:] = 1
        mask[1, 4:9] = 1
        mask[2, 3:10] = 1
        labels = _labels(ids, mask)
        old = (seq_offset(near_logp(logits[:, :-1], labels, g, noise=0.0), g) if gspo
               else near_logp(logits[:, :-1], labels, g)) * mask[:, 1:]
        ref = near_logp(logits[:, :-1], labels, g, noise=0.3) * mask[:, 1:]
        return {"logits": logits, "input_ids": ids, "response_mask": mask, "old_log_probs": old,
                "ref_log_probs": ref, "advantages": randn((B, S - 1), g),
                "sample_weights": torch.tensor([1.0, 0.5, 1.5])}
    return make


CASES = [
    Case("roll_fsdp2_logprobs_entropy", "ROLL",
         "roll/distributed/strategy/fsdp2_strategy.py:op_compute_log_probs, op_compute_entropy; "
         "roll/utils/functionals.py:log_probs_from_logits, entropy_from_logits, compute_approx_kl, agg_loss; "
         "roll/pipeline/rlvr/actor_worker.py:loss_func (dual clip, entropy loss)",
         fsdp2_actor, roll_inputs(101, gspo=False), lp_and_entropy([("logprob",)], [("entropy",)]),
         grad_kinds=("logprob", "entropy"), temperature=None),
    Case("roll_strategy_sequence_is", "ROLL",
         "roll/distributed/strategy/strategy.py:op_compute_log_probs (logits[:, :-1]); "
         "roll/pipeline/rlvr/actor_worker.py:loss_func (importance_sampling='seq', token-mean)",
         base_strategy_seq_is, roll_inputs(102, gspo=True), (("logprob",),), temperature=None),
]
