"""volcengine/verl: the FSDP actor's log-prob/entropy code and the PPO-family policy losses.

Restated from verl/utils/torch_functional.py (logprobs_from_logits_v2, the torch path taken when
flash-attn's Triton cross-entropy is absent; logprobs_from_logits_naive; entropy_from_logits;
entropy_from_logits_with_chunking; masked_sum/masked_mean), verl/workers/actor/dp_actor.py
(_forward_micro_batch: `logits.div_(temperature)`, the rmpad and padded layouts,
`entropy_checkpointing`; update_policy: entropy_coeff, use_kl_loss) and
verl/trainer/ppo/core_algos.py (agg_loss, compute_policy_loss_vanilla with dual clip,
compute_policy_loss_gspo, kl_penalty with the "+" straight-through variant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from . import (Case, gen, head_logits, lm_head, logits_leaf, lp_and_entropy, n_chunks, near_logp, one_or_each,
               randn, response_mask, seq_offset, tokens)

TEMP = 0.7

# ---- verl/utils/torch_functional.py --------------------------------------------------------------


def _gather_from_labels(data, label):
    return torch.gather(data, -1, label.unsqueeze(-1)).squeeze(-1)


def logprobs_from_logits_naive(logits, labels):
    return _gather_from_labels(F.log_softmax(logits, dim=-1), labels)


def logprobs_from_logits_v2(logits, labels):
    """fp32: x_y - logsumexp(x), the logsumexp one leading row at a time; bf16: a per-row
    log_softmax + gather loop (logsumexp is judged unstable in bf16)."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = _gather_from_labels(logits, labels)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - lse
    out = []
    for row_logits, row_labels in zip(logits, labels):
        out.append(_gather_from_labels(F.log_softmax(row_logits, dim=-1), row_labels))
    return torch.stack(out)


def entropy_from_logits(logits):
    p = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def entropy_from_logits_with_chunking(logits, chunk_size):
    """[T, V] -> [T]: an fp32 zeros buffer filled chunk by chunk, each chunk upcast first."""
    entropy = torch.zeros(logits.shape[0], device=logits.device)
    for i in range(0, logits.shape[0], chunk_size):
        chunk = logits[i:i + chunk_size].float()
        p = F.softmax(chunk, dim=-1)
        entropy[i:i + chunk_size] = torch.logsumexp(chunk, dim=-1) - (p * chunk).sum(-1)
    return entropy


def masked_sum(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=axis)


def masked_mean(values, mask, axis=None):
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + 1e-8)


# ---- verl/trainer/ppo/core_algos.py --------------------------------------------------------------


def agg_loss(loss_mat, loss_mask, mode):
    if mode == "token-mean":
        return masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if mode == "seq-mean-token-sum":
        seq = (loss_mat * loss_mask).sum(-1)
        seq_mask = (loss_mask.sum(-1) > 0).float()
        return masked_sum(seq, seq_mask) / seq_mask.sum()
    if mode == "seq-mean-token-mean":
        count = loss_mask.sum(-1)
        seq = (loss_mat * loss_mask).sum(-1) / (count + 1e-8)
        seq_mask = (count > 0).float()
        return masked_sum(seq, seq_mask) / seq_mask.sum()
    raise ValueError(mode)


def policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, mode="token-mean",
                        clip_low=0.2, clip_high=0.28, clip_c=3.0):
    """PPO clip with decoupled low/high ranges and the dual-clip lower bound for negative advantages."""
    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, mask)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    clipfrac = masked_mean(torch.gt(loss2, loss1).float(), mask)
    loss3 = -advantages * clip_c
    dual = torch.min(loss3, clipped)
    pg_losses = torch.where(advantages < 0, dual, clipped)
    return agg_loss(pg_losses, mask, mode), clipfrac.detach(), ppo_kl.detach()


def policy_loss_gspo(old_log_prob, log_prob, advantages, mask, clip_low=3e-4, clip_high=4e-4):
    """Sequence-level ratio s_i = exp(mean_t log r_t), applied per token as sg[s_i] * p / sg[p]."""
    neg_kl = log_prob - old_log_prob
    seq_len = mask.sum(-1).clamp(min=1)
    neg_kl_seq = (neg_kl * mask).sum(-1) / seq_len
    log_ratio = log_prob - log_prob.detach() + neg_kl_seq.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(loss1, loss2)
    pg_loss = agg_loss(pg_losses, mask, "seq-mean-token-mean")
    return pg_loss, masked_mean(torch.gt(loss2, loss1).float(), mask).detach()


def kl_penalty(logprob, ref_logprob, kind):
    if kind in ("low_var_kl", "k3", "k3+"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        forward = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    elif kind in ("mse", "k2"):
        forward = 0.5 * (logprob - ref_logprob).square()
    else:
        forward = logprob - ref_logprob
    if not kind.endswith("+"):
        return forward
    # The k2 gradient with the k3 value: straight-through.
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


# ---- the cases -----------------------------------------------------------------------------------

# Padded layout: B sequences of S positions, the last R+1 logits predict the R response tokens.
B1, S1, R1, H1, V1 = 3, 10, 7, 16, 53


def padded_actor_ppo(hidden, weight, responses, old_log_prob, advantages, mask, ref_log_prob,
                     temperature=TEMP, entropy_coeff=0.0, kl_coef=0.001):
    # dp_actor._forward_micro_batch, no rmpad: calculate_entropy=True with entropy_coeff == 0, so
    # the entropy is only logged (its aggregate goes to .item()).
    logits = hidden @ weight.T
    logits.div_(temperature)
    R = responses.shape[-1]
    logits = logits[:, -R - 1:-1, :]
    log_prob = logprobs_from_logits_v2(logits, responses)
    entropy = entropy_from_logits(logits)
    # dp_actor.update_policy
    pg_loss, clipfrac, ppo_kl = policy_loss_vanilla(old_log_prob, log_prob, advantages, mask)
    entropy_agg = agg_loss(entropy, mask, "token-mean")
    policy_loss = pg_loss
    if entropy_coeff != 0:
        policy_loss = policy_loss - entropy_agg * entropy_coeff
    kl = agg_loss(kl_penalty(log_prob, ref_log_prob, "low_var_kl"), mask, "token-mean")
    policy_loss = policy_loss + kl * kl_coef
    return policy_loss, entropy_agg.detach(), clipfrac, ppo_kl


def padded_actor_inputs(dtype):
    g = gen(11)
    x = lm_head((B1, S1), H1, V1, dtype, g)
    responses = tokens((B1, R1), V1, g)
    logits = head_logits(x)[:, -R1 - 1:-1]
    return {**x, "responses": responses,
            "old_log_prob": near_logp(logits, responses, g, TEMP),
            "advantages": randn((B1, R1), g),
            "mask": response_mask(B1, R1, g),
            "ref_log_prob": near_logp(logits, responses, g, TEMP, noise=0.3)}


# rmpad layout: T packed tokens, logits [T, V]; the outputs are scattered back to [B, S].
B2, S2, H2, V2, ENT_CHUNK2 = 2, 7, 16, 61, 4
T2 = 11  # packed tokens (B2 * S2 = 14 positions, the last 3 of row 1 padding)


def rmpad_actor(hidden, weight, input_ids_rmpad, indices, old_log_prob, advantages, mask,
                temperature=TEMP, entropy_coeff=0.01, response_length=4):
    # dp_actor._forward_micro_batch with use_remove_padding (sp == 1) and
    # entropy_from_logits_with_chunking; update_policy with entropy_coeff != 0.
    ids_rolled = torch.roll(input_ids_rmpad, shifts=-1, dims=0)
    logits_rmpad = hidden @ weight.T
    logits_rmpad.div_(temperature)
    log_probs = logprobs_from_logits_v2(logits_rmpad, ids_rolled)
    entropy_rmpad = entropy_from_logits_with_chunking(logits_rmpad, ENT_CHUNK2)

    def pad_input(x):  # flash_attn.bert_padding.pad_input for one feature
        out = torch.zeros(B2 * S2, dtype=x.dtype, device=x.device)
        out[indices] = x
        return out.view(B2, S2)

    R = response_length
    entropy = pad_input(entropy_rmpad)[:, -R - 1:-1]
    log_prob = pad_input(log_probs)[:, -R - 1:-1]
    pg_loss, clipfrac, ppo_kl = policy_loss_vanilla(old_log_prob, log_prob, advantages, mask,
                                                    mode="seq-mean-token-sum")
    entropy_agg = agg_loss(entropy, mask, "seq-mean-token-sum")
    policy_loss = pg_loss - entropy_agg * entropy_coeff
    return policy_loss, entropy_agg.detach(), clipfrac, ppo_kl


def rmpad_actor_inputs(dtype):
    g = gen(12)
    x = lm_head((T2,), H2, V2, dtype, g)
    ids = tokens((T2,), V2, g)
    # packed index -> padded position
    keep = torch.ones(B2 * S2, dtype=torch.bool)
    keep[-3:] = False
    indices = keep.nonzero().squeeze(-1)
    R = 4
    lp = torch.zeros(B2 * S2)
    lp[indices] = near_logp(head_logits(x), torch.roll(ids, -1, 0), g, TEMP)
    return {**x, "input_ids_rmpad": ids, "indices": indices,
            "old_log_prob": lp.view(B2, S2)[:, -R - 1:-1].contiguous(),
            "advantages": randn((B2, R), g), "mask": response_mask(B2, R, g), "response_length": R}


B3, S3, R3, H3, V3 = 2, 12, 9, 16, 47


def entropy_checkpointing(hidden, weight, responses, old_log_prob, advantages, mask,
                          temperature=TEMP, entropy_coeff=0.01):
    # dp_actor._forward_micro_batch with config.entropy_checkpointing: the entropy recomputed in
    # backward by torch.utils.checkpoint; log-probs by the naive torch path.
    logits = hidden @ weight.T
    logits.div_(temperature)
    R = responses.shape[-1]
    logits = logits[:, -R - 1:-1, :]
    log_prob = logprobs_from_logits_naive(logits, responses)
    entropy = torch.utils.checkpoint.checkpoint(entropy_from_logits, logits, use_reentrant=False)
    pg_loss, clipfrac, _ = policy_loss_vanilla(old_log_prob, log_prob, advantages, mask)
    entropy_agg = agg_loss(entropy, mask, "token-mean")
    return pg_loss - entropy_agg * entropy_coeff, entropy_agg.detach(), clipfrac


def entropy_checkpointing_inputs(dtype):
    g = gen(13)
    x = lm_head((B3, S3), H3, V3, dtype, g)
    responses = tokens((B3, R3), V3, g)
    logits = head_logits(x)[:, -R3 - 1:-1]
    return {**x, "responses": responses, "old_log_prob": near_logp(logits, responses, g, TEMP),
            "advantages": randn((B3, R3), g), "mask": response_mask(B3, R3, g)}


B4, S4, V4 = 4, 7, 41


def gspo_k3plus(logits, responses, old_log_prob, ref_log_prob, advantages, mask, kl_coef=0.01):
    # core_algos.compute_policy_loss_gspo + kl_penalty("k3+") on logprobs_from_logits_naive.
    log_prob = logprobs_from_logits_naive(logits, responses)
    pg_loss, clipfrac = policy_loss_gspo(old_log_prob, log_prob, advantages, mask)
    kl = agg_loss(kl_penalty(log_prob, ref_log_prob, "k3+"), mask, "token-mean")
    return pg_loss + kl_coef * kl, clipfrac, kl.detach()


def gspo_k3plus_inputs(dtype):
    g = gen(14)
    logits = logits_leaf((B4, S4, V4), dtype, g)
    responses = tokens((B4, S4), V4, g)
    return {"logits": logits, "responses": responses,
            "old_log_prob": seq_offset(near_logp(logits, responses, g, noise=0.0), g),
            "ref_log_prob": near_logp(logits, responses, g, noise=0.3),
            "advantages": randn((B4, S4), g), "mask": response_mask(B4, S4, g)}


CASES = [
    Case("verl_padded_actor_ppo", "verl",
         "verl/workers/actor/dp_actor.py:_forward_micro_batch (padded, logits.div_) + update_policy; "
         "verl/utils/torch_functional.py:logprobs_from_logits_v2, entropy_from_logits; "
         "verl/trainer/ppo/core_algos.py:compute_policy_loss_vanilla (dual clip), kl_penalty(low_var_kl)",
         padded_actor_ppo, padded_actor_inputs,
         lp_and_entropy([("logprob",)], [("entropy",)]),
         no_grad_kinds=("entropy",), temperature="/ 0.7"),
    Case("verl_rmpad_chunked_entropy", "verl",
         "verl/workers/actor/dp_actor.py:_forward_micro_batch (use_remove_padding, logits_rmpad.div_); "
         "verl/utils/torch_functional.py:logprobs_from_logits_v2, entropy_from_logits_with_chunking; "
         "core_algos.agg_loss(seq-mean-token-sum)",
         rmpad_actor, rmpad_actor_inputs,
         lp_and_entropy([("logprob",)], one_or_each("entropy", n_chunks(T2, ENT_CHUNK2))),
         grad_kinds=("logprob", "entropy"), temperature="/ 0.7"),
    Case("verl_entropy_checkpointing", "verl",
         "verl/workers/actor/dp_actor.py:_forward_micro_batch (entropy_checkpointing: "
         "torch.utils.checkpoint.checkpoint(entropy_from_logits, logits)); "
         "verl/utils/torch_functional.py:logprobs_from_logits_naive",
         entropy_checkpointing, entropy_checkpointing_inputs,
         lp_and_entropy([("logprob",)], [("entropy",)]),
         grad_kinds=("logprob", "entropy"), temperature="/ 0.7"),
    Case("verl_gspo_k3plus", "verl",
         "verl/trainer/ppo/core_algos.py:compute_policy_loss_gspo, kl_penalty('k3+') (straight-through); "
         "verl/utils/torch_functional.py:logprobs_from_logits_naive",
         gspo_k3plus, gspo_k3plus_inputs, (("logprob",),), temperature=None),
]
