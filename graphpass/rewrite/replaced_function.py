"""The outputs of a replaced `autograd.Function`, rebuilt from what replaces it: each with the
shape, dtype and differentiability the Function gave it. The one-device and the vocab-parallel
Function passes both rebuild them so."""

from __future__ import annotations

import torch

from graphpass import _torch_api
from graphpass.analysis.vocab_parallel import EMPTY

aten = torch.ops.aten

__all__ = ["as_the_output_was"]


def as_the_output_was(node, results: dict, kind: str, want, non_differentiable: bool,
                      sizes_of: torch.fx.Node | None = None) -> torch.fx.Node:
    """One output of a replaced Function, `kind` ("logprob", "-entropy", ..., "empty") made from
    `results[kind without its sign]` with the shape and dtype of its value `want`, detached where
    the Function marked it non-differentiable; `node(target, *args, **kwargs)` makes each node.
    A symbolic size of `want` is read from `sizes_of` (the logits), else from the result."""
    if kind == EMPTY:
        return node(aten.empty.memory_format, list(want.shape), dtype=want.dtype, device=want.device)
    new = results[kind.lstrip("-")]
    if kind.startswith("-"):
        new = node(aten.neg.default, new)
    new = node(aten.reshape.default, new, _shape_for(node, sizes_of or new, tuple(want.shape)))
    if new.meta["val"].dtype != want.dtype:
        new = node(aten._to_copy.default, new, dtype=want.dtype)
    return node(aten.detach.default, new) if non_differentiable else new


def _shape_for(node, source, want: tuple) -> list:
    """`want` as a reshape's argument: each symbolic size read from `source` (`sym_size`: a graph
    argument must be a node or a number); raises ValueError where `source` has no such size."""
    have = tuple(source.meta["val"].shape)
    out = []
    for size in want:
        if isinstance(size, int):
            out.append(size)
            continue
        same = [d for d, s in enumerate(have) if _torch_api.same_size(s, size)]
        if not same:
            raise ValueError(f"the Function's output size {size} is not one of its replacement's")
        out.append(node(aten.sym_size.int, source, same[0]))
    return out
