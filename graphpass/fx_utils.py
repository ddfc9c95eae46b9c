"""Graph walks, node values and names: the FX helpers capture, analysis/, ops/ and passes/ share."""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx


#: Ops that give a tensor a new shape over the same elements in the same order.
RESHAPES = frozenset({torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default})


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm` (same submodules; nodes' meta shallow-copied) whose graph can be edited freely."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def fake_value(x):
    """The fake value a node computes (`meta["val"]`); None for anything that is not a node."""
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else None


def value_or_constant(x):
    """A node's fake value, or `x` itself when it is a constant argument (a number, a dtype)."""
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def is_floating(x) -> bool:
    """Whether a node's value (a constant's included), or `x` itself, is a floating tensor."""
    val = value_or_constant(x)
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def arange_args(node) -> tuple | None:
    """(start, end, step) of an `aten.arange` node (any overload; ends may be symbolic), else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and getattr(node.target, "overloadpacket", None) is torch.ops.aten.arange):
        return None
    args = list(node.args)
    if len(args) == 1:
        args = [0] + args
    step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
    return args[0], args[1], step


def target_name(node: torch.fx.Node) -> str:
    """What a node calls, as messages name it (`log_softmax.default`, `sum`)."""
    return getattr(node.target, "__name__", str(node.target))


def transitive_users(nodes) -> set:
    """Every node that reads one of `nodes`, directly or through others (a seed only when read)."""
    return _reached(nodes, "users")


def transitive_inputs(nodes, stop=frozenset()) -> set:
    """Every node one of `nodes` is computed from, directly or through others (a seed only when
    another seed reads it), not looking past the nodes in `stop` (which are included)."""
    return _reached(nodes, "all_input_nodes", stop)


def _reached(nodes, along: str, stop=frozenset()) -> set:
    seen, todo = set(), list(nodes)
    while todo:
        node = todo.pop()
        if node in stop:
            continue
        for n in getattr(node, along):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def derives_from(node: torch.fx.Node, predicate: Callable[[torch.fx.Node], bool]) -> bool:
    """Whether `node`, or anything it is computed from, satisfies `predicate` (stops at the first)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if predicate(n):
            return True
        todo.extend(n.all_input_nodes)
    return False


def hashable(value, node_key: Callable = lambda node: node):
    """A node's arguments as a hashable key: lists and dicts become tuples, each node `node_key(node)`,
    a constant its type and value (1, 1.0 and True are equal in Python, not as arguments), an
    unhashable constant its identity (equal only to itself)."""
    if isinstance(value, torch.fx.Node):
        return node_key(value)
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v, node_key) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, hashable(v, node_key)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return ("unhashable", id(value))
    return (type(value).__name__, value)
