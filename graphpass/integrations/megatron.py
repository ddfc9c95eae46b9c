"""megatron-core's tensor-parallel linear layer as Dynamo can trace it.

`ColumnParallelLinear` (the GPT output layer) multiplies through
`LinearWithGradAccumulationAndAsyncCommunication`, an `autograd.Function` whose backward
all-reduces the input's gradient with `async_op=True` (or reduce-scatters it under sequence
parallelism), which Dynamo cannot trace: the graph breaks inside the layer, the loss graph
receives the `[s, b, v/tp]` logits as an input, and graphpass cannot compute them chunk by chunk.

`register()` gives Dynamo a stand-in for the two functions the layer calls,
`linear_with_grad_accumulation_and_async_allreduce` and `linear_with_frozen_weight`: the same
`torch.matmul(input, weight.t()) (+ bias)` as their Functions' forwards, with the communication
on the input alone (`_LinearInput`): under sequence parallelism the all-gather of the input's
rows first and a reduce-scatter of its gradient, otherwise the input as it is and its gradient
all-reduced over the tensor-parallel group, both as functional collectives. The layer then
traces whole, and the vocab-parallel op takes in its matmul
(`graphpass::vocab_parallel_lm_head_logprob_entropy`).

Why this mechanism. `torch.compiler.substitute_in_graph` registers a polyfill that Dynamo traces
in place of the original function whenever traced code calls it, and only then: eager calls run
megatron-core's own code, untouched (no monkeypatching), and a call Dynamo cannot trace still
falls back to the original. The alternatives do not reach the matmul or need the user:
`allow_in_graph` of a custom op would put the whole linear layer into one opaque node (the lm_head
fusion must see `hidden @ W.T`); a `TorchFunctionMode` is not consulted by
`autograd.Function.apply` and would have to be entered by the user; replacing megatron-core's
module attributes would change eager behaviour. The registration is process-wide: after it, every
`torch.compile` backend traces the stand-in (the same values and gradients as megatron-core's
Function). graphpass registers it when megatron-core is imported (`graphpass.integrations`).

What it does not stand in for falls back to megatron-core's Function with a graph break that says
why: `gradient_accumulation_fusion` (the weight's gradient accumulated into `weight.main_grad`) and
a deferred weight gradient (`grad_output_buffer`).

The collectives depend only on the configuration, never on which inputs require grad: the
stand-in's backward runs whenever any of input, weight and bias requires grad, as megatron-core's
Function's does, and always issues its one collective.
"""

from __future__ import annotations

import inspect
import logging

import torch

from graphpass import _torch_api
from graphpass.integrations import register_now

log = logging.getLogger("graphpass")

#: The module whose functions the stand-ins replace in traced code.
MODULE = "megatron.core.tensor_parallel.layers"

_registered: list = []  # the module registered for, once registered


class _LinearInput(torch.autograd.Function):
    """The linear layer's input as its matmul reads it: all-gathered over the group's ranks along
    the first dim under sequence parallelism, else as it is. Backward: its gradient
    reduce-scattered, else all-reduced, over the group. `weight` and `bias` are inputs only so
    that the backward runs whenever the layer's does (megatron-core's Function takes all three)."""

    @staticmethod
    def forward(ctx, input, weight, bias, group_name: str, sequence_parallel: bool):
        ctx.group_name, ctx.sequence_parallel = group_name, sequence_parallel
        if sequence_parallel:
            return _torch_api.functional_all_gather(input.contiguous(), group_name)
        return input.view_as(input)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sequence_parallel:
            grad = _torch_api.functional_reduce_scatter(grad.contiguous(), ctx.group_name)
        else:
            grad = _torch_api.functional_all_reduce(grad, ctx.group_name)
        return grad, None, None, None, None


def _linear(input, weight, bias, allreduce_dgrad: bool, sequence_parallel: bool, tp_group, bias_grad: bool = True):
    """`input @ weight.T (+ bias)` with the communication of megatron-core's linear Functions;
    `bias_grad=False`: the bias gets no gradient (its frozen-weight Function gives it none)."""
    if sequence_parallel or allreduce_dgrad:
        input = _LinearInput.apply(input, weight, bias, tp_group.group_name, sequence_parallel)
    output = torch.matmul(input, weight.t())
    if bias is not None:
        output = output + (bias if bias_grad else bias.detach())
    return output


def _binder(function):
    """A function of (args, kwargs) giving `function`'s arguments by name, defaults filled in
    (a plain dict: Dynamo traces it where it would not trace `inspect`)."""
    parameters = inspect.signature(function).parameters
    names = list(parameters)
    defaults = {n: p.default for n, p in parameters.items() if p.default is not inspect.Parameter.empty}

    def bind(args, kwargs):
        bound = dict(defaults)
        bound.update(zip(names, args))
        bound.update(kwargs)
        return bound

    return bind


def _unsupported(gradient_accumulation_fusion, grad_output_buffer, allreduce_dgrad, sequence_parallel,
                 gtp_remat_size=1) -> str | None:
    """Why the stand-in cannot compute what megatron-core's Function does, or None."""
    if gradient_accumulation_fusion:
        return "gradient_accumulation_fusion=True (the weight's gradient goes into weight.main_grad)"
    if grad_output_buffer is not None:
        return "a deferred weight gradient (grad_output_buffer)"
    if gtp_remat_size != 1:
        return f"gtp_remat_size={gtp_remat_size} (a GTP-sharded weight, all-gathered before its matmul)"
    if allreduce_dgrad and sequence_parallel:
        return "allreduce_dgrad and sequence_parallel together (megatron-core refuses them in backward)"
    return None


def _break_for(why: str) -> None:
    """A graph break naming why: Dynamo then runs megatron-core's own function, untraced."""
    _torch_api.graph_break(f"graphpass has no traceable stand-in for megatron-core's linear layer with {why}")


def register() -> bool:
    """Register the stand-ins with Dynamo (idempotent); False when megatron-core is not importable.

    Imports megatron-core's tensor-parallel layers if they are not imported yet."""
    return register_now(MODULE, register_for)


def register_for(layers) -> bool:
    """`register()` given megatron-core's imported `tensor_parallel.layers` module."""
    if _registered:
        return True
    group_if_none = layers.get_tensor_model_parallel_group_if_none
    trainable, frozen = layers.linear_with_grad_accumulation_and_async_allreduce, layers.linear_with_frozen_weight
    # The stand-ins take *args and bind them by the installed megatron-core's own signature:
    # releases differ (0.19 drops async_grad_allreduce and adds gtp_remat_size).
    bind_trainable, bind_frozen = _binder(trainable), _binder(frozen)
    try:
        @torch.compiler.substitute_in_graph(trainable)
        def linear_with_grad_accumulation_and_async_allreduce(*args, **kwargs):
            a = bind_trainable(args, kwargs)
            why = _unsupported(a["gradient_accumulation_fusion"], a.get("grad_output_buffer"), a["allreduce_dgrad"],
                               a["sequence_parallel"], a.get("gtp_remat_size", 1))
            if why is not None:
                _break_for(why)
            return _linear(a["input"], a["weight"], a["bias"], a["allreduce_dgrad"], a["sequence_parallel"],
                           group_if_none(a.get("tp_group")))

        @torch.compiler.substitute_in_graph(frozen)
        def linear_with_frozen_weight(*args, **kwargs):
            a = bind_frozen(args, kwargs)
            why = _unsupported(False, a.get("grad_output_buffer"), a["allreduce_dgrad"], a["sequence_parallel"],
                               a.get("gtp_remat_size", 1))
            if why is not None:
                _break_for(why)
            return _linear(a["input"], a["weight"], a["bias"], a["allreduce_dgrad"], a["sequence_parallel"],
                           group_if_none(a.get("tp_group")), bias_grad=False)
    except ValueError as error:  # another polyfill for the same function (torch refuses a second)
        log.warning("graphpass: megatron-core's linear layer keeps its graph break: %s", error)
        return False
    _registered.append(layers)
    return True
