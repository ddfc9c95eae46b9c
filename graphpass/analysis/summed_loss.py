"""Whether a region's gradient can be computed in its forward: the loss is a sum of its rows.

A chunked op recomputes its wide values in backward because the gradient reaching its outputs is
known only then. When everything the gradient crosses between the region's outputs and the loss
is per-row math ending in one sum (or mean) over all rows, e.g. PPO's
`(clipped_surrogate(logp, old, adv) * mask).sum()`, that gradient is known up to one scalar: the
sum's own gradient `g`, the same for every row. The op can then take the per-row math in, compute
every input's gradient for `g = 1` while the chunk's wide values are at hand, and scale them by
`g` in backward (Liger-Kernel's trick, for any such loss). With an lm_head this saves the
backward's recompute of the logits, one of four GEMMs.

`match_summed_loss` says which nodes the op takes in, or why not. Read-only.
"""

from __future__ import annotations

import dataclasses

import torch

from graphpass.analysis import rowlocal
from graphpass.analysis.grad_flow import edges_carrying_grad, grad_flows

aten = torch.ops.aten

_TOTALS = {aten.sum.default: "sum", aten.sum.dim_IntList: "sum", aten.mean.default: "mean", aten.mean.dim: "mean"}


@dataclasses.dataclass
class SummedLoss:
    """`total = sum(summand)` (or mean) over all rows, the summand per-row math of the region's outputs."""

    nodes: list
    """The per-row nodes between the region's outputs and `summand` (inclusive), in graph order."""
    summand: torch.fx.Node
    total: torch.fx.Node
    reduction: str
    """"sum" or "mean"."""
    place: torch.fx.Node
    """The op goes after this node: the region's place or the last outside value the nodes read."""
    layouts: dict
    """The row layouts of `nodes`."""


def _reduction(node, operand) -> str | None:
    """"sum"/"mean" when `node` reduces all of `operand` to a 0-d value, else None."""
    kind = _TOTALS.get(node.target) if node.op == "call_function" else None
    if kind is None or node.args[0] is not operand:
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.ndim != 0 or val.dtype != operand.meta["val"].dtype:
        return None
    args = rowlocal.normalized_args(node)
    if args is None:
        return None
    dims = args.get("dim")
    ndim = operand.meta["val"].ndim
    if dims is not None and sorted(d % max(ndim, 1) for d in dims) != list(range(ndim)):
        return None
    return kind


def _passes_gradient(user, node, modes) -> bool:
    """Whether a gradient from the outputs reaches `node` through `user`."""
    return grad_flows(user) is not False and node in edges_carrying_grad(user, modes)


def match_summed_loss(region, modes, order) -> tuple[SummedLoss | None, str | None]:
    """The per-row math from `region`'s outputs to one sum over its rows, or (None, why not).

    (None, None): no output of the region carries a gradient (nothing to compute in forward).
    """
    from graphpass.analysis.regions import source_of

    inside = set(region.nodes)
    start = [o for o in region.outputs if grad_flows(o) is not False]
    if not start:
        return None, None
    layouts = dict(region.layouts)
    taken, totals, frontier = set(), [], list(start)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in inside or user in taken or user in totals or not _passes_gradient(user, node, modes):
                continue
            kind = _reduction(user, node)
            if kind is not None:
                totals.append(user)
                continue
            why = rowlocal.check(user, region.rows, layouts)
            if why is not None:
                return None, f"its outputs reach the loss through {rowlocal._name(user)} at {source_of(user)}: {why}"
            layouts[user] = rowlocal.node_layout(user, region.rows)
            taken.add(user)
            frontier.append(user)
    if len(totals) != 1:
        where = ", ".join(source_of(t) for t in totals) or "no sum over all rows"
        return None, f"its gradient reaches the loss through {len(totals)} sums of its rows ({where}), not one"
    total = totals[0]
    summand = total.args[0]
    # Only what the summand is computed from: other per-row math stays outside, gradient-free.
    nodes = sorted(_ancestors_within(summand, taken), key=order.__getitem__)
    if set(nodes) != taken:
        extra = min(taken - set(nodes), key=order.__getitem__)
        return None, f"{extra.name} at {source_of(extra)} carries a gradient but does not reach the sum"
    produced = inside | taken
    outside = [a for n in nodes for a in n.all_input_nodes if a not in produced]
    downstream = _descendants([*region.outputs, *nodes])
    for a in outside:
        if a in downstream:
            return None, f"its loss math reads {a.name}, computed from its own outputs"
    place = max([region.place, *outside], key=order.__getitem__)
    if not modes[place] or any(not modes[n] for n in nodes):
        return None, "its loss math runs under no_grad"
    return SummedLoss(nodes, summand, total, _reduction(total, summand), place, layouts), None


def _ancestors_within(node, allowed) -> set:
    """`node` and its ancestors, among `allowed`."""
    found, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in found or n not in allowed:
            continue
        found.add(n)
        todo.extend(n.all_input_nodes)
    return found


def _descendants(nodes) -> set:
    seen, todo = set(), list(nodes)
    while todo:
        for user in todo.pop().users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen
