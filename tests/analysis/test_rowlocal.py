"""Unit tests of `graphpass.analysis.rowlocal`: the canonical per-chunk emission of a region's ops."""

from __future__ import annotations

import torch
from graphpass.analysis import rowlocal
from graphpass.capture import capture as capture_graph
from graphpass.analysis.regions import find_regions


def _only_region(fn, *args, dynamic=False):
    """The one row-local region of the pre-dispatch ATen graph of `fn(*args)`."""
    captured = []

    def backend(gm, example_inputs):
        captured.append(capture_graph(gm, example_inputs).gm)
        return gm.forward

    torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)(*args)
    regions, rejected = find_regions(captured[-1])
    assert len(regions) == 1, rejected
    return regions[0]


def _run_per_chunk(region, tensor_args, size):
    """Emit the region's per-chunk program and run it: tensor inputs in order, `size` for sizes."""
    graph = torch.fx.Graph()
    env = {n: graph.placeholder(n.name) for n in region.inputs}
    for n in region.nodes:
        env[n] = rowlocal.emit(graph, n, env, region.layouts)
    graph.output(tuple(env[o] for o in region.outputs))
    tensors = iter(tensor_args)
    args = [next(tensors) if isinstance(n.meta["val"], torch.Tensor) else size for n in region.inputs]
    return torch.fx.GraphModule(torch.nn.Module(), graph)(*args)


def test_expand_to_a_symbolic_width():
    """A [r, 1] value expanded to a symbolic vocabulary comes out [r, V], not [r, 1]."""

    def fn(x):
        e = torch.logsumexp(x, -1, keepdim=True).expand(-1, x.shape[-1])
        return (e * x.softmax(-1)).sum(-1), e.sum(-1)

    x = torch.randn(5, 7)
    region = _only_region(fn, x, dynamic=True)
    widths = [lay.width for lay in region.layouts.values() if lay is not None]
    assert any(isinstance(w, torch.SymInt) for w in widths), "expected a symbolic vocabulary"
    chunk = x[:3]
    outs = _run_per_chunk(region, [chunk], chunk.shape[-1])
    for out, ref in zip(outs, fn(chunk)):
        torch.testing.assert_close(out.reshape(ref.shape), ref)
