"""The vocab-parallel op with the lm_head inside: logits = hidden @ W_r.T (+ b_r), chunk by chunk.

`vocab_parallel_lm_head_logprob_entropy(hidden, weight, target, group, bias=...)` is the same op
with the lm_head inside: each chunk's logits are `hidden_c @ W_r.T (+ b_r)` from this rank's weight
(and bias) shard, in chunks of rows up to half the floor (`block_rows`), recomputed in backward;
the `[*, V/tp]` logits and their gradient never exist. The backward, where the weight needs a
gradient (no keep_mask; on an accelerator for a narrower weight with no more rows than `V/tp`:
`backward_schedule`), goes a vocabulary tile of `W_r` at a time
(`_head_backward_by_tiles`): the tile's logits for all rows, their gradient written over them,
`dW[tile]` complete in one GEMM and `dhidden += dl @ W[tile]` (this rank's partial, as autograd of
`F.linear` gives; for bf16 with compiled kernels on the CPU, row chunks write `dhidden` first and the tiles
give `dW` alone); else row chunks write `hidden.grad` rows and accumulate the weight's and bias's
gradients in fp32. The same one collective, none in backward.

`HeadLogits` is what the row loop of `vocab_parallel` (`row_chunks`) reads here instead of a logits
tensor, and gives the backward's vocabulary tiles (`HeadLogits.column_tiles`); the math is the
logits op's.
"""

from __future__ import annotations

import math

import torch

from graphpass.ops import chunk_sizes, devices
from graphpass.ops.groups import group_name
from graphpass.ops.vocab_parallel import (RowGradients, VocabParallelArgs, backward_rows, fake_outputs,
                                          forward_statistics)


def block_rows(chunk_size: int, rows: int, vocab: int, hidden_size: int, itemsize: int) -> int:
    """Rows per block: `chunk_size` (> 0), else the fewest blocks of `[block, vocab]` logits (one
    all-gather each in `vocab_parallel_lm_head_with_gradients`: a synchronisation of the ranks, on
    a loaded CPU far dearer than its bytes) within the floor's share (`chunk_sizes`), of even size
    in whole GEMM panels."""
    if chunk_size > 0:
        return max(1, min(chunk_size, rows))
    floor = chunk_sizes.lm_head_floor_bytes(rows, vocab, hidden_size, itemsize)
    limit = chunk_sizes.fitting(floor * chunk_sizes.VOCAB_PARALLEL_LM_HEAD_SHARE, vocab * itemsize, rows)
    return chunk_sizes.even_panels(rows, limit)


def _linear(hidden, weight, bias, out=None):
    """`F.linear(hidden, weight, bias)` as autograd of it computes it (into `out` when given)."""
    if bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    return torch.addmm(bias, hidden, weight.t(), out=out)


class HeadLogits:
    """This rank's `[*, Vl]` logits as `hidden @ W_r.T (+ b_r)`, never stored: each chunk of rows
    (`piece`, for `vocab_parallel.row_chunks`) or each tile of vocabulary columns (`column_tiles`)
    is computed from the hidden states when it is read. `one_buffer`: every chunk of rows is
    written into one buffer, so a chunk is valid until the next is read."""

    computed = True  # a chunk is a temporary: its gradient may take its place

    def __init__(self, hidden, weight, bias, one_buffer: bool = False):
        lead = hidden.shape[:-1]
        self.hidden = hidden.reshape(math.prod(lead), hidden.shape[-1])  # a view where hidden allows one
        self.weight, self.bias = weight, bias
        self.shape = torch.Size((*lead, weight.shape[0]))
        self.dtype, self.device = hidden.dtype, hidden.device
        self.one_buffer, self.buffer = one_buffer, None

    def new_empty(self, *args, **kwargs):
        return self.hidden.new_empty(*args, **kwargs)

    def blocks(self):
        return [(0, self.hidden)]

    def piece(self, block, start: int, stop: int):
        """The logits of rows `start:stop`, `[r, Vl]`."""
        out = None
        if self.one_buffer:
            if self.buffer is None:  # the first chunk is the largest
                self.buffer = self.hidden.new_empty(stop - start, self.weight.shape[0])
            out = self.buffer[:stop - start]
        return _linear(block[start:stop], self.weight, self.bias, out=out)

    def rows_per_chunk(self, args: VocabParallelArgs) -> int:
        """`block_rows`."""
        return block_rows(args.chunk_size, self.hidden.shape[0], self.weight.shape[0], self.weight.shape[1],
                          self.dtype.itemsize)

    def column_tiles(self, tile: int):
        """(column slice, `[rows, c]` logits of every row for those vocabulary entries) for tiles of at
        most `tile` columns in order, each written into one buffer (valid until the next is read)."""
        rows, vocab = self.hidden.shape[0], self.weight.shape[0]
        store = self.hidden.new_empty(rows * min(tile, vocab))
        for start in range(0, vocab, tile):
            columns = slice(start, min(vocab, start + tile))
            logits = store[:rows * (columns.stop - start)].view(rows, columns.stop - start)
            _linear(self.hidden, self.weight[columns], None if self.bias is None else self.bias[columns], out=logits)
            yield columns, logits


class HeadGradients:
    """The sink of `backward_rows` for `HeadLogits`: each chunk's dlogits `dl` (the logits' dtype)
    gives `dhidden[rows] = dl @ W_r` (this rank's partial; the caller's TP region sums it, as for
    `F.linear` on this rank) and `dW += dl.T @ h`, `db += dl.sum(0)` in fp32 (float64 stays float64)."""

    def __init__(self, head: HeadLogits, hidden_shape, need_hidden: bool, need_weight: bool, need_bias: bool):
        self.head, self.hidden_shape = head, hidden_shape
        hidden, weight, bias = head.hidden, head.weight, head.bias
        self.acc = torch.promote_types(weight.dtype, torch.float32)
        self.hidden_grad = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        # The first chunk writes it (no zero fill of a [V/tp, H] buffer): see `results`.
        self.weight_acc = torch.empty(weight.shape, dtype=self.acc, device=weight.device) if need_weight else None
        self.weight_written = False
        self.bias_acc = None
        if need_bias and bias is not None:
            self.bias_acc = torch.zeros(bias.shape, dtype=self.acc, device=bias.device)

    def __call__(self, sl, dl):
        if self.hidden_grad is not None:
            torch.mm(dl, self.head.weight, out=self.hidden_grad[sl])
        if self.weight_acc is not None:
            devices.mm_into(self.weight_acc, dl.t(), self.head.hidden[sl], accumulate=self.weight_written)
            self.weight_written = True
        if self.bias_acc is not None:
            self.bias_acc += dl.sum(0, dtype=self.acc)

    def results(self):
        """(dhidden, dW, db), each `[0]` where not wanted (a custom op returns tensors, never None)."""
        head = self.head
        empty = head.hidden.new_empty
        if self.weight_acc is not None and not self.weight_written:  # no rows
            self.weight_acc.zero_()
        return (empty((0,)) if self.hidden_grad is None else self.hidden_grad.view(self.hidden_shape),
                empty((0,)) if self.weight_acc is None else self.weight_acc.to(head.weight.dtype),
                empty((0,)) if self.bias_acc is None else self.bias_acc.to(head.bias.dtype))


@torch.library.custom_op("graphpass::vocab_parallel_lm_head_logprob_entropy", mutates_args=(),
                        tags=devices.NOT_CUDAGRAPH_CAPTURABLE)
def _vocab_parallel_head_op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            target: torch.Tensor, keep_mask: torch.Tensor | None, group_name: str, temperature: float,
                            with_entropy: bool, entropy_grad: bool, ignore_index: int | None, chunk_size: int,
                            kernels: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`vocab_parallel_logprob_entropy` of the logits `hidden @ weight.T (+ bias)` (this rank's
    `[V/tp, H]` weight shard and `[V/tp]` bias shard), computed chunk by chunk: the same outputs
    and the same one collective."""
    args = _head_op_args(keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, chunk_size,
                         kernels)
    return forward_statistics(HeadLogits(hidden, weight, bias), target, keep_mask, args)


def _head_op_args(keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, chunk_size, kernels):
    """The `VocabParallelArgs` of a `graphpass::vocab_parallel_lm_head_logprob_entropy` call, from
    its arguments after `target`."""
    return VocabParallelArgs(group_name, temperature, ignore_index, chunk_size, kernels, with_entropy=with_entropy,
                             entropy_grad=entropy_grad, masked=keep_mask is not None)


@_vocab_parallel_head_op.register_fake
def _(hidden, weight, bias, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index,
      chunk_size, kernels):
    return fake_outputs(hidden, hidden.shape[:-1], with_entropy, keep_mask is not None)


@torch.library.custom_op("graphpass::vocab_parallel_lm_head_logprob_entropy_backward", mutates_args=(),
                        tags=devices.NOT_CUDAGRAPH_CAPTURABLE)
def _vocab_parallel_head_backward_op(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                     target: torch.Tensor, keep_mask: torch.Tensor | None, lse_lp: torch.Tensor,
                                     lse_full: torch.Tensor, entropy: torch.Tensor, grad_logprob: torch.Tensor | None,
                                     grad_entropy: torch.Tensor | None, group_name: str, temperature: float,
                                     ignore_index: int | None, chunk_size: int, kernels: str, need_hidden: bool,
                                     need_weight: bool, need_bias: bool
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dhidden, dweight, dbias) of `vocab_parallel_lm_head_logprob_entropy`, each `[0]` where not
    wanted; each chunk's logits recomputed; no collective."""
    args = VocabParallelArgs(group_name, temperature, ignore_index, chunk_size, kernels, masked=keep_mask is not None)
    head = HeadLogits(hidden, weight, bias)
    gradients = RowGradients(head, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy, args)
    schedule = backward_schedule(hidden, weight, keep_mask, need_hidden, need_weight, kernels)
    if schedule != "rows":
        dhidden = None
        if schedule == "rows, then tiles":
            sink = HeadGradients(head, hidden.shape, True, False, False)
            backward_rows(head, gradients, sink)
            dhidden, need_hidden = sink.results()[0], False
        grads = _head_backward_by_tiles(head, hidden.shape, gradients, need_hidden, need_bias)
        return grads if dhidden is None else (dhidden, *grads[1:])
    sink = HeadGradients(head, hidden.shape, need_hidden, need_weight, need_bias)
    backward_rows(head, gradients, sink)
    return sink.results()


def backward_schedule(hidden, weight, keep_mask, need_hidden: bool, need_weight: bool, kernels: str) -> str:
    """How the backward runs: "tiles" (`_head_backward_by_tiles`: `dW` complete tile by tile, `dh`
    accumulated), "rows, then tiles" (`dh` complete per row chunk, then tiles for `dW` alone) or
    "rows" (row chunks: `dh` complete, `dW` accumulated, in fp32 for a narrower weight).

    Tiles need no keep_mask and a weight that wants a gradient. On the CPU they are always taken,
    and for bf16 with compiled kernels after row chunks for `dh`, so that nothing accumulates: the
    CPU's mm has no fp32 output for bf16 operands, and its product of fp32 copies
    (`devices.mm_into`) ran 9 x slower (`ops.lm_head`); the gradient kernel then runs twice, which
    pays when it is one fused pass (T=2048, H=1024, V=16384: one rank's bf16 step 0.28 s against
    0.39 s with inductor's kernels, 1.29 s against 0.99 s with eager ones). On an accelerator mm
    accumulates bf16 operands in fp32 without copies, and the schedule is the one with the smaller
    fp32 accumulator, as `ops.lm_head`'s: for a narrower weight, tiles (`[rows, H]` for `dh`) where
    there are no more rows than this rank's vocabulary entries, else row chunks (`[V/tp, H]` for
    `dW`); an fp32 weight's gradient accumulates in place either way, and takes row chunks."""
    if keep_mask is not None or not need_weight:
        return "rows"
    if devices.host_reads_are_free(hidden.device):
        narrow_compiled = need_hidden and hidden.dtype.itemsize < 4 and kernels == "inductor"
        return "rows, then tiles" if narrow_compiled else "tiles"
    rows = math.prod(hidden.shape[:-1])
    return "tiles" if weight.dtype.itemsize < 4 and rows <= weight.shape[0] else "rows"


def _tile_columns(chunk_size: int, rows: int, vocab: int, hidden_size: int, itemsize: int) -> int:
    """Vocabulary entries per tile of `_head_backward_by_tiles`: the `[rows, tile]` logits within
    the floor's share (`block_rows` turned on its side; `chunk_size` > 0 caps it at as many
    entries as that many rows take), of even width in whole panels."""
    floor = chunk_sizes.lm_head_floor_bytes(rows, vocab, hidden_size, itemsize)
    budget = floor * chunk_sizes.VOCAB_PARALLEL_LM_HEAD_SHARE if chunk_size <= 0 else chunk_size * vocab * itemsize
    limit = chunk_sizes.fitting(budget, max(1, rows) * itemsize, vocab)
    return chunk_sizes.even_panels(vocab, limit)


def _head_backward_by_tiles(head: HeadLogits, hidden_shape, gradients: RowGradients, need_hidden: bool,
                            need_bias: bool):
    """(dhidden, dweight, dbias) of the unmasked recomputing op, a vocabulary tile at a time: the
    tile's logits for all rows `h @ W[tile].T (+ b[tile])` (every row's statistics are known), the
    gradient kernel over them in place (targets shifted to the tile), then `dW[tile] = dl.T @ h`,
    complete in one GEMM of depth `rows` and written once in the weight's dtype (no `[V/tp, H]`
    accumulator), and `dh += dl @ W[tile]` into a `[rows, H]` accumulator (fp32 for a narrower
    dtype). No collective."""
    hidden, weight, bias = head.hidden, head.weight, head.bias
    rows, vocab = hidden.shape[0], weight.shape[0]
    acc = torch.promote_types(weight.dtype, torch.float32)
    dweight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    dhidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if need_hidden else None
    dbias = torch.empty(vocab, dtype=acc, device=weight.device) if need_bias and bias is not None else None
    tile = _tile_columns(gradients.args.chunk_size, rows, vocab, weight.shape[1], hidden.dtype.itemsize)
    for columns, logits in head.column_tiles(tile):
        # Every row's statistics are known: the tile's logits become their gradient where they are.
        gradients.of_chunk(slice(None), logits, in_place=True, column=columns.start)
        torch.mm(logits.t(), hidden, out=dweight[columns])
        if dhidden is not None:
            devices.mm_into(dhidden, logits, weight[columns], accumulate=columns.start > 0)
        if dbias is not None:
            torch.sum(logits, 0, dtype=acc, out=dbias[columns])
    empty = hidden.new_empty
    return (empty((0,)) if dhidden is None else dhidden.to(hidden.dtype).view(hidden_shape), dweight,
            empty((0,)) if dbias is None else dbias.to(bias.dtype))


@_vocab_parallel_head_backward_op.register_fake
def _(hidden, weight, bias, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy, group_name,
      temperature, ignore_index, chunk_size, kernels, need_hidden, need_weight, need_bias):
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else hidden.new_empty((0,)),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else weight.new_empty((0,)),
            torch.empty_like(bias, memory_format=torch.contiguous_format) if need_bias and bias is not None
            else weight.new_empty((0,)))


def _head_setup_context(ctx, inputs, output):
    hidden, weight, bias, target, keep_mask = inputs[:5]
    ctx.args = _head_op_args(*inputs[4:])
    logprob, entropy, lse_lp, lse_full = output
    ctx.save_for_backward(hidden, weight, bias, target, keep_mask, lse_lp, lse_full, entropy)
    ctx.mark_non_differentiable(lse_lp, lse_full)
    if not ctx.args.entropy_differentiable:
        ctx.mark_non_differentiable(entropy)


def _head_autograd_backward(ctx, grad_logprob, grad_entropy, _grad_lse_lp, _grad_lse_full):
    hidden, weight, bias, target, keep_mask, lse_lp, lse_full, entropy = ctx.saved_tensors
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    need_bias = bool(need_bias and bias is not None)
    args = ctx.args
    if not args.entropy_differentiable:
        grad_entropy = None
    if not (need_hidden or need_weight or need_bias) or (grad_logprob is None and grad_entropy is None):
        return (None,) * 12
    dh, dw, db = _vocab_parallel_head_backward_op(
        hidden, weight, bias, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy,
        args.group_name, args.temperature, args.ignore_index, args.chunk_size, args.kernels, bool(need_hidden),
        bool(need_weight), need_bias)
    return ((dh if need_hidden else None), (dw if need_weight else None), (db if need_bias else None)) + (None,) * 9


_vocab_parallel_head_op.register_autograd(_head_autograd_backward, setup_context=_head_setup_context)


def vocab_parallel_lm_head_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                           group=None, *, bias: torch.Tensor | None = None, temperature: float = 1.0,
                                           with_entropy: bool = False, entropy_grad: bool = True,
                                           ignore_index: int | None = -100, chunk_size: int | None = None):
    """`vocab_parallel_logprob_entropy(F.linear(hidden, weight, bias), target, group, ...)` without
    the `[*, V/tp]` logits or their gradient ever stored: each chunk's logits are computed from
    `hidden [*, H]`, this rank's weight shard `[V/tp, H]` (and bias shard `[V/tp]`), and recomputed
    in backward. The same one all-gather per call, none in backward.

    `hidden.grad` is this rank's share, `dlogits_r @ W_r`, as autograd of `F.linear` gives on this
    rank (Megatron sums it over the group in its own copy-to-tensor-parallel region); the weight's
    gradient is computed a vocabulary tile at a time on the CPU (complete per tile; the hidden
    states' accumulated in fp32), else accumulated in fp32 (float64 in float64) and converted once.
    `chunk_size`: rows per chunk (and a tile's bytes); None: up to half the bytes of the gradients.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.ndim < 2 or not hidden.is_floating_point():
        raise ValueError("graphpass: hidden must be a float [*, H] tensor (at least 2-D)")
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.shape[1] != hidden.shape[-1] \
            or weight.dtype != hidden.dtype or weight.shape[0] == 0:
        raise ValueError(f"graphpass: weight must be this rank's [V/tp, H] = [*, {hidden.shape[-1]}] shard in "
                         f"{hidden.dtype}, got {tuple(getattr(weight, 'shape', ()))}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != hidden.dtype):
        raise ValueError(f"graphpass: bias must be this rank's [{weight.shape[0]}] shard in {hidden.dtype}")
    if not isinstance(target, torch.Tensor) or target.dtype.is_floating_point or target.dtype == torch.bool \
            or tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError("graphpass: target must be integer token ids of shape hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"graphpass: temperature must be a positive Python number, got {temperature!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"graphpass: chunk_size must be a positive int or None, got {chunk_size!r}")
    logprob, entropy, _, _ = _vocab_parallel_head_op(hidden, weight, bias, target, None, group_name(group),
                                                     float(temperature), bool(with_entropy), bool(entropy_grad),
                                                     None if ignore_index is None else int(ignore_index),
                                                     chunk_size or 0, "eager")
    return logprob, (entropy if with_entropy else None)
