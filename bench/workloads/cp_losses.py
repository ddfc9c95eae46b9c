"""RL losses written once for one device over packed sequences, and run under context parallelism.

Each loss takes the per-token log-probs of the whole packed stream `logp [T]` and the rollout's
per-token tensors, the same on every rank: `old_logp`, `adv` (each token carries its sequence's
advantage), `mask` (response tokens whose target is a real next token) and `seq_ids` (which
sequence each token belongs to), plus `seq_zeros` (a `[num_sequences]` zero vector: the
per-sequence sums' shape, so that the number of sequences is a tensor size, not a constant).

- `ppo_token_mean`: PPO's clipped objective, mean over the response tokens of the batch;
- `grpo_sample_mean`: the same per token, mean within each sequence, mean over sequences;
- `gspo`: GSPO, one importance ratio per sequence, the exp of the mean token log-ratio;
- `opsm`: PPO with slime's off-policy sequence masking: a sequence with negative advantage whose
  mean KL(old || new) exceeds `delta` is left out.

`cp_loss(loss, layout, local_logits, tokens, ...)` is the CP program: this rank's logits `[T_local, V]`,
the shifted targets from the layout, log-probs on the local rows, `unshard`, the loss.
`single_device_loss` is the same with the whole logits `[T, V]`: the parity reference.
"""

from __future__ import annotations

import torch

LOSSES = ("ppo_token_mean", "grpo_sample_mean", "gspo", "opsm")
#: A loss that also returns every token's log-prob (for logging): its `unshard` must stay whole.
LOGGED = "ppo_logged"


def _clipped(ratio, adv, low=0.2, high=0.28):
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))


def _per_sequence(values, seq_ids, seq_zeros):
    return seq_zeros.index_add(0, seq_ids, values)


def ppo_token_mean(logp, old_logp, adv, mask, seq_ids, seq_zeros):
    pg = _clipped(torch.exp(logp - old_logp), adv)
    return (pg * mask).sum() / mask.sum().clamp_min(1)


def grpo_sample_mean(logp, old_logp, adv, mask, seq_ids, seq_zeros):
    pg = _clipped(torch.exp(logp - old_logp), adv)
    lengths = _per_sequence(mask, seq_ids, seq_zeros).clamp_min(1)
    return (_per_sequence(pg * mask, seq_ids, seq_zeros) / lengths).mean()


def gspo(logp, old_logp, adv, mask, seq_ids, seq_zeros):
    lengths = _per_sequence(mask, seq_ids, seq_zeros).clamp_min(1)
    seq_ratio = torch.exp(_per_sequence((logp - old_logp) * mask, seq_ids, seq_zeros) / lengths)
    seq_adv = _per_sequence(adv * mask, seq_ids, seq_zeros) / lengths
    return _clipped(seq_ratio, seq_adv, 3e-4, 4e-4).mean()


def opsm(logp, old_logp, adv, mask, seq_ids, seq_zeros, delta=1e-4):
    lengths = _per_sequence(mask, seq_ids, seq_zeros).clamp_min(1)
    seq_kl = _per_sequence((old_logp - logp.detach()) * mask, seq_ids, seq_zeros) / lengths
    seq_adv = _per_sequence(adv * mask, seq_ids, seq_zeros) / lengths
    keep = ~((seq_adv < 0) & (seq_kl > delta))
    pg = _clipped(torch.exp(logp - old_logp), adv)
    kept = mask * keep[seq_ids].to(mask.dtype)
    return (pg * kept).sum() / mask.sum().clamp_min(1)


def ppo_logged(logp, old_logp, adv, mask, seq_ids, seq_zeros):
    return ppo_token_mean(logp, old_logp, adv, mask, seq_ids, seq_zeros), logp.detach()


def loss_by_name(name: str):
    return {"ppo_token_mean": ppo_token_mean, "grpo_sample_mean": grpo_sample_mean, "gspo": gspo,
            "opsm": opsm, LOGGED: ppo_logged}[name]


def token_logprobs(logits, targets):
    """log softmax(logits)[target] per row; rows whose target is ignored (< 0) read column 0."""
    return torch.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[:, None])[:, 0]


def cp_loss(loss, layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    """The loss under context parallelism: local log-probs, `unshard`, the single-device loss."""
    logp = layout.unshard(token_logprobs(local_logits, layout.shifted_targets(tokens)))
    return loss(logp, old_logp, adv, mask, seq_ids, seq_zeros)


def single_device_loss(loss, logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros, seq_lens):
    """The same loss on one device over the whole `[T, V]` logits."""
    return loss(token_logprobs(logits, shifted_targets(tokens, seq_lens)), old_logp, adv, mask, seq_ids, seq_zeros)


def shifted_targets(tokens, seq_lens, ignore_index=-100):
    """The next token of each row within its sequence, `ignore_index` at each sequence's last token."""
    out = torch.full_like(tokens, ignore_index)
    start = 0
    for n in seq_lens:
        out[start:start + n - 1] = tokens[start + 1:start + n]
        start += n
    return out


def rollout(seq_lens, vocab, *, prompt_fraction=0.25, prompt_lens=None, dtype=torch.float64, seed=0,
            masked_sequences=()):
    """Random whole-batch inputs: logits `[T, V]`, tokens, old log-probs, advantages (one per
    sequence), a response mask (the rows after each prompt, except the last), sequence ids and
    `[num_sequences]` zeros. `masked_sequences`: sequences with no response token at all.
    `prompt_lens`: each sequence's prompt tokens (default: `prompt_fraction` of it, at least 1).
    `response`: the rows that predict a response token, masked or not (slime's response rows).
    `vocab=None`: no logits, only per-token log-probs `logp`; `logp` is always the float64 truth."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    if vocab is None:  # per-token log-probs only (`logp`), no logits
        logits, tokens = None, torch.zeros(total, dtype=torch.long)
    else:
        logits = torch.randn(total, vocab, generator=g, dtype=torch.float64).to(dtype)
        tokens = torch.randint(0, vocab, (total,), generator=g)
    seq_ids = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    seq_adv = torch.randn(len(seq_lens), generator=g, dtype=torch.float64)
    response = torch.zeros(total, dtype=torch.bool)
    start = 0
    for i, n in enumerate(seq_lens):
        prompt = prompt_lens[i] if prompt_lens is not None else max(1, int(n * prompt_fraction))
        response[start + prompt - 1:start + n - 1] = True
        start += n
    mask = response.to(torch.float64)
    for i in masked_sequences:
        mask[seq_ids == i] = 0
    # Old log-probs near the new ones, as after a few optimiser steps.
    if logits is None:
        logp = -5 * torch.rand(total, generator=g, dtype=torch.float64)
    else:
        logp = token_logprobs(logits.double(), shifted_targets(tokens, seq_lens))
    old_logp = logp + 0.02 * torch.randn(total, generator=g, dtype=torch.float64)
    return dict(logits=logits, logp=logp, tokens=tokens, old_logp=old_logp, adv=seq_adv[seq_ids], mask=mask, seq_ids=seq_ids,
                seq_zeros=torch.zeros(len(seq_lens), dtype=torch.float64), response=response)
