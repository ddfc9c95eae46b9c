"""allenai/open-instruct: grpo_fast's log-probs, the monitoring entropy under no_grad, the GRPO
losses, and the no_grad old-log-prob pass.

Restated from open_instruct/grpo_utils.py (forward_for_logprobs: `logits / temperature`,
`[:, :-1]`, labels cloned with pad tokens replaced in place, the entropy under
`torch.no_grad()`; mask_logprobs; compute_grpo_loss: dapo and cispo, `pg_loss *= rho_weights`,
the KL estimators; compute_logprobs: per-sample forwards under `torch.no_grad()`),
open_instruct/model_utils.py (log_softmax_and_gather, entropy_from_logits, estimate_kl) and
open_instruct/grpo_fast.py (the per-sample training step, masked_mean with a loss denominator).
"""

from __future__ import annotations

import torch

from . import Case, choices, gen, logits_leaf, lp_and_entropy, near_logp, one_or_each, randn, response_mask, tokens

TEMP = 0.7
INVALID_LOGPROB = 1.0


def log_softmax_and_gather(logits, index):
    return torch.gather(logits.log_softmax(dim=-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits):
    p = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(p * logits, dim=-1)


def estimate_kl(ref_logprobs_diff, ratio):
    return torch.stack([ref_logprobs_diff, ref_logprobs_diff ** 2 / 2,
                        torch.expm1(-ref_logprobs_diff) + ref_logprobs_diff, ratio * ref_logprobs_diff])


def mask_logprobs(logprobs, mask):
    return torch.nan_to_num(torch.masked_fill(logprobs, ~mask, INVALID_LOGPROB), nan=INVALID_LOGPROB)


def forward_for_logprobs(logits, query_responses, pad_token_id, temperature, return_entropy):
    logits = logits / temperature
    logits = logits[:, :-1]
    labels = query_responses[:, 1:].clone()
    labels[labels == pad_token_id] = 0
    logprob = log_softmax_and_gather(logits, labels)
    entropy = None
    if return_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits)
    return logprob, entropy


def masked_mean(values, mask, axis=None, denominator=None):
    num = (values * mask).sum(axis=axis)
    return num / (mask.sum(axis=axis) if denominator is None else denominator)


B, L, V = 2, 15, 59
PAD = V - 1


def grpo_step(logits, query_responses, response_masks, old_logprobs, ref_logprobs, advantages,
              rho_weights, loss_fn="dapo", temperature=TEMP, beta=0.05, clip_lower=0.2, clip_higher=0.28,
              kl_estimator=2, loss_denominator=20.0):
    local_logprobs, entropy = forward_for_logprobs(logits, query_responses, PAD, temperature,
                                                   return_entropy=(loss_fn == "dapo"))
    response_mask = response_masks[:, 1:]
    new_logprobs = mask_logprobs(local_logprobs, response_mask)
    ratio = torch.exp(new_logprobs - old_logprobs)
    if loss_fn == "dapo":
        pg_losses = -advantages * ratio
        pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_lower, 1.0 + clip_higher)
        clipfrac = (pg_losses2 > pg_losses).float()
        pg_loss = torch.max(pg_losses, pg_losses2)
    else:  # cispo: the clipped ratio is a constant weight on the log-prob
        clipfrac = (ratio > 1.0 + clip_higher).float()
        pg_loss = -advantages * torch.clamp(ratio.detach(), max=1.0 + clip_higher) * new_logprobs
    pg_loss *= rho_weights
    clipfrac *= (rho_weights != 0).float()
    ref_diff = (new_logprobs - ref_logprobs).clamp(-40.0, 40.0)
    kl = estimate_kl(ref_diff, ratio)[kl_estimator]
    loss = masked_mean(pg_loss + beta * kl, response_mask, None, loss_denominator)
    stats = [masked_mean(clipfrac, response_mask).detach()]
    if entropy is not None:
        stats.append(masked_mean(entropy, response_mask))
    return (loss, *stats)


def grpo_inputs(seed):
    def make(dtype):
        g = gen(seed)
        logits = logits_leaf((B, L, V), dtype, g)
        qr = tokens((B, L), V - 1, g)
        masks = torch.zeros(B, L, dtype=torch.bool)
        masks[:, 5:] = True
        qr[1, -3:] = PAD  # a padded response
        masks[1, -3:] = False
        labels = qr[:, 1:].clone()
        labels[labels == PAD] = 0
        lp = near_logp(logits[:, :-1], labels, g, TEMP)
        return {"logits": logits, "query_responses": qr, "response_masks": masks,
                "old_logprobs": lp, "ref_logprobs": near_logp(logits[:, :-1], labels, g, TEMP, noise=0.3),
                "advantages": randn((B, L - 1), g),
                "rho_weights": (torch.rand(B, L - 1, generator=g) > 0.1).float()}
    return make


def cispo_inputs(dtype):
    return {**grpo_inputs(52)(dtype), "loss_fn": "cispo", "beta": 0.0}


N3, L3, V3 = 3, 9, 37


def compute_logprobs_no_grad(logits, query_responses, response_masks, temperature=TEMP):
    # compute_logprobs(use_grad=False, batch_size=1): old log-probs, one sample per forward.
    out = []
    with torch.no_grad():
        for i in range(logits.shape[0]):
            lp, _ = forward_for_logprobs(logits[i:i + 1], query_responses[i:i + 1], PAD3, temperature, False)
            out.append(mask_logprobs(lp, response_masks[i:i + 1, 1:]))
    return (torch.cat(out),)


PAD3 = V3 - 1


def no_grad_inputs(dtype):
    g = gen(53)
    masks = torch.zeros(N3, L3, dtype=torch.bool)
    masks[:, 3:] = True
    return {"logits": logits_leaf((N3, L3, V3), dtype, g), "query_responses": tokens((N3, L3), V3, g),
            "response_masks": masks}


CASES = [
    Case("open_instruct_dapo_no_grad_entropy", "open-instruct",
         "open_instruct/grpo_utils.py:forward_for_logprobs (entropy under no_grad), mask_logprobs, "
         "compute_grpo_loss(dapo, pg_loss *= rho_weights); open_instruct/model_utils.py:log_softmax_and_gather, "
         "estimate_kl; open_instruct/grpo_fast.py training step",
         grpo_step, grpo_inputs(51), lp_and_entropy([("logprob",)], [("entropy",)]),
         no_grad_kinds=("entropy",), temperature="/ 0.7"),
    Case("open_instruct_cispo", "open-instruct",
         "open_instruct/grpo_utils.py:compute_grpo_loss(cispo: -A * clamp(ratio.detach()) * logp)",
         grpo_step, cispo_inputs, (("logprob",),), temperature="/ 0.7"),
    Case("open_instruct_old_logprobs_no_grad", "open-instruct",
         "open_instruct/grpo_utils.py:compute_logprobs (use_grad=False: per-sample forward_for_logprobs "
         "under torch.no_grad)",
         compute_logprobs_no_grad, no_grad_inputs, choices(one_or_each("logprob", N3)),
         no_grad_kinds=("logprob",), grad_kinds=(), temperature="/ 0.7"),
]
