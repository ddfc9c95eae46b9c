"""How large one chunk of a graphpass op is: the chunk-size policy of every op, in one place.

Each call of an op's per-chunk kernel holds one large temporary: a chunk of `[rows, V]` values
(logits, their gradient, the kernel's own temporaries). `Config.chunk_size` (rows) fixes it;
otherwise its bytes are a share of the op's floor, the bytes the step holds anyway (the logits'
gradient `[T, V]`; with the lm_head inside, `hidden.grad + W.grad`), so the peak stays within that
share of the floor while the chunk count stays bounded at any shape. `Config.chunk_budget_bytes`
bounds it:

    op                          bytes of a chunk's temporaries        why
    logits, one device          max(budget, floor / 64)               all of a chunk's temporaries
                                max(budget, floor / 8) off the CPU    each chunk costs the host a
                                                                      call: few, long ones
    lm_head, one device         max(budget, floor / 8)  in backward   on top of the gradients
                                max(budget, floor)      in forward    before any gradient exists
    logits, vocab-parallel      floor / 160, on a CPU at most budget  4-5 fp32 chunks live at once
                                                                      in backward; a CPU chunk fits
                                                                      the cache
    lm_head, vocab-parallel     floor / 2, in whole 32-row panels     each block is a collective
                                                                      (one all-gather): as few as
                                                                      the share allows

The budget is the least a chunk gets on one device (fewer, longer kernel calls: on a shared CPU
each call waits for threads other processes hold) and the most on a CPU across ranks; a
vocab-parallel lm_head block takes its share alone, since fewer blocks mean fewer collectives.
"""

from __future__ import annotations

from fractions import Fraction

# Exact fractions: a share of a floor is a whole number of bytes, rounded down.
LOGITS_SHARE = Fraction(1, 64)
# On an accelerator each chunk costs the host 0.15-0.3 ms (Python, a compiled call, launches) while
# the device's share of it is its bytes over ~4 TB/s. The PPO step over bf16 logits [32768, 151936]
# on an H200 (bench/results/gpu_profile.md): 128 chunks of 256 rows took 61 ms, its kernels busy 27 ms
# of it; 16 chunks of 2048 rows 25.3 ms (busy 25.4), 8 chunks 24.9 ms; inductor 36.7 ms.
ACCELERATOR_LOGITS_SHARE = Fraction(1, 8)
# 1/5 (192-row blocks) took the fp32 PPO step at T=2048 H=1024 V=32768 to 1.19 x its floor, 1/8 to
# 1.13 x at about the same speed (0.90 and 0.98 x inductor's time in two alternating A/B runs).
LM_HEAD_BACKWARD_SHARE = Fraction(1, 8)
LM_HEAD_FORWARD_SHARE = Fraction(1)
VOCAB_PARALLEL_LOGITS_SHARE = Fraction(1, 160)  # 1/96 left 1.11 x the floor per rank at T=1024 V=32768 TP=2
VOCAB_PARALLEL_LM_HEAD_SHARE = Fraction(1, 2)
DEFAULT_BUDGET_BYTES = 16 * 2**20
"""`Config.chunk_budget_bytes`' default."""
PANEL_ROWS = 32
"""Rows of one GEMM panel: blocks of whole panels keep the matmuls at full speed."""


def lm_head_floor_bytes(rows: int, vocab: int, hidden_size: int, itemsize: int) -> int:
    """The floor of an lm_head op (one device, or one rank's shard): the bytes of the gradients
    its backward must produce, the hidden states' `[rows, H]` and the weight's `[V, H]`."""
    return (rows + vocab) * hidden_size * itemsize


def logits_share(host: bool) -> Fraction:
    """The logits op's share of its floor: on the CPU (`host`), or on an accelerator."""
    return LOGITS_SHARE if host else ACCELERATOR_LOGITS_SHARE


def at_least_budget(floor_bytes: int, share: Fraction, budget_bytes: int) -> int:
    """Bytes of a one-device op's chunk: its share of the floor, at least the budget."""
    return max(budget_bytes, int(floor_bytes * share))


def vocab_parallel_logits_bytes(floor_bytes: int, budget_bytes: int, host: bool) -> int:
    """Bytes of one fp32 `[chunk, V/tp]` temporary of the vocab-parallel logits op: its share of
    the floor, on a CPU (`host`) at most the budget."""
    share = int(floor_bytes * VOCAB_PARALLEL_LOGITS_SHARE)
    return min(budget_bytes, share) if host else share


def fitting(budget_bytes: float, bytes_each: float, most: int) -> int:
    """How many of something of `bytes_each` (rows, columns), at least 1 and at most `most`,
    fit in the budget."""
    return max(1, min(most, int(budget_bytes // max(1, bytes_each))))


def even_panels(total: int, limit: int) -> int:
    """Entries per piece of `total` split into the fewest pieces of at most `limit`: split evenly
    and rounded up to whole panels where that still fits, else whole panels that fit (else the
    even split)."""
    if limit >= total:
        return max(1, total)
    piece = -(-total // -(-total // limit))
    panels = PANEL_ROWS * -(-piece // PANEL_ROWS)
    if panels <= limit:
        return panels
    return PANEL_ROWS * (limit // PANEL_ROWS) if limit >= PANEL_ROWS else piece
