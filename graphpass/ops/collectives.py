"""A differentiable all-reduce for the vocab-parallel rewrite: `sum_grads_over_group(x)` is `x`
whose gradient is summed over the group's ranks, as the all-reduces of the code it replaces give."""

from __future__ import annotations

import torch
import torch.distributed

from graphpass.ops.groups import rank_and_size


@torch.library.custom_op("graphpass::sum_grads_over_group", mutates_args=())
def sum_grads_over_group(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """`x`; in backward, its gradient summed over the ranks of the group: the gradient code written
    with differentiable all-reduces gets (each rank's loss counts on every rank), for values the
    vocab-parallel op computes in their place."""
    return x.clone()


@sum_grads_over_group.register_fake
def _(x, group_name):
    return torch.empty_like(x)


@torch.library.custom_op("graphpass::all_reduce_sum", mutates_args=())
def _all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of `x` over the ranks of the group (one all-reduce; none for a group of one)."""
    group, _, size = rank_and_size(group_name)
    out = x.contiguous().clone()
    if size > 1:
        torch.distributed.all_reduce(out, group=group)
    return out


@_all_reduce_sum.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _sum_grads_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


def _sum_grads_backward(ctx, grad):
    return _all_reduce_sum(grad, ctx.group_name), None


sum_grads_over_group.register_autograd(_sum_grads_backward, setup_context=_sum_grads_setup)
