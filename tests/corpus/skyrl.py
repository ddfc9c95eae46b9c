"""NovaSky-AI/SkyRL: the FSDP model wrapper's log-probs and chunked entropy, and the policy losses.

Restated from skyrl/backends/skyrl_train/utils/torch_utils.py (logprobs_from_logits_v2, the path
without flash-attn; chunked_entropy_from_logits: `torch.no_grad()` unless requires_grad, a zeros
buffer in the logits' dtype, sequence-dim chunks of `[B, S, V]`, the attention mask, slice
assignment; safe_exp_delta; masked_mean), skyrl/backends/skyrl_train/workers/model_wrapper.py
(`logits_BSV.div_(temperature)`, `torch.roll` labels) and
skyrl/backends/skyrl_train/utils/ppo_utils.py (ppo_policy_loss regular/dual_clip,
gspo_policy_loss, compute_approx_kl k3 with the `where(loss_mask)` guard, reduce_loss).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from . import (Case, gen, head_logits, lm_head, lp_and_entropy, n_chunks, near_logp, one_or_each, randn,
               response_mask, seq_offset, tokens)

TEMP = 0.6
ENT_CHUNK = 5  # logprobs_chunk_size (1024 in the library)


def logprobs_from_logits_v2(logits, labels):
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
    rows = []
    for row_logits, row_labels in zip(logits, labels):
        lp = F.log_softmax(row_logits, dim=-1)
        rows.append(lp.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def chunked_entropy_from_logits(logits, requires_grad=False, attention_mask=None, chunk_size=ENT_CHUNK):
    with (nullcontext() if requires_grad else torch.no_grad()):
        S = logits.size(1)
        out = torch.zeros((logits.shape[0], S), dtype=logits.dtype, device=logits.device)
        for i in range(n_chunks(S, chunk_size)):
            s, e = i * chunk_size, min((i + 1) * chunk_size, S)
            logp = F.log_softmax(logits[:, s:e], dim=-1)
            ent = -(logp.exp() * logp).sum(-1)
            if attention_mask is not None:
                ent = ent * attention_mask[:, s:e]
            out[:, s:e] = ent
    return out


def safe_exp_delta(delta, clip=20.0, out_dtype=None):
    return torch.clamp(delta.to(torch.float32), -clip, clip).exp().to(out_dtype or delta.dtype)


def masked_mean(t, mask, dim=None):
    return (t * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1.0)


def compute_approx_kl_k3(log_probs, log_probs_base, loss_mask):
    kl = torch.clamp(log_probs_base - log_probs, min=-20, max=20)
    kld = torch.clamp((torch.exp(kl) - kl - 1).contiguous(), min=-10, max=10)
    return torch.where(loss_mask.bool(), kld * loss_mask, 0.0)


B, S, A, H, V = 2, 13, 8, 16, 41  # sequences [B, S]; the last A log-probs are the actions'


def _forward(hidden, weight, sequences, attention_mask, temperature, entropy_requires_grad):
    # HFModelWrapper.forward without sample packing or sequence parallelism.
    rolled = torch.roll(sequences, shifts=-1, dims=1)
    logits_BSV = hidden @ weight.T
    logits_BSV.div_(temperature)
    log_probs = logprobs_from_logits_v2(logits_BSV, rolled)
    entropy_BS = chunked_entropy_from_logits(logits_BSV, requires_grad=entropy_requires_grad,
                                             attention_mask=attention_mask)
    return log_probs[:, -A - 1:-1], entropy_BS[:, -A - 1:-1]


def ppo_dual_clip(hidden, weight, sequences, attention_mask, loss_mask, old_log_probs, advantages,
                  temperature=TEMP, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0):
    log_probs, entropy = _forward(hidden, weight, sequences, attention_mask, temperature, False)
    ratio = safe_exp_delta(log_probs - old_log_probs, clip=20.0, out_dtype=log_probs.dtype)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = -torch.min(surr1, surr2)
    clip_ratio = masked_mean((-surr2 > -surr1).float(), loss_mask).detach()
    dual = torch.min(-advantages * clip_ratio_c, loss)
    loss = torch.where(advantages < 0, dual, loss)
    loss = (loss * loss_mask).sum()
    return loss, masked_mean(entropy, loss_mask), clip_ratio


def gspo_entropy_kl(hidden, weight, sequences, attention_mask, loss_mask, old_log_probs, advantages,
                    base_log_probs, temperature=TEMP, eps_low=3e-4, eps_high=4e-4, entropy_coef=0.01,
                    kl_coef=0.001):
    log_probs, entropy = _forward(hidden, weight, sequences, attention_mask, temperature, True)
    log_ratio = log_probs - old_log_probs
    seq_weights = masked_mean(log_ratio, loss_mask, dim=-1).unsqueeze(-1)
    log_token_weights = log_probs - log_probs.detach() + seq_weights.detach()
    ratio = torch.exp(torch.clamp(log_token_weights, max=10))
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = (-torch.min(surr1, surr2) * loss_mask).sum()
    kl = compute_approx_kl_k3(log_probs, base_log_probs, loss_mask)
    entropy_loss = masked_mean(entropy, loss_mask)
    loss = loss + kl_coef * kl.sum() - entropy_coef * entropy_loss
    return loss, entropy_loss.detach()


def skyrl_inputs(seed, gspo):
    def make(dtype):
        g = gen(seed)
        x = lm_head((B, S), H, V, dtype, g)
        sequences = tokens((B, S), V, g)
        attention_mask = torch.ones(B, S)
        attention_mask[1, -2:] = 0.0
        logits = head_logits(x)[:, -A - 1:-1]
        labels = torch.roll(sequences, -1, 1)[:, -A - 1:-1]
        return {**x, "sequences": sequences, "attention_mask": attention_mask,
                "loss_mask": response_mask(B, A, g, min_len=3),
                "old_log_probs": (seq_offset(near_logp(logits, labels, g, TEMP, noise=0.0), g) if gspo
                                  else near_logp(logits, labels, g, TEMP)),
                "advantages": randn((B, A), g) / A,
                "base_log_probs": near_logp(logits, labels, g, TEMP, noise=0.3)}
    return make


_ENT = one_or_each("entropy", n_chunks(S, ENT_CHUNK))
# logprobs_from_logits_v2 over B rows: fp32 gathers once and loops the logsumexp, bf16 loops rows.
_SITES = lp_and_entropy([("logprob",)], _ENT)


def _drop(inputs_fn, *names):
    def make(dtype):
        out = inputs_fn(dtype)
        for n in names:
            out.pop(n)
        return out
    return make


CASES = [
    Case("skyrl_ppo_dual_clip_no_grad_entropy", "SkyRL",
         "skyrl/backends/skyrl_train/workers/model_wrapper.py:HFModelWrapper.forward (div_); "
         "utils/torch_utils.py:logprobs_from_logits_v2, chunked_entropy_from_logits(requires_grad=False); "
         "utils/ppo_utils.py:ppo_policy_loss (dual_clip), safe_exp_delta, reduce_loss",
         ppo_dual_clip, _drop(skyrl_inputs(41, gspo=False), "base_log_probs"),
         _SITES,
         no_grad_kinds=("entropy",), temperature="/ 0.6"),
    Case("skyrl_gspo_entropy_grad_kl", "SkyRL",
         "utils/torch_utils.py:chunked_entropy_from_logits(requires_grad=True) (zeros buffer in the logits' "
         "dtype); utils/ppo_utils.py:gspo_policy_loss, compute_approx_kl(k3, loss_mask)",
         gspo_entropy_kl, skyrl_inputs(42, gspo=True),
         _SITES,
         grad_kinds=("logprob", "entropy"), temperature="/ 0.6"),
]
