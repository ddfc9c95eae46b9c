"""An lm_head's logits, chunk by chunk: `hidden @ W.T (+ b)` from the op's tensors.

A chunked op may read a wide input as the product that computes it rather than as a tensor: the
op's tensor at the head's position is the hidden states `[*rows, H]`, and the weight (and bias)
come after the region's own inputs. `HeadSpec` says where; `logits` computes a chunk's (or a
vocabulary tile's) logits. The head the op differentiates is `ops.lm_head.LinearHeadProgram`'s;
heads that need no gradient (a teacher's under no_grad) are any program's `frozen_heads`.
"""

from __future__ import annotations

import dataclasses

import torch

from graphpass.ops import devices


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """Where an lm_head's operands are among the op's tensors."""

    position: int
    """The kernel's wide input the head computes; the op's tensor there is the hidden states."""
    weight: int
    """Position of the weight among the op's tensors (after the kernel's inputs)."""
    bias: int | None
    """Position of the bias, or None."""
    weight_transposed: bool
    """False: the weight is `[V, H]` (logits = hidden @ W.T); True: it is `[H, V]`."""
    hidden_size: int


def vocab(head: HeadSpec, tensors) -> int:
    """The head's vocabulary size, from its weight."""
    weight = tensors[head.weight]
    return weight.shape[1] if head.weight_transposed else weight.shape[0]


def logits(head: HeadSpec, tensors, hidden_chunk, out=None, columns: slice = slice(None)):
    """`hidden_chunk @ W.T (+ b)`, into `out` when given; with `columns`, those logits only.
    A block's, on the CPU in fp32 with H >= 512, by one GEMM or by `_logits_by_vocab_tiles`,
    whichever ran faster on its first block (`devices.fastest`); else one GEMM. On an AMD EPYC
    (2 cores, load 2), the A/B PPO step at T=2048, H=1024, V=32768 fp32 took 0.89 x inductor's
    time by tiles, 0.95 x by one GEMM; on a Xeon one 128-row block's GEMM took 31 ms, its tiles
    36 ms. bf16, and H < 512, take one GEMM (on the EPYC: bf16 1.12 x against 1.06 x; the loss
    outside at H=256, V=65536 fp32 1.03 x against 0.99 x: a tile's transposing copy costs what
    the faster product saves when H is small)."""
    weight = tensors[head.weight]
    bias = tensors[head.bias] if head.bias is not None else None
    right = weight[:, columns] if head.weight_transposed else weight[columns].t()

    def one_gemm():
        if bias is None:
            return torch.mm(hidden_chunk, right, out=out)
        return torch.addmm(bias[columns], hidden_chunk, right, out=out)

    if (columns == slice(None) and devices.host_reads_are_free(hidden_chunk.device)
            and hidden_chunk.element_size() >= 4 and head.hidden_size >= 512):
        if out is None:
            out = hidden_chunk.new_empty(hidden_chunk.shape[0], vocab(head, tensors))
        key = ("logits", tuple(hidden_chunk.shape), tuple(weight.shape), hidden_chunk.dtype, bias is not None,
               head.weight_transposed)
        return devices.fastest(key, (one_gemm, lambda: _logits_by_vocab_tiles(
            hidden_chunk, weight, bias, head.weight_transposed, out)))
    return one_gemm()


# Vocabulary entries per tile of `_logits_by_vocab_tiles`: a tile's `[tile, rows]` product stays
# in cache while it is copied into the logits.
_VOCAB_TILE = 2048


def _logits_by_vocab_tiles(hidden, weight, bias, weight_transposed, out=None):
    """`hidden @ W.T (+ bias)` as `[rows, V]`, computed a vocabulary tile at a time as
    `(W[tile] @ hidden.T).T`: for a block of a few hundred rows MKL multiplies the weight as the
    left operand about 30 % faster than `hidden @ W.T` (0.77 s against 1.10 s for T=1920, H=1024,
    V=32768 in 160-row blocks, fp32, 2 cores), and each tile's transpose is a copy in cache (where
    it pays: `logits`)."""
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
