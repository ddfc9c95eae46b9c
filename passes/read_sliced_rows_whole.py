"""Compute a target's log-prob over every row where the code reads it over a row slice of
log-probs that other code reads over all rows.

Before (a preference loss: the NLL of the chosen half, the log-probs of both halves)::

    lp = log_softmax(h @ W.T)                                # [2B, S, V]
    nll = nll_loss_nd(lp[:B].view(-1, V), t[:B].view(-1), reduction=none)
    per_token = lp.gather(-1, t[..., None])                  # all rows

After::

    t_slice = slice_scatter(full_like(t, ignore_index), t[:B], 0, 0, B)   # other rows ignored
    nll = nll_loss_nd(lp.view(-1, V), t_slice.view(-1), reduction=none).view(2B, S)[:B].view(-1)

Values and gradients are unchanged: the slice's rows read what they read, and the other rows
read an index that contributes nothing (the ignore index of an NLL or a cross-entropy; index 0
of a gather, whose value is then sliced away, its gradient zero). The log-probs are then read
over all rows alone, so they are one region and its lm_head can be fused; the `[2B, S, V]`
log-probs are never built. A reader moves only when its index is the same row slice of an index
tensor over all rows, so every row it now reads has an index of the code's own.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from graphpass._torch_api import detect_fake_mode, fake_node, known_equal, same_shape
from graphpass.analysis.rowlocal import clamp_index, slice_span

aten = torch.ops.aten

__all__ = ["read_sliced_rows_whole_pass"]

#: Readers of a target's log-prob per row, a reduction-free NLL or cross-entropy: (the position of
#: their ignore index, its default), the index the other rows get (a gather's other rows get 0).
_NLL = {aten.nll_loss_nd.default: (4, -100), aten.cross_entropy_loss.default: (4, -100)}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
          aten.flatten.using_ints}


def read_sliced_rows_whole_pass(gm: torch.fx.GraphModule, example_inputs, *, config,
                                record) -> torch.fx.GraphModule:
    """Each per-row reader of a row slice of values also read over all rows -> the reader over all
    rows, its result sliced."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and (node.target in _NLL or node.target is aten.gather.default):
            changed |= _read_whole(gm.graph, node)
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _behind_views(node):
    """`node` behind the reshapes applied to it."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def _row_slice(node, rows_of):
    """(source, dim, start, stop) if `node` is `source[start:stop]` along a row dim (not the last
    of `rows_of`'s rank), step 1 and constant bounds; else None."""
    if not (isinstance(node, torch.fx.Node) and node.target is aten.slice.Tensor):
        return None
    dim, start, stop, step = slice_span(node)
    source = node.args[0]
    val = source.meta.get("val")
    if step != 1 or not isinstance(val, torch.Tensor) or not all(isinstance(v, (int, type(None))) for v in (start, stop)):
        return None
    dim %= val.ndim
    if dim >= rows_of or not isinstance(val.shape[dim], int):
        return None
    size = val.shape[dim]
    start, stop = clamp_index(start or 0, size), clamp_index(stop, size)
    return source, dim, start, stop



def _read_whole(graph, reader) -> bool:
    if reader.target in _NLL:
        position, fill = _NLL[reader.target]
        weight = reader.args[2] if len(reader.args) > 2 else None
        reduction = reader.args[3] if len(reader.args) > 3 else 1  # the schema's default: a mean
        if weight is not None or reduction != 0 or reader.kwargs:
            return False  # a class weight or a reduction: not one value per row
        fill = reader.args[position] if len(reader.args) > position else fill
        values, index, vocab_dim = reader.args[0], reader.args[1], 1
    else:
        values, vocab_dim, index = reader.args[:3]
        fill = 0
    wide = values.meta["val"]
    if wide.ndim < 2 or vocab_dim % wide.ndim != wide.ndim - 1:
        return False  # a gather or a loss whose classes are not the last dim
    first = _behind_views(values)
    sliced = _row_slice(first, first.meta["val"].ndim - 1) if isinstance(first, torch.fx.Node) else None
    if sliced is None:
        return False
    source, dim, start, stop = sliced
    rows = tuple(source.meta["val"].shape[:-1])
    if all(u is first for u in source.users):
        return False  # nothing else reads the source: its region may as well be the slice's
    picked = _row_slice(_behind_views(index), len(rows))
    if picked is None or picked[1:] != (dim, start, stop):
        return False
    whole_index = picked[0]
    index_val = whole_index.meta["val"]
    if tuple(index_val.shape[:len(rows)]) != rows or index_val.is_floating_point() or \
            index_val.ndim not in (len(rows), len(rows) + 1) or (index_val.ndim > len(rows) and index_val.shape[-1] != 1):
        return False
    if not _the_slice_rows_in_order(wide, source.meta["val"], dim, start, stop):
        return False
    fake_mode = detect_fake_mode([wide, index_val])
    with graph.inserting_before(reader):
        kept = _slice_like(graph, fake_mode, whole_index, dim, start, stop, reader)
        filled = fake_node(graph, fake_mode, aten.full_like.default, (whole_index, fill), {}, reader)
        index_all = fake_node(graph, fake_mode, aten.slice_scatter.default, (filled, kept, dim, start, stop), {}, reader)
        flat_values = fake_node(graph, fake_mode, aten.reshape.default, (source, [-1, wide.shape[-1]]), {}, reader) \
            if reader.target in _NLL else source
        if reader.target in _NLL:
            flat_index = fake_node(graph, fake_mode, aten.reshape.default, (index_all, [-1]), {}, reader)
        else:
            flat_index = index_all if index_val.ndim == len(rows) + 1 else \
                fake_node(graph, fake_mode, aten.unsqueeze.default, (index_all, -1), {}, reader)
        args = list(reader.args)
        args[0], args[1 if reader.target in _NLL else 2] = flat_values, flat_index
        whole = fake_node(graph, fake_mode, reader.target, tuple(args), {}, reader)
        per_row = fake_node(graph, fake_mode, aten.reshape.default,
                            (whole, list(rows) + ([1] if reader.target is aten.gather.default else [])), {}, reader)
        rows_read = _slice_like(graph, fake_mode, per_row, dim, start, stop, reader)
        out = fake_node(graph, fake_mode, aten.reshape.default, (rows_read, list(reader.meta["val"].shape)), {}, reader)
    if not same_shape(out.meta["val"].shape, reader.meta["val"].shape) or out.meta["val"].dtype != reader.meta["val"].dtype:
        return False  # (the new nodes are dead and go with the clean-up)
    reader.replace_all_uses_with(out)
    graph.erase_node(reader)
    return True


def _slice_like(graph, fake_mode, node, dim, start, stop, like):
    return fake_node(graph, fake_mode, aten.slice.Tensor, (node, dim, start, stop), {}, like)


def _the_slice_rows_in_order(wide, source, dim, start, stop) -> bool:
    """Whether the reader's values `wide` can be the rows `start:stop` (along `dim`) of `source`
    reshaped: the same vocabulary last and as many rows (a reshape keeps row-major order)."""
    rows = list(source.shape[:-1])
    rows[dim] = stop - start
    return known_equal(math.prod(wide.shape[:-1]), math.prod(rows)) and known_equal(wide.shape[-1], source.shape[-1])
