"""torch.distributed's list-form `reduce_scatter` traced by Dynamo (`graphpass.integrations.torch_distributed`).

On 2 gloo ranks: a synchronous SUM of equal blocks compiles without a graph break (fullgraph)
and gives eager's values; eager calls run torch's own function (they are logged as
`reduce_scatter`). Where graphpass's stand-in runs (torch 2.11-2.13), another op (MAX) breaks the
graph (fullgraph raises) and still gives eager's values; from torch 2.14 on, torch traces the list
form itself, for any op, and no stand-in is registered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import graphpass  # noqa: F401 - registers the stand-in
from bench.harness.ranks import collectives
from graphpass import _torch_api
from graphpass.integrations import torch_distributed
from tests import spawned


def _scatter(blocks):
    out = torch.empty_like(blocks[0])
    dist.reduce_scatter(out, list(blocks))
    return out * 2


def _max(blocks):
    out = torch.empty_like(blocks[0])
    dist.reduce_scatter(out, list(blocks), op=dist.ReduceOp.MAX)
    return out


def _ranks(rank, world):
    x = torch.arange(12, dtype=torch.float32).reshape(world, 6) + 10 * rank
    eager = _scatter(x.unbind())
    torch._dynamo.reset()
    with collectives() as compiled_log:
        compiled = torch.compile(_scatter, backend="aot_eager", fullgraph=True)(x.unbind())
    try:
        torch._dynamo.reset()
        torch.compile(_max, backend="aot_eager", fullgraph=True)(x.unbind())
        max_broke = False
    except Exception:  # noqa: BLE001 - a graph break under fullgraph
        max_broke = True
    torch._dynamo.reset()
    maximum = torch.compile(_max, backend="aot_eager")(x.unbind())
    with collectives() as eager_log:
        _scatter(x.unbind())
    return dict(stand_in=torch_distributed.registered(), torch_traces=_torch_api.traces_list_reduce_scatter(),
                same=torch.equal(compiled, eager), max_broke=max_broke, max_same=torch.equal(maximum, _max(x.unbind())),
                compiled_log=[c[0] for c in compiled_log], eager_log=[c[0] for c in eager_log])


_SPAWN = spawned.once(_ranks, 2, 120)


def test_the_stand_in_is_registered_only_where_torch_does_not_trace_it():
    for rank, r in enumerate(_SPAWN()):
        assert r["stand_in"] != r["torch_traces"], (rank, r)
    assert torch_distributed.registered() == (not _torch_api.traces_list_reduce_scatter())


def test_list_reduce_scatter_compiles_whole_with_eager_values():
    for rank, r in enumerate(_SPAWN()):
        assert r["same"], (rank, r)
        assert r["compiled_log"] == [] and r["eager_log"] == ["reduce_scatter"], (rank, r)


def test_another_op_runs_as_torch_does_and_breaks_the_graph_where_the_stand_in_runs():
    for rank, r in enumerate(_SPAWN()):
        assert r["max_same"] and r["max_broke"] == r["stand_in"], (rank, r)
