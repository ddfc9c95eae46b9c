"""Check a hand-written `autograd.Function`'s backward against the gradient of its forward's math.

A Function without collectives whose forward computes exactly log-probs and/or entropies
(`vocab_parallel.match_single_device`) may be replaced by that math, which graphpass then chunks
like any other, only if its backward is that math's gradient: a straight-through estimator, a
detached entropy or a plain bug would otherwise change silently. So the forward and the backward
are evaluated together on a few rows, in float64, and compared with autograd of the plain math:

* both bodies must be row by row (`rowlocal`, plus the few ops hand-written backwards scatter the
  target's gradient with), so that a few rows are exactly the computation on those rows;
* the probe rows are random logits at three scales, a row of ties and a flat one, with targets at
  0, V - 1 and on both sides of every integer the code compares token ids with;
* the code may branch on token ids only (compared with constants, which the targets straddle):
  an op that branches on float values (a comparison, `where` or `clamp` of logits) is an
  unchecked case, so such a Function stays as it is.

The math of these bodies is analytic away from those branches, so agreement at random points to
float64 precision means the same function. Anything the check cannot read keeps the Function, with
the reason in words about the user's code.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from graphpass._torch_api import set_grad_enabled
from graphpass.analysis import catalogue, rowlocal
from graphpass.analysis.lm_head import METADATA_CHECKS
from graphpass.analysis.rowlocal import ROW
from graphpass.fx_utils import arange_args, is_floating, target_name, value_or_constant

aten = torch.ops.aten

#: Relative error of the probe's gradient (and outputs) against autograd's, in float64.
TOLERANCE = 1e-9

_COMPARISONS = {aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge}
#: Ops whose result depends on which side of a threshold a value lies: position of that value.
_BRANCHING = {aten.where: 0, aten.masked_fill: 1, aten.clamp: 0, aten.clamp_min: 0, aten.clamp_max: 0,
              aten.abs: 0, aten.sign: 0, aten.relu: 0, aten.maximum: 0, aten.minimum: 0,
              aten.floor: 0, aten.ceil: 0, aten.round: 0, aten.trunc: 0}

#: Of these, the ones whose two operands may both be row statistics (`_branches_on_floats`).
_ROW_EXTREMES = {aten.maximum, aten.minimum}


def check_backward(joint, inputs, logits_position: int, target_position: int | None, kinds, temperature: float,
                   non_differentiable=()) -> str | None:
    """Why the backward of a Function is not the gradient of log-probs / entropies `kinds`
    ("logprob", "-entropy", ..., "empty" per output) of its logits input at `temperature`, or
    None when the probe shows it is.

    `joint`: the functional ATen graph `(*inputs, *grad_outputs) -> (*outputs, *grad_inputs)` of its
    forward then its backward (`grad_inputs` one per input, None where the backward returns
    None); `inputs`: fakes of its inputs, `logits_position` / `target_position` among them."""
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    logits_val = inputs[logits_position]
    vocab = logits_val.shape[-1]
    if not isinstance(vocab, int) or not all(isinstance(s, int) for s in logits_val.shape):
        return "its shapes are symbolic"
    rows = logits_val.numel() // vocab
    results = list(joint.graph.output_node().args[0])
    grads = results[len(kinds):]
    for i, grad in enumerate(grads):
        if i != logits_position and grad is not None:
            return f"its backward returns a gradient for its input {i + 1}, not the logits"
    if grads[logits_position] is None:
        return "its backward returns no gradient for the logits"
    why = _branches_on_floats(joint.graph, tuple(logits_val.shape[:-1]))
    if why is not None:
        return why
    probe, why = _per_row_program(joint, placeholders, rows)
    if probe is None:
        return why
    targets = _probe_targets(joint.graph, vocab)
    g = torch.Generator().manual_seed(0)
    x, target = _probe_rows(len(targets), vocab, g), torch.tensor(targets)
    grad_outputs = [torch.zeros(len(targets)) if i in non_differentiable or kind == "empty"
                    else torch.randn(len(targets), generator=g, dtype=torch.float64) for i, kind in enumerate(kinds)]
    args = []
    for i, p in enumerate(placeholders):
        if i == logits_position:
            args.append(x)
        elif i == target_position:
            args.append(target[:, None])
        elif not p.users:
            args.append(None)
        elif i >= len(inputs) and kinds[i - len(inputs)] == "empty":
            args.append(torch.zeros(p.meta["val"].shape, dtype=torch.float64))
        elif i >= len(inputs):
            args.append(grad_outputs[i - len(inputs)][:, None].to(torch.float64))
        else:
            return f"it reads an input besides its logits and target ({p.name})"
    try:
        with torch.no_grad():
            got = probe(*args)
    except Exception as e:  # noqa: BLE001 - a probe that does not run checks nothing
        return f"its forward and backward do not run on a few rows ({type(e).__name__}: {str(e).splitlines()[0]})"
    want_outputs, want_grad = _reference(x, target, kinds, temperature, grad_outputs, non_differentiable)
    for j, kind in enumerate(kinds):
        if kind != "empty" and not _close(got[j].reshape(-1), want_outputs[j]):
            return "its forward does not evaluate to its log-prob or entropy row by row"
    if not _close(got[len(kinds)], want_grad):
        return "its backward is not the gradient of its forward's math (checked on a few rows in float64)"
    return None


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    got = got.to(torch.float64).reshape(want.shape)
    scale = want.abs().max().clamp_min(1e-300)
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max() / scale) <= TOLERANCE


def _reference(x, target, kinds, temperature, grad_outputs, non_differentiable):
    """Autograd of the plain math: the outputs, and the logits' gradient for `grad_outputs`."""
    x = x.clone().requires_grad_()
    logp = torch.log_softmax(x / temperature, dim=-1)
    values = {"logprob": logp.gather(-1, target[:, None])[:, 0], "entropy": -(logp.exp() * logp).sum(-1)}
    outputs, total = [], 0
    for i, kind in enumerate(kinds):
        if kind == "empty":
            outputs.append(None)
            continue
        value = values[kind.lstrip("-")] * (-1 if kind.startswith("-") else 1)
        outputs.append(value.detach())
        if i not in non_differentiable:
            total = total + (value * grad_outputs[i]).sum()
    (grad,) = torch.autograd.grad(total, x) if isinstance(total, torch.Tensor) else (torch.zeros_like(x),)
    return outputs, grad


def _probe_rows(n: int, vocab: int, g) -> torch.Tensor:
    """Logits at unit, peaked and flat scales, one row of ties (every value the row's max)."""
    x = torch.randn(n, vocab, generator=g, dtype=torch.float64)
    scales = torch.tensor([1.0, 8.0, 1e-3, 1.0, 3.0, 0.3])
    x = x * scales.repeat(-(-n // len(scales)))[:n, None]
    if n > 3:
        x[3] = 0.5  # ties
    return x


def _probe_targets(graph: torch.fx.Graph, vocab: int) -> list[int]:
    """0, V - 1, some inner ids, and both sides of every integer constant a comparison or a clamp reads."""
    targets = {0, vocab - 1, vocab // 2, 1 % vocab, (7 * vocab) // 9}
    for node in graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        if node.op == "call_function" and (packet in _COMPARISONS or packet in _BRANCHING):
            for a in node.args:
                if isinstance(a, int) and not isinstance(a, bool):
                    targets.update(t for t in (a - 1, a, a + 1) if 0 <= t < vocab)
    for k in range(8):  # at least 8 rows where the vocabulary allows
        if len(targets) >= 8:
            break
        targets.add((k * 37 + 3) % vocab)
    return sorted(targets)


def _branches_on_floats(graph: torch.fx.Graph, row_shape: tuple) -> str | None:
    """Why the code branches on a float value (the probe could miss one side), or None.

    A value derived only from integer tensors and constants (token ids) may be compared, and
    what branches on such a comparison selects analytic pieces alike on every row. The larger of
    two row statistics (an online log-sum-exp's running max, `maximum(m, block.amax(-1))`) is one
    too: which side wins varies from probe row to probe row, as `amax`'s argmax does."""
    from_floats = set()  # nodes whose value depends on a float tensor
    for node in graph.nodes:
        if node.op == "placeholder":
            if is_floating(node):
                from_floats.add(node)
            continue
        if node.op != "call_function":
            continue
        inputs = [a for a in node.all_input_nodes if a in from_floats]
        if inputs or is_floating(node):
            from_floats.add(node)
        packet = getattr(node.target, "overloadpacket", None)
        if packet in _COMPARISONS and inputs:
            return f"its code compares float values ({target_name(node)}), which a probe cannot check on every side"
        if packet in _ROW_EXTREMES and len(inputs) == 2 and tuple(node.meta["val"].shape) == row_shape \
                and all(tuple(a.meta["val"].shape) == row_shape for a in inputs):
            continue
        if packet in _BRANCHING:
            decided = node.args[_BRANCHING[packet]] if len(node.args) > _BRANCHING[packet] else None
            if isinstance(decided, torch.fx.Node) and decided in from_floats and (
                    packet in (aten.where, aten.masked_fill) or is_floating(decided)):
                return f"its code branches on float values ({target_name(node)}), which a probe cannot check"
    return None


# ---- the per-row program -------------------------------------------------------------------------
def _per_row_program(joint, placeholders, rows: int):
    """(`joint` on a few rows, in float64, or None; why not). Every tensor is `[r, w]` there."""
    graph, root = torch.fx.Graph(), torch.nn.Module()
    env, layouts = {}, {}
    for node in joint.graph.find_nodes(op="get_attr"):  # a constant the code made (`x[mask] = 0`'s 0)
        value = getattr(joint, node.target)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            return None, f"its code reads a constant tensor of shape {tuple(getattr(value, 'shape', ()))}"
        setattr(root, node.target, value.to(torch.float64) if value.is_floating_point() else value)
        env[node] = graph.get_attr(node.target)
    for p in placeholders:
        env[p] = graph.placeholder(p.name)
        if _is_empty(p) or not p.users:
            continue  # an empty output's gradient (slime's entropy when not asked for)
        lay = rowlocal.node_layout(p, rows)
        if lay is None or lay.kind != ROW:
            return None, f"its input {p.name} is not laid out over the rows"
        layouts[p] = lay
    for node in joint.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is set_grad_enabled or node.target in METADATA_CHECKS:
            continue
        special = _SPECIAL.get(node.target)
        if _is_empty(node):  # `new_zeros((0,))`: a value of no element, whatever it reads
            val = node.meta["val"]
            env[node] = graph.call_function(aten.empty.memory_format, (list(val.shape),), {"dtype": val.dtype})
            continue
        val = node.meta.get("val")
        layouts[node] = rowlocal.layout_of(val[0] if isinstance(val, (tuple, list)) else val, rows)
        if layouts[node] is None or layouts[node].kind != ROW:
            if any(layouts.get(a) is not None and layouts[a].kind == ROW for a in node.all_input_nodes):
                return None, f"its code is not row by row: {target_name(node)} reduces or moves the rows"
            env[node] = graph.node_copy(node, lambda n: env[n])  # made of constants: the same on any rows
            continue
        if special is not None:
            new = special(graph, node, env, rows)
            if isinstance(new, str):
                return None, f"its code {new}"
            if new is None:
                continue
        else:
            why = rowlocal.check(node, rows, layouts)
            if why is not None:
                return None, f"its code is not row by row: {why}"
            new = rowlocal.emit(graph, node, env, layouts)
        env[node] = new
    out = [env[o] if isinstance(o, torch.fx.Node) else o for o in joint.graph.output_node().args[0]]
    graph.output(tuple(o for o in out if o is not None))
    _in_float64(graph)
    return torch.fx.GraphModule(root, graph), None


def _is_empty(node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape) and val.numel() == 0


def _in_float64(graph: torch.fx.Graph) -> None:
    """Every floating dtype the code names becomes float64: the probe checks the math."""
    def f64(a):
        return torch.float64 if isinstance(a, torch.dtype) and a.is_floating_point else a

    for node in graph.nodes:
        node.args = tuple(f64(a) for a in node.args)
        node.kwargs = {k: f64(v) for k, v in node.kwargs.items()}


def _is_row_arange(node, rows: int) -> bool:
    """`arange(rows)`: the row indices, as `x[arange(T), t]` pairs each row with its target."""
    return arange_args(node) == (0, rows, 1)


def _arange(graph, node, env, rows):
    """The row indices: read only as the rows of an index or index_put, they need no value here."""
    if not _is_row_arange(node, rows) or any(
            u.target not in (aten.index.Tensor, aten.index_put.default) or _row_indices(u, rows) is None
            or node in u.args[1][1:] or u.args[0] is node or node in u.args[2:] for u in node.users):
        return "uses arange other than as the rows of x[arange(rows), target]"
    return None


def _row_indices(node, rows):
    """The per-row index of `x[arange(rows), t]` / `index_put(x, [arange(rows), t], ...)`, else None."""
    indices = node.args[1]
    if len(indices) == 2 and _is_row_arange(indices[0], rows) and isinstance(indices[1], torch.fx.Node):
        x = value_or_constant(node.args[0])
        if x.ndim == 2 and x.shape[0] == rows:
            return indices[1]
    return None


def _index(graph, node, env, rows):
    t = _row_indices(node, rows)
    if t is None:
        return "indexes the logits other than x[arange(rows), target]"
    return graph.call_function(aten.gather.default, (env[node.args[0]], -1, env[t]))


def _index_put(graph, node, env, rows):
    t = _row_indices(node, rows)
    if t is None or len(node.args) < 3:
        return "writes into the logits other than x[arange(rows), target]"
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    values = env[node.args[2]]
    target = aten.scatter_add.default if accumulate else aten.scatter.src
    src = graph.call_function(aten.expand.default, (values, [-1, 1]))
    return graph.call_function(target, (env[node.args[0]], -1, env[t], src))


def _scatter(graph, node, env, rows):
    x, dim, index = node.args[:3]
    xv = value_or_constant(x)
    if dim not in (-1, xv.ndim - 1) or value_or_constant(index).shape[-1] != 1:
        return "scatters other than one entry per row along the vocabulary"
    rest = [env[a] if isinstance(a, torch.fx.Node) else a for a in node.args[3:]]
    return graph.call_function(node.target, (env[x], -1, env[index], *rest), dict(node.kwargs))


def _one_hot(graph, node, env, rows):
    classes = node.args[1] if len(node.args) > 1 else node.kwargs.get("num_classes", -1)
    if not isinstance(classes, int) or classes < 1:
        return "takes one_hot without a number of classes"
    ids = graph.call_function(aten.squeeze.dim, (env[node.args[0]], -1))
    return graph.call_function(aten.one_hot.default, (ids, classes))


def _select(graph, node, env, rows):
    x, dim, index = node.args[:3]
    shape = value_or_constant(x).shape
    if not (dim in (-1, len(shape) - 1) and len(shape) >= 2 and shape[-1] == 1 and index in (0, -1)):
        return "selects other than the one column of a per-row value"
    return env[x]  # `v[:, 0]` of a `[rows, 1]` value: the chunk already is `[r, 1]`


def _fill(graph, node, env, rows):
    """A fill over the rows (`torch.full((T,), -inf)`, `zeros_like(m)`): the same value, `[1, width]`,
    which broadcasts against the probe's rows as the fill did against the code's."""
    position = catalogue.FILLS[node.target.overloadpacket]
    value = 0.0 if position is None else node.args[position]
    width = rowlocal.layout_of(node.meta["val"], rows).width
    if not isinstance(value, (int, float)) or not isinstance(width, int):
        return "fills a tensor with a value or a width that is not a number"
    return graph.call_function(aten.full.default, ([1, width], value), {"dtype": node.meta["val"].dtype})


def _cat(graph, node, env, rows):
    """Blocks of the vocabulary put side by side (a gradient computed block by block)."""
    tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    if dim not in (-1, node.meta["val"].ndim - 1) or any(
            getattr(rowlocal.node_layout(t, rows), "kind", None) != ROW for t in tensors):
        return "puts values side by side other than along the vocabulary"
    return graph.call_function(aten.cat.default, ([env[t] for t in tensors], -1))


_SPECIAL = {**{fill.default: _fill for fill in catalogue.FILLS}, aten.cat.default: _cat, aten.select.int: _select, aten.arange.default: _arange, aten.arange.start: _arange, aten.arange.start_step: _arange,
            aten.index.Tensor: _index, aten.index_put.default: _index_put, aten.scatter_add.default: _scatter,
            aten.scatter.src: _scatter, aten.scatter.value: _scatter, aten.one_hot.default: _one_hot}


def joint_module(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, n_inputs: int, n_outputs: int,
                 n_saved: int) -> torch.fx.GraphModule:
    """Dynamo's Function bodies as one module `(*inputs, *grad_outputs) -> (*outputs, *grad_inputs)`."""
    root = torch.nn.Module()
    root.forward_body, root.backward_body = forward, backward
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(f"input{i}") for i in range(n_inputs)]
    grads = [graph.placeholder(f"grad{j}") for j in range(n_outputs)]
    result = graph.call_module("forward_body", tuple(inputs))
    outs, saved = (graph.call_function(operator.getitem, (result, k)) for k in (0, 1))
    outputs = [graph.call_function(operator.getitem, (outs, j)) for j in range(n_outputs)]
    saved = [graph.call_function(operator.getitem, (saved, k)) for k in range(n_saved)]
    grad_inputs = graph.call_module("backward_body", (*grads, *saved))
    returned = backward.graph.output_node().args[0]
    graph.output((*outputs, *[None if returned[i] is None else graph.call_function(operator.getitem, (grad_inputs, i))
                              for i in range(n_inputs)]))
    return torch.fx.GraphModule(root, graph)
