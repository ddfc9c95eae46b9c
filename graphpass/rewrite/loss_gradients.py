"""The gradient plumbing of an op that computes its inputs' gradients in forward for a loss affine
in sums of per-token terms (`graphpass.analysis.summed_loss`): the coefficient of each sum in the
loss, and the carrier that takes the loss's gradient back to the op. The one-device chunked op and
the vocab-parallel lm_head op both use them."""

from __future__ import annotations

import torch

from graphpass._torch_api import fake_node
from graphpass.analysis.summed_loss import SummedLoss

aten = torch.ops.aten

__all__ = ["add_gradient_carrier", "loss_coefficients"]


def loss_coefficients(graph, loss: SummedLoss, fake_mode, replaced) -> list:
    """Nodes computing each total's coefficient in the sink, d sink / d total, by reverse mode over
    the affine steps from the factors outside the region (the op's seeds: what autograd would
    send each total for a sink gradient of 1)."""
    sink = loss.sink.meta["val"]
    adjoint = {loss.sink: fake_node(graph, fake_mode, aten.scalar_tensor.default, (1.0,),
                                    dict(dtype=sink.dtype, device=sink.device))}
    for node, operand, step in reversed(loss.affine):
        if node not in adjoint:
            continue
        g = adjoint[node]
        if step[0] == "neg":
            g = fake_node(graph, fake_mode, aten.neg.default, (g,))
        elif step[0] in ("mul", "div"):
            factor = replaced.get(step[1], step[1]) if isinstance(step[1], torch.fx.Node) else step[1]
            g = fake_node(graph, fake_mode, aten.mul.Tensor if step[0] == "mul" else aten.div.Tensor, (g, factor))
        dtype = operand.meta["val"].dtype  # "one" and "cast": the same gradient, in the operand's dtype
        if g.meta["val"].dtype != dtype:
            g = fake_node(graph, fake_mode, aten._to_copy.default, (g,), dict(dtype=dtype))
        adjoint[operand] = g if operand not in adjoint else fake_node(graph, fake_mode, aten.add.Tensor,
                                                                      (adjoint[operand], g))
    return [adjoint[t] for t in loss.totals]


def add_gradient_carrier(graph, sink, carrier, fake_mode) -> None:
    """`sink + carrier` in place of `sink` for every reader: the carrier is the op's -0.0 (the sum
    is `sink` exactly, whatever its value) whose gradient, the sink's, scales the op's gradients."""
    with graph.inserting_after(sink):
        if carrier.meta["val"].dtype != sink.meta["val"].dtype:  # the first total's dtype
            carrier = fake_node(graph, fake_mode, aten._to_copy.default, (carrier,), dict(dtype=sink.meta["val"].dtype))
        total = fake_node(graph, fake_mode, aten.add.Tensor, (sink, carrier), like=sink)
    sink.replace_all_uses_with(total, delete_user_cb=lambda u: u is not total)
