"""Move slices of elementwise results onto the elementwise op's inputs.

Before::

    scaled = aten.div.Tensor(logits, 0.7)                 # [B, S, V]: a scaled copy of the logits
    shifted = aten.slice.Tensor(scaled, 1, 0, -1)         # logits[:, :-1] / 0.7, as the loss reads it

After::

    shifted = aten.div.Tensor(aten.slice.Tensor(logits, 1, 0, -1), 0.7)

The same for a row-wise matmul (an lm_head): `linear(hidden, W)[:, :-1]` becomes
`linear(hidden[:, :-1], W)`, so the region reaches the matmul and the op can absorb it.

The slice of an input is a view, so the region that reads `shifted` now reaches the logits
themselves and scales each chunk on the fly: the `[B, S, V]` scaled copy is gone. Values are
unchanged (an elementwise op commutes with slicing). An op moves only when every reader picks
rows (a slice, a chunk loop's `split`, a per-sequence loop's `select`) or reshapes it, so no
reader needs the whole result and nothing is computed twice. A `split` becomes its slices first;
a split into a single piece, that piece being the whole tensor, becomes the tensor.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from graphpass._torch_api import detect_fake_mode, same_shape, same_size
from graphpass.analysis.catalogue import is_deterministic_pointwise, is_row_matmul
from graphpass.analysis.rowlocal import derives_from_reduction
from graphpass.fx_utils import RESHAPES

aten = torch.ops.aten


def sink_row_slices_pass(gm: torch.fx.GraphModule, example_inputs, *, config, record) -> torch.fx.GraphModule:
    """Rewrite `slice(f(a, b), ...)` into `f(slice(a), slice(b))` while `f` is elementwise."""
    # An in-place op on a slice (`logits[:, :-1] /= t`) is captured as the op on the slice and a
    # `slice_scatter` of the result back into the logits; unread, that write-back would count as a
    # reader of the whole logits and keep the slice from moving. The captured graph is functional.
    gm.graph.eliminate_dead_code()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.split.Tensor:
            _split_as_slices(gm.graph, node)
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if (_is_elementwise(node) and node.users and all(_movable(u, node) for u in node.users)
                    and not derives_from_reduction(node)):  # per-token math stays as written
                _sink(gm.graph, node)
                changed = True
            elif is_row_matmul(node) and node.users and all(_picks_rows(u, node) for u in node.users):
                _sink(gm.graph, node, operands=1)  # only the hidden states are read alike
                changed = True
    gm.graph.eliminate_dead_code()
    return gm


#: Readers a slice can move past: they pick rows (a chunk, one sequence of a batch, `[:, :-1]`)
#: or, when every operand has the full shape, only reshape.
_PICKS = {aten.slice.Tensor, aten.select.int}


def _movable(user, source) -> bool:
    if user.op != "call_function" or user.args[0] is not source:
        return False
    if user.target in _PICKS:
        return True
    # A reshape moves only onto contiguous operands, where it stays a view (never a copy).
    shape = source.meta["val"].shape
    return user.target in RESHAPES and all(
        a.meta["val"].ndim == 0 or (same_shape(a.meta["val"].shape, shape) and a.meta["val"].is_contiguous())
        for a in source.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor))


def _sink(graph: torch.fx.Graph, source: torch.fx.Node, operands: int | None = None) -> None:
    """Replace each reader of `source` by `source`'s op applied to its operands read alike (the
    first `operands` of them; the rest as they are)."""
    fake_mode = detect_fake_mode([source.meta["val"]])
    for user in list(source.users):
        with graph.inserting_before(user):
            count = len(source.args) if operands is None else operands
            args = [_read_alike(graph, a, user, source, fake_mode) if i < count else a
                    for i, a in enumerate(source.args)]
            moved = graph.call_function(source.target, tuple(args), dict(source.kwargs))
        moved.meta.update(source.meta)
        moved.meta["val"] = user.meta["val"]
        user.replace_all_uses_with(moved)
        graph.erase_node(user)
    graph.erase_node(source)


def _read_alike(graph, arg, user, source, fake_mode):
    """`arg` read as `user` reads `source` (a slice, select or reshape); broadcast operands kept."""
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.ndim == 0:
        return arg
    rest = list(user.args[1:])
    if user.target in _PICKS:
        out_ndim = source.meta["val"].ndim
        dim = rest[0] % out_ndim - (out_ndim - val.ndim)  # operands align from the right
        if dim < 0:
            return arg
        if same_size(val.shape[dim], 1):
            if user.target is aten.slice.Tensor:
                return arg  # broadcasts over the picked rows as over all of them
            rest = [dim, 0]
        else:
            rest[0] = dim
    new = graph.call_function(user.target, (arg, *rest), dict(user.kwargs))
    with fake_mode:
        new.meta["val"] = user.target(val, *rest, **user.kwargs)
    return new


def _split_as_slices(graph, split) -> None:
    """`split(x, size, dim)[i]` -> `slice(x, dim, i * size, (i + 1) * size)` (static sizes only);
    a split into one piece -> `x` itself (a chunk loop over no more rows than one chunk, as TRL's
    `entropy_from_logits` at 128 tokens or fewer: the piece is the whole tensor, and the region
    then reads the logits as the loss's other readers do)."""
    source, size = split.args[:2]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if not all(u.target is operator.getitem for u in split.users):
        return
    pieces = split.meta.get("val")
    if isinstance(pieces, (list, tuple)) and len(pieces) == 1 and isinstance(source, torch.fx.Node):
        for item in list(split.users):
            item.replace_all_uses_with(source)
            graph.erase_node(item)
        graph.erase_node(split)
        return
    if not isinstance(size, int):
        return
    for item in list(split.users):
        i = item.args[1]
        with graph.inserting_before(item):
            piece = graph.call_function(aten.slice.Tensor, (source, dim, i * size, (i + 1) * size))
        piece.meta.update(item.meta)
        item.replace_all_uses_with(piece)
        graph.erase_node(item)
    graph.erase_node(split)


def _picks_rows(user, source) -> bool:
    """A slice or select of `source` along a dim other than its last (the matmul's columns)."""
    if user.op != "call_function" or user.target not in _PICKS or user.args[0] is not source:
        return False
    ndim = source.meta["val"].ndim
    dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
    # A size-1 dim would be read as a broadcast (not picked) by `_read_alike`: leave it.
    return (isinstance(dim, int) and dim % ndim != ndim - 1 and not user.kwargs
            and not same_size(source.meta["val"].shape[dim], 1))


def _is_elementwise(node) -> bool:
    """A deterministic pointwise op (or cast) whose tensor operands broadcast to its output."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or "val" not in node.meta:
        return False
    target = node.target
    pointwise = is_deterministic_pointwise(target)
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
