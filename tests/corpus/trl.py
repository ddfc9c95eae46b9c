"""huggingface/trl: GRPOTrainer's per-token log-probs and entropies, its losses, and the PPO trainer.

Restated from trl/trainer/utils.py (selective_log_softmax: fp32 gathers and loops the logsumexp
over the leading rows, bf16 loops a per-row log_softmax + gather; entropy_from_logits: flatten,
`split(chunk_size)`, log_softmax, `-(exp * logp).sum`, `cat`), trl/trainer/grpo_trainer.py
(_get_per_token_logps_and_entropies: `logits[:, :-1, :]`, `[:, -logits_to_keep:, :]`,
`logits.div_(self.temperature)`, the entropies under `torch.no_grad()` unless the entropy bonus
is on; get_high_entropy_mask; _compute_loss: token/sequence importance sampling, the k3 KL with
beta, two-sided clipping `delta`, loss types grpo and dapo, the entropy bonus) and
trl/experimental/ppo/ppo_trainer.py (`logits /= temperature + 1e-7`, INVALID_LOGPROB fill,
clipped value loss, the entropy statistic under `torch.no_grad()`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import (Case, gen, head_logits, lm_head, lp_and_entropy, n_chunks, near_logp, one_or_each, randn,
               response_mask, seq_offset, tokens)

TEMP = 0.7
ENT_CHUNK = 8  # entropy_from_logits' chunk_size (128 in the library)
INVALID_LOGPROB = 1.0


def selective_log_softmax(logits, index):
    squeeze = index.ndim == logits.ndim - 1
    if squeeze:
        index = index.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index)
        lse = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        logps = selected - lse.unsqueeze(-1)
    else:
        rows = []
        for row_logits, row_labels in zip(logits, index):
            rows.append(F.log_softmax(row_logits, dim=-1).gather(dim=-1, index=row_labels))
        logps = torch.stack(rows)
    return logps.squeeze(-1) if squeeze else logps


def entropy_from_logits(logits, chunk_size=ENT_CHUNK):
    lead, V = logits.shape[:-1], logits.shape[-1]
    parts = []
    for chunk in logits.reshape(-1, V).split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        parts.append(-(torch.exp(logps) * logps).sum(-1))
    return torch.cat(parts, dim=0).reshape(lead)


def high_entropy_mask(entropies, mask, quantile):
    valid = entropies.float().masked_fill(~mask.bool(), float("nan")).flatten()
    threshold = torch.nanquantile(valid, quantile)
    return ((entropies * mask.float()) >= threshold) & mask.bool()


B, P, C, H, V = 3, 4, 7, 16, 43  # prompt P + completion C tokens; logits for P + C positions


def _policy_logits(hidden, weight, logits_to_keep, temperature):
    logits = hidden @ weight.T
    logits = logits[:, :-1, :]
    logits = logits[:, -logits_to_keep:, :]
    logits.div_(temperature)
    return logits


def grpo_entropy_mask(hidden, weight, completion_ids, completion_mask, advantages, ref_per_token_logps,
                      temperature=TEMP, beta=0.04, eps_low=0.2, eps_high=0.28, top_entropy_quantile=0.5):
    # _compute_loss with loss_type="grpo", importance_sampling_level="token", beta != 0,
    # top_entropy_quantile < 1 and no entropy bonus (so the entropies are computed under no_grad).
    logits = _policy_logits(hidden, weight, completion_ids.shape[1], temperature)
    per_token_logps = selective_log_softmax(logits, completion_ids)
    with torch.no_grad():
        entropies = entropy_from_logits(logits)
    mask = completion_mask
    entropy_mask = high_entropy_mask(entropies, mask, 1 - top_entropy_quantile)
    advantages = advantages.unsqueeze(1)
    old_per_token_logps = per_token_logps.detach()  # num_iterations == 1
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    diff = ref_per_token_logps - per_token_logps
    per_token_kl = torch.exp(diff) - diff - 1
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token_loss = per_token_loss * entropy_mask
    per_token_loss = per_token_loss + beta * per_token_kl
    loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    mean_entropy = (entropies * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, mean_entropy, ((per_token_kl * mask).sum() / mask.sum()).detach()


def grpo_inputs(seed, gspo=False):
    def make(dtype):
        g = gen(seed)
        x = lm_head((B, P + C), H, V, dtype, g)
        ids = tokens((B, C), V, g)
        logits = head_logits(x)[:, :-1][:, -C:]
        out = {**x, "completion_ids": ids, "completion_mask": response_mask(B, C, g),
               "advantages": randn((B,), g),
               "ref_per_token_logps": near_logp(logits, ids, g, TEMP, noise=0.3)}
        if gspo:
            out["old_per_token_logps"] = seq_offset(near_logp(logits, ids, g, TEMP, noise=0.0), g)
        return out
    return make


def dapo_sequence_is_entropy_bonus(hidden, weight, completion_ids, completion_mask, advantages,
                                   ref_per_token_logps, old_per_token_logps, temperature=TEMP,
                                   eps_low=3e-4, eps_high=4e-4, delta=1.5, entropy_coef=0.01,
                                   num_items_in_batch=17.0):
    # _compute_loss with loss_type="dapo", importance_sampling_level="sequence", beta == 0, the
    # two-sided `delta` clip and the entropy bonus (entropies keep their gradient).
    logits = _policy_logits(hidden, weight, completion_ids.shape[1], temperature)
    per_token_logps = selective_log_softmax(logits, completion_ids)
    entropies = entropy_from_logits(logits)
    mask = completion_mask
    advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    normalizer = torch.tensor(num_items_in_batch).clamp(min=1.0)
    loss = (per_token_loss * mask).sum() / normalizer
    entropy_loss = (entropies * mask).sum() / normalizer
    loss = loss - entropy_coef * entropy_loss
    return loss, entropy_loss.detach()


B2, S2, CTX, H2, V2 = 2, 12, 4, 16, 37  # query_responses [B, S]; responses after CTX


def ppo_step(hidden, weight, vpred_temp, responses, padding_mask, padding_mask_p1, mb_logprobs,
             mb_advantage, mb_values, mb_return, temperature=TEMP, cliprange=0.2, cliprange_value=0.2,
             vf_coef=0.1):
    # PPOTrainer.train, one micro-batch: policy and value losses, then statistics under no_grad.
    logits = (hidden @ weight.T)[:, CTX - 1:-1]
    logits /= temperature + 1e-7
    new_logprobs = selective_log_softmax(logits, responses)
    new_logprobs = torch.masked_fill(new_logprobs, padding_mask, INVALID_LOGPROB)
    vpred = vpred_temp[:, CTX - 1:-1].squeeze(-1)
    vpred = torch.masked_fill(vpred, padding_mask_p1, 0)
    vpredclipped = torch.clamp(vpred, mb_values - cliprange_value, mb_values + cliprange_value)
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss = 0.5 * _masked_mean(torch.max(vf_losses1, vf_losses2), ~padding_mask_p1)
    logprobs_diff = new_logprobs - mb_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = _masked_mean(torch.max(pg_losses, pg_losses2), ~padding_mask)
    loss = pg_loss + vf_coef * vf_loss
    with torch.no_grad():
        pg_clipfrac = _masked_mean((pg_losses2 > pg_losses).float(), ~padding_mask)
        prob_dist = torch.nn.functional.softmax(logits, dim=-1)
        entropy = torch.logsumexp(logits, dim=-1) - torch.sum(prob_dist * logits, dim=-1)
        approxkl = 0.5 * (logprobs_diff ** 2).mean()
    return loss, entropy.mean(), approxkl, pg_clipfrac


def _masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def ppo_inputs(dtype):
    g = gen(33)
    x = lm_head((B2, S2), H2, V2, dtype, g)
    R = S2 - CTX
    responses = tokens((B2, R), V2, g)
    padding_mask = response_mask(B2, R, g, min_len=3) == 0
    padding_mask_p1 = torch.cat([torch.zeros(B2, 1, dtype=torch.bool), padding_mask[:, :-1]], 1)
    logits = head_logits(x)[:, CTX - 1:-1]
    return {**x, "vpred_temp": torch.randn(B2, S2, 1, generator=g).requires_grad_(),
            "responses": responses, "padding_mask": padding_mask, "padding_mask_p1": padding_mask_p1,
            "mb_logprobs": near_logp(logits, responses, g, TEMP).masked_fill(padding_mask, INVALID_LOGPROB),
            "mb_advantage": randn((B2, R), g), "mb_values": randn((B2, R), g),
            "mb_return": randn((B2, R), g)}


_GRPO_ENT = one_or_each("entropy", n_chunks(B * C, ENT_CHUNK))

CASES = [
    Case("trl_grpo_entropy_mask", "trl",
         "trl/trainer/utils.py:selective_log_softmax, entropy_from_logits; "
         "trl/trainer/grpo_trainer.py:_get_per_token_logps_and_entropies (div_, entropies under no_grad), "
         "get_high_entropy_mask, _compute_loss (grpo, beta k3)",
         grpo_entropy_mask, grpo_inputs(31),
         lp_and_entropy([("logprob",)], _GRPO_ENT),
         no_grad_kinds=("entropy",), temperature="/ 0.7"),
    Case("trl_dapo_sequence_is_entropy_bonus", "trl",
         "trl/trainer/grpo_trainer.py:_compute_loss (dapo, importance_sampling_level='sequence', delta, "
         "entropy bonus); trl/trainer/utils.py:selective_log_softmax, entropy_from_logits",
         dapo_sequence_is_entropy_bonus, grpo_inputs(32, gspo=True),
         lp_and_entropy([("logprob",)], _GRPO_ENT),
         grad_kinds=("logprob", "entropy"), temperature="/ 0.7"),
    Case("trl_ppo_value_no_grad_entropy", "trl",
         "trl/experimental/ppo/ppo_trainer.py:PPOTrainer.train (logits /= T + 1e-7, INVALID_LOGPROB, "
         "clipped value loss, entropy statistic under no_grad); trl/trainer/utils.py:selective_log_softmax",
         ppo_step, ppo_inputs,
         lp_and_entropy([("logprob",)], [("entropy",)]),
         no_grad_kinds=("entropy",), temperature="/ 0.7"),
]
