"""PrimeIntellect-ai/prime-rl: per-token temperatures, the no_grad entropy, per-sample DPPO+KL
losses; and the fused lm-head autograd.Function with an online logsumexp over vocabulary chunks.

Restated from src/prime_rl/trainer/rl/train.py (the VanillaOutputLinear path:
`logits / temperatures.unsqueeze(-1)`, selective_log_softmax, compute_entropy, shift_tensor_right,
per-sample `split(sequence_lengths)`), src/prime_rl/trainer/rl/loss.py (selective_log_softmax;
compute_entropy with its own `torch.no_grad()`; shift_tensor_right; default_loss_fn: DPPO-Binary TV
mask + squared log-ratio KL) and src/prime_rl/trainer/models/layers/lm_head.py
(_SequenceChunkedLogProbEntropyFn: token chunks of `hidden @ weight.T`, vocabulary chunks combined
by _online_logsumexp_and_weighted_update, a backward that recomputes each chunk).
"""

from __future__ import annotations

import math

import torch

from . import Case, gen, logits_leaf, lm_head, lp_and_entropy, near_logp, randn

T, V = 26, 53
SEQ_LENS = (10, 9, 7)


def selective_log_softmax(logits, index):
    return torch.gather(logits.log_softmax(dim=-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


def compute_entropy(shifted_logits):
    with torch.no_grad():
        p = torch.nn.functional.softmax(shifted_logits, dim=-1)
        return torch.logsumexp(shifted_logits, dim=-1) - torch.sum(p * shifted_logits, dim=-1)


def shift_tensor_right(t, pad_value=0.0):
    return torch.cat([torch.full((t.shape[0], 1), pad_value, device=t.device, dtype=t.dtype), t[:, :-1]], dim=1)


def default_loss(trainer_logprobs, inference_logprobs, advantages, loss_mask, dppo_mask_high=0.2,
                 dppo_mask_low=0.2, adv_tau=1.0, kl_tau=1e-3):
    log_ratio = trainer_logprobs - inference_logprobs
    ratio = torch.exp(log_ratio)
    mismatch_kl = ratio - log_ratio - 1
    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    invalid = torch.where(advantages > 0, probs_diff > dppo_mask_high, probs_diff < -dppo_mask_low)
    keep = loss_mask & ~invalid
    pg_loss = keep * (adv_tau * advantages) * ratio
    kl_loss = loss_mask * log_ratio ** 2
    loss = (-pg_loss + kl_tau * kl_loss).sum()
    masked_kl = torch.where(keep, mismatch_kl, 0.0).sum() / keep.sum().clamp(min=1)
    return loss, masked_kl.detach()


def per_token_temperature(logits, labels, temperatures, inference_logprobs, advantages, loss_mask):
    # train.py, VanillaOutputLinear: per-token temperatures, entropy for logging only.
    scaled = logits / temperatures.unsqueeze(-1)
    logprobs = selective_log_softmax(scaled, labels)
    entropy = compute_entropy(scaled)
    logprobs = shift_tensor_right(logprobs, pad_value=math.log(1.0 / V))
    entropy = shift_tensor_right(entropy, pad_value=math.log(float(V)))
    total, kls = 0.0, []
    for lp, ilp, adv, m in zip(logprobs.squeeze(0).split(SEQ_LENS), inference_logprobs.squeeze(0).split(SEQ_LENS),
                               advantages.squeeze(0).split(SEQ_LENS), loss_mask.squeeze(0).split(SEQ_LENS)):
        loss, kl = default_loss(lp, ilp, adv, m)
        total = total + loss
        kls.append(kl)
    mean_entropy = torch.where(loss_mask, entropy, 0.0).sum() / loss_mask.sum()
    return total / loss_mask.sum(), mean_entropy, torch.stack(kls).mean()


def per_token_inputs(dtype):
    g = gen(111)
    logits = logits_leaf((1, T, V), dtype, g)
    labels = torch.randint(0, V, (1, T), generator=g)
    temps = torch.cat([torch.full((n,), t) for n, t in zip(SEQ_LENS, (0.7, 1.0, 0.6))])[None]
    lp = near_logp(logits.detach().float() / temps[..., None], labels, g, noise=0.05)
    lp = shift_tensor_right(lp, math.log(1.0 / V))
    mask = torch.ones(1, T, dtype=torch.bool)
    mask[0, [0, 10, 19]] = False  # each sample's first position
    return {"logits": logits, "labels": labels, "temperatures": temps, "inference_logprobs": lp,
            "advantages": randn((1, T), g), "loss_mask": mask}


# ---- the fused lm-head Function ------------------------------------------------------------------

N, HID, V2, TOKEN_CHUNK, VOCAB_CHUNK = 19, 16, 45, 8, 16


def _online_update(m, s, t, chunk_logits):
    m_new = torch.maximum(m, torch.amax(chunk_logits, dim=-1))
    exp_old = torch.exp(m - m_new)
    chunk_exp = torch.exp(chunk_logits - m_new.unsqueeze(-1))
    return m_new, s * exp_old + chunk_exp.sum(-1), t * exp_old + (chunk_exp * chunk_logits).sum(-1)


class ChunkedLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_temperature, chunk_size):
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 for bf16 weights
        n, vocab = hidden.shape[0], weight.shape[0]
        logprobs = torch.empty((n,), dtype=acc)
        entropy = torch.empty((n,), dtype=acc)
        logz = torch.empty((n,), dtype=acc)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            h, y = hidden[start:end], labels[start:end]
            inv_t = inv_temperature[start:end].unsqueeze(-1).to(acc)
            m = torch.full((end - start,), float("-inf"), dtype=acc)
            s = torch.zeros(end - start, dtype=acc)
            t = torch.zeros(end - start, dtype=acc)
            target = torch.zeros(end - start, dtype=acc)
            for v0 in range(0, vocab, VOCAB_CHUNK):
                v1 = min(v0 + VOCAB_CHUNK, vocab)
                scaled = (h @ weight[v0:v1].t()).to(acc) * inv_t
                m, s, t = _online_update(m, s, t, scaled)
                in_range = (y >= v0) & (y < v1)
                local = (y - v0).clamp(0, v1 - v0 - 1)
                target = torch.where(in_range, scaled.gather(1, local.unsqueeze(1)).squeeze(1), target)
            lz = m + torch.log(s)
            logz[start:end] = lz
            logprobs[start:end] = target - lz
            entropy[start:end] = lz - t / s
        ctx.save_for_backward(hidden, weight, labels, inv_temperature, logz)
        ctx.chunk_size = chunk_size
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, inv_temperature, logz = ctx.saved_tensors
        acc = logz.dtype
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=acc)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h, inv_t = hidden[start:end], inv_temperature[start:end].unsqueeze(-1).to(acc)
            z = (h @ weight.t()).to(acc) * inv_t
            p = torch.exp(z - logz[start:end].unsqueeze(-1))
            g_lp = grad_logprobs[start:end].unsqueeze(-1).to(acc)
            dz = -p * g_lp
            dz.scatter_add_(1, labels[start:end].unsqueeze(1), g_lp)
            if grad_entropy is not None:
                expected = (p * z).sum(-1, keepdim=True)
                dz = dz + grad_entropy[start:end].unsqueeze(-1).to(acc) * p * (expected - z)
            dlogits = dz * inv_t
            grad_hidden[start:end] = (dlogits @ weight.to(acc)).to(hidden.dtype)
            grad_weight += dlogits.t() @ h.to(acc)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def fused_lm_head(hidden, weight, labels, temperatures, inference_logprobs, advantages, loss_mask):
    # FusedOutputLinear: logprobs and entropy straight from the hidden states.
    inv_t = 1.0 / temperatures
    logprobs, entropy = ChunkedLogProbEntropy.apply(hidden, weight, labels, inv_t, TOKEN_CHUNK)
    loss, kl = default_loss(logprobs, inference_logprobs, advantages, loss_mask)
    return loss / loss_mask.sum(), torch.where(loss_mask, entropy.detach(), 0.0).sum() / loss_mask.sum(), kl


def fused_inputs(dtype):
    g = gen(112)
    x = lm_head((N,), HID, V2, dtype, g)
    labels = torch.randint(0, V2, (N,), generator=g)
    temps = torch.where(torch.arange(N) < 10, 0.7, 1.0)
    logits = x["hidden"].detach().float() @ x["weight"].detach().float().T
    mask = torch.ones(N, dtype=torch.bool)
    mask[[0, 10]] = False
    return {**x, "labels": labels, "temperatures": temps,
            "inference_logprobs": near_logp(logits / temps[:, None], labels, g, noise=0.05),
            "advantages": randn((N,), g), "loss_mask": mask}


CASES = [
    Case("prime_rl_per_token_temperature", "prime-rl",
         "src/prime_rl/trainer/rl/train.py (logits / temperatures.unsqueeze(-1), shift_tensor_right, split); "
         "src/prime_rl/trainer/rl/loss.py:selective_log_softmax, compute_entropy (no_grad), default_loss_fn",
         per_token_temperature, per_token_inputs, lp_and_entropy([("logprob",)], [("entropy",)]),
         no_grad_kinds=("entropy",), temperature="/ per-token"),
    Case("prime_rl_fused_lm_head_function", "prime-rl",
         "src/prime_rl/trainer/models/layers/lm_head.py:_SequenceChunkedLogProbEntropyFn "
         "(autograd.Function, online logsumexp over vocab chunks), _online_logsumexp_and_weighted_update; "
         "loss.py:default_loss_fn",
         fused_lm_head, fused_inputs, ((),), grad_kinds=()),
]
