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
the partial results over the group: one `cp_sum_over_ranks` for all the reductions that do not
depend on one another (a GSPO or OPSM loss, whose token math reads per-sequence values, needs a
second). Its backward is `unshard`'s: each rank's loss is the whole loss, so no gradient crosses
ranks.

All or nothing, per graph: if anything reads an unsharded value otherwise (a graph output, an op
that mixes rows, rows of another layout), or an operand of the row-wise math may carry a gradient
(an input that requires grad, a per-sequence value read back per token without `detach`: on local
rows each rank would get only its share of that gradient), every `unshard` stays as it is, with
the reason recorded. The rewrite depends on the graph alone, never on values or on whether the
local values require grad, so all ranks issue the same collectives.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis.cp_rows import (RESHAPES_OR_EXPAND, SCATTERS, SLICES, UNSHARD, CantLocalize, Plan, aligned,
                                        per_sequence_alignment, plan_localization, reduced_dims, row_operand_ndim,
                                        scatter_index, scatter_source)
from graphpass.analysis.regions import source_of
from graphpass.ops.cp_shards import sum_over_ranks_bytes
from graphpass.ops.groups import rank_and_size
from graphpass.records import CollectiveRecord, CpRecord

aten = torch.ops.aten

__all__ = ["localize_cp_reductions_pass"]

_SUM_OVER_RANKS = torch.ops.graphpass.cp_sum_over_ranks.default


def localize_cp_reductions_pass(gm: torch.fx.GraphModule, example_inputs, *, config, record) -> torch.fx.GraphModule:
    """Reductions of unsharded values -> local reductions + one sum over ranks (see the module doc)."""
    unshards = list(gm.graph.find_nodes(op="call_function", target=UNSHARD))
    if not unshards:
        return gm
    source = source_of(unshards[0])
    try:
        plan = plan_localization(gm, example_inputs, unshards)
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


# ---- rewrite -------------------------------------------------------------------------------------
def _rewrite(graph: torch.fx.Graph, plan: Plan) -> list:
    """Each row value of `plan` computed on the local rows, each reduction as this rank's partial,
    then one sum over the ranks per phase. Returns the collectives it inserted."""
    local = _LocalRows(graph, plan)
    local.localize_values()
    partials = {}
    for r, extent in plan.reductions.items():
        with graph.inserting_before(r):
            partials[r] = _partial(local.node, r, extent, plan.rows, local.twins,
                                   lambda a, c, extent=extent: local.local_of(a, c, extent), local.mask_of(extent),
                                   lambda of, extent=extent: local.row_index(extent, of), local.fake_mode, graph)
    return _sum_over_ranks(graph, plan, local.node, partials)


class _LocalRows:
    """The local rows of a plan's values, built in `graph`: each row value's local twin and what
    they read (row masks, row indices, replicated operands read at the local rows), each made once."""

    def __init__(self, graph: torch.fx.Graph, plan: Plan):
        self.graph, self.plan = graph, plan
        rows = plan.rows
        self.fake_mode = _torch_api.detect_fake_mode([rows.local_rows.meta["val"]])
        self.first_value = next(iter(plan.row_values))
        node = self.node
        # Padding rows compute what one real local row computes (a copy of its values, detached),
        # so that no padding row can make an inf or NaN that the single-device program does not;
        # the reductions then leave them out. `first`: the local row holding the last global row.
        with graph.inserting_before(self.first_value):
            self.valid = node(aten.ge.Scalar, rows.local_rows, 0)
            first = node(aten.unsqueeze.default, node(aten.argmax.default, rows.local_rows), 0)
            self.fill_rows = node(aten.where.self, self.valid, rows.local_rows,
                                  node(aten.clamp_min.default, node(aten.index_select.default, rows.local_rows, 0,
                                                                    first), 0))
            self.twins = {u: node(aten.where.self, _row_mask(node, self.valid, u.args[0]), u.args[0],
                                  node(aten.detach.default, node(aten.index_select.default, u.args[0], 0, first)))
                          for u in plan.row_values if u.target is UNSHARD}
        self.masks, self.reads = {}, {}

    def node(self, target, *args, like=None, **kwargs):
        return _torch_api.fake_node(self.graph, self.fake_mode, target, args, kwargs, like)

    def whole(self, extent) -> bool:
        return extent.start == 0 and _torch_api.known_equal(extent.length, self.plan.total)

    def mask_of(self, extent):
        """The local rows that hold a row of `extent` (real rows only)."""
        if self.whole(extent):
            return self.valid
        key = (extent.start, extent.length)
        if key not in self.masks:
            rows = self.plan.rows.local_rows
            with self.graph.inserting_before(self.first_value):
                self.masks[key] = self.node(aten.logical_and.default, self.node(aten.ge.Scalar, rows, extent.start),
                                            self.node(aten.lt.Scalar, rows, extent.start + extent.length))
        return self.masks[key]

    def local_of(self, a, consumer, extent):
        """The local rows of `a`, as `consumer` reads it in `extent`: its local twin, the replicated
        `a` read at the local rows, or `a` itself (a broadcast operand)."""
        if not isinstance(a, torch.fx.Node):
            return a
        if a in self.twins:
            return self.twins[a]
        if extent.cols is not None:
            return self.per_sequence_operand(a, consumer, extent)
        key = (a, extent.start)
        if key not in self.reads and aligned(a, extent) and a.meta["val"].ndim == row_operand_ndim(consumer, a):
            self.reads[key] = self.node(aten.index_select.default, a, 0, self.row_index(extent, "rows"), like=a)
        return self.reads.get(key, a)

    def row_index(self, extent, of: str):
        """Per local row: its row in `extent` ("rows": row i of a value is global row start + i),
        its sequence ("seq") or its position in its sequence ("col"), clamped into range (rows
        outside the range are left out later)."""
        if of == "rows" and self.whole(extent):
            return self.fill_rows
        key = (extent.start, extent.length, extent.cols, of)
        if key not in self.reads:
            node = self.node
            with self.graph.inserting_before(self.first_value):
                index = node(aten.clamp.default, node(aten.sub.Tensor, self.fill_rows, extent.start), 0,
                             max(0, extent.length - 1))
                if of == "seq":
                    index = node(aten.div.Tensor_mode, index, extent.cols, rounding_mode="floor")
                elif of == "col":
                    index = node(aten.remainder.Scalar, index, extent.cols)
                self.reads[key] = index
        return self.reads[key]

    def per_sequence_operand(self, a, consumer, extent):
        """A replicated operand of `[B, S, ...]` math, as `[T_local or 1, ...]` against the local rows."""
        v, val = a.meta["val"], consumer.meta["val"]
        how = per_sequence_alignment(v, val) if isinstance(v, torch.Tensor) else None
        if how is None:
            return a
        key = (a, extent.start, extent.length, extent.cols)
        if key not in self.reads:
            missing = val.ndim - v.ndim
            trailing = list(v.shape[2 - missing:]) if missing < 2 else list(v.shape)
            if how == "bcast":
                self.reads[key] = a if missing >= 2 else self.node(aten.reshape.default, a, trailing or [])
            else:
                flat = self.node(aten.reshape.default, a, [-1, *trailing])
                self.reads[key] = self.node(aten.index_select.default, flat, 0, self.row_index(extent, how), like=a)
        return self.reads[key]

    def localize_values(self) -> None:
        """Each row value's local twin, in graph order (an unshard's twin is made in `__init__`)."""
        twins, node = self.twins, self.node
        for value, extent in self.plan.row_values.items():
            if value.target is UNSHARD:
                continue
            if value.target in RESHAPES_OR_EXPAND and self.plan.row_values.get(value.args[0], extent).cols != extent.cols:
                twins[value] = twins[value.args[0]]  # [T, ...] <-> [B, S, ...]: the local rows stay flat
                continue
            with self.graph.inserting_before(value):
                if value.target in SLICES or value.target is operator.getitem:
                    # A slice keeps every local row; only its range's rows pass a gradient back.
                    source = twins[value.args[0] if value.target in SLICES else value.args[0].args[0]]
                    twins[value] = node(aten.where.self, _row_mask(node, self.mask_of(extent), source), source,
                                        node(aten.detach.default, source), like=value)
                    continue
                args = torch.fx.node.map_arg(value.args, lambda a: self.local_of(a, value, extent))
                kwargs = torch.fx.node.map_arg(value.kwargs, lambda a: self.local_of(a, value, extent))
                if value.target in RESHAPES_OR_EXPAND:  # the same shape with the local row count
                    args = (args[0], [-1, *value.meta["val"].shape[1:]]) + tuple(args[2:])
                twins[value] = node(value.target, *args, like=value, **kwargs)


def _sum_over_ranks(graph: torch.fx.Graph, plan: Plan, node, partials: dict) -> list:
    """One sum over the ranks per phase of the reductions' partials; each reduction's readers read
    its total (a scatter's base added once). Returns the collectives."""
    collectives = []
    for phase in sorted(set(plan.phase.values())):
        members = [r for r in plan.reductions if plan.phase[r] == phase]
        last = members[-1]
        with graph.inserting_after(partials[last]):
            summed = node(_SUM_OVER_RANKS, [partials[r] for r in members], plan.rows.group_name, like=last)
        collectives.append(CollectiveRecord("all_reduce", rank_and_size(plan.rows.group_name)[2],
                                            _hint_bytes([partials[r].meta["val"] for r in members])))
        for i, r in enumerate(members):
            with graph.inserting_after(summed):
                total_r = node(operator.getitem, summed, i)
            result = total_r
            if r.target in SCATTERS:  # the scatter's base, added once
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
    if r.target in SCATTERS:
        kept = _kept(node, mask, local[scatter_source(r)])
        index = local_of(scatter_index(r), r)
        base = node(aten.zeros_like.default, r.args[0])
        if r.target is aten.index_put.default:
            return node(r.target, base, [index], kept, True, like=r)
        return node(r.target, base, 0, index, kept, *r.args[4:], like=r, **r.kwargs)
    kept = _kept(node, mask, local[r.args[0]])
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
    dims, val = reduced_dims(r), r.args[0].meta["val"]
    x = _kept(node, mask, src)
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


def _kept(node, mask, src):
    """`src` on the local rows in `mask`, zero on the others (by `where`: a NaN there stays out)."""
    zero = node(aten.scalar_tensor.default, 0.0, dtype=src.meta["val"].dtype)
    return node(aten.where.self, _row_mask(node, mask, src), src, zero)


def _row_mask(node, valid, src):
    """`valid` shaped to broadcast over `src`'s trailing dims."""
    extra = src.meta["val"].ndim - 1
    return valid if extra == 0 else node(aten.view.default, valid, [-1] + [1] * extra)


def _count(node, r, extent, rows, fake_mode, graph):
    """How many elements the mean `r` averages: the rows times its other reduced dims (a float64 tensor)."""
    src = r.args[0].meta["val"]
    other = math.prod(src.shape[d] for d in reduced_dims(r) if d != 0)  # an int: checked by the plan
    if isinstance(extent.length, int):
        return node(aten.scalar_tensor.default, float(extent.length * other), dtype=torch.float64)
    # The whole range, of a symbolic T: read from the layout's [T] table, not from the unsharded value.
    size = node(aten.sym_size.int, rows.order, 0)
    if other != 1:
        size = node(operator.mul, size, other)
    return _torch_api.float64_tensor_node(graph, size, fake_mode)


# ---- helpers -------------------------------------------------------------------------------------
def _reduction_name(r) -> str:
    return r.target.__name__.split(".")[0]


def _hint_bytes(partials) -> int:
    with _torch_api.new_fake_mode():
        concrete = [torch.empty([_torch_api.size_hint(s) for s in p.shape], dtype=p.dtype) for p in partials]
    return sum_over_ranks_bytes(concrete)


def _unshard_record(u) -> CollectiveRecord:
    y = u.args[0].meta["val"]
    rows = _torch_api.size_hint(y.numel())
    return CollectiveRecord("all_gather", rank_and_size(u.args[3])[2], rows * y.dtype.itemsize)
