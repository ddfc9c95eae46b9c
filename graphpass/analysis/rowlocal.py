"""Which ATen ops are row-local, and how each looks in the canonical per-chunk layout.

A tensor in a region over R rows is either a *row* tensor (its leading dims flatten to R rows
with an optional trailing width: `[*rows]`, `[*rows, w]`) or a *broadcast* one (every row dim
is 1). On one chunk of r rows, a row tensor is `[r, w]` and a broadcast tensor `[1, w]` or 0-d;
each row-local op maps to the same op with its dim arguments pointed at the last dim.

One more layout exists for the losses only: `x.transpose(1, 2)` of a `[B, S, V]` row tensor is a
*transposed* `[B, V, S]` tensor, the class-dim-1 input that `cross_entropy`/`nll_loss` take. Its
chunk is the `[r, V]` chunk of `x`, and nothing but those losses may read it.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch

from graphpass._torch_api import is_aten_overload, known_equal, schema_of
from graphpass.analysis import catalogue
from graphpass.analysis.layouts import Role
from graphpass.fx_utils import derives_from, target_name, value_or_constant

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class RegionLayout:
    """How a tensor lies over a region's rows: ROW ([*rows] or [*rows, width]), BCAST, or TRANSPOSED
    (not to be confused with `graphpass.cp.Layout`, how rows lie over context-parallel ranks)."""

    kind: Role
    width: object  # int or SymInt
    row_dims: int  # how many leading dims index rows (tail present iff row_dims < ndim)


ROW, BCAST, TRANSPOSED = Role.ROW, Role.BCAST, Role.TRANSPOSED


def layout_of(val, rows) -> RegionLayout | None:
    """Classify a fake tensor relative to a region with `rows` rows; None if neither."""
    if not isinstance(val, torch.Tensor):
        return None
    shape = val.shape
    if len(shape) == 0:
        return RegionLayout(BCAST, 1, 0)
    lead = math.prod(shape[:-1]) if len(shape) > 1 else 1
    if known_equal(lead, rows):
        return RegionLayout(ROW, shape[-1], len(shape) - 1)
    if known_equal(math.prod(shape), rows):
        return RegionLayout(ROW, 1, len(shape))
    if known_equal(lead, 1):
        return RegionLayout(BCAST, shape[-1], len(shape) - 1)
    return None


def _is_vocab_to_dim1(node, rows) -> bool:
    """True if `node` is `x.transpose(1, 2)` of a `[B, S, V]` row tensor `x` (rows = B * S)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target is not aten.transpose.int:
        return False
    src = value_or_constant(node.args[0])
    if not isinstance(src, torch.Tensor) or src.ndim != 3:
        return False
    # Only 3-D: for more dims, swapping 1 and -1 would also reorder the row dims.
    src_layout = layout_of(src, rows)
    return (sorted(d % 3 for d in node.args[1:3]) == [1, 2] and src_layout is not None
            and src_layout.kind == ROW and src_layout.row_dims == 2)


def node_layout(node, rows) -> RegionLayout | None:
    """`layout_of` a node's value, recognising a transposed loss input (see the module docstring)."""
    if _is_vocab_to_dim1(node, rows):
        return RegionLayout(TRANSPOSED, node.meta["val"].shape[1], 2)
    return layout_of(value_or_constant(node), rows)


def rows_and_vocab(anchor):
    """(rows, V) of a region started at `anchor`: V is the last dim, or for a loss the class dim 1."""
    shape = value_or_constant(anchor.args[0]).shape
    if anchor.target in _NLL and len(shape) >= 3:
        return shape[0] * math.prod(shape[2:]), shape[1]
    return math.prod(shape[:-1]), shape[-1]


# ---- op families (graphpass.analysis.catalogue) ------------------------------------------
_VIEWS, _REDUCTIONS, _REDUCTIONS_INT_DIM = catalogue.VIEWS, catalogue.REDUCTIONS, catalogue.REDUCTIONS_INT_DIM
_SOFTMAX, _GATHER, _NLL = catalogue.SOFTMAX, catalogue.GATHERS, catalogue.LOSSES
TOKEN_ID_OPS, NORMALISERS, ANCHORS = catalogue.TOKEN_ID_OPS, catalogue.NORMALISERS, catalogue.ANCHORS


def data_inputs(node) -> list:
    """The input nodes whose values `node` reads."""
    if node.target in catalogue.SHAPE_ONLY_SECOND_ARG:
        return [node.args[0]] if isinstance(node.args[0], torch.fx.Node) else []
    return list(node.all_input_nodes)


def derives_from_reduction(node) -> bool:
    """True if `node` or anything it is computed from reduces over a dim or gathers: a per-token
    value, never logits."""
    return derives_from(node, lambda n: n.op == "call_function" and (n.target in ANCHORS or n.target in TOKEN_ID_OPS))


def is_pointwise(target) -> bool:
    return target in catalogue.ELEMENTWISE or target in catalogue.BROADCASTS or (
        is_aten_overload(target) and torch.Tag.pointwise in target.tags)


def normalized_args(node) -> dict | None:
    """The node's arguments by schema name, defaults filled in."""
    schema = schema_of(node.target)
    if schema is None:
        return None
    kw = {a.name: v for a, v in zip(schema.arguments, node.args)}
    kw.update(node.kwargs)
    for a in schema.arguments:
        if a.name not in kw and a.has_default_value():
            kw[a.name] = a.default_value
    return kw


def slice_span(node) -> tuple:
    """(dim, start, end, step) of a `slice` or `slice_scatter` node, defaults filled in."""
    args = normalized_args(node)
    return args["dim"], args["start"], args["end"], args["step"]


def clamp_index(index, size: int) -> int:
    """A slice bound (None: the end; negative: from the end) as the position it means in `size`."""
    if index is None:
        return size
    return max(0, min(index + size if index < 0 else index, size))


def _last_dim(dim, ndim) -> bool:
    return isinstance(dim, int) and dim % max(ndim, 1) == ndim - 1




def operand_role(operand_val, out_val, out_layout: RegionLayout) -> Role | None:
    """How a pointwise operand lines up with the op's output rows: ROW, BCAST, or None."""
    if not isinstance(operand_val, torch.Tensor) or operand_val.ndim == 0:
        return BCAST
    if operand_val.ndim > out_val.ndim:
        return None
    padded = (1,) * (out_val.ndim - operand_val.ndim) + tuple(operand_val.shape)
    k = out_layout.row_dims
    if all(known_equal(a, b) for a, b in zip(padded[:k], out_val.shape[:k])):
        return ROW
    if all(known_equal(a, 1) for a in padded[:k]):
        return BCAST
    return None


def check(node, rows, layouts: dict) -> str | None:
    """Why `node` is not row-local in a region of `rows` rows, or None if it is.

    `layouts` maps already-classified nodes to their RegionLayout (inputs classify on demand).
    """
    target = node.target
    if node.op != "call_function":
        return f"{node.op} is not an op"
    if target is aten.transpose.int:
        return None if _is_vocab_to_dim1(node, rows) else "transpose moves the rows"
    for a in node.all_input_nodes:
        # A transposed value's rows are not its leading dims: only a loss may read it, as input.
        if _is_vocab_to_dim1(a, rows) and not (target in _NLL and a is node.args[0]):
            return f"{target_name(node)} reads a transposed [rows, V] value"
    if target is operator.getitem:
        return None if node.args[0] in layouts else "getitem of a value outside the region"
    val = node.meta.get("val")
    outs = val if isinstance(val, (tuple, list)) else (val,)
    out_layouts = [layout_of(v, rows) for v in outs]
    if any(lay is None or lay.kind != ROW for lay in out_layouts):
        return f"{target_name(node)} output is not laid out over the region's rows"
    out_layout = out_layouts[0]
    tensor_args = [a for a in node.all_input_nodes if isinstance(value_or_constant(a), torch.Tensor)]
    if is_pointwise(target):
        for a in tensor_args:
            role = operand_role(value_or_constant(a), outs[0], out_layout)
            # A [V] operand when R == V: broadcast along V here, but its layout (how it is
            # chunked) says one value per row.
            lay = layouts.get(a) or node_layout(a, rows)
            mismatched = role == BCAST and lay is not None and lay.kind == ROW and not known_equal(rows, 1)
            if role is None or mismatched:
                return f"{target_name(node)} broadcasts {a.name} across rows"
        return None
    first = node.args[0] if node.args else None
    in_layout = layouts.get(first) or node_layout(first, rows)
    if in_layout is None or in_layout.kind not in (ROW, TRANSPOSED):
        return f"{target_name(node)} input is not laid out over the rows"
    ndim = value_or_constant(first).ndim
    has_tail = in_layout.row_dims < ndim
    if target in _VIEWS:
        if known_equal(in_layout.width, out_layout.width) or (
                target in (aten.expand.default, aten.expand_as.default) and known_equal(in_layout.width, 1)):
            return None
        return f"{target_name(node)} moves elements between rows and the vocabulary"
    kw = normalized_args(node)
    if kw is None:
        return f"cannot read the arguments of {target_name(node)}"
    if target in _REDUCTIONS:
        dims = kw.get("dim")
        if not (has_tail and dims is not None and len(dims) == 1 and _last_dim(dims[0], ndim)):
            return f"{target_name(node)} reduces over rows, not the vocabulary"
        return None
    if target in _REDUCTIONS_INT_DIM or target in _SOFTMAX:
        if not (has_tail and _last_dim(kw.get("dim"), ndim)):
            dim = kw.get("dim")
            return (f"{target_name(node)} is over dim {dim}, not the last: put the vocabulary last "
                    f"(x.transpose({dim}, -1), then dim=-1) to have it chunked")
        return None
    if target in _GATHER:
        index = kw.get("index", kw.get("indices"))
        index_layout = layout_of(value_or_constant(index), rows)
        if not (has_tail and _last_dim(kw.get("dim"), ndim) and index_layout is not None
                and index_layout.kind == ROW and value_or_constant(index).ndim == ndim):
            return f"{target_name(node)} does not pick along the vocabulary with a per-row index"
        return None
    if target in _NLL:
        target_val = value_or_constant(kw.get("target"))
        weight = kw.get("weight")
        if (ndim != 2 and in_layout.kind != TRANSPOSED) or kw.get("reduction") != 0 or target_val is None \
                or target_val.ndim != ndim - 1:
            return f"{target_name(node)} is not per-token ([N, V] or transposed [B, V, S] logits, reduction='none')"
        if weight is not None and value_or_constant(weight).ndim != 1:
            return f"{target_name(node)} has a weight that is not per-class"
        return None
    if target is aten.slice.Tensor:
        if has_tail and _last_dim(kw.get("dim"), ndim) and all(
                isinstance(kw.get(k), (int, type(None))) for k in ("start", "end", "step")):
            return None
        return "slice over rows"
    if target is aten.select.int:
        # `x[..., 0]` of a one-wide value (a gathered `[rows, 1]`): the same values, as a squeeze.
        if has_tail and _last_dim(kw.get("dim"), ndim) and known_equal(value_or_constant(first).shape[-1], 1):
            return None
        return f"{target_name(node)} picks along the rows or a vocabulary"
    return f"{target_name(node)} is not a row-local op"




def reads_only_as_shape(node, layouts: dict) -> bool:
    """Whether `emit(node)` reads none of `node`'s size arguments: a view that keeps the row's
    width is the chunk itself (`view(x, [B, S])` of `[B * S]` values), so a symbolic size it
    names (Dynamo's `s0`) is no input of the per-chunk program."""
    return node.target in _VIEWS and node.args[0] in layouts and node in layouts and \
        known_equal(layouts[node.args[0]].width, layouts[node].width)


# ---- canonical emission ------------------------------------------------------------------
def emit(graph: torch.fx.Graph, node, env, layouts):
    """Append `node`'s canonical per-chunk form to `graph`; `env` maps old nodes to new ones."""
    target = node.target

    def arg(a):
        return torch.fx.node.map_arg(a, lambda n: env[n])

    if target is operator.getitem:
        return graph.call_function(operator.getitem, (env[node.args[0]], node.args[1]))
    if target is aten.transpose.int:
        return env[node.args[0]]  # a chunk already has V last, as the losses read it here
    if is_pointwise(target):
        return graph.call_function(target, arg(node.args), arg(node.kwargs))
    source = node.args[0]
    if target is aten.select.int:
        return env[source]  # of a one-wide value (`check`): the chunk keeps it `[rows, 1]`
    if target in _VIEWS:
        if known_equal(layouts[source].width, layouts[node].width):
            return env[source]
        width = _width_in_chunk(graph, layouts[node].width, env, layouts)
        return graph.call_function(aten.expand.default, (env[source], [-1, width]))
    kw = normalized_args(node)
    if target in _REDUCTIONS:
        kw.update(dim=[-1], keepdim=True)
    elif target in _REDUCTIONS_INT_DIM:
        kw.update(dim=-1, keepdim=True)
    elif target in _SOFTMAX or target is aten.slice.Tensor:
        kw.update(dim=-1)
    elif target in _GATHER:
        index = kw.pop("index", None) or kw.pop("indices")
        return graph.call_function(aten.gather.default, (env[source], -1, env[index]))
    elif target in _NLL:
        kw = {k: arg(v) for k, v in kw.items()}
        kw["target"] = graph.call_function(aten.squeeze.dim, (kw["target"], -1))
        if kw.get("weight") is not None:
            kw["weight"] = graph.call_function(aten.reshape.default, (kw["weight"], [-1]))
        loss = _call(graph, target, kw)
        return graph.call_function(aten.unsqueeze.default, (loss, -1))
    return _call(graph, target, {k: arg(v) for k, v in kw.items()})


def _call(graph, target, kw):
    """Call an ATen overload from normalized kwargs: positional args in schema order."""
    args, kwargs = [], {}
    for a in schema_of(target).arguments:
        if a.name not in kw:
            continue
        if a.kwarg_only:
            kwargs[a.name] = kw[a.name]
        else:
            args.append(kw[a.name])
    return graph.call_function(target, tuple(args), kwargs)


def _width_in_chunk(graph, width, env, layouts):
    """`width` as an int, or for a symbolic width the last size of a chunk tensor that has it.

    (-1 in `expand` would keep a width-1 dim at 1, not broadcast it to the symbolic width.)
    """
    if isinstance(width, int):
        return width
    for n, lay in layouts.items():
        if n in env and isinstance(value_or_constant(n), torch.Tensor) and lay is not None and known_equal(lay.width, width):
            return graph.call_function(aten.sym_size.int, (env[n], -1))
    raise ValueError(f"graphpass: no tensor in the region has the width {width}")
