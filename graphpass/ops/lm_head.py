"""The chunked op with the lm_head inside: the logits `[rows, V]` are never stored.

`LinearHeadProgram` is a `RegionProgram` whose wide input is not a tensor but a product: the op
takes `hidden [*rows, H]` where the region read the logits, and the weight (and bias) after the
region's own inputs. The base class's chunk loops are unchanged; this class only says what a
chunk's wide value is and where its gradient goes:

- forward, per chunk: `logits_c = hidden_c @ W.T (+ b)`, then the region's forward kernel (its
  outputs and O(rows) row statistics, as for logits given as a tensor);
- backward, per block of rows: the block's logits recomputed the same way; the region's backward
  kernel, per chunk of the block (an eighth), writes the chunk's `dlogits` into one scratch
  buffer, copied back over the chunk's logits it has just read; then `dhidden[block] = dlogits @ W`
  in place and `dW += dlogits.T @ hidden[block]` (and `db += dlogits.sum(0)`) into fp32
  accumulators, one buffer each, converted to the weight's dtype once at the end (for an fp32
  weight the accumulator is the gradient).

So the backward's peak is the two gradients plus a block and an eighth of `[rows, V]` (and for a
bf16 weight its fp32 accumulator, twice the gradient's bytes); a bf16 weight is multiplied as it
is, never copied to fp32. That backward does four GEMMs (forward, the recompute, dhidden, dW) where
code that keeps the logits does three. Where the loss is one sum of per-token terms, the op
computes the gradients in its forward instead (`RegionProgram.forward_with_gradients`, the same
blocks and sinks while each block's logits are at hand): three GEMMs, and the same peak.
"""

from __future__ import annotations

import dataclasses

import torch

from graphpass.ops import devices
from graphpass.ops.chunked_op import _TEMPORARIES_PER_CHUNK, RegionProgram


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """Where the lm_head's operands are among the op's tensors."""

    position: int
    """The kernel's wide input the head computes; the op's tensor there is the hidden states."""
    weight: int
    """Position of the weight among the op's tensors (after the kernel's inputs)."""
    bias: int | None
    """Position of the bias, or None."""
    weight_transposed: bool
    """False: the weight is `[V, H]` (logits = hidden @ W.T); True: it is `[H, V]`."""
    hidden_size: int


class LinearHeadProgram(RegionProgram):
    """A region program whose wide input `head.position` is `hidden @ W.T (+ b)`, chunk by chunk."""

    def __init__(self, graph_module, inputs, outputs, *, head: HeadSpec, **kwargs):
        self.head = head  # before the base's __init__: the content key includes it
        super().__init__(graph_module, inputs, outputs, **kwargs)

    def _identity(self) -> tuple:
        return (*super()._identity(), self.head)

    # ---- sizes -------------------------------------------------------------------------
    # The backward multiplies blocks of rows (its GEMMs are faster for more rows) and runs the
    # region's kernel on quarter blocks: the kernel writes a quarter block's dlogits into a scratch
    # buffer, copied back over the logits it has just read, so one block plus a quarter is alive.
    SUB_CHUNKS = 8

    def floor_bytes(self, rows: int, vocab: int, itemsize: int) -> int:
        """Bytes of the gradients the backward must produce: hidden's and the weight's."""
        return (rows + vocab) * self.head.hidden_size * itemsize

    def block_rows(self, rows: int, vocab: int, grad_itemsize: int = 4, backward: bool = True) -> int:
        """Rows per matmul: the configured chunk size, else what keeps the temporaries within a
        share of the floor: a fifth in backward (a block and a quarter of `[rows, V]`, on top of
        the gradients), half in forward (one block, before any gradient exists)."""
        if self.chunk_size is not None:
            return max(1, min(self.chunk_size, rows))
        floor = self.floor_bytes(rows, vocab, grad_itemsize)
        budget = max(self.chunk_budget_bytes, floor // (5 if backward else 2))
        per_row = vocab * self._bytes_per_row(grad_itemsize, backward)
        block = max(1, min(rows, int(budget // per_row)))
        return block - block % 32 if block >= 64 else block  # whole GEMM panels

    def _bytes_per_row(self, itemsize: int, backward: bool) -> float:
        """Temporary bytes per row of a block, per vocabulary entry."""
        kernel = 4 * _TEMPORARIES_PER_CHUNK[self.inner] / (self.SUB_CHUNKS if backward else 1)
        if not backward:
            return itemsize + kernel
        # The block's fp32 copy for the weight's gradient, on the CPU only (`devices.mm_into`).
        upcast = 4 if itemsize < 4 and devices.host_reads_are_free(self.device) else 0
        return itemsize * (1 + 1 / self.SUB_CHUNKS) + upcast + kernel

    def rows_per_chunk(self, rows: int, vocab: int, grad_itemsize: int = 4, backward: bool = True) -> int:
        """Rows per call of the region's kernel: a block in forward, a quarter block in backward."""
        block = self.block_rows(rows, vocab, grad_itemsize, backward)
        return max(1, -(-block // self.SUB_CHUNKS)) if backward else block

    def _chunk_rows(self, tensors, rows: int, vocab: int, backward: bool) -> int:
        return self.rows_per_chunk(rows, vocab, tensors[self.head.weight].element_size(), backward)

    def workspace_bytes(self, rows: int, vocab: int, grad_itemsize: int = 4, backward: bool = True) -> int:
        """Transient bytes while the op runs, beyond its inputs, outputs and the gradients it returns:
        the block's logits (in backward also the kernel's scratch, a bf16 block's fp32 copy and, for
        a weight that is not fp32, the weight's fp32 accumulator)."""
        block = self.block_rows(rows, vocab, grad_itemsize, backward)
        total = int(block * vocab * self._bytes_per_row(grad_itemsize, backward))
        if backward and grad_itemsize < 4:
            total += vocab * self.head.hidden_size * 4
        return total

    # ---- layout ------------------------------------------------------------------------
    def _layout(self, tensors):
        """(rows, V, blocks) as the base's, with the hidden states `[rows, H]` as the head's view."""
        head = self.head
        hidden, weight = tensors[head.position], tensors[head.weight]
        vocab = weight.shape[1] if head.weight_transposed else weight.shape[0]
        rows = hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0
        views = []
        for i in self.wide_input_positions:
            t = tensors[i]
            views.append(t.reshape(rows, t.shape[-1]))
        return rows, vocab, [(0, rows, views)]

    def _logits(self, tensors, hidden_chunk, out=None):
        """`hidden_chunk @ W.T (+ b)`, into `out` ([rows, V]) when given."""
        head = self.head
        weight = tensors[head.weight]
        bias = tensors[head.bias] if head.bias is not None else None
        if hidden_chunk.device.type == "cpu":
            return _logits_by_vocab_tiles(hidden_chunk, weight, bias, head.weight_transposed, out)
        right = weight if head.weight_transposed else weight.t()
        if bias is None:
            return torch.mm(hidden_chunk, right, out=out)
        return torch.addmm(bias, hidden_chunk, right, out=out)

    def _kernel_args(self, tensors, args, sl, sinks=()):
        args = list(args)
        head_sinks = [sink for sink in sinks if isinstance(sink, _HeadGradients)]
        if head_sinks:  # backward: a view of the recomputed block
            args[self.head.position] = head_sinks[0].logits(sl)
        else:
            args[self.head.position] = self._logits(tensors, args[self.head.position])
        return args

    def _kernel_wanted(self, needs_grad) -> tuple[int, ...]:
        head = self.head
        operands = [head.position, head.weight] + ([head.bias] if head.bias is not None else [])
        wanted = [i for i in range(len(self.inputs)) if needs_grad[i] and i != head.position]
        if any(needs_grad[i] for i in operands):
            wanted.append(head.position)
        return tuple(sorted(wanted))

    def _gradient_sink(self, i, tensors, needs_grad, rows, vocab, chunk):
        if i != self.head.position:
            return super()._gradient_sink(i, tensors, needs_grad, rows, vocab, chunk)
        block = self.block_rows(rows, vocab, tensors[self.head.weight].element_size())
        return _HeadGradients(self, tensors, needs_grad, rows, vocab, chunk, block)


# Vocabulary entries per tile of `_logits_by_vocab_tiles`: a tile's `[tile, rows]` product stays
# in cache while it is copied into the logits.
_VOCAB_TILE = 2048


def _logits_by_vocab_tiles(hidden, weight, bias, weight_transposed, out=None):
    """`hidden @ W.T (+ bias)` as `[rows, V]`, computed a vocabulary tile at a time as
    `(W[tile] @ hidden.T).T`: for a block of a few hundred rows MKL multiplies the weight as the
    left operand about 30 % faster than `hidden @ W.T` (0.77 s against 1.10 s for T=1920, H=1024,
    V=32768 in 160-row blocks, fp32, 2 cores), and each tile's transpose is a copy in cache."""
    vocab = weight.shape[1] if weight_transposed else weight.shape[0]
    if out is None:
        out = torch.empty(hidden.shape[0], vocab, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, vocab, _VOCAB_TILE):
        stop = min(vocab, start + _VOCAB_TILE)
        tile = weight[:, start:stop].t() if weight_transposed else weight[start:stop]
        if bias is None:
            product = torch.mm(tile, hidden.t())
        else:
            product = torch.addmm(bias[start:stop, None], tile, hidden.t())
        out[:, start:stop].copy_(product.t())
    return out


class _HeadGradients:
    """The head's gradients, block by block. For each block of rows: its logits, recomputed;
    the kernel's chunks within it, each writing its dlogits into a scratch buffer that is copied
    back over the chunk's (consumed) logits; then, with the block's dlogits complete,
    `dhidden[block] = dlogits @ W` in place and `dW += dlogits.T @ hidden[block]`,
    `db += dlogits.sum(0)` into fp32 accumulators."""

    def __init__(self, program: LinearHeadProgram, tensors, needs_grad, rows, vocab, chunk, block):
        head = self.head = program.head
        self.program, self.tensors = program, tensors
        hidden, weight = tensors[head.position], tensors[head.weight]
        self.weight = weight
        self.bias = tensors[head.bias] if head.bias is not None else None
        self.hidden = hidden.reshape(rows, hidden.shape[-1])
        self.rows, self.block = rows, max(1, block // chunk) * chunk  # whole chunks: none crosses a block
        self.start = self.stop = 0  # rows of the block whose logits are in `self.values`
        self.values = self.buffer = None
        self.scratch = torch.empty(min(chunk, rows), vocab, dtype=hidden.dtype, device=hidden.device)
        self.hidden_grad = self.weight_acc = self.bias_acc = None
        if needs_grad[head.position]:
            self.hidden_grad = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
            self.hidden_flat = self.hidden_grad.view(rows, hidden.shape[-1])
        # fp32 at least: a float64 weight sums in float64.
        self.acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        if needs_grad[head.weight]:
            # Written by the first block's product, accumulated into by the others.
            self.weight_acc = torch.empty(weight.shape, dtype=self.acc_dtype, device=weight.device)
        if head.bias is not None and needs_grad[head.bias]:
            self.bias_acc = torch.zeros(self.bias.shape, dtype=self.acc_dtype, device=weight.device)
        self.first_block = True

    def logits(self, sl):
        """The logits of the chunk of rows `sl`: a view of its block's, recomputed on entering it."""
        if not self.start <= sl.start < self.stop:
            self._flush()
            self.start, self.stop = sl.start, min(self.rows, sl.start + self.block)
            if self.buffer is None:  # one block's buffer, reused by every block
                self.buffer = torch.empty(min(self.block, self.rows), self.scratch.shape[1],
                                          dtype=self.scratch.dtype, device=self.scratch.device)
            self.values = self.program._logits(self.tensors, self.hidden[self.start:self.stop],
                                               out=self.buffer[:self.stop - self.start])
        if sl.stop > self.stop:
            raise RuntimeError("graphpass: an lm_head chunk crosses its block")  # chunks divide blocks
        return self.values[sl.start - self.start:sl.stop - self.start]

    def slot(self, sl):
        return self.scratch[:sl.stop - sl.start]

    def take(self, sl, args):
        # The chunk's logits are read; its dlogits take their place in the block.
        self.values[sl.start - self.start:sl.stop - self.start].copy_(self.scratch[:sl.stop - sl.start])

    def _flush(self):
        """The block's dlogits are complete: its share of every gradient."""
        if self.values is None:
            return
        dlogits, rows = self.values, slice(self.start, self.stop)
        hidden_block = self.hidden[rows]
        transposed = self.head.weight_transposed
        if self.hidden_grad is not None:
            # [block, V] @ [V, H] into the block's rows of the gradient. On the CPU as
            # (W.T @ dlogits.T).T: MKL streams the weight faster as the left operand (0.79 s
            # against 0.92 s for T=1920, H=1024, V=32768 in 160-row blocks, fp32, 2 cores).
            weight = self.weight.t() if transposed else self.weight
            if dlogits.device.type == "cpu":
                self.hidden_flat[rows].copy_(torch.mm(weight.t(), dlogits.t()).t())
            else:
                torch.mm(dlogits, weight, out=self.hidden_flat[rows])
        if self.weight_acc is not None:
            # dW [V, H] += dlogits.T @ h, or for an [H, V] weight dW += h.T @ dlogits
            left, right = (hidden_block.t(), dlogits) if transposed else (dlogits.t(), hidden_block)
            devices.mm_into(self.weight_acc, left, right, accumulate=not self.first_block)
        if self.bias_acc is not None:
            self.bias_acc += dlogits.sum(0, dtype=self.acc_dtype)
        self.first_block = False
        self.values = None

    def finish(self, grads):
        self._flush()
        self.buffer = self.scratch = None
        if self.first_block and self.weight_acc is not None:  # no rows at all: nothing was written
            self.weight_acc.zero_()
        head = self.head
        if self.hidden_grad is not None:
            grads[head.position] = self.hidden_grad
        if self.weight_acc is not None:
            grads[head.weight] = self.weight_acc.to(self.weight.dtype)
        if self.bias_acc is not None:
            grads[head.bias] = self.bias_acc.to(self.bias.dtype)
