"""pytorch/torchtune: the RLHF recipes' log-probs (one with a preallocated buffer filled batch
chunk by batch chunk) and the PPO and GRPO losses.

Restated from torchtune/rlhf/sequence_processing.py (truncate_sequence_for_logprobs,
logits_to_logprobs, batched_logits_to_logprobs: `torch.empty_like(sequences, dtype=float32)`
filled by slices, `logits[chunk] / temperature`), torchtune/rlhf/loss/ppo.py (PPOLoss),
torchtune/dev/grpo/loss.py (GRPOLoss) and the recipes ppo_full_finetune_single_device.py and
dev/grpo_full_finetune_distributed.py (ppo/grpo_step: `pi_logprobs[padding_masks] = 1.0`,
`phi_values[value_padding_masks] = 0.0`, `loss /= gradient_accumulation_steps`, the approximate
KL under `torch.no_grad()`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Case, choices, gen, logits_leaf, near_logp, one_or_each, randn, tokens

TEMP = 0.7


def truncate_sequence_for_logprobs(logits, context_length):
    return logits[:, context_length - 1:-1]


def logits_to_logprobs(logits, sequences, temperature=1.0):
    return torch.gather(F.log_softmax(logits / temperature, dim=-1), 2, sequences.unsqueeze(-1)).squeeze(-1)


def batched_logits_to_logprobs(logits, sequences, temperature=1.0, chunk_size=4):
    batch = logits.shape[0]
    result = torch.empty_like(sequences, dtype=torch.float32, device=logits.device)
    for start in range(0, batch, chunk_size):
        end = min(start + chunk_size, batch)
        chunk_lp = F.log_softmax(logits[start:end] / temperature, dim=-1)
        result[start:end] = torch.gather(chunk_lp, 2, sequences[start:end].unsqueeze(-1)).squeeze(-1)
    return result


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


B, CTX, R, V = 4, 3, 8, 67  # query_responses of CTX + R tokens


def grpo_step(pi_logits, responses, response_padding_masks, pi_old_logprobs, ref_logprobs, advantages,
              temperature=TEMP, epsilon=0.1, kl_coeff=0.1):
    # grpo_full_finetune_distributed.grpo_step + GRPOLoss.
    pi_logits = truncate_sequence_for_logprobs(pi_logits, CTX)
    pi_logprobs = batched_logits_to_logprobs(pi_logits, responses, temperature, chunk_size=1)
    pi_logprobs[response_padding_masks] = 1.0
    padding_masks = ~response_padding_masks
    ratios = torch.exp(pi_logprobs - pi_old_logprobs)
    clipped = torch.clamp(ratios, 1.0 - epsilon, 1.0 + epsilon)
    adv = advantages[:, None]
    policy_clipped, policy_unclipped = adv * clipped, adv * ratios
    clipfrac = masked_mean((policy_clipped < policy_unclipped).float(), padding_masks)
    policy_loss = masked_mean(torch.minimum(policy_clipped, policy_unclipped), padding_masks)
    kl = torch.exp(ref_logprobs - pi_logprobs) - (ref_logprobs - pi_logprobs) - 1
    kl_loss = masked_mean(kl, padding_masks)
    loss = -(policy_loss - kl_coeff * kl_loss)
    with torch.no_grad():
        approx_policy_kls = (0.5 * (pi_logprobs - pi_old_logprobs).pow(2)).mean()
    return loss, policy_loss.detach(), kl_loss.detach(), clipfrac.detach(), approx_policy_kls


def _padding(g, batch, length):
    lens = torch.randint(3, length + 1, (batch,), generator=g)
    lens[0] = length
    return torch.arange(length)[None, :] >= lens[:, None]


def grpo_inputs(dtype):
    g = gen(61)
    logits = logits_leaf((B, CTX + R, V), dtype, g)
    responses = tokens((B, R), V, g)
    pad = _padding(g, B, R)
    trunc = logits[:, CTX - 1:-1]
    return {"pi_logits": logits, "responses": responses, "response_padding_masks": pad,
            "pi_old_logprobs": near_logp(trunc, responses, g, TEMP, clip=0.1).masked_fill(pad, 1.0),
            "ref_logprobs": near_logp(trunc, responses, g, TEMP, noise=0.3).masked_fill(pad, 1.0),
            "advantages": randn((B,), g)}


B2, CTX2, R2, H2, V2 = 2, 4, 9, 8, 53


def ppo_step(pi_logits, value_hidden, value_weight, responses, response_padding_masks,
             value_padding_masks, old_logprobs, old_values, advantages, returns, temperature=TEMP,
             epsilon=0.1, value_clip_range=0.2, value_coeff=0.1, grad_accum=2):
    # ppo_full_finetune_single_device.ppo_step + PPOLoss.
    pi_logits = truncate_sequence_for_logprobs(pi_logits, CTX2)
    pi_logprobs = logits_to_logprobs(pi_logits, responses, temperature)
    pi_logprobs[response_padding_masks] = 1.0
    phi_values = value_hidden @ value_weight  # the value model's head
    phi_values = truncate_sequence_for_logprobs(phi_values, CTX2).squeeze(-1)
    phi_values[value_padding_masks] = 0.0
    ratios = torch.exp(pi_logprobs - old_logprobs)
    clipped = torch.clamp(ratios, 1.0 - epsilon, 1.0 + epsilon)
    losses_clipped, losses_unclipped = -advantages * clipped, -advantages * ratios
    padding_masks = ~response_padding_masks
    clipfrac = masked_mean((losses_clipped > losses_unclipped).to(pi_logprobs.dtype), padding_masks)
    policy_loss = masked_mean(torch.maximum(losses_clipped, losses_unclipped), padding_masks)
    values_clipped = torch.clamp(phi_values, old_values - value_clip_range, old_values + value_clip_range)
    value_loss = torch.maximum((phi_values - returns) ** 2, (values_clipped - returns) ** 2)
    value_loss = 0.5 * masked_mean(value_loss, ~value_padding_masks)
    loss = policy_loss + value_loss * value_coeff
    loss /= grad_accum
    with torch.no_grad():
        approx_policy_kls = (0.5 * (pi_logprobs - old_logprobs).pow(2)).mean()
    return loss, policy_loss.detach(), value_loss.detach(), clipfrac.detach(), approx_policy_kls


def ppo_inputs(dtype):
    g = gen(62)
    logits = logits_leaf((B2, CTX2 + R2, V2), dtype, g)
    responses = tokens((B2, R2), V2, g)
    pad = _padding(g, B2, R2)
    value_pad = pad.clone()
    value_pad[:, :-1] = pad[:, 1:]  # the value of the last response token is kept
    trunc = logits[:, CTX2 - 1:-1]
    return {"pi_logits": logits,
            "value_hidden": torch.randn(B2, CTX2 + R2, H2, generator=g).to(dtype).requires_grad_(),
            "value_weight": (torch.randn(H2, 1, generator=g) / H2 ** 0.5).to(dtype).requires_grad_(),
            "responses": responses, "response_padding_masks": pad, "value_padding_masks": value_pad,
            "old_logprobs": near_logp(trunc, responses, g, TEMP, clip=0.1).masked_fill(pad, 1.0),
            "old_values": randn((B2, R2), g), "advantages": randn((B2, R2), g), "returns": randn((B2, R2), g)}


CASES = [
    Case("torchtune_grpo_batched_logprobs", "torchtune",
         "torchtune/rlhf/sequence_processing.py:batched_logits_to_logprobs (torch.empty_like buffer, "
         "chunk_size=1); recipes/dev/grpo_full_finetune_distributed.py:grpo_step; torchtune/dev/grpo/loss.py:GRPOLoss",
         grpo_step, grpo_inputs, (("logprob",),), temperature="/ 0.7"),
    Case("torchtune_ppo_value_head", "torchtune",
         "torchtune/rlhf/sequence_processing.py:logits_to_logprobs, truncate_sequence_for_logprobs; "
         "recipes/ppo_full_finetune_single_device.py:ppo_step; torchtune/rlhf/loss/ppo.py:PPOLoss",
         ppo_step, ppo_inputs, (("logprob",),), temperature="/ 0.7"),
]
