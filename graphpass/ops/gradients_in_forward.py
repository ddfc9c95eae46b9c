"""The chunked op that computes its gradients in its forward pass.

`graphpass::rowwise_chunked_with_gradients(key, tensors, out_sizes, needs_grad, seeds)` runs a
registered program whose differentiable outputs are totals over all rows (`OutputSpec.reduction`),
summed into the loss with coefficients known before it runs, `seeds` (see
`graphpass.analysis.summed_loss`). Its forward returns the outputs (the totals carry no gradient),
a -0.0 the graph adds to the loss (the "carrier"), the gradient of each input flagged in
`needs_grad` for a loss gradient of 1 (`RegionProgram.forward_with_gradients`), and a count of the
backward passes that used them. Its backward scales the saved gradients by the carrier's gradient
`g`, the loss's, in place (`graphpass::scale_gradients_`; skipped when `g` is exactly 1, as after
`loss.backward()`), and returns them: no recompute, no new buffer.

Scaled in place, they may become a `.grad` (autograd takes a returned buffer it alone holds), so
they cannot serve a second backward through a retained graph: that raises, never rescales.
"""

from __future__ import annotations

import torch

from graphpass.ops import devices
from graphpass.ops.chunked_op import program

_SECOND_BACKWARD = ("graphpass: a second backward through a retained graph of a loss whose gradients were "
                    "computed in forward (their buffers are already handed out); compile the loss with "
                    "graphpass.Backend(gradients_in_forward=False) to backpropagate it more than once")


@torch.library.custom_op("graphpass::rowwise_chunked_with_gradients", mutates_args=(),
                        tags=devices.NOT_CUDAGRAPH_CAPTURABLE)
def rowwise_chunked_with_gradients(key: str, tensors: list[torch.Tensor], out_sizes: list[int],
                                   needs_grad: list[bool], seeds: list[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs, the carrier, the flagged inputs' gradients for the totals' gradients `seeds`, then
    how many backward passes used them (0, int64, on the CPU)."""
    outs = program(key, tensors).forward_with_gradients(tensors, out_sizes, needs_grad, seeds)
    return outs + [torch.zeros((), dtype=torch.int64)]


@rowwise_chunked_with_gradients.register_fake
def _(key, tensors, out_sizes, needs_grad, seeds):
    return program(key).fake_outputs_with_gradients(tensors, out_sizes, needs_grad, seeds) + [
        torch.empty((), dtype=torch.int64)]


@torch.library.custom_op("graphpass::scale_gradients_", mutates_args=("grads", "calls"),
                        tags=devices.NOT_CUDAGRAPH_CAPTURABLE)
def scale_gradients_(grads: list[torch.Tensor], calls: torch.Tensor, g: torch.Tensor) -> None:
    """Scale `grads` (for a loss of gradient 1) by the loss's gradient `g`, once."""
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
    key, tensors, out_sizes, needs_grad, seeds = inputs
    # `needs_grad` is what the graph's grad-flow tags said (`tag_grad_flow_pass`): an input that
    # requires grad but is not flagged receives no gradient from the loss, so None is exact.
    ctx.carrier_at = len(program(key).outputs)
    ctx.needs_grad = list(needs_grad)
    # The gradient of `out_sizes`: None, but an empty list must come back as one (torch matches
    # the structure, and cannot tell an empty list of ints from one of tensors).
    ctx.sizes_grad = None if out_sizes else []
    ctx.seeds_grad = [None] * len(seeds)  # the carrier's value does not depend on them
    ctx.save_for_backward(*output[ctx.carrier_at + 1:])
    ctx.mark_non_differentiable(*[o for j, o in enumerate(output) if j != ctx.carrier_at])
    ctx.set_materialize_grads(False)  # no zeros for the outputs that have no gradient


def _backward(ctx, grad_outputs):
    *grads, calls = ctx.saved_tensors
    g = grad_outputs[ctx.carrier_at]
    if g is None:
        return None, [None] * len(ctx.needs_grad), ctx.sizes_grad, None, ctx.seeds_grad
    scale_gradients_(grads, calls, g)
    it = iter(grads)
    return None, [next(it) if need else None for need in ctx.needs_grad], ctx.sizes_grad, None, ctx.seeds_grad


rowwise_chunked_with_gradients.register_autograd(_backward, setup_context=_setup_context)
