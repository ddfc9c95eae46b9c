"""Whether a region's gradient can be computed in its forward: the loss is a sum of its rows.

A chunked op recomputes its wide values in backward because the gradient reaching its outputs is
known only then. When everything the gradient crosses between the region's outputs and the loss
is per-row math ending in one sum (or mean) over all rows, e.g. PPO's
`(clipped_surrogate(logp, old, adv) * mask).sum()`, that gradient is known up to one scalar: the
sum's own gradient `g`, the same for every row. The op can then take the per-row math in, compute
every input's gradient for `g = 1` while the chunk's wide values are at hand, and scale them by
`g` in backward (Liger-Kernel's trick, for any such loss). With an lm_head this saves the
backward's recompute of the logits, one of four GEMMs.

Several sums are one scalar's too when the loss is affine in them, with coefficients computed
from values the region does not reach (`masked_mean(pg) - c * masked_mean(entropy)`: `1 / n`
and `-c / n`): the op gets the coefficients (the gradient each sum would receive for a loss
gradient of 1) and the loss's own gradient scales its gradients (`_affine_sink`).

`match_summed_loss` says which nodes the op takes in, or why not. Read-only.
"""

from __future__ import annotations

import dataclasses

import torch

from graphpass.analysis import rowlocal
from graphpass.analysis.grad_flow import edges_carrying_grad, grad_flows
from graphpass.fx_utils import target_name, transitive_users

aten = torch.ops.aten

_TOTALS = {aten.sum.default: "sum", aten.sum.dim_IntList: "sum", aten.mean.default: "mean", aten.mean.dim: "mean"}


@dataclasses.dataclass
class SummedLoss:
    """`totals[k] = sum(summands[k])` (or mean) over all rows, each summand per-row math of the
    region's outputs, and `sink`, the one value the gradient reaches the outputs through, an
    affine function of the totals with coefficients that do not depend on the region."""

    nodes: list
    """The per-row nodes between the region's outputs and the summands (inclusive), in graph order."""
    summands: list
    totals: list
    reductions: list
    """Per total: "sum" or "mean"."""
    sink: torch.fx.Node
    """A total, or the scalar the totals reach through `affine` (e.g. the loss itself)."""
    affine: list
    """`(node, operand, step)` in graph order: `node` is affine in `operand`, itself a total or an
    earlier node, with d node / d operand = `step` (see `AFFINE_STEPS`)."""
    place: torch.fx.Node
    """The op goes after this node: the region's place or the last outside value the op reads."""
    layouts: dict
    """The row layouts of `nodes`."""

    @property
    def factors(self) -> list:
        """The outside nodes the coefficients d sink / d total are computed from."""
        return [f for _, _, step in self.affine for f in step[1:] if isinstance(f, torch.fx.Node)]


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
    """The per-row math from `region`'s outputs to sums over its rows and on to one affine sink,
    or (None, why not).

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
                return None, f"its outputs reach the loss through {target_name(user)} at {source_of(user)}: {why}"
            layouts[user] = rowlocal.node_layout(user, region.rows)
            taken.add(user)
            frontier.append(user)
    returned = [n for n in [*start, *taken] if any(u.op == "output" for u in n.users)]
    if returned:
        # A gradient may reach it from outside the graph, which the loss's sums do not see.
        return None, f"its per-row value {returned[0].name} at {source_of(returned[0])} is returned"
    if not totals:
        return None, "its gradient reaches the loss through no sum over all rows"
    totals.sort(key=order.__getitem__)
    summands = [t.args[0] for t in totals]
    # Only what the summands are computed from: other per-row math stays outside, gradient-free.
    nodes = sorted(set().union(*(_ancestors_within(s, taken) for s in summands)), key=order.__getitem__)
    if set(nodes) != taken:
        extra = min(taken - set(nodes), key=order.__getitem__)
        return None, f"{extra.name} at {source_of(extra)} carries a gradient but does not reach a sum"
    produced = inside | taken
    outside = [a for n in nodes for a in n.all_input_nodes if a not in produced]
    downstream = transitive_users([*region.outputs, *nodes])
    for a in outside:
        if a in downstream:
            return None, f"its loss math reads {a.name}, computed from its own outputs"
    sink, affine = _affine_sink(totals, modes, order, downstream)
    if sink is None:
        if len(totals) > 1:
            where = ", ".join(source_of(t) for t in totals)
            return None, (f"its gradient reaches the outputs through {len(totals)} sums of its rows ({where}), "
                          "not through one value affine in them")
        sink, affine = totals[0], []
    loss = SummedLoss(nodes, summands, totals, [_reduction(t, s) for t, s in zip(totals, summands)], sink, affine,
                      region.place, layouts)
    loss.place = max([region.place, *outside, *loss.factors], key=order.__getitem__)
    if not modes[loss.place] or any(not modes[n] for n in nodes):
        return None, "its loss math runs under no_grad"
    return loss, None


# Scalar ops through which a value stays affine in its operand: the step d node / d operand is
# ("one",), ("neg",), ("mul", c), ("div", c) or ("cast",), with c a number or a node.
def _affine_steps(node, affine: set) -> list | None:
    """`(operand, step)` for each operand of `node` in `affine`, or None where `node` is not affine
    in them (a product of two of them, a division by one, an op not listed)."""
    args = rowlocal.normalized_args(node)
    if args is None:
        return None
    target = node.target
    operands = [a for a in node.all_input_nodes if a in affine]
    if target in (aten.mul.Tensor, aten.mul.Scalar):
        x, y = args["self"], args["other"]
        if len(operands) != 1 or x is y:
            return None
        return [(x, ("mul", y))] if x in affine else [(y, ("mul", x))]
    if target in (aten.div.Tensor, aten.div.Scalar):
        if operands != [args["self"]] or args.get("rounding_mode") is not None:
            return None
        return [(args["self"], ("div", args["other"]))]
    if target in (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar):
        alpha = args.get("alpha", 1)
        if isinstance(alpha, torch.fx.Node):
            return None
        steps = [(args["self"], ("one",))] if args["self"] in affine else []
        if args["other"] in affine:
            sign = -alpha if target in (aten.sub.Tensor, aten.sub.Scalar) else alpha
            steps.append((args["other"], ("one",) if sign == 1 else ("mul", sign)))
        return steps
    if target is aten.neg.default:
        return [(args["self"], ("neg",))]
    if target in (aten._to_copy.default, aten.to.dtype, aten.clone.default, aten.alias.default):
        return [(args["self"], ("cast",))]
    return None


def _affine_sink(totals, modes, order, dependent) -> tuple:
    """(sink, affine steps): the one value through which a gradient from the outputs reaches the
    totals, affine in them with coefficients computed from values outside `dependent` (the
    region's descendants); (None, None) where there is none."""
    affine, steps = set(totals), []
    for node in sorted(transitive_users(totals), key=order.__getitem__):
        val = node.meta.get("val")
        if node.op != "call_function" or not modes[node] or not isinstance(val, torch.Tensor) \
                or val.ndim != 0 or not val.is_floating_point():
            continue
        found = _affine_steps(node, affine)
        if not found or any(isinstance(f, torch.fx.Node) and f in dependent for _, step in found for f in step[1:]):
            continue
        affine.add(node)
        steps += [(node, operand, step) for operand, step in found]
    exits = [n for n in affine if any(u.op == "output" or (u not in affine and _passes_gradient(u, n, modes))
                                      for u in n.users)]
    if len(exits) != 1:
        return None, None
    [sink] = exits
    reaching = _ancestors_within(sink, affine)
    if not set(totals) <= reaching:
        return None, None
    return sink, [s for s in steps if s[0] in reaching]


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
