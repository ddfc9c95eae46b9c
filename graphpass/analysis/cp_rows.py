"""Which values of a context-parallel loss are row-wise in the unsharded rows, and what reduces them.

The plan `passes.localize_cp_reductions` carries out: from each `cp_unshard`, the values computed
row-wise from its rows (`Range`: which global rows a value holds, a slice of them, or a `[B, S]`
view of equal-length sequences), the reductions that sum them over tokens, how many levels of
sums depend on one another, and why not (`CantLocalize`) where anything else reads them or an
operand of the row-wise math may carry a gradient. Read-only: nothing here changes the graph.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis import catalogue
from graphpass.analysis.grad_flow import edges_carrying_grad
from graphpass.analysis.regions import source_of
from graphpass.fx_utils import RESHAPES
from graphpass.ops import cp_shards  # noqa: F401 - registers graphpass::cp_unshard

aten = torch.ops.aten

__all__ = ["CantLocalize", "Plan", "Range", "Rows", "plan_localization", "aligned", "per_sequence_alignment",
           "reduced_dims", "row_operand_ndim", "scatter_index", "scatter_source",
           "UNSHARD", "ROW_SUMS", "SCATTERS", "SLICES", "RESHAPES_OR_EXPAND"]

UNSHARD = torch.ops.graphpass.cp_unshard.default

#: Reductions over the rows (over other dims they are row-wise), and sums by an index per row.
ROW_SUMS = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim}
SCATTERS = {aten.index_add.default, aten.scatter_add.default, aten.scatter_reduce.two, aten.index_put.default}
#: A range of the rows.
SLICES = {aten.slice.Tensor, aten.narrow.default, aten.split.Tensor, aten.split_with_sizes.default}
#: Row-wise ops beyond the pointwise ones: views that keep the row dim first.
RESHAPES_OR_EXPAND = RESHAPES | {aten.expand.default}
ROW_VIEWS = RESHAPES_OR_EXPAND | {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims}


class CantLocalize(Exception):
    """Why the unsharded values must stay whole."""


@dataclasses.dataclass
class Rows:
    """What the row-wise values of one layout share: its tables' nodes and its group."""

    local_rows: torch.fx.Node
    order: torch.fx.Node
    group_name: str


# ---- the plan ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Range:
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
class Plan:
    rows: Rows
    total: object  # T
    row_values: dict  # node computed row-wise from unsharded values -> its Range, graph order (unshards first)
    splits: dict  # a split of a row value -> the Range of each piece
    reductions: dict  # node reducing a row value over its rows -> that value's Range, graph order
    phase: dict  # reduction -> how many sums over ranks it waits for


def plan_localization(gm, example_inputs, unshards) -> Plan:
    """What runs on local rows from `unshards` (every `cp_unshard` of `gm`), and what sums it;
    raises `CantLocalize` with the reason when the unshards must stay whole."""
    rows = _layout_of(unshards)
    carries = _may_carry_gradient(gm, example_inputs, unshards)
    total = unshards[0].meta["val"].shape[0]
    row_values, splits, reductions = {u: Range(0, total) for u in unshards}, {}, {}
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
            raise CantLocalize(f"an unsharded value reaches {describe(node)} at {source_of(node)}, which {what}")
        for operand in node.all_input_nodes:
            if operand not in row_values and operand not in splits and carries[operand] \
                    and not (node.target in SCATTERS and operand is node.args[0]):
                raise CantLocalize(f"{describe(operand)} ({source_of(node)}) may carry a gradient into the loss's "
                                   "row-wise math: on local rows each rank would get only its share of it")
    return Plan(rows, total, row_values, splits, reductions, _phases(gm.graph, reductions))


def _layout_of(unshards) -> Rows:
    first = unshards[0]
    rows = Rows(first.args[1], first.args[2], first.args[3])
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
    if target in SLICES:
        return _sliced(node, extent)
    val = node.meta.get("val")
    if target in RESHAPES and _sequences_view(node, extent):
        return "row", dataclasses.replace(extent, cols=val.shape[1])
    if target in ROW_SUMS:
        if 0 in reduced_dims(node):
            other = [node.args[0].meta["val"].shape[d] for d in reduced_dims(node) if d != 0]
            if target in (aten.mean.default, aten.mean.dim) and not all(isinstance(d, int) for d in other):
                return "averages over symbolic dims besides the rows", None
            return "reduction", extent
        return ("row", extent) if aligned(node, extent) else ("changes the row count", None)
    if target in SCATTERS:
        why = _not_a_sum_by_index(node)
        if why:
            return why, None
        index, src = scatter_index(node), scatter_source(node)
        if node.args[0] in row_values or index in row_values or src not in row_values:
            return "scatters by an unsharded index or into an unsharded base", None
        if not (aligned(src, extent) and aligned(index, extent)):
            return "scatters rows of another shape", None
        if target is not aten.index_add.default and not _torch_api.same_shape(index.meta["val"].shape,
                                                                              src.meta["val"].shape):
            return "scatters by an index of another shape than its source", None
        return "reduction", extent
    if not isinstance(val, torch.Tensor) or not aligned(node, extent):
        return "mixes or changes the rows", None
    if target in ROW_VIEWS:
        src = node.args[0].meta["val"]
        if target is aten.unsqueeze.default and node.args[1] % (src.ndim + 1) == 0:
            return "adds a dim before the rows", None
        if target in (aten.squeeze.dim, aten.squeeze.dims) and 0 in _as_dims(node.args[1], src.ndim):
            return "squeezes the row dim", None
        if target is aten.expand.default and len(node.args[1]) != src.ndim:
            return "expands with new leading dims", None
        if target in RESHAPES_OR_EXPAND and not all(isinstance(d, int) for d in val.shape[1:]):
            return "reshapes to symbolic trailing dims", None
        return "row", extent
    if target in catalogue.ELEMENTWISE or catalogue.is_deterministic_pointwise(target):
        for operand in node.all_input_nodes:
            v = operand.meta.get("val")
            if operand in row_values and v.ndim != val.ndim:
                return "broadcasts the rows against another dim", None
            if isinstance(v, torch.Tensor) and v.ndim == val.ndim and not _torch_api.known_equal(v.shape[0], 1) \
                    and not aligned(operand, extent):
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
    if target in RESHAPES and src is not None and node.args[0] in row_values:
        if _torch_api.known_equal(val.shape[0], extent.length) and list(val.shape[1:]) == list(src.shape[2:]):
            return "row", dataclasses.replace(extent, cols=None)
        return "reshapes a per-sequence view otherwise", None
    if target in ROW_SUMS:
        dims = reduced_dims(node)
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
            elif isinstance(v, torch.Tensor) and per_sequence_alignment(v, val) is None:
                return "broadcasts an operand of another shape against a per-sequence view", None
        return "row", extent
    return "is not known to be row-wise (on a per-sequence view)", None


def per_sequence_alignment(operand, val) -> str | None:
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


def scatter_index(node):
    return node.args[1][0] if node.target is aten.index_put.default else node.args[2]


def scatter_source(node):
    return node.args[2] if node.target is aten.index_put.default else node.args[3]


def _common_range(node, row_values):
    """The one range of the row values `node` reads; None if they differ."""
    ranges = [row_values[i] for i in node.all_input_nodes if i in row_values]
    if not ranges:  # reads only a split: classified by its getitems
        return Range(0, 0)
    return ranges[0] if all(r.same(ranges[0]) for r in ranges) else None


def _sliced(node, extent: Range):
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
        return "row", Range(extent.start + begin, max(0, stop - begin))
    if node.target is aten.narrow.default:
        begin, length = node.args[2], node.args[3]
        if not (isinstance(n, int) and isinstance(begin, int) and isinstance(length, int)):
            return "narrows the rows at symbolic bounds", None
        begin = begin % n if begin < 0 else begin
        return "row", Range(extent.start + begin, length)
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
    return "split", [Range(extent.start + b, k) for b, k in zip(offsets, sizes)]


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
            carries[node] = node.target is UNSHARD or any(carries.get(a, False) for a in _grad_edges(node))
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


def row_operand_ndim(node, operand) -> int:
    """The rank an operand of `node` has when it holds one row per row of `node`'s rows (a
    lower-rank operand broadcasts along the trailing dims instead)."""
    val = node.meta.get("val")
    if node.target in ROW_SUMS or node.target in SCATTERS or not isinstance(val, torch.Tensor):
        return operand.meta["val"].ndim
    return val.ndim


def _phases(graph, reductions) -> dict:
    """How many sums over ranks each reduction waits for: 0 unless its rows read values computed
    from another reduction (GSPO's per-sequence ratio, OPSM's sequence mask). One pass in graph
    order: a node waits for as many sums as the most any input waits for, a reduction's result for
    one more."""
    waits, phase = {}, {}
    for node in graph.nodes:
        waits[node] = max((waits[i] for i in node.all_input_nodes), default=0)
        if node in reductions:
            phase[node] = waits[node]
            waits[node] += 1
    return phase


# ---- helpers -------------------------------------------------------------------------------------
def aligned(n, extent: Range) -> bool:
    """A tensor whose dim 0 has one row per row of `extent`."""
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return isinstance(v, torch.Tensor) and v.ndim >= 1 and _torch_api.known_equal(v.shape[0], extent.length)


def reduced_dims(node) -> set:
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


def describe(node) -> str:
    target = node.target
    if node.op == "placeholder":
        return f"input {node.name}"
    return getattr(target, "__name__", str(target)).replace(".default", "")
