"""Tag each node with whether its gradient can reach a differentiable graph output."""

from __future__ import annotations

import torch

from graphpass.analysis.grad_flow import edges_carrying_grad, grad_modes, requires_grad, set_grad_flows

aten = torch.ops.aten

__all__ = ["tag_grad_flow_pass"]


def tag_grad_flow_pass(gm: torch.fx.GraphModule, example_inputs, *, config, record) -> torch.fx.GraphModule:
    """Tag each node (`graphpass.analysis.grad_flow.grad_flows`): True iff it requires grad and a gradient from
    the graph outputs can reach it.

    Blocked by detach, no_grad blocks, non-differentiable ops, and multiplication by a constant
    0 (Dynamo bakes a Python-float coefficient into the graph on first compile).
    """
    modes = grad_modes(gm.graph)
    nodes = list(gm.graph.nodes)
    requires = requires_grad(gm, example_inputs, modes)
    flows = {n: False for n in nodes}
    for out in gm.graph.find_nodes(op="output"):
        for a in out.all_input_nodes:
            flows[a] = requires[a]
    for node in reversed(nodes):
        if flows[node]:
            for a in edges_carrying_grad(node, modes):
                flows[a] = requires.get(a, False)
    for node in nodes:
        set_grad_flows(node, flows[node])
    return gm
