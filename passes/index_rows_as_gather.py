"""Rewrite `x[arange(d0), ..., t]`, each row's entry picked by advanced indexing, into a gather.

Before::

    rows = aten.arange.default(T)
    picked = aten.index.Tensor(log_probs, [rows, target])      # log_probs [T, V] -> [T]

After::

    picked = aten.squeeze.dim(aten.gather.default(log_probs, -1, unsqueeze(where(target < 0,
                                                                              target + V, target), -1)), -1)

Megatron's loss and hand-written log-probs pick each row's target logit this way
(`logits[torch.arange(T), target]`, `lp[b, s, t]` with broadcast aranges); the region analysis reads
gathers. Exact: every leading index must be `arange(0, d_i, 1)` varying along its own dim only (so
entry `p` of the result is `x[p, t[p]]`), the last an integer tensor broadcasting to the leading
shape. A negative target counts from the end, as indexing does (a gather would reject it); a target
outside `[-V, V)` raises, as indexing does. Any other indexing of a distribution is left as it is,
the reason recorded.
"""

from __future__ import annotations

import torch
import torch.fx

from graphpass._torch_api import detect_fake_mode, fake_node, same_shape, same_size
from graphpass.analysis import catalogue
from graphpass.analysis.regions import source_of
from graphpass.fx_utils import RESHAPES, arange_args, derives_from, fake_value
from graphpass.records import Rejection

aten = torch.ops.aten

# Ops that only give an arange size-1 dims around its one dim (its values stay in order).
_RESHAPES = RESHAPES | {aten.unsqueeze.default}


def index_rows_as_gather_pass(gm: torch.fx.GraphModule, example_inputs, *, config, record) -> torch.fx.GraphModule:
    """Each `aten.index.Tensor` that picks one entry per row of its last dim -> a gather."""
    changed = False
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.index.Tensor)):
        target = _row_target(node)
        if target is None:
            if _reads_a_distribution(node.args[0]):  # what the region analysis will not see
                record.rejected.append(Rejection(source_of(node), "indexing kept: it picks entries other than "
                                                 "one per row, as x[arange(T), t] does"))
            continue
        _replace(gm.graph, node, target, detect_fake_mode([fake_value(node.args[0])]))
        changed = True
    if changed:  # the aranges the picks read are dead now
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _row_target(node) -> torch.fx.Node | None:
    """The target index of `x[arange(d0), ..., arange(d_k-1), t]`, else None."""
    x, indices = node.args[0], node.args[1]
    x_val, out_val = fake_value(x), fake_value(node)
    if x_val is None or out_val is None or x_val.ndim < 2 or len(indices) != x_val.ndim:
        return None
    if not isinstance(x_val.shape[-1], int):  # the wrap of negative targets adds V as a constant
        return None
    lead = x_val.shape[:-1]
    *aranges, target = indices
    t_val = fake_value(target)
    if t_val is None or t_val.dtype not in (torch.int64, torch.int32) or t_val.ndim > len(lead):
        return None
    if any(not _is_arange_along(a, i, lead) for i, a in enumerate(aranges)):
        return None
    # The target broadcasts to the leading shape (right-aligned, size 1 or the same size).
    t_shape = (1,) * (len(lead) - t_val.ndim) + tuple(t_val.shape)
    if not all(same_size(s, 1) or same_size(s, d) for s, d in zip(t_shape, lead)):
        return None
    if not same_shape(t_val.shape, lead) and not all(isinstance(d, int) for d in lead):
        return None  # expanding it would need symbolic sizes as nodes
    return target if same_shape(out_val.shape, lead) else None


def _reads_a_distribution(x) -> bool:
    """Whether `x` is computed from a softmax, log-softmax or log-sum-exp (through any ops)."""
    return isinstance(x, torch.fx.Node) and derives_from(
        x, lambda n: n.op == "call_function" and n.target in catalogue.NORMALISERS)


def _is_arange_along(index, dim: int, lead) -> bool:
    """`index`, right-aligned to `lead`'s rank, is `arange(0, lead[dim], 1)` along `dim` (size 1
    elsewhere), reshaped only by adding size-1 dims."""
    val = fake_value(index)
    if val is None or val.ndim > len(lead):
        return False
    shape = (1,) * (len(lead) - val.ndim) + tuple(val.shape)
    if not all(same_size(s, 1) for i, s in enumerate(shape) if i != dim):
        return False
    node = index
    while node.op == "call_function" and node.target in _RESHAPES:
        node = node.args[0]
    bounds = arange_args(node)
    if bounds is None:
        return False
    start, end, step = bounds
    end = fake_value(end) if isinstance(end, torch.fx.Node) else end
    return start == 0 and step == 1 and same_size(end, lead[dim]) and same_size(shape[dim], lead[dim])


def _replace(graph: torch.fx.Graph, node, target, fake_mode) -> None:
    x = node.args[0]
    lead, vocab = fake_value(x).shape[:-1], fake_value(x).shape[-1]
    # The target's wrap goes right after the target, not before the pick: the region built around
    # the pick starts at its first op (the log-softmax, say, before a no_grad block the pick follows)
    # and its inputs must exist there. An integer value, the wrap does not care about grad mode.
    after = target if target.op != "placeholder" else list(graph.find_nodes(op="placeholder"))[-1]

    def add(op, *args, **kwargs):
        nonlocal after
        with graph.inserting_after(after):
            after = fake_node(graph, fake_mode, op, args, kwargs, like=target)
        return after

    t = target if fake_value(target).dtype == torch.int64 else add(aten._to_copy.default, target, dtype=torch.int64)
    wrapped = add(aten.where.self, add(aten.lt.Scalar, t, 0), add(aten.add.Tensor, t, vocab), t)
    if not same_shape(fake_value(wrapped).shape, lead):
        wrapped = add(aten.expand.default, wrapped, list(lead))
    index = add(aten.unsqueeze.default, wrapped, -1)
    with graph.inserting_before(node):
        picked = fake_node(graph, fake_mode, aten.gather.default, (x, -1, index), like=node)
        out = fake_node(graph, fake_mode, aten.squeeze.dim, (picked, -1), like=node)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
