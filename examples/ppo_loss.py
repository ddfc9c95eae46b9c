"""A PPO policy loss as written in RL trainers: log-prob + entropy over `[T, V]` logits.

Used by `graphpass inspect examples/ppo_loss.py:ppo_loss` and by the memory-model benchmark.
"""

from __future__ import annotations

import torch


def ppo_loss(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 0.7,
    ent_coef: float = 0.0,
    clip_eps: float = 0.2,
) -> torch.Tensor:
    """Clipped-ratio policy loss minus an entropy bonus, averaged over unmasked tokens.

    logits [T, V] (any float dtype), tokens [T] int64, old_logp / advantages / mask [T].
    """
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)

    ratio = torch.exp(logp - old_logp)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(pg_unclipped, pg_clipped) - ent_coef * entropy
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def example_inputs(T: int, V: int, dtype: torch.dtype = torch.float32, *, seed: int = 0):
    """Real inputs of the right shapes: (logits requiring grad, tokens, old_logp, advantages, mask)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, V, (T,), generator=g)
    old_logp = -torch.rand(T, generator=g) * 5
    advantages = torch.randn(T, generator=g)
    mask = (torch.rand(T, generator=g) > 0.1).float()
    return logits, tokens, old_logp, advantages, mask
