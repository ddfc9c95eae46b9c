"""The chunked op with the lm_head inside: the logits `[rows, V]` are never stored.

`LinearHeadProgram` is a `RegionProgram` whose wide input is not a tensor but a product: the op
takes `hidden [*rows, H]` where the region read the logits, and the weight (and bias) after the
region's own inputs. The base class's chunk loop is unchanged; this class only says what a chunk's
wide value is and where its gradient goes:

- forward, per chunk: `logits_c = hidden_c @ W.T (+ b)`, then the region's forward kernel (its
  outputs and O(rows) row statistics, as for logits given as a tensor);
- backward, per chunk: the logits recomputed the same way, the region's backward kernel writes
  `dlogits_c` into one `[chunk, V]` scratch buffer, then `dhidden[rows_c] = dlogits_c @ W` in
  place and `dW += dlogits_c.T @ hidden_c` (and `db += dlogits_c.sum(0)`) into fp32 accumulators,
  one buffer each, converted to the weight's dtype once at the end (for an fp32 weight the
  accumulator is the gradient).

So the backward's peak is the two gradients plus two `[chunk, V]` buffers (and for a bf16 weight
its fp32 accumulator); a bf16 weight is multiplied as it is, never copied to fp32.
"""

from __future__ import annotations

import dataclasses

import torch

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
    def floor_bytes(self, rows: int, vocab: int, itemsize: int) -> int:
        """Bytes of the gradients the backward must produce: hidden's and the weight's."""
        return (rows + vocab) * self.head.hidden_size * itemsize

    def rows_per_chunk(self, rows: int, vocab: int, grad_itemsize: int = 4, backward: bool = True) -> int:
        """The configured size, else what keeps one chunk's temporaries within a share of the floor:
        a sixth in backward (two `[chunk, V]` buffers on top of the gradients), a quarter in forward
        (one buffer, no gradient exists yet). Larger chunks make faster matmuls."""
        if self.chunk_size is not None:
            return max(1, min(self.chunk_size, rows))
        floor = self.floor_bytes(rows, vocab, grad_itemsize)
        budget = max(self.chunk_budget_bytes, floor // (6 if backward else 4))
        per_row = vocab * ((8 if backward else 4) + 4 * _TEMPORARIES_PER_CHUNK[self.inner])
        chunk = max(1, min(rows, budget // per_row))
        return chunk - chunk % 32 if chunk >= 64 else chunk  # whole GEMM panels

    def _chunk_rows(self, tensors, rows: int, vocab: int, backward: bool) -> int:
        return self.rows_per_chunk(rows, vocab, tensors[self.head.weight].element_size(), backward)

    def workspace_bytes(self, rows: int, vocab: int, grad_itemsize: int = 4, backward: bool = True) -> int:
        """Transient bytes while the op runs, beyond its inputs, outputs and the gradients it returns:
        in backward the recomputed logits, their gradient (and its fp32 copy for a bf16 weight) and,
        for a weight that is not fp32, its fp32 accumulator; in forward the chunk's logits."""
        chunk = self.rows_per_chunk(rows, vocab, grad_itemsize, backward)
        temporaries = _TEMPORARIES_PER_CHUNK[self.inner] * chunk * vocab * 4
        if not backward:
            return temporaries + chunk * vocab * grad_itemsize
        upcast = 4 if grad_itemsize != 4 else 0
        accumulator = vocab * self.head.hidden_size * 4 if grad_itemsize != 4 else 0
        return temporaries + chunk * vocab * (2 * grad_itemsize + upcast) + accumulator

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

    def _logits(self, tensors, hidden_chunk):
        head = self.head
        weight = tensors[head.weight]
        right = weight if head.weight_transposed else weight.t()
        if head.bias is None:
            return torch.mm(hidden_chunk, right)
        return torch.addmm(tensors[head.bias], hidden_chunk, right)

    def _kernel_args(self, tensors, args):
        args = list(args)
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
        return _HeadGradients(self.head, tensors, needs_grad, rows, vocab, chunk)


class _HeadGradients:
    """The head's gradients: the kernel writes each chunk's `dlogits` into a scratch buffer, from
    which the hidden states' rows are written and the weight's (and bias's) gradient accumulated."""

    def __init__(self, head: HeadSpec, tensors, needs_grad, rows, vocab, chunk):
        self.head = head
        hidden, weight = tensors[head.position], tensors[head.weight]
        self.weight = weight
        self.bias = tensors[head.bias] if head.bias is not None else None
        self.scratch = torch.empty(min(chunk, rows), vocab, dtype=hidden.dtype, device=hidden.device)
        self.hidden_grad = self.weight_acc = self.bias_acc = None
        if needs_grad[head.position]:
            self.hidden_grad = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
            self.hidden_flat = self.hidden_grad.view(rows, hidden.shape[-1])
        if needs_grad[head.weight]:
            self.weight_acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if head.bias is not None and needs_grad[head.bias]:
            self.bias_acc = torch.zeros(self.bias.shape, dtype=torch.float32, device=weight.device)

    def slot(self, sl):
        return self.scratch[:sl.stop - sl.start]

    def take(self, sl, args):
        dlogits = self.scratch[:sl.stop - sl.start]
        hidden_chunk = args[self.head.position]
        transposed = self.head.weight_transposed
        if self.hidden_grad is not None:
            # [chunk, V] @ [V, H], straight into the chunk's rows of the gradient.
            torch.mm(dlogits, self.weight.t() if transposed else self.weight, out=self.hidden_flat[sl])
        if self.weight_acc is not None or self.bias_acc is not None:
            wide = dlogits.float()  # the same tensor for fp32; a chunk-sized copy for bf16
            if self.weight_acc is not None:
                if transposed:  # dW [H, V] += h_c.T @ dlogits_c
                    self.weight_acc.addmm_(hidden_chunk.t().float(), wide)
                else:  # dW [V, H] += dlogits_c.T @ h_c
                    self.weight_acc.addmm_(wide.t(), hidden_chunk.float())
            if self.bias_acc is not None:
                self.bias_acc += wide.sum(0)

    def finish(self, grads):
        head = self.head
        if self.hidden_grad is not None:
            grads[head.position] = self.hidden_grad
        if self.weight_acc is not None:
            grads[head.weight] = self.weight_acc.to(self.weight.dtype)
        if self.bias_acc is not None:
            grads[head.bias] = self.bias_acc.to(self.bias.dtype)
