"""The context-parallel ops: this rank's rows of a global tensor, the next token of each local row,
the global tensor back from every rank's rows, and the sum over ranks a rewritten loss reduces to.

A layout is data, not code: three index tensors that `graphpass.cp.Layout` computes once (the same
on every rank, from the sequence lengths alone) and passes to the ops as ordinary tensor inputs,
so a new batch with other sequence lengths reuses the compiled graph instead of recompiling it.

- `local_rows` `[T_local]`: the global row each local row holds, -1 for a padding row;
- `next_rows` `[T_local]`: the global row of each local row's target (the next token of its
  sequence), -1 at a sequence's last token and on padding;
- `order` `[T]`: where global row g sits in the `[cp * T_local]` concatenation of every rank's rows.

Every rank holds the same number of rows, so `unshard` is one exact all-gather of `[T_local, ...]`
(no zero-padded all-reduce). The collectives depend only on these shapes and the group, never on
values, requires_grad or grad mode.
"""

from __future__ import annotations

import torch
import torch.distributed

from graphpass.ops.groups import all_gather, rank_and_size


def _take_rows(x: torch.Tensor, rows: torch.Tensor, fill=0) -> torch.Tensor:
    """`x[rows]` along dim 0, `fill` where `rows` is -1."""
    valid = rows >= 0
    picked = x.index_select(0, rows.clamp_min(0))
    shape = (-1,) + (1,) * (x.ndim - 1)
    return torch.where(valid.view(shape), picked, torch.full((), fill, dtype=x.dtype, device=x.device))


def _put_rows(grad: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """The `[total, ...]` tensor whose rows `rows` are `grad`'s rows (padding rows dropped), zero elsewhere."""
    valid = (rows >= 0).view((-1,) + (1,) * (grad.ndim - 1))
    # A padding row adds zero to row 0: chosen by `where`, not a product, so a NaN there stays out.
    kept = torch.where(valid, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    return grad.new_zeros((total,) + tuple(grad.shape[1:])).index_put((rows.clamp_min(0),), kept, accumulate=True)


# ---- shard -----------------------------------------------------------------------------------------
@torch.library.custom_op("graphpass::cp_shard", mutates_args=())
def cp_shard(x: torch.Tensor, local_rows: torch.Tensor) -> torch.Tensor:
    """This rank's rows `[T_local, ...]` of the global `[T, ...]` tensor `x`; padding rows zero.
    No communication. Backward: the local gradient rows put back in place, zero elsewhere."""
    return _take_rows(x, local_rows)


@cp_shard.register_fake
def _(x, local_rows):
    return x.new_empty((local_rows.shape[0],) + tuple(x.shape[1:]))


def _shard_setup(ctx, inputs, output):
    x, local_rows = inputs
    ctx.total = x.shape[0]
    ctx.save_for_backward(local_rows)


def _shard_backward(ctx, grad):
    (local_rows,) = ctx.saved_tensors
    return _put_rows(grad, local_rows, ctx.total), None


cp_shard.register_autograd(_shard_backward, setup_context=_shard_setup)


# ---- shifted targets -----------------------------------------------------------------------------
@torch.library.custom_op("graphpass::cp_shifted_targets", mutates_args=())
def cp_shifted_targets(tokens: torch.Tensor, next_rows: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The next token of each local row within its sequence, `ignore_index` at a sequence's last
    token and on padding; `tokens` is the global `[T]` stream, the same on every rank (so no
    communication: a target across a shard boundary is read from the replicated tokens)."""
    return _take_rows(tokens, next_rows, ignore_index)


@cp_shifted_targets.register_fake
def _(tokens, next_rows, ignore_index):
    return tokens.new_empty(next_rows.shape)


# ---- unshard -------------------------------------------------------------------------------------
def _gather_rows(y: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every rank's `[T_local, ...]` rows concatenated in rank order: `[cp * T_local, ...]`."""
    group, _, size = rank_and_size(group_name)
    if size == 1:
        return y
    y = y.contiguous()
    out = y.new_empty((size * y.shape[0],) + tuple(y.shape[1:]))
    all_gather(out, y, group)
    return out


@torch.library.custom_op("graphpass::cp_unshard", mutates_args=())
def cp_unshard(y: torch.Tensor, local_rows: torch.Tensor, order: torch.Tensor, group_name: str) -> torch.Tensor:
    """The global `[T, ...]` tensor, in global order and without padding, from every rank's
    `[T_local, ...]` rows: one all-gather of `y`. Backward: each rank takes the rows of the
    gradient it holds (every rank's loss is the whole loss), no collective."""
    return _gather_rows(y, group_name).index_select(0, order)


@cp_unshard.register_fake
def _(y, local_rows, order, group_name):
    return y.new_empty((order.shape[0],) + tuple(y.shape[1:]))


def _unshard_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _unshard_backward(ctx, grad):
    (local_rows,) = ctx.saved_tensors
    return cp_shard(grad, local_rows), None, None, None


cp_unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup)


# ---- the sums over ranks of a reduced loss -------------------------------------------------------
@torch.library.custom_op("graphpass::cp_sum_over_ranks", mutates_args=())
def cp_sum_over_ranks(partials: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    """Each of `partials` summed over the group's ranks, all in one all-reduce (of the widest
    dtype among them). Backward: the gradients as they are: every rank computes the whole loss
    from the sums, so d loss / d partial is d loss / d sum on every rank, no collective."""
    group, _, size = rank_and_size(group_name)
    if size == 1:
        return [p.clone() for p in partials]
    dtype = _common_dtype(partials)
    flat = torch.cat([p.reshape(-1).to(dtype) for p in partials])
    torch.distributed.all_reduce(flat, group=group)
    # Copies: a custom op's outputs may not alias one another (they are small: sums, not rows).
    return [piece.view(p.shape).to(p.dtype, copy=True)
            for piece, p in zip(flat.split([p.numel() for p in partials]), partials)]


def _common_dtype(partials) -> torch.dtype:
    dtypes = {p.dtype for p in partials}
    return dtypes.pop() if len(dtypes) == 1 else torch.float64


def sum_over_ranks_bytes(partials) -> int:
    """Bytes one rank contributes to `cp_sum_over_ranks(partials)` (fake tensors are fine)."""
    return sum(p.numel() for p in partials) * _common_dtype(partials).itemsize


@cp_sum_over_ranks.register_fake
def _(partials, group_name):
    return [torch.empty_like(p, memory_format=torch.contiguous_format) for p in partials]


def _sum_backward(ctx, grads):
    return list(grads), None


cp_sum_over_ranks.register_autograd(_sum_backward, setup_context=lambda ctx, inputs, output: None)
