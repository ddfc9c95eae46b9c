"""Row sums with their row-constant factors taken out, so that a kernel makes fewer passes per row.

A per-chunk kernel reads each wide row once per dependent reduction: the entropy of a
log-softmax, `-sum(exp(lsm) * lsm)` with `lsm = x - m - log(s)` and `s = sum(exp(x - m))`,
needs `s` before it can start, so it is a third pass over the row after the max's and the sum's.
Expanded into terms, each a row-constant coefficient times a product of wide factors,

    sum(exp(a - L) * (a - L))  =  exp(-L) * sum(exp(a) * a)  -  exp(-L) * L * sum(exp(a)),

its sums depend on `a = x - m` only: they run in the same pass as `s` (`sum(exp(a))` *is* `s`),
and a backward whose row sums expand to the same sums reads them from the forward (the joint's
common subexpressions are merged, and the split saves them as narrow row statistics), so it is
one pass too: read the logits, write the gradient.

Only constants that depend on another row sum are taken out (`L = log(s)` above, a gradient
arriving per row); the max shift stays inside `exp`, where it keeps the sum finite. Exact in real
arithmetic; in floating point, the sums differ from the user's by rounding, and they lose no
digits only where the terms cannot be large and opposite: `a - L` is taken apart, and `exp(a - L)`
becomes `exp(-L) * exp(a)`, only where `a` is a max-shifted value (`<= 0`) and `L` the log of a
sum of its exponentials (`>= 0`), so that each factor's terms share one sign and `exp(a)` is at
most 1. Spelled `x - logsumexp(x)`, the row constant is `m + log(s)` and `x` is not shifted: with
logits near 100 (a temperature of 0.1), `exp(x)` overflowed to a NaN entropy, and the smoothed
cross-entropy's `sum(x) - V * lse` lost 5 x eager's digits; such sums stay as written. Where the terms read
two wide inputs they are not taken apart: a KL's `sum(p * (lp - lq))` expands into sums over each
distribution that are large and nearly equal when the two are close, and their difference
cancels (TRL's JSD lost 14 x in its student's gradient, 6e-6 against eager's 4e-7, fp32); one
distribution's terms (the entropy's above: `a <= 0`, `L >= 0`, each term negative) do not. Nor
are sums in bf16 or fp16, whose every factored term would be rounded to a few bits.
"""

from __future__ import annotations

import itertools
import operator

import torch
import torch.fx

from graphpass._torch_api import schema_of
from graphpass.analysis.catalogue import is_deterministic_pointwise
from graphpass.fx_utils import hashable, transitive_users

aten = torch.ops.aten

_MAX_TERMS = 16
#: Sums in these dtypes stay as written: each factored term rounds to 8 (or 11) bits where the user's
#: sum rounds once (a bf16 temperature gradient 1.7 x further from float64 than eager's, seed 10323
#: of `bench.fuzz`). Math the user upcasts (`logits.float()`, as RL losses do) is factored.
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_ROW_SUM = aten.sum.dim_IntList


def factor_row_sums(gm: torch.fx.GraphModule, gradients: int = 0) -> bool:
    """Rewrite each last-dim sum of `gm` whose summand has a factorable row constant; merge the
    common subexpressions this makes. True if the graph changed (its new nodes lack example values).

    `gm`'s last `gradients` inputs are the gradients of a joint's outputs. Where the joint takes the
    gradient of a max shift (`_max_shift_gradients`), the sums that read them stay as written."""
    graph = gm.graph
    if any(_mutates(node) for node in graph.nodes):
        return False  # its values are not functions of its nodes (see `merge_common_subexpressions`)
    after_sum = _DependsOnRowSum()
    sources = _WideSources()
    changed = False
    inputs = list(graph.find_nodes(op="placeholder"))
    backward = (transitive_users(inputs[len(inputs) - gradients:]) if gradients and _max_shift_gradients(graph)
                else set())
    for node in list(graph.nodes):
        if not _is_row_sum(node) or node.meta["val"].dtype in _LOW_PRECISION or node in backward:
            continue
        summand = node.args[0]
        width = summand.meta["val"].shape[-1]
        terms = _Expansion(width, after_sum).terms(summand)
        if terms is None or not any(after_sum(c) for _, coefs, _ in terms for c in coefs):
            continue
        if len(set().union(*(sources(_factor_node(w)) for _, _, wide in terms for w in wide))) > 1:
            continue  # a difference of sums over two inputs would cancel (module doc)
        with graph.inserting_before(node):
            total = _emit(graph, terms, width, summand.meta["val"].device)
            if not _keepdim(node):
                total = graph.call_function(aten.squeeze.dim, (total, -1))
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        changed = True
    if changed:
        merge_common_subexpressions(graph)
        graph.eliminate_dead_code()
        gm.recompile()
    return changed


def _max_shift_gradients(graph: torch.fx.Graph) -> set:
    """The row sums that make the gradient of a max shift (`x - amax(x)` in the user's code): the
    sum over the row of the shifted values' gradient, which the backward of `amax` adds at the max.
    Exactly 0 in real arithmetic; in floating point eager's sum of its own rounded terms puts at the
    max what the row's gradient sums to, so the gradient sums to 0 and a sum of it against the
    logits (a temperature's gradient) is taken about the max. Factored, it would read the forward's
    sum, be 0 to rounding, and lose that: a per-token temperature's gradient 3 x eager's error
    (seed 405 of `bench.fuzz`). Such a backward keeps every sum as written, as eager computes them:
    kept alone, its compensation would be added to the other sums' factored (exactly normalised)
    terms and count twice (6 x eager's error in a temperature's gradient, seed 814)."""
    found, todo = set(), []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.eq.Tensor and any(isinstance(a, torch.fx.Node) and a.target is aten.amax.default
                                                 for a in node.args):
            # amax's backward: the gradient, divided among the ties, where `x == amax(x)`.
            todo += [u.args[0] if u.args[1] is node else u.args[1] for u in node.users if u.target is aten.mul.Tensor]
        elif node.target in (aten.scatter.src, aten.scatter_add.default) and _max_indices(node.args[2]):
            todo.append(node.args[3])  # max(dim)'s backward: the gradient scattered to its indices
    while todo:
        node = todo.pop()
        if not isinstance(node, torch.fx.Node) or node in found:
            continue
        if _is_row_sum(node):
            found.add(node)
        elif node.op == "call_function" and node.target in (aten.div.Tensor, aten.neg.default, aten.mul.Tensor):
            todo.extend(a for a in node.args if isinstance(a, torch.fx.Node) and _narrow(a))
    return found


def _max_indices(node) -> bool:
    """Whether `node` is the indices of a `max(x, dim)`."""
    return (isinstance(node, torch.fx.Node) and node.target is operator.getitem and node.args[1] == 1
            and isinstance(node.args[0], torch.fx.Node) and node.args[0].target is aten.max.dim)


def _narrow(node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and (val.ndim == 0 or val.shape[-1] == 1)


def merge_common_subexpressions(graph: torch.fx.Graph) -> None:
    """One node for each pure op applied to the same arguments (the first, in graph order). The
    graph must be functional: a value an in-place op changed would be merged with its old self."""
    if any(_mutates(node) for node in graph.nodes):
        raise ValueError("graphpass: merging common subexpressions of a graph with in-place ops")
    seen = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.is_impure() or not _is_pure(node.target):
            continue
        key = (node.target, hashable(node.args), hashable(node.kwargs))
        try:
            earlier = seen.setdefault(key, node)
        except TypeError:  # an unhashable constant argument
            continue
        if earlier is not node:
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)


def _mutates(node) -> bool:
    schema = schema_of(node.target)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _is_pure(target) -> bool:
    return is_deterministic_pointwise(target) or target in (
        _ROW_SUM, aten.amax.default, aten.gather.default, aten.expand.default, aten.arange.default,
        aten.sym_size.int, aten._to_copy.default, aten.squeeze.dim, aten.unsqueeze.default, aten.view.default)




def _is_row_sum(node) -> bool:
    if node.op != "call_function" or node.target is not _ROW_SUM or node.kwargs.get("dtype") is not None:
        return False
    summand, dims = node.args[0], node.args[1]
    val = summand.meta.get("val") if isinstance(summand, torch.fx.Node) else None
    return (isinstance(val, torch.Tensor) and val.ndim == 2 and isinstance(val.shape[-1], int)
            and val.is_floating_point() and list(dims) in ([-1], [1]))


def _keepdim(node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


class _DependsOnRowSum:
    """Whether a node's value depends on some last-dim row sum (memoised)."""

    def __init__(self):
        self._memo = {}

    def __call__(self, node) -> bool:
        if not isinstance(node, torch.fx.Node):
            return False
        if node not in self._memo:
            self._memo[node] = False  # no cycles in a graph; guards a revisit while computing
            self._memo[node] = _is_row_sum(node) or any(self(a) for a in node.all_input_nodes)
        return self._memo[node]


class _WideSources:
    """The wide (`[rows, V]`) placeholders a node's value depends on (memoised)."""

    def __init__(self):
        self._memo = {}

    def __call__(self, node) -> frozenset:
        if not isinstance(node, torch.fx.Node):
            return frozenset()
        if node not in self._memo:
            self._memo[node] = frozenset()
            if node.op == "placeholder":
                val = node.meta.get("val")
                wide = isinstance(val, torch.Tensor) and val.ndim == 2 and not _one(val.shape[-1])
                self._memo[node] = frozenset([node]) if wide else frozenset()
            else:
                self._memo[node] = frozenset().union(*(self(a) for a in node.all_input_nodes))
        return self._memo[node]


def _one(size) -> bool:
    return isinstance(size, int) and size == 1


def _factor_node(factor):
    """The graph node a wide factor of `_Expansion` reads."""
    return factor[1] if isinstance(factor, tuple) else factor


class _Expansion:
    """A summand as terms `(scale, coefficients, wide factors)`: their product, summed."""

    def __init__(self, width, after_sum):
        self.width = width
        self.after_sum = after_sum

    def terms(self, node):
        try:
            terms = self._expand(node)
        except _TooMany:
            return None
        return terms if len(terms) > 1 or terms[0][1] else None

    def _kind(self, x) -> str:
        """"const" (a number or 0-d), "row" ([rows, 1]) or "wide" ([rows, width])."""
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else x
        if not isinstance(val, torch.Tensor) or val.ndim == 0:
            return "const"
        if val.ndim == 2 and val.shape[-1] == 1:
            return "row"
        if val.ndim == 2 and val.shape[-1] == self.width:
            return "wide"
        return "other"

    def _expand(self, x):
        kind = self._kind(x)
        if kind in ("const", "row"):
            return [(1.0, (x,), ())]
        if kind != "wide" or x.op != "call_function":
            return [(1.0, (), (x,))]
        target, args = x.target, x.args
        if target is aten.expand.default and self._kind(args[0]) in ("const", "row"):
            return [(1.0, (args[0],), ())]
        if target in (aten.add.Tensor, aten.sub.Tensor) and len(args) == 2 and not x.kwargs:
            if any(self._kind(a) != "wide" and not self.after_sum(a) for a in args):
                return [(1.0, (), (x,))]  # e.g. the max shift: taken out, it would cancel in the sum
            if any(self._kind(a) != "wide" for a in args) and not _same_signs(target, *args):
                return [(1.0, (), (x,))]  # its terms could be large and opposite (module doc)
            sign = 1.0 if target is aten.add.Tensor else -1.0
            return self._limit(self._expand(args[0]) + [(sign * s, c, w) for s, c, w in self._expand(args[1])])
        if target is aten.neg.default:
            return [(-s, c, w) for s, c, w in self._expand(args[0])]
        if target is aten.mul.Tensor and len(args) == 2:
            return self._limit([(s1 * s2, c1 + c2, w1 + w2) for (s1, c1, w1), (s2, c2, w2)
                                in itertools.product(self._expand(args[0]), self._expand(args[1]))])
        if target is aten.where.ScalarOther and args[2] == 0 and self._kind(args[1]) in ("const", "row"):
            return [(1.0, (args[1],), (("indicator", args[0]),))]  # where(c, g, 0) = g * where(c, 1, 0)
        if target is aten.exp.default:
            inner = args[0]
            if (isinstance(inner, torch.fx.Node) and inner.target is aten.sub.Tensor and len(inner.args) == 2
                    and self._kind(inner.args[1]) == "row" and self.after_sum(inner.args[1])
                    and _same_signs(aten.sub.Tensor, *inner.args)):
                # exp(a - L) = exp(-L) * exp(a): the row constant L comes out of the sum.
                return [(1.0, (("exp_neg", inner.args[1]),), (("exp", inner.args[0]),))]
        return [(1.0, (), (x,))]

    @staticmethod
    def _limit(terms):
        if len(terms) > _MAX_TERMS:
            raise _TooMany
        return terms


class _TooMany(Exception):
    pass


def _same_signs(target, wide, row) -> bool:
    """Whether `wide - row` (target sub) has terms of one sign: `wide` max-shifted (`<= 0`) and
    `row` the log of a sum of exponentials of a max-shifted value (`>= 0`)."""
    return target is aten.sub.Tensor and _max_shifted(wide) and _log_sum_exp_shifted(row)


def _max_shifted(node) -> bool:
    """`y - amax(y, -1, keepdim=True)`: at most 0 (a -inf column stays -inf)."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.sub.Tensor
            and len(node.args) == 2 and isinstance(node.args[1], torch.fx.Node)):
        return False
    y, m = node.args
    m = _through_aliases(m)
    return (m.op == "call_function" and m.target is aten.amax.default and m.args[0] is y
            and list(m.args[1]) in ([-1], [1]) and bool(m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim")))


def _log_sum_exp_shifted(node) -> bool:
    """`log(sum(exp(a), -1, keepdim=True))` with `a` max-shifted: at least log(1) = 0."""
    node = _through_aliases(node)
    if not (node.op == "call_function" and node.target is aten.log.default):
        return False
    total = node.args[0]
    if not (isinstance(total, torch.fx.Node) and _is_row_sum(total) and _keepdim(total)):
        return False
    e = total.args[0]
    return (isinstance(e, torch.fx.Node) and e.op == "call_function" and e.target is aten.exp.default
            and _max_shifted(e.args[0]))


def _through_aliases(node):
    """The value under detaches and aliases (a detached max shifts the same)."""
    while (isinstance(node, torch.fx.Node) and node.op == "call_function"
           and node.target in (aten.detach.default, aten.alias.default)):
        node = node.args[0]
    return node


def _emit(graph, terms, width, device):
    """`sum_t scale_t * prod(coefficients_t) * sum(prod(wide factors_t), -1, keepdim=True)`, with
    equal wide products summed once."""
    by_product: dict = {}
    for scale, coefs, wide in terms:
        by_product.setdefault(tuple(sorted(wide, key=_order)), []).append((scale, coefs))
    total = None
    for wide, parts in by_product.items():
        if wide:
            product = _product(graph, [_node(graph, w) for w in wide], device)
            row_sum = graph.call_function(_ROW_SUM, (product, [-1], True))
        else:
            row_sum = float(width)  # a sum of row constants over the row
        coefficient = None
        for scale, coefs in parts:
            c = _product(graph, [_node(graph, f) for f in coefs], device, scale)
            coefficient = c if coefficient is None else graph.call_function(aten.add.Tensor, (coefficient, c))
        value = graph.call_function(aten.mul.Tensor, (coefficient, row_sum))
        total = value if total is None else graph.call_function(aten.add.Tensor, (total, value))
    return total


def _product(graph, factors, device, scale=1.0):
    result = None
    for f in factors:
        result = f if result is None else graph.call_function(aten.mul.Tensor, (result, f))
    if result is None:  # on the kernel's device: a CPU scalar in a CUDA kernel is a second device
        return graph.call_function(aten.scalar_tensor.default, (scale,), {"dtype": torch.float32, "device": device})
    return result if scale == 1.0 else graph.call_function(aten.mul.Tensor, (result, scale))


def _node(graph, factor):
    """The node for a factor: an existing value, or one of the forms `_Expansion` introduces."""
    if isinstance(factor, tuple):
        form, arg = factor
        if form == "exp":
            return graph.call_function(aten.exp.default, (arg,))
        if form == "exp_neg":
            return graph.call_function(aten.exp.default, (graph.call_function(aten.neg.default, (arg,)),))
        if form == "indicator":
            return graph.call_function(aten.where.Scalar, (arg, 1.0, 0.0))
    return factor


def _order(factor):
    """A stable order of wide factors, so that equal products are spelled alike."""
    form, node = factor if isinstance(factor, tuple) else ("", factor)
    return (node.name if isinstance(node, torch.fx.Node) else repr(node), form)
