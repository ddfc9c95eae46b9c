"""Tensor-parallel loss code as RL trainers write it, for `bench.tp` and the tests.

* `megatron_logprob`: megatron-core's `tensor_parallel.vocab_parallel_cross_entropy`, negated.
* `megatron_fused_logprob`: megatron-core's fused `fused_vocab_parallel_cross_entropy` (one
  all-reduce of the target logit and the sum of exp concatenated), negated, as slime calls it.
* `SlimeStyleLogProbEntropy`: an `autograd.Function` written the way slime's
  `_VocabParallelLogProbEntropy` is (our own code, same structure): the rank's first column from
  the group, a MAX all-reduce of the row max, SUM all-reduces of the sum of exp, the owned target's
  logit and, for the entropy, of sum(softmax * x); the whole fp32 softmax saved; a hand-written
  backward with no collective. `slime_style_logprob_entropy` calls it as slime's
  `calculate_log_probs_and_entropy` does (optionally one Function per chunk of rows).
* `VerlStyleEntropy`: an entropy-only `autograd.Function` written the way verl's Megatron backend
  writes its `vocab_parallel_entropy` (our own code, same structure): the row max all-reduced MAX,
  the sum of exp and sum(softmax * x) all-reduced SUM, entropy = max + log(sum exp) - that; the
  logits and the whole softmax saved; a hand-written backward with no collective.
  `megatron_logprob_entropy` calls it beside megatron-core's loss on a clone of the same logits,
  as verl's Megatron actor does.
* `ppo_loss`: the token-level PPO objective both feed (clipped ratio, entropy bonus, optionally
  masked per token).

Every function takes this rank's `[T, V/tp]` logits and the global targets `[T]`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def megatron_logprob(logits: torch.Tensor, target: torch.Tensor, group=None, temperature: float = 1.0):
    """Log-probs by megatron-core's vocab-parallel cross-entropy (its group: `parallel_state`'s TP group)."""
    from megatron.core import tensor_parallel

    del group  # megatron-core reads the tensor-parallel group from parallel_state
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    # It writes into its input (the softmax, for its backward): hand it a tensor the caller does
    # not read again. Under graphpass the write disappears with the Function.
    return -tensor_parallel.vocab_parallel_cross_entropy(x, target)


def megatron_fused_logprob(logits: torch.Tensor, target: torch.Tensor, group=None):
    """Log-probs `[T, 1]` by megatron-core's fused vocab-parallel cross-entropy, as slime's
    `compute_log_probs` calls it: `-fused_vocab_parallel_cross_entropy(logits[:, None], target[:, None])`
    over `parallel_state`'s tensor-parallel group (or `group`). Its backward returns a bf16 gradient."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    group = parallel_state.get_tensor_model_parallel_group() if group is None else group
    # fp32 logits: it writes into them (its `.float()` is no copy); callers hand it a clone.
    return -fused_vocab_parallel_cross_entropy(logits.unsqueeze(1), target.unsqueeze(1), group)


class VerlStyleEntropy(torch.autograd.Function):
    """Entropy `[T]` of vocab-parallel logits `[T, V/tp]`, in the style of verl's Megatron backend."""

    @staticmethod
    def forward(ctx, logits, group):
        row_max = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - row_max).exp()
        sum_exp = exp.sum(dim=-1, keepdim=True)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        softmax = exp.div_(sum_exp)
        mean_x = (softmax * logits).sum(dim=-1, keepdim=True)
        dist.all_reduce(mean_x, op=dist.ReduceOp.SUM, group=group)
        entropy = row_max + sum_exp.log() - mean_x
        ctx.save_for_backward(logits, softmax, mean_x)
        return entropy.squeeze(-1)

    @staticmethod
    def backward(ctx, grad_entropy):
        logits, softmax, mean_x = ctx.saved_tensors
        # d entropy / d x_j = p_j (E[x] - x_j)
        return softmax * (mean_x - logits) * grad_entropy[:, None], None


def verl_style_entropy(logits: torch.Tensor, group=None) -> torch.Tensor:
    """Entropy `[T]` by `VerlStyleEntropy` over `group` (default: megatron-core's tensor-parallel
    group when model parallelism is initialised, else the default group)."""
    return VerlStyleEntropy.apply(logits, _tp_group(group))


def _tp_group(group):
    if group is not None:
        return group
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_model_parallel_group()
    except ImportError:
        pass
    return dist.group.WORLD


def megatron_logprob_entropy(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = 1.0,
                             with_entropy: bool = True, group=None):
    """(log-prob `[T]`, entropy `[T]` or None) as verl's Megatron actor computes them: the logits
    divided by the temperature, megatron-core's `vocab_parallel_cross_entropy` on a clone of them
    (it overwrites its input), `VerlStyleEntropy` on the same logits."""
    from megatron.core import tensor_parallel

    if temperature != 1.0:
        logits = logits / temperature
    log_prob = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), target)
    return log_prob, (verl_style_entropy(logits, group) if with_entropy else None)


class SlimeStyleLogProbEntropy(torch.autograd.Function):
    """(log-prob `[T, 1]`, entropy `[T]` or `[0]`) of vocab-parallel logits, in slime's style."""

    @staticmethod
    def forward(ctx, logits, target, group, with_entropy: bool, with_entropy_grad: bool):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
        rows, width = logits.shape
        first = dist.get_rank(group) * width
        target_mask = (target < first) | (target >= first + width)
        local_target = (target - first).clone()
        local_target[target_mask] = 0
        arange = torch.arange(rows, device=logits.device)

        row_max = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        normalized = logits - row_max
        predicted = normalized[arange, local_target]
        exp = normalized.exp_()
        sum_exp = exp.sum(dim=-1, keepdim=True)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        softmax = exp.div_(sum_exp)

        if with_entropy:
            mean_x = (softmax * logits).sum(dim=-1, keepdim=True)
            dist.all_reduce(mean_x, op=dist.ReduceOp.SUM, group=group)
            entropy = (row_max + sum_exp.log() - mean_x).squeeze(-1)
        else:
            mean_x = logits.new_empty((0,))
            entropy = logits.new_zeros((0,))
        predicted = predicted.masked_fill_(target_mask, 0.0).unsqueeze(-1)
        dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=group)
        log_prob = predicted - sum_exp.log()

        entropy_grad = with_entropy and with_entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.entropy_grad = entropy_grad
        ctx.save_for_backward(softmax, target_mask, local_target, mean_x,
                              logits if entropy_grad else logits.new_empty((0,)))
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        softmax, target_mask, local_target, mean_x, logits = ctx.saved_tensors
        grad = None
        if ctx.entropy_grad and grad_entropy is not None:
            grad = (mean_x - logits) * softmax * grad_entropy[:, None]
        lp = -softmax * grad_log_prob
        arange = torch.arange(lp.shape[0], device=lp.device)
        lp[arange, local_target] += (~target_mask).to(lp.dtype) * grad_log_prob[:, 0]
        grad = lp if grad is None else grad + lp
        return grad, None, None, None, None


def slime_style_logprob_entropy(logits, target, group=None, *, with_entropy=False, with_entropy_grad=True,
                                temperature: float = 1.0, chunk_size: int = -1):
    """(log-prob `[T]`, entropy `[T]` or None), one Function call per `chunk_size` rows (all at once if -1)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    group = group if group is not None else dist.group.WORLD
    if chunk_size > 0:
        pieces = [SlimeStyleLogProbEntropy.apply(x, t, group, with_entropy, with_entropy_grad)
                  for x, t in zip(logits.split(chunk_size), target.split(chunk_size))]
        log_prob = torch.cat([p[0] for p in pieces])
        entropy = torch.cat([p[1] for p in pieces]) if with_entropy else None
    else:
        log_prob, entropy = SlimeStyleLogProbEntropy.apply(logits, target, group, with_entropy, with_entropy_grad)
        entropy = entropy if with_entropy else None
    return log_prob.squeeze(-1), entropy


def ppo_loss(log_prob, old_log_prob, advantages, entropy=None, *, clip: float = 0.2, entropy_coef: float = 0.01,
             mask=None):
    """Token-mean clipped PPO objective, minus an entropy bonus when `entropy` is given; with a
    per-token `mask` (1 = a response token), both means are over the masked tokens only."""
    ratio = (log_prob - old_log_prob).exp()
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    if mask is None:
        loss = per_token.mean()
        if entropy is not None:
            loss = loss - entropy_coef * entropy.mean()
        return loss
    mask = mask.to(per_token.dtype)
    tokens = mask.sum().clamp_min(1)
    loss = (per_token * mask).sum() / tokens
    if entropy is not None:
        loss = loss - entropy_coef * (entropy * mask).sum() / tokens
    return loss
