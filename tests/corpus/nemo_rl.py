"""NVIDIA NeMo-RL: next-token log-probs (the non-parallel torch path, and DistributedLogprob's
autograd.Function on one rank) under ClippedPGLossFn.

Restated from nemo_rl/distributed/model_utils.py (get_next_token_logprobs_from_logits, the
non-parallel branch: `.to(torch.float32)`, `[:, :-1]`, top-k/top-p a no-op at top_p=1,
log_softmax + gather; DistributedLogprob with tp=1: the log-softmax under `torch.no_grad()`
inside forward, `masked_target[target_mask] = 0`, `log_probs[target_mask] = 0.0`, the softmax saved
and a one-hot backward), nemo_rl/algorithms/utils.py (calculate_kl with importance weights that
are detached where the input clamp binds; masked_mean with a global normalization factor) and
nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossFn: KL with exp(lp - sg[lp]) weights,
token or sequence-level (GSPO) ratios, dual clip, truncated importance sampling).
"""

from __future__ import annotations

import torch

from . import Case, gen, logits_leaf, near_logp, randn, response_mask, seq_offset, tokens


def masked_mean(values, mask, dim=None, global_normalization_factor=None):
    if global_normalization_factor is None:
        return (values * mask).sum(dim=dim) / (mask.sum(dim=dim) + 1e-8)
    return (values * mask).sum(dim=dim) / global_normalization_factor


def calculate_kl(logprobs, logprobs_reference, importance_sampling_weights=None, input_clamp=20.0,
                 output_clamp=10.0):
    logr = logprobs_reference - logprobs
    clamped = logr.clamp(min=-input_clamp, max=input_clamp)
    if importance_sampling_weights is not None:
        importance_sampling_weights = torch.where(logr == clamped, importance_sampling_weights,
                                                  importance_sampling_weights.detach())
    logr = clamped
    kl = torch.exp(logr) - 1 - logr
    if importance_sampling_weights is not None:
        kl = importance_sampling_weights * kl
    return kl.clamp(min=-output_clamp, max=output_clamp)


def next_token_logprobs(input_ids, next_token_logits):
    next_token_logits = next_token_logits.to(torch.float32)
    wo_last = next_token_logits[:, :-1]
    logp = torch.nn.functional.log_softmax(wo_last, dim=-1)
    return logp.gather(dim=-1, index=input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


B, S, V = 3, 11, 43


def clipped_pg(logits, input_ids, token_mask, sample_mask, prev_logprobs, generation_logprobs,
               reference_policy_logprobs, advantages, kl_penalty=0.01, clip_min=0.2, clip_max=0.28,
               clip_c=3.0, tis_ratio=2.0, global_valid_toks=25.0):
    # ClippedPGLossFn.__call__, token level, with the reference KL, dual clip and TIS.
    curr_logprobs = next_token_logprobs(input_ids, logits)
    token_mask = token_mask[:, 1:]
    mask = token_mask * sample_mask.unsqueeze(-1)
    prev = prev_logprobs[:, 1:]
    gen_lp = generation_logprobs[:, 1:]
    ref = reference_policy_logprobs[:, 1:]
    adv = advantages[:, 1:]
    weights = torch.exp(curr_logprobs - curr_logprobs.detach())
    weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
    kl = kl_penalty * calculate_kl(curr_logprobs, ref, importance_sampling_weights=weights)
    kl = masked_mean(kl, mask, global_normalization_factor=global_valid_toks)
    ratios = (curr_logprobs - prev).exp()
    ratios_clamped = ratios.clamp(1.0 - clip_min, 1.0 + clip_max)
    clip_loss = torch.max(-adv * ratios, -adv * ratios_clamped)
    clip_loss = torch.where(adv < 0, torch.min(clip_loss, -adv * clip_c), clip_loss)
    is_weights = torch.nan_to_num(torch.exp(prev - gen_lp), nan=0.0, posinf=0.0, neginf=0.0)
    is_weights = torch.clamp(is_weights, min=0.0, max=tis_ratio)
    actor_loss = masked_mean(is_weights * clip_loss, mask, global_normalization_factor=global_valid_toks)
    probs_ratio = masked_mean(ratios.detach(), mask, global_normalization_factor=global_valid_toks)
    return actor_loss + kl, probs_ratio, kl.detach()


def clipped_pg_inputs(dtype):
    g = gen(81)
    logits = logits_leaf((B, S, V), dtype, g)
    ids = tokens((B, S), V, g)
    lp = torch.zeros(B, S)
    lp[:, 1:] = near_logp(logits[:, :-1], ids[:, 1:], g)
    gen_lp = lp + 0.1 * torch.randn(B, S, generator=g)
    ref = torch.zeros(B, S)
    ref[:, 1:] = near_logp(logits[:, :-1], ids[:, 1:], g, noise=0.3)
    return {"logits": logits, "input_ids": ids, "token_mask": response_mask(B, S, g, min_len=4),
            "sample_mask": torch.tensor([1.0, 1.0, 0.0]), "prev_logprobs": lp,
            "generation_logprobs": gen_lp, "reference_policy_logprobs": ref, "advantages": randn((B, S), g)}


@torch.no_grad()
def _log_softmax_no_grad(logits):
    """_compute_distributed_log_softmax on one rank."""
    logits_max = torch.amax(logits, dim=-1, keepdim=True)
    shifted = logits - logits_max
    return shifted - shifted.exp().sum(-1, keepdim=True).float().log()


class DistributedLogprob(torch.autograd.Function):
    """DistributedLogprob with tp=1 (vocab range [0, V)), the one-hot backward."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index):
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target - vocab_start_index
        masked_target[target_mask] = 0
        logits = vocab_parallel_logits.to(dtype=torch.float32)
        full_log_probs = _log_softmax_no_grad(logits)
        log_probs = torch.gather(full_log_probs, -1, masked_target.unsqueeze(-1)).squeeze(-1)
        log_probs[target_mask] = 0.0
        ctx.save_for_backward(full_log_probs.exp(), target_mask, masked_target)
        return log_probs

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target = ctx.saved_tensors
        V = softmax.size(-1)
        is_chosen = (~target_mask).unsqueeze(-1) * torch.nn.functional.one_hot(masked_target, num_classes=V)
        grad_input = is_chosen.float().sub_(softmax)
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input, None, None, None


def distributed_logprob_gspo(logits, input_ids, token_mask, sample_mask, prev_logprobs, advantages,
                             clip_min=3e-4, clip_max=4e-4):
    # get_next_token_logprobs_from_logits through from_parallel_logits_to_logprobs (tp=1, no cp):
    # DistributedLogprob on logits[:, :-1] vs input_ids[:, 1:]; ClippedPGLossFn with
    # sequence_level_importance_ratios and token_level_loss=False.
    V_local = logits.shape[-1]
    curr_logprobs = DistributedLogprob.apply(logits[:, :-1], input_ids[:, 1:], 0, V_local)
    token_mask = token_mask[:, 1:]
    adv = advantages[:, 1:]
    log_ratios = curr_logprobs - prev_logprobs[:, 1:]
    seq_ratio = masked_mean(log_ratios, token_mask, dim=-1).unsqueeze(-1).exp()
    ratios = seq_ratio.repeat(1, adv.shape[1])
    clip_loss = torch.max(-adv * ratios, -adv * ratios.clamp(1.0 - clip_min, 1.0 + clip_max))
    loss = masked_mean(masked_mean(clip_loss, token_mask, dim=-1), sample_mask)
    return loss, masked_mean(curr_logprobs.detach(), token_mask)


def gspo_inputs(dtype):
    out = clipped_pg_inputs(dtype)
    g = gen(82)
    out["prev_logprobs"] = seq_offset(out["prev_logprobs"], g)
    for k in ("generation_logprobs", "reference_policy_logprobs"):
        out.pop(k)
    return out


@torch.no_grad()
def _apply_top_k_only(logits, top_k):
    """_apply_top_k_only_fn: everything below the k-th largest logit of its row set to -inf."""
    top_k_values, _ = torch.topk(logits, top_k, dim=-1)
    keep_mask = logits >= top_k_values[..., -1:].expand_as(logits)
    return torch.where(keep_mask, logits, torch.tensor(-float("inf"), dtype=logits.dtype)), keep_mask


class ApplyTopKTopP(torch.autograd.Function):
    """_ApplyTopKTopP (top-k only): the filtering runs under no_grad; backward masks the gradient."""

    @staticmethod
    def forward(ctx, logits, top_k):
        filtered, keep_mask = _apply_top_k_only(logits, top_k)
        ctx.save_for_backward(keep_mask)
        return filtered, keep_mask

    @staticmethod
    def backward(ctx, grad_filtered, grad_mask):
        (keep_mask,) = ctx.saved_tensors
        return grad_filtered.masked_fill(~keep_mask, 0.0), None


TOP_K = 6


def top_k_filtered_clipped_pg(logits, input_ids, token_mask, sample_mask, prev_logprobs, reference_policy_logprobs,
                              advantages, kl_penalty=0.05, clip_min=0.2, clip_max=0.28):
    # prepare_loss_input with sampling_params.top_k: the filtered log-probs for the ratio (through
    # _ApplyTopKTopP), the unfiltered ones (curr_logprobs_unfiltered) for the reference KL.
    logits32 = logits.to(torch.float32)
    filtered, _ = ApplyTopKTopP.apply(logits32[:, :-1], TOP_K)
    next_tokens = input_ids[:, 1:]
    curr_logprobs = torch.nn.functional.log_softmax(filtered, dim=-1).gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1)
    unfiltered = next_token_logprobs(input_ids, logits)
    mask = token_mask[:, 1:] * sample_mask.unsqueeze(-1)
    weights = torch.exp(unfiltered - unfiltered.detach())
    kl = kl_penalty * calculate_kl(unfiltered, reference_policy_logprobs[:, 1:], importance_sampling_weights=weights)
    adv = advantages[:, 1:]
    ratios = (curr_logprobs - prev_logprobs[:, 1:]).exp()
    clip_loss = torch.max(-adv * ratios, -adv * ratios.clamp(1.0 - clip_min, 1.0 + clip_max))
    return masked_mean(clip_loss, mask) + masked_mean(kl, mask), masked_mean(ratios.detach(), mask)


def top_k_inputs(dtype):
    g = gen(83)
    logits = logits_leaf((B, S, V), dtype, g)
    # The sampler drew every next token from its row's top k.
    top = torch.topk(logits.detach()[:, :-1].float(), TOP_K, dim=-1).indices
    pick = torch.randint(0, TOP_K, (B, S - 1, 1), generator=g)
    ids = torch.zeros(B, S, dtype=torch.long)
    ids[:, 0] = torch.randint(0, V, (B,), generator=g)
    ids[:, 1:] = top.gather(-1, pick).squeeze(-1)
    filtered = logits.detach()[:, :-1].float()
    kth = torch.topk(filtered, TOP_K, dim=-1).values[..., -1:]
    filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    prev = torch.zeros(B, S)
    prev[:, 1:] = near_logp(filtered, ids[:, 1:], g)
    ref = torch.zeros(B, S)
    ref[:, 1:] = near_logp(logits[:, :-1], ids[:, 1:], g, noise=0.3)
    return {"logits": logits, "input_ids": ids, "token_mask": response_mask(B, S, g, min_len=4),
            "sample_mask": torch.tensor([1.0, 1.0, 0.0]), "prev_logprobs": prev,
            "reference_policy_logprobs": ref, "advantages": randn((B, S), g)}


CASES = [
    Case("nemo_rl_clipped_pg_nonparallel", "NeMo-RL",
         "nemo_rl/distributed/model_utils.py:get_next_token_logprobs_from_logits (non-parallel branch); "
         "nemo_rl/algorithms/loss/loss_functions.py:ClippedPGLossFn (KL k3 with exp(lp - sg[lp]) weights, "
         "dual clip, TIS); nemo_rl/algorithms/utils.py:calculate_kl, masked_mean",
         clipped_pg, clipped_pg_inputs, (("logprob",),), temperature=None),
    Case("nemo_rl_distributed_logprob_function_gspo", "NeMo-RL",
         "nemo_rl/distributed/model_utils.py:DistributedLogprob (autograd.Function, tp=1, no_grad "
         "log-softmax in forward), _compute_distributed_log_softmax; loss_functions.py:ClippedPGLossFn "
         "(sequence_level_importance_ratios)",
         distributed_logprob_gspo, gspo_inputs, (("logprob",),)),
    Case("nemo_rl_top_k_function_and_unfiltered_kl", "NeMo-RL",
         "nemo_rl/algorithms/logits_sampling_utils.py:_ApplyTopKTopP (autograd.Function, filtering under "
         "no_grad, masked backward), _apply_top_k_only_fn; nemo_rl/algorithms/loss/utils.py:prepare_loss_input "
         "(curr_logprobs_unfiltered for the KL); loss_functions.py:ClippedPGLossFn",
         top_k_filtered_clipped_pg, top_k_inputs,
         # The filtered log-probs read the Function's output, the unfiltered ones the logits: two
         # regions (or one site with two wide inputs).
         (("logprob", "logprob"), ("logprob",)), temperature=None),
]
