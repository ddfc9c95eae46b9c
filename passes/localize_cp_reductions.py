"""Reduce before `unshard`: row-wise loss math on this rank's rows, then one all-reduce of the sums.

A context-parallel loss (`graphpass.cp`) unshards its per-token values (`[T_local] -> [T]`, one
all-gather) and then runs single-device code: row-wise math with replicated per-token tensors (old
log-probs, advantages, masks) ending in reductions over tokens, a sum, a mean, or per-sequence sums
(`index_add`, `scatter_add`, or a loop over `split` by sequence lengths, slime's per-sample mean),
of all the rows or of a slice of them, or of a `[B, S]` view of equal-length sequences (TRL's and
verl's padded-batch losses: `.sum(-1)` per sequence, `.mean(0)` per position). Every rank then
holds every row, though all it needs are the sums.

This pass runs that row-wise math on the local rows instead (each replicated operand read at the
local rows), reduces locally with padding rows (and the rows outside a slice) left out, and sums
the partial results
over the group: one `cp_sum_over_ranks` for all the reductions that do not depend on one another
(a GSPO or OPSM loss, whose token math reads per-sequence values, needs a second). Its backward is
`unshard`'s: each rank's loss is the whole loss, so no gradient crosses ranks.

All or nothing, per graph: if anything reads an unsharded value otherwise (a graph output, an op
that mixes rows, rows of another layout), or an operand of the row-wise math may carry a gradient
(an input that requires grad, a per-sequence value read back per token without `detach`: on local
rows each rank would get only its share of that gradient), every `unshard` stays as it is, with
the reason recorded. The rewrite depends on the graph alone, never on values or on whether the
local values require grad, so all ranks issue the same collectives.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis import catalogue
from graphpass.analysis.grad_flow import edges_carrying_grad
from graphpass.analysis.regions import source_of
from graphpass.ops.cp import sum_over_ranks_bytes
from graphpass.records import CollectiveRecord, CpRecord

aten = torch.ops.aten

__all__ = ["localize_cp_reductions_pass"]

_UNSHARD = torch.ops.graphpass.cp_unshard.default
_SUM_OVER_RANKS = torch.ops.graphpass.cp_sum_over_ranks.default

#: Reductions over the rows (over other dims they are row-wise), and sums by an index per row.
_ROW_SUMS = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim}
_SCATTERS = {aten.index_add.default, aten.scatter_add.default, aten.scatter_reduce.two, aten.index_put.default}
#: A range of the rows.
_SLICES = {aten.slice.Tensor, aten.narrow.default, aten.split.Tensor, aten.split_with_sizes.default}
#: Row-wise ops beyond the pointwise ones: views that keep the row dim first.
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_ROW_VIEWS = _RESHAPES | {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims}


class CantLocalize(Exception):
    """Why the unsharded values must stay whole."""


@dataclasses.dataclass
class _Rows:
    """What the row-wise values of one layout share: its tables' nodes and its group."""

    local_rows: torch.fx.Node
    order: torch.fx.Node
    group_name: str


def localize_cp_reductions_pass(gm: torch.fx.GraphModule, example_inputs, *, config, record) -> torch.fx.GraphModule:
    """Reductions of unsharded values -> local reductions + one sum over ranks (see the module doc)."""
    unshards = list(gm.graph.find_nodes(op="call_function", target=_UNSHARD))
    if not unshards:
        return gm
    source = source_of(unshards[0])
    try:
        plan = _plan(gm, example_inputs, unshards)
    except CantLocalize as why:
        record.cp.append(CpRecord(source, rewritten=False, reason=str(why), unshards=len(unshards),
                                  collectives=[_unshard_record(u) for u in unshards]))
        record.collectives.extend(record.cp[-1].collectives)
        return gm
    collectives = _rewrite(gm.graph, plan)
    _torch_api.stable_topological_sort(gm.graph)
    # Erased here: dead-code elimination keeps a custom op (it may be impure), and so the unshard.
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for value in sorted([*plan.row_values, *plan.splits], key=order.__getitem__, reverse=True):
        if not value.users:
            gm.graph.erase_node(value)
    record.cp.append(CpRecord(source, rewritten=True, reason=None, unshards=len(unshards),
                              reductions=[_reduction_name(r) for r in plan.reductions], collectives=collectives))
    record.collectives.extend(collectives)
    return gm


# ---- analysis ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Range:
    """The global rows a row value holds: `length` rows from `start` (a slice of the unsharded rows)."""

    start: int
    length: object  # int, or the symbolic T of the whole range
    cols: int | None = None
    """None: dim 0 indexes the rows. S: the value is a `[B, S, ...]` view of the `B * S` rows
    (equal-length sequences, one per row of dim 0), the per-sequence form of padded-batch losses."""

    def same(self, other) -> bool:
        return (self.start == other.start and _torch_api.known_equal(self.length, other.length)
                and self.cols == other.cols)


@dataclasses.dataclass
class _Plan:
    rows: _Rows
    total: object  # T
    row_values: dict  # node computed row-wise from unsharded values -> its _Range, graph order (unshards first)
    splits: dict  # a split of a row value -> the _Range of each piece
    reductions: dict  # node reducing a row value over its rows -> that value's _Range, graph order
    phase: dict  # reduction -> how many sums over ranks it waits for


def _plan(gm, example_inputs, unshards) -> _Plan:
    rows = _layout_of(unshards)
    carries = _may_carry_gradient(gm, example_inputs, unshards)
    total = unshards[0].meta["val"].shape[0]
    row_values, splits, reductions = {u: _Range(0, total) for u in unshards}, {}, {}
    for node in gm.graph.nodes:
        if node in row_values or not any(i in row_values or i in splits for i in node.all_input_nodes):
            continue
        if node.op == "output":
            raise CantLocalize(f"an unsharded value is returned ({source_of(_first_in(node, row_values))}); "
                               "it needs every row")
        what, extent = _classify(node, row_values, splits)
        if what == "row":
            row_values[node] = extent
        elif what == "split":
            splits[node] = extent
        elif what == "reduction":
            reductions[node] = extent
        else:
            raise CantLocalize(f"an unsharded value reaches {_name(node)} at {source_of(node)}, which {what}")
        for operand in node.all_input_nodes:
            if operand not in row_values and operand not in splits and carries[operand] \
                    and not (node.target in _SCATTERS and operand is node.args[0]):
                raise CantLocalize(f"{_name(operand)} ({source_of(node)}) may carry a gradient into the loss's "
                                   "row-wise math: on local rows each rank would get only its share of it")
    return _Plan(rows, total, row_values, splits, reductions, _phases(list(reductions)))


def _layout_of(unshards) -> _Rows:
    first = unshards[0]
    rows = _Rows(first.args[1], first.args[2], first.args[3])
    for u in unshards[1:]:
        if (u.args[1], u.args[2], u.args[3]) != (rows.local_rows, rows.order, rows.group_name):
            raise CantLocalize("the loss unshards values of two different layouts")
    return rows


def _classify(node, row_values, splits):
    """("row" | "split" | "reduction", the rows it reads or makes), or (why `node` cannot run on
    local rows, None)."""
    if node.op != "call_function":
        return "is not an op", None
    target = node.target
    if target is operator.getitem and node.args[0] in splits:
        return "row", splits[node.args[0]][node.args[1]]
    extent = _common_range(node, row_values)
    if extent is None:
        return "combines rows of different ranges", None
    if extent.cols is not None:
        return _classify_per_sequence(node, extent, row_values)
    if target in _SLICES:
        return _sliced(node, extent)
    val = node.meta.get("val")
    if target in _RESHAPES and target is not aten.expand.default and _sequences_view(node, extent):
        return "row", dataclasses.replace(extent, cols=val.shape[1])
    if target in _ROW_SUMS:
        if 0 in _reduced_dims(node):
            other = [node.args[0].meta["val"].shape[d] for d in _reduced_dims(node) if d != 0]
            if target in (aten.mean.default, aten.mean.dim) and not all(isinstance(d, int) for d in other):
                return "averages over symbolic dims besides the rows", None
            return "reduction", extent
        return ("row", extent) if _aligned(node, extent) else ("changes the row count", None)
    if target in _SCATTERS:
        why = _not_a_sum_by_index(node)
        if why:
            return why, None
        index, src = _scatter_index(node), _scatter_source(node)
        if node.args[0] in row_values or index in row_values or src not in row_values:
            return "scatters by an unsharded index or into an unsharded base", None
        if not (_aligned(src, extent) and _aligned(index, extent)):
            return "scatters rows of another shape", None
        if target is not aten.index_add.default and not _torch_api.same_shape(index.meta["val"].shape,
                                                                              src.meta["val"].shape):
            return "scatters by an index of another shape than its source", None
        return "reduction", extent
    if not isinstance(val, torch.Tensor) or not _aligned(node, extent):
        return "mixes or changes the rows", None
    if target in _ROW_VIEWS:
        src = node.args[0].meta["val"]
        if target is aten.unsqueeze.default and node.args[1] % (src.ndim + 1) == 0:
            return "adds a dim before the rows", None
        if target in (aten.squeeze.dim, aten.squeeze.dims) and 0 in _as_dims(node.args[1], src.ndim):
            return "squeezes the row dim", None
        if target is aten.expand.default and len(node.args[1]) != src.ndim:
            return "expands with new leading dims", None
        if target in _RESHAPES and not all(isinstance(d, int) for d in val.shape[1:]):
            return "reshapes to symbolic trailing dims", None
        return "row", extent
    if target in catalogue.ELEMENTWISE or catalogue.is_deterministic_pointwise(target):
        for operand in node.all_input_nodes:
            v = operand.meta.get("val")
            if operand in row_values and v.ndim != val.ndim:
                return "broadcasts the rows against another dim", None
            if isinstance(v, torch.Tensor) and v.ndim == val.ndim and not _torch_api.known_equal(v.shape[0], 1) \
                    and not _aligned(operand, extent):
                return "broadcasts rows of another count", None
        return "row", extent
    return "is not known to be row-wise", None


def _sequences_view(node, extent) -> bool:
    """`rows.view(B, S, ...)`: the rows of a static range as B sequences of S tokens."""
    x, val = node.args[0].meta["val"], node.meta["val"]
    if not (isinstance(extent.length, int) and val.ndim == x.ndim + 1 and len(val.shape) >= 2):
        return False
    shape = list(val.shape)
    return (all(isinstance(d, int) for d in shape) and shape[0] * shape[1] == extent.length
            and list(x.shape[1:]) == shape[2:])


def _classify_per_sequence(node, extent, row_values):
    """`_classify` for a `[B, S, ...]` view of the rows: elementwise math with per-token `[B, S]`,
    per-sequence `[B, 1]`, per-position `[S]` or broadcast operands, sums over the tokens of each
    sequence (dim 1), over the sequences (dim 0) or both, and the view back to rows."""
    target, val = node.target, node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return "mixes or changes the rows", None
    src = node.args[0].meta["val"] if isinstance(node.args[0], torch.fx.Node) else None
    if target in _RESHAPES and target is not aten.expand.default and src is not None and node.args[0] in row_values:
        if _torch_api.known_equal(val.shape[0], extent.length) and list(val.shape[1:]) == list(src.shape[2:]):
            return "row", dataclasses.replace(extent, cols=None)
        return "reshapes a per-sequence view otherwise", None
    if target in _ROW_SUMS:
        dims = _reduced_dims(node)
        if not dims & {0, 1}:
            return "reduces only the trailing dims of a per-sequence view", None
        return "reduction", extent
    if target in catalogue.ELEMENTWISE or catalogue.is_deterministic_pointwise(target):
        if list(val.shape[:2]) != [extent.length // extent.cols, extent.cols]:
            return "broadcasts a per-sequence view to another shape", None
        for operand in node.all_input_nodes:
            v = operand.meta.get("val")
            if operand in row_values:
                if v.ndim != val.ndim:
                    return "broadcasts the rows against another dim", None
            elif isinstance(v, torch.Tensor) and _per_sequence_alignment(v, val) is None:
                return "broadcasts an operand of another shape against a per-sequence view", None
        return "row", extent
    return "is not known to be row-wise (on a per-sequence view)", None


def _per_sequence_alignment(operand, val) -> str | None:
    """How an operand broadcasts against a `[B, S, ...]` view: per token ("rows"), per sequence
    ("seq", `[B, 1, ...]`), per position in a sequence ("col", `[S, ...]` or `[1, S, ...]`),
    or not along B and S at all ("bcast"); None if its sizes are not static."""
    if not all(isinstance(d, int) for d in operand.shape):
        return None
    missing = val.ndim - operand.ndim
    along_b = missing == 0 and operand.shape[0] != 1
    along_s = missing <= 1 and operand.ndim > 1 - missing and operand.shape[1 - missing] != 1
    return {(True, True): "rows", (True, False): "seq", (False, True): "col", (False, False): "bcast"}[
        (along_b, along_s)]


def _not_a_sum_by_index(node) -> str | None:
    """Why a scatter is not a sum of rows by an index over dim 0 (None: it is)."""
    if node.target is aten.index_put.default:
        indices, accumulate = node.args[1], (node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate"))
        if not accumulate or len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
            return "puts values by index without accumulating, or by several indices"
        return None
    if node.args[1] != 0:
        return "scatters along another dim"
    if node.target is aten.scatter_reduce.two:
        include_self = node.args[5] if len(node.args) > 5 else node.kwargs.get("include_self", True)
        if node.args[4] != "sum" or not include_self:
            return "scatters with another reduction than a sum into its base"
    return None


def _scatter_index(node):
    return node.args[1][0] if node.target is aten.index_put.default else node.args[2]


def _scatter_source(node):
    return node.args[2] if node.target is aten.index_put.default else node.args[3]


def _common_range(node, row_values):
    """The one range of the row values `node` reads; None if they differ."""
    ranges = [row_values[i] for i in node.all_input_nodes if i in row_values]
    if not ranges:  # reads only a split: classified by its getitems
        return _Range(0, 0)
    return ranges[0] if all(r.same(ranges[0]) for r in ranges) else None


def _sliced(node, extent: _Range):
    """A slice, narrow or split of a row value along its rows: the range of each result."""
    x = node.args[0].meta["val"]
    dim = node.args[1] if len(node.args) > 1 else 0
    if node.target in (aten.split.Tensor, aten.split_with_sizes.default):
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if dim % x.ndim != 0:
        return "slices a dim after the rows", None  # not a row op: keep it simple
    n = extent.length
    if node.target is aten.slice.Tensor:
        begin, stop = (list(node.args[2:4]) + [None, None])[:2]
        step = node.args[4] if len(node.args) > 4 else 1
        if step != 1:
            return "slices the rows with a step", None
        if (begin in (None, 0)) and (stop is None or (isinstance(stop, int) and stop >= 2**62)):
            return "row", extent  # the whole range
        if not (isinstance(n, int) and all(isinstance(b, int) or b is None for b in (begin, stop))):
            return "slices the rows at symbolic bounds", None
        begin, stop, _ = slice(begin, stop).indices(n)
        return "row", _Range(extent.start + begin, max(0, stop - begin))
    if node.target is aten.narrow.default:
        begin, length = node.args[2], node.args[3]
        if not (isinstance(n, int) and isinstance(begin, int) and isinstance(length, int)):
            return "narrows the rows at symbolic bounds", None
        begin = begin % n if begin < 0 else begin
        return "row", _Range(extent.start + begin, length)
    if not isinstance(n, int):
        return "splits rows of a symbolic count", None
    sizes = node.args[1]
    if node.target is aten.split.Tensor:
        if not isinstance(sizes, int):
            return "splits the rows at symbolic sizes", None
        sizes = [min(sizes, n - b) for b in range(0, n, sizes)] or [0]
    if not all(isinstance(k, int) for k in sizes):
        return "splits the rows at symbolic sizes", None
    offsets = [0]
    for k in sizes:
        offsets.append(offsets[-1] + k)
    return "split", [_Range(extent.start + b, k) for b, k in zip(offsets, sizes)]


def _may_carry_gradient(gm, example_inputs, unshards) -> dict:
    """For each node: whether a gradient could flow from it into an unsharded value, a local input
    or an input that requires grad, whatever the grad mode.

    On local rows, an operand of the row-wise math gets only this rank's rows' share of its
    gradient, which is right only where no gradient flows. The answer must be the same on every
    rank, so it never depends on whether the local inputs require grad (ranks may differ there:
    slime #2123): a local input (one from which the unsharded values are computed) counts as
    requiring grad, and a gradient is assumed to flow wherever an op passes one (casts to integer
    or bool, comparisons and `detach` do not).
    """
    local = _local_inputs(unshards)
    examples = dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
    carries = {}
    for node in gm.graph.nodes:
        if not _is_float(node):
            carries[node] = False
        elif node.op == "placeholder":
            x = examples.get(node)
            carries[node] = node in local or (isinstance(x, torch.Tensor) and x.requires_grad)
        else:
            carries[node] = node.target is _UNSHARD or any(carries.get(a, False) for a in _grad_edges(node))
    return carries


def _local_inputs(unshards) -> set:
    """The graph inputs a gradient could reach from an unshard's local values."""
    found, seen, stack = set(), set(), [u.args[0] for u in unshards]
    while stack:
        n = stack.pop()
        if n in seen or not _is_float(n):
            continue
        seen.add(n)
        if n.op == "placeholder":
            found.add(n)
        stack.extend(_grad_edges(n))
    return found


def _grad_edges(node) -> list:
    """The inputs of `node` a gradient from it may reach, in any grad mode."""
    if node.op != "call_function":
        return []
    return edges_carrying_grad(node, _ALWAYS_ENABLED)


class _AlwaysEnabled(dict):
    def __missing__(self, key):
        return True


_ALWAYS_ENABLED = _AlwaysEnabled()


def _is_float(node) -> bool:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(v, (list, tuple)):
        return any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in v)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _ndim(node, operand) -> int:
    """The rank an operand of `node` has when it holds one row per row of `node`'s rows (a
    lower-rank operand broadcasts along the trailing dims instead)."""
    val = node.meta.get("val")
    if node.target in _ROW_SUMS or node.target in _SCATTERS or not isinstance(val, torch.Tensor):
        return operand.meta["val"].ndim
    return val.ndim


def _phases(reductions) -> dict:
    """How many sums over ranks each reduction waits for: 0 unless its rows read values computed
    from another reduction (GSPO's per-sequence ratio, OPSM's sequence mask)."""
    phase = {}
    for r in reductions:
        earlier = [p for p in reductions if p in phase and _depends_on(r, p)]
        phase[r] = 1 + max((phase[p] for p in earlier), default=-1)
    return phase


def _depends_on(node, other) -> bool:
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n is other:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


# ---- rewrite -------------------------------------------------------------------------------------
def _rewrite(graph: torch.fx.Graph, plan: _Plan) -> list:
    rows = plan.rows
    fake_mode = _torch_api.detect_fake_mode([rows.local_rows.meta["val"]])
    first_value = next(iter(plan.row_values))

    def node(target, *args, like=None, **kwargs):
        new = graph.call_function(target, args, kwargs)
        if like is not None:
            new.meta.update({k: v for k, v in like.meta.items() if k != "val"})
        vals = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with fake_mode:
            new.meta["val"] = target(*vals[0], **vals[1])
        return new

    # Padding rows compute what one real local row computes (a copy of its values, detached), so
    # that no padding row can make an inf or NaN that the single-device program does not; the
    # reductions then leave them out. `first`: the local row holding the last global row.
    with graph.inserting_before(first_value):
        valid = node(aten.ge.Scalar, rows.local_rows, 0)
        first = node(aten.unsqueeze.default, node(aten.argmax.default, rows.local_rows), 0)
        fill_rows = node(aten.where.self, valid, rows.local_rows,
                         node(aten.clamp_min.default, node(aten.index_select.default, rows.local_rows, 0, first), 0))
        local = {u: node(aten.where.self, _row_mask(node, valid, u.args[0]), u.args[0],
                         node(aten.detach.default, node(aten.index_select.default, u.args[0], 0, first)))
                 for u, extent in plan.row_values.items() if u.target is _UNSHARD}
    masks, reads = {}, {}

    def whole(extent) -> bool:
        return extent.start == 0 and _torch_api.known_equal(extent.length, plan.total)

    def mask_of(extent):
        """The local rows that hold a row of `extent` (real rows only)."""
        if whole(extent):
            return valid
        key = (extent.start, extent.length)
        if key not in masks:
            with graph.inserting_before(first_value):
                masks[key] = node(aten.logical_and.default, node(aten.ge.Scalar, rows.local_rows, extent.start),
                                  node(aten.lt.Scalar, rows.local_rows, extent.start + extent.length))
        return masks[key]

    def local_of(a, consumer, extent):
        """The local rows of `a`, as `consumer` reads it in `extent`: its local twin, the replicated
        `a` read at the local rows, or `a` itself (a broadcast operand)."""
        if not isinstance(a, torch.fx.Node):
            return a
        if a in local:
            return local[a]
        if extent.cols is not None:
            return per_sequence_operand(a, consumer, extent)
        key = (a, extent.start)
        if key not in reads and _aligned(a, extent) and a.meta["val"].ndim == _ndim(consumer, a):
            index = fill_rows
            if not whole(extent):  # row i of `a` is global row start + i
                index = node(aten.clamp.default, node(aten.sub.Tensor, fill_rows, extent.start), 0,
                             max(0, extent.length - 1))
            reads[key] = node(aten.index_select.default, a, 0, index, like=a)
        return reads.get(key, a)

    def sequence_index(extent, of: str):
        """Per local row: its row in `extent` ("rows"), its sequence ("seq") or its position in
        its sequence ("col"), clamped into range (rows outside the range are left out later)."""
        key = (extent.start, extent.length, extent.cols, of)
        if key not in reads:
            with graph.inserting_before(first_value):
                index = node(aten.clamp.default, node(aten.sub.Tensor, fill_rows, extent.start), 0,
                             max(0, extent.length - 1))
                if of == "seq":
                    index = node(aten.div.Tensor_mode, index, extent.cols, rounding_mode="floor")
                elif of == "col":
                    index = node(aten.remainder.Scalar, index, extent.cols)
                reads[key] = index
        return reads[key]

    def per_sequence_operand(a, consumer, extent):
        """A replicated operand of `[B, S, ...]` math, as `[T_local or 1, ...]` against the local rows."""
        v, val = a.meta["val"], consumer.meta["val"]
        how = _per_sequence_alignment(v, val) if isinstance(v, torch.Tensor) else None
        if how is None:
            return a
        key = (a, extent.start, extent.length, extent.cols)
        if key not in reads:
            missing = val.ndim - v.ndim
            trailing = list(v.shape[2 - missing:]) if missing < 2 else list(v.shape)
            if how == "bcast":
                reads[key] = a if missing >= 2 else node(aten.reshape.default, a, trailing or [])
            else:
                flat = node(aten.reshape.default, a, [-1, *trailing])
                reads[key] = node(aten.index_select.default, flat, 0, sequence_index(extent, how), like=a)
        return reads[key]

    for value, extent in plan.row_values.items():
        if value.target is _UNSHARD:
            continue
        if value.target in _RESHAPES and plan.row_values.get(value.args[0], extent).cols != extent.cols:
            local[value] = local[value.args[0]]  # [T, ...] <-> [B, S, ...]: the local rows stay flat
            continue
        with graph.inserting_before(value):
            if value.target in _SLICES or value.target is operator.getitem:
                # A slice keeps every local row; only its range's rows pass a gradient back.
                source = local[value.args[0] if value.target in _SLICES else value.args[0].args[0]]
                local[value] = node(aten.where.self, _row_mask(node, mask_of(extent), source), source,
                                    node(aten.detach.default, source), like=value)
                continue
            args = torch.fx.node.map_arg(value.args, lambda a: local_of(a, value, extent))
            kwargs = torch.fx.node.map_arg(value.kwargs, lambda a: local_of(a, value, extent))
            if value.target in _RESHAPES:  # the same shape with the local row count
                args = (args[0], [-1, *value.meta["val"].shape[1:]]) + tuple(args[2:])
            local[value] = node(value.target, *args, like=value, **kwargs)

    partials = {}
    for r, extent in plan.reductions.items():
        with graph.inserting_before(r):
            partials[r] = _partial(node, r, extent, rows, local, lambda a, c: local_of(a, c, extent), mask_of(extent),
                                   lambda of: sequence_index(extent, of), fake_mode, graph)

    collectives = []
    for phase in sorted(set(plan.phase.values())):
        members = [r for r in plan.reductions if plan.phase[r] == phase]
        last = members[-1]
        with graph.inserting_after(partials[last]):
            summed = node(_SUM_OVER_RANKS, [partials[r] for r in members], rows.group_name, like=last)
        collectives.append(CollectiveRecord("all_reduce", _group_size(rows.group_name),
                                            _hint_bytes([partials[r].meta["val"] for r in members])))
        for i, r in enumerate(members):
            with graph.inserting_after(summed):
                total_r = node(operator.getitem, summed, i)
            result = total_r
            if r.target in _SCATTERS:  # the scatter's base, added once
                with graph.inserting_after(total_r):
                    result = node(aten.add.Tensor, r.args[0], total_r, like=r)
            r.replace_all_uses_with(result)
            graph.erase_node(r)
    return collectives


def _partial(node, r, extent, rows, local, local_of, mask, index_of, fake_mode, graph):
    """This rank's share of reduction `r` over the rows of `extent`: the local rows that hold
    them reduced, the others (padding, rows outside a slice) left out."""
    if extent.cols is not None:
        return _per_sequence_partial(node, r, local[r.args[0]], mask, index_of)
    if r.target in _SCATTERS:
        src = local[_scatter_source(r)]
        index = local_of(_scatter_index(r), r)
        kept = node(aten.where.self, _row_mask(node, mask, src), src, node(aten.scalar_tensor.default, 0.0,
                                                                             dtype=src.meta["val"].dtype))
        base = node(aten.zeros_like.default, r.args[0])
        if r.target is aten.index_put.default:
            return node(r.target, base, [index], kept, True, like=r)
        return node(r.target, base, 0, index, kept, *r.args[4:], like=r, **r.kwargs)
    src = local[r.args[0]] if r.args[0] in local else local_of(r.args[0], r)
    zero = node(aten.scalar_tensor.default, 0.0, dtype=src.meta["val"].dtype)
    kept = node(aten.where.self, _row_mask(node, mask, src), src, zero)
    if r.target in (aten.sum.default, aten.mean.default):
        part = node(aten.sum.default, kept, **r.kwargs)
    else:
        part = node(aten.sum.dim_IntList, kept, *r.args[1:], like=r, **r.kwargs)
    if r.target in (aten.mean.default, aten.mean.dim):
        count = _count(node, r, extent, rows, fake_mode, graph)
        part = node(aten.div.Tensor, part, count, like=r)
        if part.meta["val"].dtype != r.meta["val"].dtype:
            part = node(aten._to_copy.default, part, dtype=r.meta["val"].dtype)
    return part


def _per_sequence_partial(node, r, src, mask, index_of):
    """This rank's share of a sum (mean) over dims of a `[B, S, ...]` view, from the flat local
    rows `[T_local, ...]`: over both B and S a sum over the rows, over S alone a sum into each
    row's sequence, over B alone into each row's position."""
    dims, val = _reduced_dims(r), r.args[0].meta["val"]
    x = node(aten.where.self, _row_mask(node, mask, src), src,
             node(aten.scalar_tensor.default, 0.0, dtype=src.meta["val"].dtype))
    if r.kwargs.get("dtype") is not None:
        x = node(aten._to_copy.default, x, dtype=r.kwargs["dtype"])
    trailing = sorted(d - 1 for d in dims if d >= 2)  # the view's dims after S, on the flat rows
    if {0, 1} <= dims:
        part = node(aten.sum.dim_IntList, x, [0, *trailing])
    else:
        if trailing:
            x = node(aten.sum.dim_IntList, x, trailing)
        of, size = ("seq", val.shape[0]) if 1 in dims else ("col", val.shape[1])
        v = x.meta["val"]
        part = node(aten.index_add.default, node(aten.zeros.default, [size, *v.shape[1:]], dtype=v.dtype,
                                                 device=v.device), 0, index_of(of), x)
    part = node(aten.reshape.default, part, list(r.meta["val"].shape))
    if r.target in (aten.mean.default, aten.mean.dim):
        count = node(aten.scalar_tensor.default, float(math.prod(val.shape[d] for d in dims)), dtype=torch.float64)
        part = node(aten.div.Tensor, part, count, like=r)
    if part.meta["val"].dtype != r.meta["val"].dtype:
        part = node(aten._to_copy.default, part, dtype=r.meta["val"].dtype)
    return part


def _row_mask(node, valid, src):
    """`valid` shaped to broadcast over `src`'s trailing dims."""
    extra = src.meta["val"].ndim - 1
    return valid if extra == 0 else node(aten.view.default, valid, [-1] + [1] * extra)


def _count(node, r, extent, rows, fake_mode, graph):
    """How many elements the mean `r` averages: the rows times its other reduced dims (a float64 tensor)."""
    src = r.args[0].meta["val"]
    other = math.prod(src.shape[d] for d in _reduced_dims(r) if d != 0)  # an int: checked by the plan
    if isinstance(extent.length, int):
        return node(aten.scalar_tensor.default, float(extent.length * other), dtype=torch.float64)
    # The whole range, of a symbolic T: read from the layout's [T] table, not from the unsharded value.
    size = node(aten.sym_size.int, rows.order, 0)
    if other != 1:
        size = node(operator.mul, size, other)
    return _torch_api.float64_tensor_node(graph, size, fake_mode)


# ---- helpers -------------------------------------------------------------------------------------
def _aligned(n, extent: _Range) -> bool:
    """A tensor whose dim 0 has one row per row of `extent`."""
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return isinstance(v, torch.Tensor) and v.ndim >= 1 and _torch_api.known_equal(v.shape[0], extent.length)


def _reduced_dims(node) -> set:
    ndim = node.args[0].meta["val"].ndim
    if node.target in (aten.sum.default, aten.mean.default):
        return set(range(ndim))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return set(range(ndim)) if dims is None or dims == [] else _as_dims(dims, ndim)


def _as_dims(dims, ndim) -> set:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return {d % max(ndim, 1) for d in dims}


def _first_in(node, values):
    return next(i for i in node.all_input_nodes if i in values)


def _name(node) -> str:
    target = node.target
    if node.op == "placeholder":
        return f"input {node.name}"
    return getattr(target, "__name__", str(target)).replace(".default", "")


def _reduction_name(r) -> str:
    return r.target.__name__.split(".")[0]


def _group_size(group_name: str) -> int:
    if not group_name:
        return 1
    return _torch_api.resolve_process_group(group_name).size()


def _hint_bytes(partials) -> int:
    with _torch_api.new_fake_mode():
        concrete = [torch.empty([_torch_api.size_hint(s) for s in p.shape], dtype=p.dtype) for p in partials]
    return sum_over_ranks_bytes(concrete)


def _unshard_record(u) -> CollectiveRecord:
    y = u.args[0].meta["val"]
    rows = _torch_api.size_hint(y.numel())
    return CollectiveRecord("all_gather", _group_size(u.args[3]), rows * y.dtype.itemsize)
