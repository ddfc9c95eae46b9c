"""THUDM/slime: log-probs and entropy of packed `[1, T, V]` logits (a fused autograd.Function
today, separate entropy Function + cross-entropy before), the per-sample PPO/GSPO/CISPO losses.

Restated on one tensor-parallel rank (every all-reduce is the identity) from
slime/utils/ppo_utils.py: calculate_log_probs_and_entropy (`logits.chunk(num_chunks)` then `cat`),
_VocabParallelLogProbEntropy (forward with `sub`, advanced-index gather, `exp_`, `div_`, entropy
marked non-differentiable when its gradient is not needed; backward reusing the softmax in place),
compute_policy_loss (dual clip), compute_cispo_loss, compute_approx_kl; from its history (the
version before "perf: fuse PPO logprob entropy computation") _VocabParallelEntropy (a backward that
mutates its saved logits and restores them), compute_entropy_from_logits on `chunk.clone()` and
compute_log_probs (Megatron's fused vocab-parallel cross-entropy, on one rank `-cross_entropy`,
with the top-p keep mask); and slime/backends/megatron_utils/loss.py (get_log_probs_and_entropy:
`logits / rollout_temperature`, shifted tokens, per-sample response slices; policy_loss_function:
`pg_loss - entropy_coef * entropy_loss`, compute_gspo_kl, the KL loss; sum_of_sample_mean).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, choices, gen, logits_leaf, n_chunks, near_logp, one_or_each, randn, seq_offset

TEMP = 0.8
CHUNK = 8  # args.log_probs_chunk_size

# Three packed samples: (total_length, response_length); T = sum of total lengths.
SAMPLES = ((9, 5), (6, 4), (8, 6))
T = sum(t for t, _ in SAMPLES)
V = 59


class FusedLogProbEntropy(torch.autograd.Function):
    """_VocabParallelLogProbEntropy on one rank, without a top-p mask."""

    @staticmethod
    def forward(ctx, logits, target, with_entropy_grad):
        logits = logits.float()
        rows = torch.arange(logits.shape[0], device=logits.device)
        logits_max = logits.max(dim=-1, keepdim=True).values
        normalized = logits - logits_max
        predicted = normalized[rows, target]  # before exp_ overwrites it
        exp_logits = normalized.exp_()
        sum_exp = exp_logits.sum(dim=-1, keepdim=True)
        softmax = exp_logits.div_(sum_exp)
        sum_p_x = (softmax * logits).sum(dim=-1, keepdim=True)
        entropy = (logits_max + sum_exp.log() - sum_p_x).squeeze(-1)
        log_prob = predicted.unsqueeze(-1) - sum_exp.log()
        if not with_entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.with_entropy_grad = with_entropy_grad
        empty = logits.new_empty((0,))
        ctx.save_for_backward(softmax, target, sum_p_x if with_entropy_grad else empty,
                              logits if with_entropy_grad else empty)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        softmax, target, sum_p_x, logits = ctx.saved_tensors
        grad_entropy_input = None
        if ctx.with_entropy_grad and grad_entropy is not None:
            grad_entropy_input = (sum_p_x - logits) * softmax * grad_entropy.reshape(-1, 1)
        grad = softmax.neg_()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, target] += 1.0
        grad.mul_(grad_log_prob.reshape(-1, 1))
        if grad_entropy_input is not None:
            grad.add_(grad_entropy_input)
        return grad, None, None


class EntropyFunction(torch.autograd.Function):
    """_VocabParallelEntropy (slime 2025) on one rank."""

    @staticmethod
    def forward(ctx, logits):
        logits_max = logits.max(dim=-1, keepdim=True).values
        normalized = logits - logits_max
        exp_logits = normalized.exp_()
        sum_exp = exp_logits.sum(dim=-1, keepdim=True)
        softmax = exp_logits.div_(sum_exp)
        sum_p_x = (softmax * logits).sum(dim=-1, keepdim=True)
        entropy = logits_max + sum_exp.log() - sum_p_x
        ctx.save_for_backward(logits, softmax, sum_p_x)
        return entropy.squeeze(dim=-1)

    @staticmethod
    def backward(ctx, grad_output):
        logits, softmax, sum_p_x = ctx.saved_tensors
        logits.sub_(sum_p_x)  # reuse the saved tensors, then put the logits back
        softmax.mul_(logits)
        softmax.mul_(grad_output.unsqueeze(-1))
        logits.add_(sum_p_x)
        softmax.mul_(-1)
        return softmax


def shifted_tokens(unconcat_tokens):
    """_build_shifted_tokens, cp=1: the target of position i of a sample is its token i+1."""
    parts = []
    for toks in unconcat_tokens:
        parts.append(torch.cat([toks[1:], toks.new_zeros(1)]))
    return torch.cat(parts)


def per_sample(full):
    """_extract_per_sample, cp=1: each sample's response positions (offset one to the left)."""
    out, offset = [], 0
    for total, resp in SAMPLES:
        end = offset + total
        out.append(full[end - resp - 1:end - 1])
        offset += total
    return out


def sum_of_sample_mean(x, loss_masks):
    """Mean over each sample's response tokens, summed over samples, over the sample count."""
    out, pos = 0.0, 0
    for mask in loss_masks:
        n = mask.shape[0]
        out = out + (x[pos:pos + n] * mask).sum() / mask.sum().clamp(min=1)
        pos += n
    return out / len(loss_masks)


def compute_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c=None):
    ratio = (-ppo_kl).exp()
    loss1 = -ratio * advantages
    loss2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clipped = torch.maximum(loss1, loss2)
    clipfrac = torch.gt(loss2, loss1).float()
    if eps_clip_c is None:
        return clipped, clipfrac
    loss3 = -eps_clip_c * advantages
    return torch.where(advantages < 0, torch.min(loss3, clipped), clipped), clipfrac


def compute_approx_kl(log_probs, log_probs_base, kind, importance_ratio=None):
    log_ratio = log_probs.float() - log_probs_base.float()
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = log_ratio ** 2 / 2.0
    else:
        log_ratio = -log_ratio
        kl = log_ratio.exp() - 1 - log_ratio
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kind == "low_var_kl":
        kl = torch.clamp(kl, min=-10, max=10)
    return kl


def _loss_masks(loss_mask):
    out, pos = [], 0
    for _, resp in SAMPLES:
        out.append(loss_mask[pos:pos + resp])
        pos += resp
    return out


def fused_ppo(logits, unconcat_tokens, old_log_probs, ref_log_probs, advantages, loss_mask,
              rollout_temperature=TEMP, entropy_coef=0.0, kl_coef=0.01):
    # get_log_probs_and_entropy (HEAD) + policy_loss_function with eps_clip_c and use_kl_loss.
    logits = logits.squeeze(0)
    logits = logits / rollout_temperature
    logits = logits.contiguous()
    full_tokens = shifted_tokens(unconcat_tokens)
    with_entropy_grad = entropy_coef != 0
    num = (logits.size(0) - 1) // CHUNK + 1
    log_probs, entropies = [], []
    for lg, tk in zip(logits.chunk(num, dim=0), full_tokens.chunk(num, dim=0)):
        lp, ent = FusedLogProbEntropy.apply(lg, tk, with_entropy_grad)
        log_probs.append(lp)
        entropies.append(ent)
    log_prob_full = torch.cat(log_probs, dim=0).squeeze(-1)
    entropy_full = torch.cat(entropies, dim=0)
    log_probs = torch.cat(per_sample(log_prob_full))
    entropy = torch.cat(per_sample(entropy_full))
    masks = _loss_masks(loss_mask)
    ppo_kl = old_log_probs - log_probs
    pg_loss, clipfrac = compute_policy_loss(ppo_kl, advantages, 0.2, 0.28, eps_clip_c=3.0)
    entropy_loss = sum_of_sample_mean(entropy, masks)
    loss = sum_of_sample_mean(pg_loss, masks) - entropy_coef * entropy_loss
    kl = compute_approx_kl(log_probs, ref_log_probs, "low_var_kl")
    loss = loss + kl_coef * sum_of_sample_mean(kl, masks)
    return loss, entropy_loss.detach(), sum_of_sample_mean(clipfrac, masks), sum_of_sample_mean(ppo_kl, masks).detach()


def slime_inputs(seed):
    def make(dtype):
        g = gen(seed)
        logits = logits_leaf((1, T, V), dtype, g)
        unconcat = [torch.randint(0, V, (t,), generator=g) for t, _ in SAMPLES]
        full = torch.cat(per_sample(near_logp(logits[0], shifted_tokens(unconcat), g, TEMP)))
        ref = torch.cat(per_sample(near_logp(logits[0], shifted_tokens(unconcat), g, TEMP, 0.3)))
        n = full.shape[0]
        mask = torch.ones(n)
        mask[3] = 0.0
        return {"logits": logits, "unconcat_tokens": unconcat, "old_log_probs": full, "ref_log_probs": ref,
                "advantages": randn((n,), g), "loss_mask": mask}
    return make


def entropy_function_cispo(logits, unconcat_tokens, old_log_probs, ref_log_probs, advantages, loss_mask,
                           rollout_temperature=TEMP, entropy_coef=0.01, kl_coef=0.01):
    # slime 2025: calculate_log_probs_and_entropy with with_entropy and a chunk size: the entropy
    # through _VocabParallelEntropy on a clone of each chunk, the log-probs by cross-entropy on
    # another clone; compute_cispo_loss; the KL with the unbiased importance ratio.
    logits = logits.squeeze(0).div(rollout_temperature).contiguous()
    full_tokens = shifted_tokens(unconcat_tokens)
    num = (logits.size(0) - 1) // CHUNK + 1
    logits_chunks, token_chunks = logits.chunk(num, dim=0), full_tokens.chunk(num, dim=0)
    entropy_full = torch.cat([EntropyFunction.apply(lg.clone()) for lg in logits_chunks], dim=0)
    log_prob_full = torch.cat([-F.cross_entropy(lg.clone(), tk, reduction="none")
                               for lg, tk in zip(logits_chunks, token_chunks)], dim=0)
    log_probs = torch.cat(per_sample(log_prob_full))
    entropy = torch.cat(per_sample(entropy_full))
    masks = _loss_masks(loss_mask)
    ppo_kl = old_log_probs - log_probs
    ratio = (-ppo_kl).exp()
    truncated = torch.clamp(ratio, min=1.0 - 1.0, max=1.0 + 0.28)
    pg_loss = -truncated.detach() * advantages * log_probs
    entropy_loss = sum_of_sample_mean(entropy, masks)
    loss = sum_of_sample_mean(pg_loss, masks) - entropy_coef * entropy_loss
    importance_ratio = torch.exp(log_probs - old_log_probs)
    kl = compute_approx_kl(log_probs, ref_log_probs, "k3", importance_ratio=importance_ratio)
    loss = loss + kl_coef * sum_of_sample_mean(kl, masks)
    return loss, entropy_loss.detach()


def top_p_gspo(logits, unconcat_tokens, keep_mask, old_log_probs, advantages, loss_mask,
               rollout_temperature=TEMP):
    # slime 2025, chunk_size -1 and no entropy: compute_log_probs with the rollout's top-p keep mask
    # (the sampled token forced in), then GSPO's per-sample KL (compute_gspo_kl, cp=1).
    logits = logits.squeeze(0).div(rollout_temperature).contiguous()
    full_tokens = shifted_tokens(unconcat_tokens)
    keep = keep_mask.clone()
    keep.scatter_(-1, full_tokens.unsqueeze(-1), True)
    masked = logits.clone().masked_fill(~keep, float("-inf"))
    log_prob_full = -F.cross_entropy(masked, full_tokens, reduction="none")
    log_probs = per_sample(log_prob_full)
    olds = _split(old_log_probs)
    masks = _loss_masks(loss_mask)
    kls = [((o - lp) * m).sum() / m.sum().clamp(min=1) for lp, o, m in zip(log_probs, olds, masks)]
    ppo_kl = torch.cat([k.expand(m.shape[0]) for k, m in zip(kls, masks)])
    pg_loss, clipfrac = compute_policy_loss(ppo_kl, advantages, 3e-4, 4e-4)
    return sum_of_sample_mean(pg_loss, masks), sum_of_sample_mean(clipfrac, masks)


def _split(x):
    out, pos = [], 0
    for _, resp in SAMPLES:
        out.append(x[pos:pos + resp])
        pos += resp
    return out


def top_p_inputs(dtype):
    base = slime_inputs(73)(dtype)
    g = gen(74)
    keep = torch.rand(T, V, generator=g) < 0.7
    base.pop("ref_log_probs")
    # The old log-probs of the rollout were taken under the same keep mask.
    logits = base["logits"].detach()[0].float() / TEMP
    tgt = shifted_tokens(base["unconcat_tokens"])
    keep_t = keep.clone()
    keep_t.scatter_(-1, tgt.unsqueeze(-1), True)
    lp = torch.log_softmax(logits.masked_fill(~keep_t, float("-inf")), -1).gather(-1, tgt[:, None]).squeeze(-1)
    base["old_log_probs"] = seq_offset(torch.cat(per_sample(lp)), g, lengths=[r for _, r in SAMPLES])
    return {**base, "keep_mask": keep}


CASES = [
    Case("slime_fused_function_chunked", "slime",
         "slime/utils/ppo_utils.py:calculate_log_probs_and_entropy (chunked), _VocabParallelLogProbEntropy "
         "(autograd.Function, tp=1), compute_policy_loss (eps_clip_c), compute_approx_kl; "
         "slime/backends/megatron_utils/loss.py:get_log_probs_and_entropy, policy_loss_function",
         fused_ppo, slime_inputs(71), tuple(one_or_each("entropy+logprob", n_chunks(T, CHUNK))), dtypes=("fp32",)),
    Case("slime_entropy_function_cispo", "slime",
         "slime/utils/ppo_utils.py@2025 (before #2144): _VocabParallelEntropy (autograd.Function) on "
         "chunk.clone(), compute_log_probs (fused vocab-parallel CE, tp=1), compute_cispo_loss, "
         "compute_approx_kl(importance_ratio)",
         entropy_function_cispo, slime_inputs(72),
         choices(one_or_each("logprob", -(-T // CHUNK))), dtypes=("fp32",), temperature="/ 0.8"),
    Case("slime_top_p_keep_mask_gspo", "slime",
         "slime/utils/ppo_utils.py@2025: compute_log_probs(keep_mask) (masked_fill -inf, sampled token "
         "forced in), compute_gspo_kl; loss.py:get_log_probs_and_entropy (logits / rollout_temperature)",
         top_p_gspo, top_p_inputs, (("logprob",),), dtypes=("fp32",), temperature="/ 0.8"),
]
