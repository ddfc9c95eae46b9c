"""Rewrites of per-chunk kernel graphs that keep each kernel one fused pass over the vocabulary.

- gather through elementwise ops: `gather(f(a, b), -1, idx)` with `f` elementwise and `b` row-
  broadcast becomes `f(gather(a, -1, idx), b)`, so the picked value is computed from the input at
  the picked column instead of being read from a materialised `[rows, V]` intermediate::

      gather(sub(div(x, t), lse), -1, idx)  ->  sub(div(gather(x, -1, idx), t), lse)

- gather's backward as a select: `scatter_add(zeros[rows, V], -1, idx[rows, 1], g[rows, 1])`
  (or `scatter` of a `[rows, 1]` value or a scalar, as `nll_loss_backward` decomposes) becomes
  `where(arange(V) == idx, g, 0)`, a pointwise op that fuses with the rest of the gradient
  instead of a zero-filled buffer and a scatter.

- a row sum of that select (log_softmax's backward sums its incoming gradient) is the select's
  value at the one column it picks: `sum(where(arange(V) == idx, g, 0), -1)` becomes
  `where((0 <= idx) & (idx < V), g, 0)`, instead of a loop over the vocabulary per row. So is a
  row sum of selects and row constants added together (label smoothing's gradient,
  `-eps/V * g + (1 - eps) * onehot`): each constant counts `V` times, `c * V`. Besides a pass, this
  saves digits: such a summand reads no `[rows, V]` tensor, so inductor's CPU kernel vectorizes it
  over rows and adds the V values one after another (the smoothed cross-entropy's gradient came out
  16 x further from float64 than eager's, whose sum is pairwise).
"""

from __future__ import annotations

import torch
import torch.fx

from graphpass._torch_api import same_shape
from graphpass.analysis.catalogue import is_deterministic_pointwise

aten = torch.ops.aten


def optimize(graph: torch.fx.Graph) -> None:
    """Apply both rewrites in place; nodes they make unused are removed."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.gather.default:
            _push_gather(graph, node)
        elif node.target in (aten.scatter_add.default, aten.scatter.value, aten.scatter.src):
            _scatter_as_select(graph, node)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.sum.dim_IntList:
            _sum_of_select(graph, node)
    graph.eliminate_dead_code()


# ---- gather through elementwise ops ---------------------------------------------------------------
def _push_gather(graph, gather) -> None:
    src, dim, index = gather.args[:3]
    if gather.kwargs.get("sparse_grad") or not _is_last_dim(dim, src) or not _is_elementwise(src):
        return
    # gather allows an index with fewer rows than its source; pushed down, that would broadcast.
    index_val = index.meta.get("val") if isinstance(index, torch.fx.Node) else None
    if index_val is None or not same_shape(index_val.shape[:-1], src.meta["val"].shape[:-1]):
        return
    with graph.inserting_before(gather):
        gather.replace_all_uses_with(_gathered(graph, src, dim, index))


def _gathered(graph, src, dim, index):
    """A node equal to gather(src, dim, index), pushed as far towards the inputs as it goes."""
    if not _is_elementwise(src):
        return graph.call_function(aten.gather.default, (src, dim, index))
    shape = src.meta["val"].shape

    def picked(arg):
        if isinstance(arg, torch.fx.Node) and same_shape(arg.meta["val"].shape, shape):
            return _gathered(graph, arg, dim, index)
        return arg

    return graph.call_function(src.target, tuple(picked(a) for a in src.args), dict(src.kwargs))


def _is_elementwise(node) -> bool:
    """Elementwise in its tensor arguments, each either full-shape or constant along the last dim."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target = node.target
    pointwise = is_deterministic_pointwise(target)  # a random op must not move
    cast = target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}
    if not (pointwise or cast) or "val" not in node.meta:
        return False
    shape = node.meta["val"].shape
    for arg in node.args:
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if isinstance(arg, torch.fx.Node) and not isinstance(val, torch.Tensor):
            return False
        if val is None or val.ndim == 0 or same_shape(val.shape, shape):
            continue
        if not (val.ndim == len(shape) and val.shape[-1] == 1):
            return False
    return True


# ---- gather's backward as a select ------------------------------------------------------------------
def _scatter_as_select(graph, scatter) -> None:
    base, dim, index, src = scatter.args[:4]
    if not _is_zeros(base):
        return
    size, index_val = base.meta["val"].shape, index.meta.get("val")
    if not (_is_last_dim(dim, base) and index_val is not None and index_val.shape[-1] == 1
            and same_shape(index_val.shape[:-1], size[:-1]) and isinstance(size[-1], int)):
        return
    if scatter.kwargs or len(scatter.args) > 4:
        return  # `reduce=`: not a plain write
    scalar = scatter.target is aten.scatter.value
    src_val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    if not scalar and (src_val is None or not same_shape(src_val.shape, index_val.shape)):
        return  # a src wider than the index: only its first column is written, not `src[r, idx]`
    with graph.inserting_before(scatter):
        columns = graph.call_function(aten.arange.default, (size[-1],),
                                      {"dtype": index_val.dtype, "device": index_val.device})
        hit = graph.call_function(aten.eq.Tensor, (columns, index))
        if scalar:  # a 0-d tensor of the base's dtype: the select keeps it
            base_val = base.meta["val"]
            src = graph.call_function(aten.scalar_tensor.default, (src,),
                                      {"dtype": base_val.dtype, "device": base_val.device})
        select = graph.call_function(aten.where.ScalarOther, (hit, src, 0))
        select.meta["val"] = scatter.meta["val"]  # the same shape and dtype
        scatter.replace_all_uses_with(select)


# ---- a row sum of a select -------------------------------------------------------------------------
def _sum_of_select(graph, row_sum) -> None:
    summand, dims = row_sum.args[0], row_sum.args[1]
    keepdim = row_sum.args[2] if len(row_sum.args) > 2 else row_sum.kwargs.get("keepdim", False)
    if (row_sum.kwargs.get("dtype") is not None or not isinstance(summand, torch.fx.Node)
            or summand.op != "call_function" or list(dims) not in ([-1], [1])):
        return
    val = summand.meta.get("val")
    if _as_select(summand) is not None:
        parts = [(1, "select", summand)]
    elif val is not None and val.ndim == 2 and isinstance(val.shape[-1], int):
        parts = _parts(summand, val)
    else:
        return
    if parts is None:
        return
    total = None
    with graph.inserting_before(row_sum):
        for sign, kind, node in parts:
            if kind == "constant":  # `[rows, 1]`: the same value at each of the row's columns
                value = graph.call_function(aten.mul.Tensor, (node, float(val.shape[-1])))
            else:
                value = _picked_value(graph, *_as_select(node))
            if total is None:
                total = value if sign > 0 else graph.call_function(aten.neg.default, (value,))
            else:
                total = graph.call_function(aten.add.Tensor if sign > 0 else aten.sub.Tensor, (total, value))
        if not keepdim:
            total = graph.call_function(aten.squeeze.dim, (total, -1))
    row_sum.replace_all_uses_with(total)
    graph.erase_node(row_sum)


def _as_select(node):
    """(select, scale) when `node` is `where(arange(V) == idx, value, 0)` with `value` a row's
    constant, or that times a row constant `scale` (nll_loss_backward's gradient); else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    select, scale = node, None
    if node.target is aten.mul.Tensor and len(node.args) == 2:
        for a, b in (node.args, node.args[::-1]):
            if isinstance(a, torch.fx.Node) and a.op == "call_function" and _is_row_constant(b):
                select, scale = a, b
                break
    if select.target not in (aten.where.ScalarOther, aten.where.Scalar) or select.args[2] != 0:
        return None
    if _picked_column(select.args[0]) is None or not _is_row_constant(select.args[1]):
        return None
    return select, scale


def _picked_value(graph, select, scale):
    """The `[rows, 1]` row sum of `select * scale`: its value at the one column it picks."""
    index, vocab = _picked_column(select.args[0])
    valid = graph.call_function(aten.logical_and.default, (graph.call_function(aten.ge.Scalar, (index, 0)),
                                                          graph.call_function(aten.lt.Scalar, (index, vocab))))
    picked = graph.call_function(select.target, (valid, select.args[1], select.args[2]))
    return picked if scale is None else graph.call_function(aten.mul.Tensor, (picked, scale))


def _parts(node, val):
    """`node` (of `[rows, V]` example value `val`) as signed parts `(sign, kind, node)` that add up
    to it, each a select (`_as_select`) or a `[rows, 1]` constant of `val`'s dtype broadcast over
    the row; None if it is not such a sum."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    own = node.meta.get("val")
    if own is None or own.dtype != val.dtype:
        return None  # a type promotion: the sum's parts would round differently
    if own.ndim == 2 and own.shape[-1] == 1:
        return [(1, "constant", node)]
    if not same_shape(own.shape, val.shape):
        return None
    if _as_select(node) is not None:
        return [(1, "select", node)]
    target, args = node.target, node.args
    if target is aten.expand.default:
        return _parts(args[0], val)
    if target is aten.neg.default:
        inner = _parts(args[0], val)
        return None if inner is None else [(-sign, kind, n) for sign, kind, n in inner]
    if target in (aten.add.Tensor, aten.sub.Tensor) and len(args) == 2 and not node.kwargs:
        first, second = _parts(args[0], val), _parts(args[1], val)
        if first is None or second is None:
            return None
        sign = 1 if target is aten.add.Tensor else -1
        return first + [(sign * s, kind, n) for s, kind, n in second]
    return None


def _is_row_constant(value) -> bool:
    """A Python number, a 0-d tensor or a `[..., 1]` one: the same at every column of a row."""
    if not isinstance(value, torch.fx.Node):
        return isinstance(value, (int, float, bool))
    if value.target is aten.scalar_tensor.default:  # made by `_scatter_as_select`, without an example value
        return True
    val = value.meta.get("val")
    return isinstance(val, torch.Tensor) and (val.ndim == 0 or val.shape[-1] == 1)


def _picked_column(hit):
    """(idx, V) when `hit` is `arange(V) == idx` with idx a `[rows, 1]` integer tensor, else None."""
    if not (isinstance(hit, torch.fx.Node) and hit.op == "call_function" and hit.target is aten.eq.Tensor):
        return None
    columns, index = hit.args
    if not (isinstance(columns, torch.fx.Node) and columns.target is aten.arange.default
            and len(columns.args) == 1 and isinstance(columns.args[0], int)):
        return None
    val = index.meta.get("val") if isinstance(index, torch.fx.Node) else None
    if val is None or val.ndim != 2 or val.shape[-1] != 1 or val.is_floating_point():
        return None
    return index, columns.args[0]


def _is_zeros(node) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or "val" not in node.meta:
        return False
    if node.target is aten.full.default:
        return node.args[1] == 0
    return node.target in (aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default)


def _is_last_dim(dim, node) -> bool:
    return isinstance(node, torch.fx.Node) and "val" in node.meta and dim in (-1, node.meta["val"].ndim - 1)
