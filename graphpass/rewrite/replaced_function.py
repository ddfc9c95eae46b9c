"""The outputs of a replaced `autograd.Function`, rebuilt from what replaces it: each with the
shape, dtype and differentiability the Function gave it. The one-device and the vocab-parallel
Function passes both rebuild them so."""

from __future__ import annotations

import torch

from graphpass.analysis.vocab_parallel import EMPTY

aten = torch.ops.aten

__all__ = ["as_the_output_was"]


def as_the_output_was(node, results: dict, kind: str, want, non_differentiable: bool) -> torch.fx.Node:
    """One output of a replaced Function, `kind` ("logprob", "-entropy", ..., "empty") made from
    `results[kind without its sign]` with the shape and dtype of its value `want`, detached where
    the Function marked it non-differentiable; `node(target, *args, **kwargs)` makes each node."""
    if kind == EMPTY:
        return node(aten.empty.memory_format, list(want.shape), dtype=want.dtype, device=want.device)
    new = results[kind.lstrip("-")]
    if kind.startswith("-"):
        new = node(aten.neg.default, new)
    new = node(aten.reshape.default, new, list(want.shape))
    if new.meta["val"].dtype != want.dtype:
        new = node(aten._to_copy.default, new, dtype=want.dtype)
    return node(aten.detach.default, new) if non_differentiable else new
