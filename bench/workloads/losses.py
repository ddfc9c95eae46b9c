"""RL loss workloads over policy logits [T, V], written in plain PyTorch as an RL framework user would."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

import torch

CLIP = 0.2
KL_BETA = 0.04
SLIME_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class Workload:
    """One loss: its kind ("ppo" or "grpo"), sampling temperature and entropy coefficient."""

    kind: str
    temperature: float
    ent_coef: float

    @property
    def key(self) -> str:
        return f"{self.kind}-t{self.temperature:g}-e{self.ent_coef:g}"

    @classmethod
    def parse(cls, key: str) -> "Workload":
        """Inverse of `key`, e.g. "ppo-t0.7-e0"."""
        kind, t, e = key.split("-")
        if kind not in LOSSES or t[0] != "t" or e[0] != "e":
            raise ValueError(f"bad workload {key!r}; expected KIND-tTEMP-eCOEF with KIND in {sorted(LOSSES)}")
        return cls(kind, float(t[1:]), float(e[1:]))

    def loss_fn(self, logprob_entropy: Callable) -> Callable:
        """The loss as a function of (logits, targets, mask, advantages, old_logp, ref_logp)."""
        loss, temp, coef = LOSSES[self.kind], self.temperature, self.ent_coef

        # Temperature and coefficient are closure constants, as in a trainer's config: Dynamo bakes
        # them in, so `0.0 * entropy` is visibly dead to a compiler.
        def fn(logits, targets, mask, advantages, old_logp, ref_logp):
            return loss(logits, targets, mask, advantages, old_logp, ref_logp, temp, coef, logprob_entropy)

        return fn


# The user's code --------------------------------------------------------------------------------


def logprob_entropy(logits, targets, temperature):
    """Per-token log-prob of the sampled tokens and entropy, one shared fp32 log_softmax."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def logprob_entropy_exact(logits, targets, temperature):
    """The same math in the logits' own dtype (no fp32 cast): the float64 references."""
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def chunked_logprob_entropy(logits, targets, temperature, chunk=SLIME_CHUNK):
    """The hand-chunked loop RL frameworks ship (slime's calculate_log_probs_and_entropy): no recompute."""
    logps, entropies = [], []
    for logits_chunk, targets_chunk in zip(logits.split(chunk), targets.split(chunk)):
        logp, entropy = logprob_entropy(logits_chunk, targets_chunk, temperature)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)


def masked_mean(x, mask):
    """Token-level mean over unmasked tokens."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def clipped_surrogate(logp, old_logp, advantages):
    """PPO's clipped importance-ratio objective, per token (to minimise)."""
    ratio = torch.exp(logp - old_logp)
    return -torch.min(ratio * advantages, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * advantages)


def ppo_loss(logits, targets, mask, advantages, old_logp, ref_logp, temperature, ent_coef, lp_ent):
    """PPO: clipped ratio loss minus an entropy bonus, masked token mean."""
    logp, entropy = lp_ent(logits, targets, temperature)
    pg = clipped_surrogate(logp, old_logp, advantages)
    return masked_mean(pg, mask) - ent_coef * masked_mean(entropy, mask)


def grpo_loss(logits, targets, mask, advantages, old_logp, ref_logp, temperature, ent_coef, lp_ent):
    """GRPO: clipped ratio loss plus a k3 KL penalty to the reference policy, masked token mean."""
    logp, entropy = lp_ent(logits, targets, temperature)
    pg = clipped_surrogate(logp, old_logp, advantages)
    delta = ref_logp - logp
    kl = torch.exp(delta) - delta - 1  # k3 estimator: unbiased, always >= 0
    return masked_mean(pg + KL_BETA * kl, mask) - ent_coef * masked_mean(entropy, mask)


LOSSES = {"ppo": ppo_loss, "grpo": grpo_loss}

# Inputs ------------------------------------------------------------------------------------------

BATCH_FIELDS = ("logits", "targets", "mask", "advantages", "old_logp", "ref_logp")


def make_batch(T: int, V: int, dtype: torch.dtype, device: str, temperature: float, seed: int = 0) -> dict:
    """Synthetic inputs; old/ref log-probs sit near the policy's own, so clipping and KL are active.

    Logits are N(0, 1), so each row's logsumexp of logits/temp is log V + 1/(2 temp^2) to within
    ~1e-2 at V >= 32k: the policy's log-prob comes from a gather, with no extra [T, V] pass.
    Drawn on `device` by its own generator (on a GPU, billions of logits in milliseconds, where
    the CPU took tens of seconds; the values differ from the CPU's draw).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.empty(T, V, dtype=dtype, device=device)
    logits.normal_(generator=gen)  # in place in the target dtype: no transient fp32 copy of bf16 logits
    targets = torch.randint(0, V, (T,), generator=gen, device=device)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1).float() / temperature - (
        math.log(V) + 0.5 / temperature**2
    )

    def draw(fn):
        return fn(T, generator=gen, device=device)

    batch = dict(
        logits=logits,
        targets=targets,
        mask=(draw(torch.rand) < 0.9).float(),
        advantages=draw(torch.randn),
        old_logp=logp + 0.3 * draw(torch.randn),
        ref_logp=logp + 0.3 * draw(torch.randn),
    )
    batch["logits"].requires_grad_()
    return batch


def reference_diffs(workload: Workload, batch: dict, loss: float, grad: torch.Tensor,
                    cache: str | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """Max abs difference of loss and logits.grad against eager `dtype` (see `reference`).

    With `cache` (a file path), the reference is loaded from there when present and saved there
    otherwise: every method of one configuration compares against one computation of it.
    """
    if cache and os.path.exists(cache):
        ref = torch.load(cache)
    else:
        ref = reference(workload, batch, dtype=dtype)
        if cache:
            torch.save(ref, cache)
    return _diffs(ref, loss, grad)


def eager_fp32_as_reference(batch: dict, loss: float, grad: torch.Tensor, cache: str | None) -> dict:
    """The eager method on fp32 logits computes the reference itself: keep its rows, compare."""
    ref = dict(loss=loss, grads={start: grad[start:start + rows].clone()
                                 for start, rows in _grad_blocks(*batch["logits"].shape)})
    if cache:
        torch.save(ref, cache)
    return _diffs(ref, loss, grad)


def _diffs(ref: dict, loss: float, grad: torch.Tensor) -> dict:
    grad_diff = max((float((grad[start:start + g.shape[0]].float() - g).abs().max()) for start, g in ref["grads"].items()),
                    default=0.0)
    return dict(ref_loss=ref["loss"], loss_diff=abs(loss - ref["loss"]), grad_diff=grad_diff,
                ref_grad_max=max((float(g.abs().max()) for g in ref["grads"].values()), default=0.0),
                grad_rows_checked=sum(g.shape[0] for g in ref["grads"].values()))


def reference(workload: Workload, batch: dict, budget_bytes: int = 2**30, grad_blocks: int = 2,
              dtype: torch.dtype = torch.float32) -> dict:
    """The eager fp32 (or `dtype`: float64) loss and some rows of logits.grad, in row blocks: {loss, grads}.

    Every workload is a masked token mean of row-local terms, so block b contributes
    loss_b * n_b / n and the same scale on its gradient: exact up to fp32 summation order, with
    one block of fp32 intermediates alive at a time (the full eager reference would not fit at
    the sizes measured). The loss covers all rows; the gradient all rows when the logits fit in
    one block, else the first and last `grad_blocks // 2` blocks ({first row: block gradient}),
    to bound the time spent (gradient rows are independent, so a sample checks the same code path).
    """
    T, V = batch["logits"].shape
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = _block_rows(T, V, budget_bytes, itemsize)
    grad_starts = {start for start, _ in _grad_blocks(T, V, budget_bytes, grad_blocks, itemsize)}
    # `logprob_entropy` casts to fp32: a float64 reference needs the same math without the cast.
    fn = workload.loss_fn(logprob_entropy if dtype == torch.float32 else logprob_entropy_exact)
    n = batch["mask"].sum().clamp(min=1).double()
    ref_loss, grads = 0.0, {}
    for start in range(0, T, rows):
        sl = slice(start, start + rows)
        with_grad = start in grad_starts
        x = batch["logits"][sl].detach().to(dtype).requires_grad_(with_grad)
        part = [batch[k][sl].to(dtype) if batch[k].is_floating_point() else batch[k][sl] for k in BATCH_FIELDS[1:]]
        scale = float(batch["mask"][sl].sum().double() / n)
        with torch.set_grad_enabled(with_grad):
            block_loss = fn(x, *part) * scale
        ref_loss += float(block_loss)
        if with_grad:
            block_loss.backward()
            grads[start] = x.grad
    return dict(loss=ref_loss, grads=grads)


def _block_rows(T: int, V: int, budget_bytes: int = 2**30, itemsize: int = 4) -> int:
    return max(1, min(T, budget_bytes // (V * itemsize * 6)))  # ~6 [rows, V] buffers in eager backward


def _grad_blocks(T: int, V: int, budget_bytes: int = 2**30, grad_blocks: int = 2,
                 itemsize: int = 4) -> list[tuple[int, int]]:
    """(first row, rows) of the blocks whose gradient the reference keeps: all, or the first and last."""
    rows = _block_rows(T, V, budget_bytes, itemsize)
    starts = list(range(0, T, rows))
    if len(starts) > grad_blocks:
        starts = sorted(set(starts[: grad_blocks // 2] + starts[-(grad_blocks // 2):]))
    return [(start, min(rows, T - start)) for start in starts]
