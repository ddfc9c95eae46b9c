"""Grad mode at each node, and the typed tag saying whether a node's gradient is ever needed."""

from __future__ import annotations

import torch

from graphpass._torch_api import set_grad_enabled

_GRAD_FLOWS = "graphpass.grad_flows"


def grad_modes(graph: torch.fx.Graph) -> dict:
    """Grad mode in force at each node, following `_set_grad_enabled` calls in graph order."""
    enabled, modes = torch.is_grad_enabled(), {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is set_grad_enabled:
            enabled = bool(node.args[0])
        modes[node] = enabled
    return modes


def set_grad_flows(node: torch.fx.Node, flows: bool) -> None:
    """Tag `node`: True iff it requires grad and a gradient from the graph outputs reaches it."""
    node.meta[_GRAD_FLOWS] = bool(flows)


def grad_flows(node: torch.fx.Node) -> bool | None:
    """The tag set by `passes.tag_grad_flow`, or None where the pass has not run."""
    return node.meta.get(_GRAD_FLOWS)
