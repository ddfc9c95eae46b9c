"""Triton kernels graphpass generates for the row-local per-chunk programs it extracts (issue 45).

`rowwise.GeneratedKernel(graph, kind)` turns a `JointSplit`'s forward or backward graph into one
Triton kernel with the graph's calling convention, or raises `NotGenerated` with the reason. The
ops ask `unavailable` first: generated kernels run only on CUDA tensors, with Triton importable and
`Config.generated_kernels` on; anywhere else, and for any graph the generator does not express,
the inner compiler's kernel runs as before.
"""

from __future__ import annotations

import importlib.util

import torch

from graphpass.kernels import rowwise  # noqa: F401  (`kernels.rowwise.GeneratedKernel`)
from graphpass.kernels.emit import NotGenerated

__all__ = ["NotGenerated", "generate", "unavailable"]


def unavailable(device: torch.device, enabled: bool) -> str | None:
    """Why generated kernels do not run on `device` (None: they do)."""
    if not enabled:
        return "turned off (Config.generated_kernels=False)"
    if torch.device(device).type != "cuda":
        return f"the device is {torch.device(device).type}, not CUDA"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def generate(graph: torch.fx.GraphModule, kind: str):
    """The generated kernel of a per-chunk `graph` of this `kind` ("forward" or "backward");
    NotGenerated says why there is none."""
    return rowwise.GeneratedKernel(graph, kind)
