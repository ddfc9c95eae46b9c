"""Move slices of elementwise results onto the elementwise op's inputs.

Before::

    scaled = aten.div.Tensor(logits, 0.7)                 # [B, S, V]: a scaled copy of the logits
    shifted = aten.slice.Tensor(scaled, 1, 0, -1)         # logits[:, :-1] / 0.7, as the loss reads it

After::

    shifted = aten.div.Tensor(aten.slice.Tensor(logits, 1, 0, -1), 0.7)

The slice of an input is a view, so the region that reads `shifted` now reaches the logits
themselves and scales each chunk on the fly: the `[B, S, V]` scaled copy is gone. Values are
unchanged (an elementwise op commutes with slicing). An op moves only when every reader is a
slice, so no reader needs the whole result; a chunk loop's `split` counts as slices.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from graphpass._torch_api import is_aten_overload, same_size
from graphpass.analysis.rowlocal import derives_from_reduction

aten = torch.ops.aten


def sink_row_slices_pass(gm: torch.fx.GraphModule, example_inputs, *, config, record) -> torch.fx.GraphModule:
    """Rewrite `slice(f(a, b), ...)` into `f(slice(a), slice(b))` while `f` is elementwise."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.split.Tensor and _is_elementwise(node.args[0]):
            _split_as_slices(gm.graph, node)
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if (_is_elementwise(node) and node.users and all(_is_slice(u) for u in node.users)
                    and not derives_from_reduction(node)):  # per-token math stays as written
                _sink(gm.graph, node)
                changed = True
    gm.graph.eliminate_dead_code()
    return gm


def _sink(graph: torch.fx.Graph, source: torch.fx.Node) -> None:
    """Replace each slice of `source` by `source`'s op applied to slices of its operands."""
    out_shape = source.meta["val"].shape
    for sliced in list(source.users):
        dim = (sliced.args[1] if len(sliced.args) > 1 else 0) % len(out_shape)
        with graph.inserting_before(sliced):
            args = [_slice_operand(graph, a, sliced, dim, out_shape) for a in source.args]
            moved = graph.call_function(source.target, tuple(args), dict(source.kwargs))
        moved.meta.update(source.meta)
        moved.meta["val"] = sliced.meta["val"]
        sliced.replace_all_uses_with(moved)
        graph.erase_node(sliced)
    graph.erase_node(source)


def _split_as_slices(graph, split) -> None:
    """`split(x, size, dim)[i]` -> `slice(x, dim, i * size, (i + 1) * size)` (static sizes only)."""
    source, size = split.args[:2]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if not isinstance(size, int) or not all(u.target is operator.getitem for u in split.users):
        return
    for item in list(split.users):
        i = item.args[1]
        with graph.inserting_before(item):
            piece = graph.call_function(aten.slice.Tensor, (source, dim, i * size, (i + 1) * size))
        piece.meta.update(item.meta)
        item.replace_all_uses_with(piece)
        graph.erase_node(item)
    graph.erase_node(split)


def _slice_operand(graph, arg, sliced, dim, out_shape):
    """`arg` sliced like the output when it spans the sliced dim; broadcast operands as they are."""
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return arg
    offset = len(out_shape) - val.ndim  # operands align from the right
    if dim < offset or same_size(val.shape[dim - offset], 1):
        return arg
    new = graph.call_function(aten.slice.Tensor, (arg, dim - offset, *sliced.args[2:]), dict(sliced.kwargs))
    fake = val[(slice(None),) * (dim - offset) + (slice(*_bounds(sliced)),)]
    new.meta["val"] = fake
    return new


def _bounds(sliced):
    args = list(sliced.args[2:]) + [None] * (3 - len(sliced.args[2:]))
    start, end, step = args[:3]
    return start, end, 1 if step is None else step


def _is_slice(node) -> bool:
    return node.op == "call_function" and node.target is aten.slice.Tensor


def _is_elementwise(node) -> bool:
    """A deterministic pointwise op (or cast) whose tensor operands broadcast to its output."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or "val" not in node.meta:
        return False
    target = node.target
    pointwise = (is_aten_overload(target) and torch.Tag.pointwise in target.tags
                 and torch.Tag.nondeterministic_seeded not in target.tags)
    cast = target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}
    if not (pointwise or cast) or not isinstance(node.meta["val"], torch.Tensor):
        return False
    shape = node.meta["val"].shape
    for a in node.all_input_nodes:
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor):
            if isinstance(val, (torch.SymInt, torch.SymFloat, int, float)):
                continue
            return False
        if val.ndim > len(shape) or not all(
                same_size(s, o) or same_size(s, 1) for s, o in zip(reversed(val.shape), reversed(shape))):
            return False
    return True
