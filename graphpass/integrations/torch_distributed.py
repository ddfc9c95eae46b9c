"""torch.distributed's list-form `reduce_scatter` as Dynamo can trace it.

Dynamo traces most of `torch.distributed`'s collectives by remapping them to functional
collectives (`all_reduce`, `all_gather` into a list, `reduce_scatter_tensor`, ...), but not
`reduce_scatter(output, input_list)`: it traces into c10d's Python and breaks the graph. A
hand-written `autograd.Function` whose backward reduce-scatters a list (NeMo-RL's
`ChunkedDistributedHiddenStatesToLogprobs` under sequence parallelism) then cannot be traced at
all: Dynamo runs the whole Function outside the graph, where graphpass cannot read it.

torch 2.14 traces it itself (for any reduce op), and there nothing is registered. On 2.11-2.13
`register()` gives Dynamo a stand-in with the same effect: the list concatenated along dim 0,
reduce-scattered as one functional collective, the result copied into `output`. It covers a
synchronous SUM over blocks of `output`'s shape (what a Function's backward issues); anything else
(`async_op=True`, another op, uneven blocks) breaks the graph with the reason, and Dynamo runs
c10d's own function as it did before. Eager calls are untouched. Registered when graphpass is
imported (`graphpass.integrations.register_available`), process-wide like every Dynamo polyfill.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from graphpass import _torch_api

log = logging.getLogger("graphpass")

_registered: list = []  # the function registered for, once registered (`registered()`)


def registered() -> bool:
    """Whether Dynamo traces graphpass's stand-in (not torch's own remap) for the list-form reduce-scatter."""
    return bool(_registered)


def register() -> bool:
    """Register the stand-in with Dynamo (idempotent); False where torch has no distributed package
    or traces the list-form reduce-scatter itself."""
    if _registered:
        return True
    if not dist.is_available() or _torch_api.traces_list_reduce_scatter():
        return False
    try:
        # Arguments taken as *args: torch 2.11's Dynamo cannot hold the default `op` (a ReduceOp
        # member) as a constant; a wildcard signature is the one substitute_in_graph also accepts.
        @torch.compiler.substitute_in_graph(dist.reduce_scatter)
        def reduce_scatter(*args, **kwargs):
            bound = dict(zip(("output", "input_list", "op", "group", "async_op"), args), **kwargs)
            output, input_list, group = bound["output"], bound["input_list"], bound.get("group")
            op = bound.get("op")
            if bound.get("async_op") or (op is not None and op != dist.ReduceOp.SUM) or \
                    any(t.shape != output.shape for t in input_list):
                _torch_api.graph_break("graphpass traces torch.distributed.reduce_scatter only as a synchronous "
                                       "SUM of blocks of the output's shape")
            whole = torch.cat([t.to(output.dtype) for t in input_list])
            _torch_api.functional_reduce_scatter_into(output, whole, group)
    except ValueError as error:  # another polyfill for the same function (torch refuses a second)
        log.warning("graphpass: torch.distributed.reduce_scatter keeps its graph break: %s", error)
        return False
    _registered.append(dist.reduce_scatter)
    return True
