"""The chunked op that computes its gradients in its forward pass.

`graphpass::rowwise_chunked_with_gradients(key, tensors, out_sizes, needs_grad)` runs a registered
program whose one differentiable output is a total over all rows (`OutputSpec.reduction`, see
`graphpass.analysis.summed_loss`). Its forward returns the outputs, the gradient of each input
flagged in `needs_grad` for a total whose gradient is 1 (`RegionProgram.forward_with_gradients`),
and a count of the backward passes that used them. Its backward scales the saved gradients by the
total's gradient `g`, in place (`graphpass::scale_gradients_`), and returns them: no recompute, no
new buffer.

Scaled in place, they may become a `.grad` (autograd takes a returned buffer it alone holds), so
they cannot serve a second backward through a retained graph: that raises, never rescales.
"""

from __future__ import annotations

import torch

from graphpass.ops.chunked_op import program

_SECOND_BACKWARD = ("graphpass: a second backward through a retained graph of a loss whose gradients were "
                    "computed in forward (their buffers are already handed out); compile the loss with "
                    "graphpass.Backend(gradients_in_forward=False) to backpropagate it more than once")


@torch.library.custom_op("graphpass::rowwise_chunked_with_gradients", mutates_args=())
def rowwise_chunked_with_gradients(key: str, tensors: list[torch.Tensor], out_sizes: list[int],
                                   needs_grad: list[bool]) -> list[torch.Tensor]:
    """Outputs, then the flagged inputs' gradients for a total of gradient 1, then how many
    backward passes used them (0, int64, on the CPU)."""
    outs = program(key).forward_with_gradients(tensors, out_sizes, needs_grad)
    return outs + [torch.zeros((), dtype=torch.int64)]


@rowwise_chunked_with_gradients.register_fake
def _(key, tensors, out_sizes, needs_grad):
    return program(key).fake_outputs_with_gradients(tensors, out_sizes, needs_grad) + [
        torch.empty((), dtype=torch.int64)]


@torch.library.custom_op("graphpass::scale_gradients_", mutates_args=("grads", "calls"))
def scale_gradients_(grads: list[torch.Tensor], calls: torch.Tensor, g: torch.Tensor) -> None:
    """Scale `grads` (for a total of gradient 1) by the total's gradient `g`, once."""
    if int(calls) > 0:
        raise RuntimeError(_SECOND_BACKWARD)
    if not (g.device.type == "cpu" and bool(g == 1)):  # skip the no-op multiply where it is free to know
        for grad in grads:
            grad.mul_(g)
    calls += 1


@scale_gradients_.register_fake
def _(grads, calls, g):
    return None


def _setup_context(ctx, inputs, output):
    key, tensors, out_sizes, needs_grad = inputs
    prog = program(key)
    # `needs_grad` is what the graph's grad-flow tags said (`tag_grad_flow_pass`): an input that
    # requires grad but is not flagged receives no gradient from the loss, so None is exact.
    n = len(prog.outputs)
    ctx.total_at = prog.total_position
    ctx.needs_grad = list(needs_grad)
    # The gradient of `out_sizes`: None, but an empty list must come back as one (torch matches
    # the structure, and cannot tell an empty list of ints from one of tensors).
    ctx.sizes_grad = None if out_sizes else []
    ctx.save_for_backward(*output[n:])
    ctx.mark_non_differentiable(*[o for j, o in enumerate(output) if j != ctx.total_at])
    ctx.set_materialize_grads(False)  # no zeros for the outputs that have no gradient


def _backward(ctx, grad_outputs):
    *grads, calls = ctx.saved_tensors
    g = grad_outputs[ctx.total_at]
    if g is None:
        return None, [None] * len(ctx.needs_grad), ctx.sizes_grad, None
    scale_gradients_(grads, calls, g)
    it = iter(grads)
    return None, [next(it) if need else None for need in ctx.needs_grad], ctx.sizes_grad, None


rowwise_chunked_with_gradients.register_autograd(_backward, setup_context=_setup_context)
