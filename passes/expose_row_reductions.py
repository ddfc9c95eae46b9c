"""Rewrite reductions that hide row-local math into a reduction over the vocabulary, then over rows.

A region is the row-local math from `[rows, V]` to `[rows]`; a loss that reduces over rows and
vocabulary in one op hides it. Each rewrite below computes the same value (up to the order of a
floating-point sum) from per-row terms a region can take in:

- `cross_entropy(x, t)` reduced ('mean' or 'sum', no class weights, any label smoothing): its
  per-token form and `sum(...) / count(t != ignore_index)`, as torch's own kernel averages;
- `kl_div(input, target, reduction, log_target)`: its pointwise terms (`exp(t) * (t - x)`, or
  `xlogy(t, t) - t * x`, as torch spells them), a sum over the vocabulary, then the reduction;
- a full `sum` or `mean` of a `[*rows, V]` value computed from a softmax (a KL written out
  with `.sum()`): a sum over the vocabulary, then over the rows;
- `logsumexp(stack([a, b, ...]), 0)` of equally shaped values (GKD's generalised JSD mixture):
  `logaddexp(a, logaddexp(b, ...))`, pointwise.

A low-precision reduction sums in fp32 and rounds once, as torch's reduced kernels do.
"""

from __future__ import annotations

import functools

import torch

from graphpass._torch_api import detect_fake_mode, fake_node
from graphpass.analysis import catalogue, rowlocal

aten = torch.ops.aten

_REDUCED_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default}
_NONE, _MEAN, _SUM = 0, 1, 2  # torch's Reduction enum
_FULL_REDUCTIONS = {aten.sum.default, aten.mean.default, aten.sum.dim_IntList, aten.mean.dim}


def expose_row_reductions_pass(gm, example_inputs, *, config, record) -> torch.fx.GraphModule:
    """Apply every rewrite of the module docstring to `gm`, in place."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if node.target in _REDUCED_LOSSES:
            _split_reduced_loss(graph, node)
        elif node.target is aten.kl_div.default:
            _split_kl_div(graph, node)
        elif node.target in _FULL_REDUCTIONS:
            _split_full_reduction(graph, node)
        elif node.target is aten.logsumexp.default:
            _stacked_logsumexp_as_logaddexp(graph, node)
    graph.eliminate_dead_code()
    return gm


class _Builder:
    """New nodes before `node`, with example values and `node`'s stack trace; `done(value)`
    replaces `node` by `value`."""

    def __init__(self, graph, node):
        self.graph, self.node = graph, node
        self.fake_mode = detect_fake_mode([node.meta["val"]])

    def __call__(self, target, *args, **kwargs):
        with self.graph.inserting_before(self.node):
            out = fake_node(self.graph, self.fake_mode, target, args, kwargs)
        if "stack_trace" in self.node.meta:
            out.meta["stack_trace"] = self.node.meta["stack_trace"]
        return out

    def reduce(self, terms, reduction: int):
        """`terms` ([*rows, V]) summed over the vocabulary, then reduced as `reduction` over all
        of it (a mean divides by its number of elements), in the node's dtype."""
        dtype = self.node.meta["val"].dtype
        low = dtype in (torch.bfloat16, torch.float16)
        acc = {"dtype": torch.float32} if low else {}
        total = self(aten.sum.default, self(aten.sum.dim_IntList, terms, [-1], **acc))
        if reduction == _MEAN:
            total = self(aten.div.Tensor, total, terms.meta["val"].numel())
        return self(aten._to_copy.default, total, dtype=dtype) if low else total

    def done(self, value):
        self.node.replace_all_uses_with(value)
        self.graph.erase_node(self.node)


def _split_reduced_loss(graph, node) -> None:
    args = rowlocal.normalized_args(node)
    logits, target = args["self"], args["target"]
    target_val = target.meta.get("val") if isinstance(target, torch.fx.Node) else None
    if (args["reduction"] not in (_MEAN, _SUM) or args.get("weight") is not None
            or not isinstance(target_val, torch.Tensor) or target_val.is_floating_point()
            or target_val.ndim < 1 or not isinstance(args["ignore_index"], int)):
        return
    build = _Builder(graph, node)
    kw = {k: args[k] for k in ("ignore_index", "label_smoothing") if k in args}
    per_token = build(node.target, logits, target, None, _NONE, *kw.values())
    low = node.meta["val"].dtype in (torch.bfloat16, torch.float16)
    total = build(aten.sum.default, per_token, dtype=torch.float32) if low else build(aten.sum.default, per_token)
    if args["reduction"] == _MEAN:
        total = build(aten.div.Tensor, total, build(aten.sum.default, build(aten.ne.Scalar, target, args["ignore_index"])))
    build.done(build(aten._to_copy.default, total, dtype=node.meta["val"].dtype) if low else total)


def _split_kl_div(graph, node) -> None:
    args = rowlocal.normalized_args(node)
    x, y = args["self"], args["target"]
    if not all(isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor) for v in (x, y)):
        return
    if x.meta["val"].shape != y.meta["val"].shape or x.meta["val"].ndim < 2:
        return  # a broadcasting kl_div is not a per-row sum
    build = _Builder(graph, node)
    if args.get("log_target", False):
        terms = build(aten.mul.Tensor, build(aten.exp.default, y), build(aten.sub.Tensor, y, x))
    else:
        terms = build(aten.sub.Tensor, build(aten.xlogy.Tensor, y, y), build(aten.mul.Tensor, y, x))
    if args["reduction"] == _NONE:
        build.done(terms)
    else:
        build.done(build.reduce(terms, args["reduction"]))


def _split_full_reduction(graph, node) -> None:
    x = node.args[0]
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.ndim < 2 or not val.is_floating_point():
        return
    args = rowlocal.normalized_args(node)
    dims = args.get("dim")
    if dims is not None and sorted(d % val.ndim for d in dims) != list(range(val.ndim)):
        return  # a reduction over some dims only
    if args.get("keepdim") or args.get("dtype") is not None or not _from_normaliser(x):
        return
    build = _Builder(graph, node)
    build.done(build.reduce(x, _MEAN if node.target in (aten.mean.default, aten.mean.dim) else _SUM))


def _stacked_logsumexp_as_logaddexp(graph, node) -> None:
    stacked, dims = node.args[0], node.args[1]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if not (isinstance(stacked, torch.fx.Node) and stacked.target is aten.stack.default and list(dims) == [0]
            and not keepdim and (stacked.args[1] if len(stacked.args) > 1 else 0) == 0 and len(stacked.users) == 1):
        return
    parts = stacked.args[0]
    vals = [p.meta.get("val") if isinstance(p, torch.fx.Node) else None for p in parts]
    if len(parts) < 2 or any(not isinstance(v, torch.Tensor) or v.shape != vals[0].shape or v.dtype != vals[0].dtype
                             for v in vals):
        return
    build = _Builder(graph, node)
    build.done(functools.reduce(lambda a, b: build(aten.logaddexp.default, a, b), parts))


def _from_normaliser(node, depth: int = 12) -> bool:
    """Whether `node` is computed, through values of its own shape, from a softmax-family op."""
    shape, todo, seen = node.meta["val"].shape, [node], set()
    while todo and depth:
        depth -= 1
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if catalogue.normalises(n):
            return True
        todo.extend(a for a in n.all_input_nodes
                    if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].shape == shape)
    return False
