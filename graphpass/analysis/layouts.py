"""The one vocabulary for how a tensor lies over a region's rows.

The analyses (`analysis.rowlocal`, `analysis.regions`) classify each value of a region by it, and
the chunked op (`ops.chunked_op`) lays each input over chunks by it. R is the region's row count:
the token positions, `B * S` of a `[B, S, V]` tensor.
"""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    """Where a tensor's values are, relative to the rows."""

    ROW = "row"
    """One value or vector per row: `[*rows]` or `[*rows, w]` (a per-token value, or the logits)."""
    WIDE = "wide"
    """A ROW tensor as wide as the vocabulary, `[*rows, V]`: the op reads it through views, chunk
    by chunk, and writes its gradient into one buffer of its dtype."""
    BCAST = "bcast"
    """The same for every row: `[w]` or `[1, ..., 1, w]` (a vocabulary mask, a bias)."""
    SCALAR = "scalar"
    """A 0-d tensor (a runtime temperature): a BCAST value of width 1 the op passes as it is."""
    TRANSPOSED = "transposed"
    """`x.transpose(1, 2)` of a `[B, S, V]` ROW tensor: the class-dim-1 input of the losses, which
    alone may read it; its chunk is the `[r, V]` chunk of `x`."""

    def __str__(self) -> str:
        return self.value
