"""Capture: Dynamo's graph as a functional, pre-dispatch ATen graph that means what it means.

The passes assume a functional graph: no mutation, no aliasing. A Dynamo graph has both
(`buf[s:e] = x` is a `setitem`, `x.exp_()` an in-place op) and higher-order ops whose semantics
live in subgraphs (a user `autograd.Function` with its own backward, a checkpoint). So:

1. Checkpoint and `wrap` bodies are inlined: they mean their body (checkpointing changes what
   autograd saves, never a value or a gradient), and our chunked op recomputes anyway.
2. Every other higher-order op becomes an opaque stub, `graphpass::opaque`, whose fake runs the
   op itself; the passes see one node that reads tensors (and the symbolic sizes Dynamo passes
   the op where shapes are dynamic) and makes tensors, and never look in.
3. The graph is functionalized by AOTAutograd's export (`slice_scatter` instead of `setitem`,
   `exp` instead of `exp_`), keeping grad-mode changes as `_set_grad_enabled` nodes and each
   node's stack trace. Functional `copy` (from `copy_`) becomes differentiable ops.
4. After the passes, `Captured.restore` puts the higher-order ops back in place of their stubs
   and re-applies the mutations of graph inputs as `copy_` at the end. An autograd.Function whose
   forward writes into its inputs (megatron-core's cross-entropy uses its logits as scratch) and
   that no pass replaced gets a clone of each input it writes, where nothing after it reads that
   input: the graph was made functional on the premise that it writes nothing, and on a clone
   that premise holds. (Eager code would see the caller's tensor overwritten; graphpass leaves it
   as it was, as it does where a pass replaces such a Function.)

What capture cannot model raises `CantCapture`: the graph then runs unchanged, reason recorded.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import NamedTuple

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis.rowlocal import slice_span
from graphpass.fx_utils import copy_graph_module

aten = torch.ops.aten


class CantCapture(RuntimeError):
    """The Dynamo graph uses something capture cannot model soundly; the message says what."""


@dataclasses.dataclass
class _Hop:
    """A higher-order op hidden behind a stub: how to call it again."""

    target: object
    args: tuple  # the HOP's args; tensors and sizes replaced by their position among the stub's
    kwargs: dict
    submodules: dict  # get_attr name -> module, for subgraph arguments
    mutates_inputs: str | None = None  # that its forward writes into its inputs (it goes back on clones)
    unread: str | None = None  # why no pass may read its bodies (their outputs could not be told)

    @property
    def bodies(self) -> list:
        """Its subgraphs, in argument order (an autograd.Function's: forward, backward)."""
        return [self.submodules[a.name] for a in self.args if isinstance(a, _Submodule)]

    def operands(self, stub: torch.fx.Node) -> list:
        """The graph values the op passes its bodies, in order, in `stub`'s graph: its tensors and
        sizes (a size is a node or an int); an autograd.Function's forward body reads them as its
        inputs, one placeholder each."""
        return [_argument(a, stub.args[1], stub.args[2]) for a in self.args if isinstance(a, (_Tensor, _Symbol))]

    def tensor_position(self, operand: int) -> int | None:
        """The position among the stub's tensors of its `operand`-th operand; None for a size."""
        a = [a for a in self.args if isinstance(a, (_Tensor, _Symbol))][operand]
        return a.position if isinstance(a, _Tensor) else None


@dataclasses.dataclass
class Captured:
    """A captured graph: functional ATen ops, higher-order ops behind stubs."""

    gm: torch.fx.GraphModule
    fakes: list
    hops: dict  # stub key -> _Hop
    mutated_inputs: list  # for each leading graph output, the user input position it updates

    def restore(self, gm: torch.fx.GraphModule, *, for_analysis: bool = False) -> torch.fx.GraphModule:
        """`gm` (this capture after the passes) with its stubs back as higher-order ops and the
        inputs' mutations applied in place.

        A stub whose op writes into its inputs goes back reading clones of those it writes
        (`_clones_of_written`; raises CantCapture where the graph reads such an input after it),
        but as it is into a graph that is only analysed (`for_analysis`: the memory model)."""
        graph = gm.graph
        for node in list(graph.find_nodes(op="call_function", target=_opaque_op())):
            hop = self.hops[node.args[0]]
            tensors, symbols = node.args[1], node.args[2]
            if hop.mutates_inputs and not for_analysis:
                tensors = _clones_of_written(graph, node, hop)
            with graph.inserting_before(node):
                args = []
                for a in hop.args:
                    if isinstance(a, _Submodule):
                        if not hasattr(gm, a.name):
                            gm.add_submodule(a.name, hop.submodules[a.name])
                        args.append(graph.get_attr(a.name))
                    else:
                        args.append(_argument(a, tensors, symbols))
                call = graph.call_function(hop.target, tuple(args), dict(hop.kwargs))
            call.meta.update(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
        if self.mutated_inputs:
            _apply_input_mutations(graph, self.mutated_inputs)
        graph.lint()
        gm.recompile()
        return gm


def _clones_of_written(graph: torch.fx.Graph, stub: torch.fx.Node, hop: _Hop) -> list:
    """The stub's tensors, each that its op's forward writes into replaced by a clone made just
    before it; raises CantCapture where the graph reads such a tensor (or an alias of it) after
    the stub: it would read the written value in eager, the value before the write here."""
    tensors = list(stub.args[1])
    written = written_inputs(hop.bodies[0])  # positions among the operands, sizes included
    reader = later_reader(graph, stub, hop.operands(stub), written)
    if reader is not None:
        raise CantCapture(f"{hop.mutates_inputs}: {reader} after it")
    fake_mode = _torch_api.detect_fake_mode([t.meta["val"] for t in tensors if "val" in t.meta])
    n_operands = len(hop.operands(stub))
    for operand in (range(n_operands) if written is None else sorted(written)):
        position = hop.tensor_position(operand) if operand < n_operands else None
        if position is not None:
            with graph.inserting_before(stub):
                tensors[position] = _torch_api.fake_node(graph, fake_mode, aten.clone.default, (tensors[position],),
                                                         {}, like=tensors[position])
    return tensors


def later_reader(graph: torch.fx.Graph, stub: torch.fx.Node, tensors: list, written: set | None) -> str | None:
    """What reads, after `stub`, one of `tensors` (the op's operands: sizes among them are never
    written) at the positions `written` (None: every one) or an alias of it: "its input X, which
    the graph's output reads" (or "which Y (where) reads"); None when nothing does."""
    from graphpass.analysis.regions import source_of

    order = {n: i for i, n in enumerate(graph.nodes)}
    for position in (range(len(tensors)) if written is None else sorted(written)):
        if position >= len(tensors) or not isinstance(tensors[position], torch.fx.Node) \
                or not isinstance(tensors[position].meta.get("val"), torch.Tensor):
            continue
        aliases = aliases_of(tensors[position])
        for alias in aliases:
            for user in alias.users:
                if user not in aliases and user is not stub and order[user] > order[stub]:
                    what = "the graph's output" if user.op == "output" else f"{user.name} ({source_of(user)})"
                    return f"its input {tensors[position].name}, which {what} reads"
    return None


def _may_alias_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and bool(node.args) and isinstance(node.args[0], torch.fx.Node) and (
        getattr(node.target, "is_view", False) or node.target in _MAY_ALIAS_OPS)


_MAY_ALIAS_OPS = {aten.reshape.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
                  aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other, aten.view_as.default,
                  aten.reshape_as.default, aten.flatten.using_ints, aten.type_as.default}


def aliases_of(node: torch.fx.Node) -> set:
    """Every node of an ATen graph that may share `node`'s memory: its bases through views, and
    their views."""
    base = node
    while _may_alias_node(base):
        base = base.args[0]
    out, todo = set(), [base]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(u for u in n.users if _may_alias_node(u) and u.args[0] is n)
    return out


class _Tensor(NamedTuple):
    """A Function argument that is the call's `position`-th tensor."""
    position: int


class _Submodule(NamedTuple):
    """A Function argument that is the graph's submodule `name`."""
    name: str


class _Symbol(NamedTuple):
    """A Function argument that is the call's `position`-th size (a SymInt Dynamo lifted where
    shapes are dynamic)."""
    position: int


def _argument(a, tensors, symbols):
    """The op's argument `a` (a `_Tensor`, `_Symbol` or constant) among a stub's `tensors` and `symbols`."""
    if isinstance(a, _Tensor):
        return tensors[a.position]
    if isinstance(a, _Symbol):
        return symbols[a.position]
    return a


def capture(gm: torch.fx.GraphModule, example_inputs) -> Captured:
    """Capture Dynamo's `gm` (left untouched) on fakes of `example_inputs`; see the module doc."""
    fake_mode, fakes = _torch_api.fakify_inputs(example_inputs)
    if any(True for _ in gm.named_parameters()) or any(True for _ in gm.named_buffers()):
        raise CantCapture("the graph holds parameters or buffers (expected as inputs)")
    gm = copy_graph_module(gm)
    _inline_bodies(gm)
    hops = _stub_higher_order_ops(gm)
    with fake_mode:
        exported, signature = _torch_api.export_functional(gm, fakes)
    if signature.input_tokens or signature.output_tokens:
        raise CantCapture("the graph has side-effecting ops (effect tokens)")
    if signature.parameters or signature.buffers:
        raise CantCapture("the export lifted parameters or buffers")
    kept = {stub.args[0] for stub in exported.graph.find_nodes(op="call_function", target=_opaque_op())}
    for key, hop in hops.items():
        if hop.mutates_inputs and key not in kept:
            # Its results are unread (torch 2.11's Dynamo reads the written input instead), so the
            # export dropped the stub, and with it the op's write: the graph would run without it.
            raise CantCapture(f"{hop.mutates_inputs}, and its results are unread (the written input is read)")
    user_inputs = list(signature.user_inputs)
    mutated = [user_inputs.index(signature.user_inputs_to_mutate[name])
               for name in list(signature.user_inputs_to_mutate)]
    _decompose_functional_copy(exported.graph)
    _read_back_writes(exported.graph)
    _drop_whole_slices(exported.graph)
    exported.graph.lint()
    exported.recompile()
    return Captured(exported, fakes, hops, mutated)




# ---- 1. inline checkpoint and wrap bodies ------------------------------------------------------
def _inline_bodies(gm: torch.fx.GraphModule) -> None:
    """Replace each checkpoint / wrap call by the nodes of its body (recursively)."""
    inlined = True
    while inlined:
        inlined = False
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in _torch_api.inlinable_hops():
                _inline(gm, node)
                inlined = True


def _inline(gm, node) -> None:
    body_node, *operands = node.args
    body = getattr(gm, body_node.target)
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise CantCapture(f"{node.target}: {len(operands)} operands for {len(placeholders)} body inputs")
    env = dict(zip(placeholders, operands))
    graph = gm.graph
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                result = torch.fx.node.map_arg(inner.args[0], env.__getitem__)
                break
            if inner.op == "get_attr":  # a nested body: move it onto the outer module
                name = _fresh_attr(gm, inner.target)
                setattr(gm, name, getattr(body, inner.target))
                env[inner] = graph.get_attr(name)
            else:  # its stack trace names the user's line inside the checkpointed function
                env[inner] = graph.node_copy(inner, env.__getitem__)
    results = result if isinstance(result, (tuple, list)) else (result,)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        else:
            raise CantCapture(f"{node.target}: its result is used whole, not item by item")
    graph.erase_node(node)


def _fresh_attr(gm, name: str) -> str:
    for i in itertools.count():
        candidate = f"{name}_inlined{i}"
        if not hasattr(gm, candidate):
            return candidate


# ---- 2. stub the other higher-order ops --------------------------------------------------------
_HOPS: dict[str, _Hop] = {}  # every stub of this process, by key (a fake may run after capture)
_counter = itertools.count()


def _opaque_op():
    return torch.ops.graphpass.opaque.default


@torch.library.custom_op("graphpass::opaque", mutates_args=())
def opaque(key: str, tensors: list[torch.Tensor], symbols: list[int]) -> list[torch.Tensor]:
    """A higher-order op the passes must not look into; only ever run on fakes. `symbols`: the
    sizes (SymInts) it reads."""
    raise RuntimeError("graphpass: an opaque stub ran outside capture; this is a graphpass bug")


@opaque.register_fake
def _(key, tensors, symbols):
    hop = _HOPS[key]
    args = [hop.submodules[a.name] if isinstance(a, _Submodule) else _argument(a, tensors, symbols)
            for a in hop.args]
    outs = hop.target(*args, **hop.kwargs)
    # A stub's outputs are new tensors (the op may return an input as is).
    return [o.clone() for o in outs]


def _stub_higher_order_ops(gm: torch.fx.GraphModule) -> dict:
    hops = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not _torch_api.is_higher_order_op(node.target):
            continue
        unread = None
        if node.target is _torch_api.autograd_function_apply():
            unread = _torch_api.drop_function_intermediates(gm, node)
        mutates_inputs = _check_stubbable(gm, node)
        tensors, symbols, args, submodules = [], [], [], {}
        for a in node.args:
            if isinstance(a, torch.fx.Node) and a.op == "get_attr":
                submodules[a.target] = getattr(gm, a.target)
                args.append(_Submodule(a.target))
            elif isinstance(a, torch.fx.Node) and isinstance(_example(a), torch.Tensor):
                args.append(_Tensor(len(tensors)))
                tensors.append(a)
            elif isinstance(a, torch.fx.Node):  # a size (_check_stubbable lets nothing else through)
                args.append(_Symbol(len(symbols)))
                symbols.append(a)
            else:
                args.append(a)
        key = f"hop{next(_counter)}"
        hops[key] = _HOPS[key] = _Hop(node.target, tuple(args), dict(node.kwargs), submodules, mutates_inputs,
                                       unread)
        with gm.graph.inserting_before(node):
            stub = gm.graph.call_function(_opaque_op(), (key, tensors, symbols))
        stub.meta.update(node.meta)
        node.replace_all_uses_with(stub)
        gm.graph.erase_node(node)
    gm.recompile()
    return hops


def _check_stubbable(gm, node) -> str | None:
    """Raise CantCapture if `node` cannot stand behind a stub. An autograd.Function whose forward
    writes into its inputs (Megatron's cross-entropy uses its logits as scratch) is stubbed with
    that returned: a pass may replace it; if none does, `restore` hands it clones."""
    name = getattr(node.target, "__name__", str(node.target))
    for a in node.args:
        if isinstance(a, torch.fx.Node) and a.op != "get_attr" and not isinstance(_example(a), torch.Tensor) \
                and not _is_size(_example(a)):
            raise CantCapture(f"higher-order op {name} reads {a.name}, which is neither a tensor nor an integer")
    for value in node.kwargs.values():
        if isinstance(value, torch.fx.Node):
            raise CantCapture(f"higher-order op {name} takes a graph value as a keyword argument")
    outs = _example(node)
    if not isinstance(outs, (tuple, list)) or not all(isinstance(o, torch.Tensor) for o in outs):
        raise CantCapture(f"higher-order op {name} returns something other than a tuple of tensors")
    for body in _forward_bodies(gm, node):
        if _mutates_inputs(body):
            reason = f"higher-order op {name} mutates its inputs"
            if node.target is not _torch_api.autograd_function_apply():
                raise CantCapture(reason)
            return reason
    return None


def _is_size(value) -> bool:
    """An integer a stub can pass on as a `SymInt` (Dynamo lifts a symbolic size as one)."""
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def hop_of(node: torch.fx.Node) -> _Hop | None:
    """The higher-order op behind stub `node`, None if `node` is not a stub."""
    if node.op != "call_function" or node.target is not _opaque_op():
        return None
    return _HOPS[node.args[0]]


def _forward_bodies(gm, node) -> list:
    """The subgraphs `node` runs in the forward (an autograd.Function's backward runs later, on
    tensors of its own: mutating them is invisible here)."""
    bodies = [getattr(gm, a.target) for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    if node.target is _torch_api.autograd_function_apply():
        return bodies[:1]
    return bodies


def _example(node):
    return node.meta.get("example_value", node.meta.get("val"))


#: Tensor methods and functions whose result may share its input's memory (a view, or the input
#: itself when nothing changes, as `x.float()` of a float tensor).
_MAY_ALIAS = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
    "transpose", "swapaxes", "swapdims", "permute", "movedim", "t", "T", "mT", "H", "mH", "adjoint",
    "expand", "expand_as", "narrow", "select", "diagonal", "as_strided", "unfold", "split",
    "split_with_sizes", "chunk", "unbind", "tensor_split", "detach", "contiguous", "to", "type",
    "type_as", "float", "double", "half", "bfloat16", "real", "imag", "view_as_real", "view_as_complex",
    "alias", "getitem", "data", "requires_grad_", "__getitem__",
}


def _mutates_inputs(body) -> bool:
    """Whether `body` may write into memory it did not allocate: an in-place op, a setitem or an
    out= argument whose target is one of its inputs or a possible alias of one. Tensors the body
    creates itself (`e = x.exp(); e.div_(s)`) may be mutated freely."""
    return written_inputs(body) != set()


#: Python's in-place operators as Dynamo records `x -= y` (megatron-core's loss writes its logits
#: so): they write into their first argument and return it.
_INPLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior",
                      "ixor", "ilshift", "irshift"}


def written_inputs(body, sources=None) -> set[int] | None:
    """The positions of `body`'s inputs (or of `sources`, nodes of `body`) that it may write into
    once they exist: an in-place op (`add_`, `x -= y`), a setitem or an out= argument whose target
    is the value or a possible alias of it; None when it cannot tell which (a nested body that
    writes into its inputs)."""
    if not isinstance(body, torch.fx.GraphModule):
        return set()
    roots: dict = {}
    for i, source in enumerate(body.graph.find_nodes(op="placeholder") if sources is None else sources):
        roots.setdefault(source, set()).add(i)
    written_positions = set()
    for node in body.graph.nodes:
        name = _callee_name(node)
        args = [a for a in node.args if isinstance(a, torch.fx.Node)]
        inplace_operator = name in _INPLACE_OPERATORS or name.strip("_") in _INPLACE_OPERATORS
        if (name in _MAY_ALIAS or inplace_operator) and args and args[0] in roots and not _new_by_cast(node, name):
            roots[node] = roots[args[0]] | roots.get(node, set())
        written = []
        if (name.endswith("_") and not name.endswith("__")) or name in ("setitem", "__setitem__") or inplace_operator:
            written = args[:1]
        out = node.kwargs.get("out")
        written += [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.fx.Node)]
        for w in written:
            written_positions |= roots.get(w, set())
        if node.op == "get_attr" and _mutates_inputs(getattr(body, node.target, None)):
            return None
    return written_positions


#: Casts that return their input itself when it has the dtype asked for, a new tensor otherwise.
_CASTS = {"to", "type", "type_as", "float", "double", "half", "bfloat16"}


def _new_by_cast(node, name: str) -> bool:
    """Whether `node` is a cast to another dtype than its input's (in the traced example values):
    a new tensor (megatron-core's fused loss writes into `logits.float()` of bf16 logits, not into
    them)."""
    if name not in _CASTS:
        return False
    out, source = _example(node), _example(node.args[0])
    return isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor) and out.dtype != source.dtype


def _callee_name(node) -> str:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", "")
    return ""


# ---- 3. after the export ------------------------------------------------------------------------
def _decompose_functional_copy(graph: torch.fx.Graph) -> None:
    """`copy(dst, src)` -> `src` cast to dst's dtype, broadcast to its shape, as a new tensor.

    Functional `copy` has no derivative formula; these ops do, with the same values.
    """
    for node in list(graph.find_nodes(op="call_function", target=aten.copy.default)):
        dst, src = node.args[:2]  # a non_blocking flag changes no value
        dst_val, src_val = dst.meta["val"], src.meta["val"]
        # A device only where the copy changes it: a region program runs on whatever device its
        # inputs are on, and a device named in it would be baked into its kernels.
        to = {"dtype": dst_val.dtype}
        if src_val.device != dst_val.device:
            to["device"] = dst_val.device
        with graph.inserting_before(node):
            cast = graph.call_function(aten._to_copy.default, (src,), to)
            expanded = graph.call_function(aten.expand_as.default, (cast, dst))
            new = graph.call_function(aten.clone.default, (expanded,))
        with _torch_api.detect_fake_mode([dst_val]):
            cast.meta["val"] = src_val.to(dtype=dst_val.dtype, device=dst_val.device)
            expanded.meta["val"] = cast.meta["val"].expand_as(dst_val)
            new.meta["val"] = expanded.meta["val"].clone()
        for n in (cast, expanded, new):
            if "stack_trace" in node.meta:
                n.meta["stack_trace"] = node.meta["stack_trace"]
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def _read_back_writes(graph: torch.fx.Graph) -> None:
    """`slice(slice_scatter(base, src, d, s, e), d, s, e)` -> `src`: reading back exactly the span
    just written (functionalized `x[:, 3:].div_(T)`, then `x[:, 3:]`) is the written value, so a
    region reads the scaling op instead of a copy of the whole buffer."""
    for node in list(graph.find_nodes(op="call_function", target=aten.slice.Tensor)):
        scatter = node.args[0]
        if scatter.op != "call_function" or scatter.target is not aten.slice_scatter.default:
            continue
        span, written = slice_span(node), slice_span(scatter)
        src = scatter.args[1]
        if span == written and tuple(src.meta["val"].shape) == tuple(node.meta["val"].shape):
            node.replace_all_uses_with(src)
            graph.erase_node(node)


def _drop_whole_slices(graph: torch.fx.Graph) -> None:
    """`slice(x, ...)` whose result has x's shape (`x[:, None]` where x's rows are symbolic) -> `x`.

    With static sizes the export leaves no such slice; with symbolic ones it keeps them, and an
    analysis would read a slice of the rows where there is the whole. In a functional graph the
    whole of `x` is `x`; a slice the graph returns stays (it is another tensor than `x` to the caller)."""
    for node in list(graph.find_nodes(op="call_function", target=aten.slice.Tensor)):
        src, val = node.args[0], node.meta.get("val")
        step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        if step != 1 or not isinstance(val, torch.Tensor) or not isinstance(src, torch.fx.Node) \
                or not isinstance(src.meta.get("val"), torch.Tensor) or any(u.op == "output" for u in node.users):
            continue
        if _torch_api.same_shape(tuple(val.shape), tuple(src.meta["val"].shape)):
            node.replace_all_uses_with(src)
            graph.erase_node(node)


def _apply_input_mutations(graph: torch.fx.Graph, mutated_inputs: list) -> None:
    """Turn the export's leading outputs (new values of mutated inputs) back into `copy_`s."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    output = graph.output_node()
    values = list(output.args[0])
    with graph.inserting_before(output):
        for position, value in zip(mutated_inputs, values):
            graph.call_function(aten.copy_.default, (placeholders[position], value))
    output.args = (tuple(values[len(mutated_inputs):]),)


def capture_function(fn, *args) -> Captured:
    """The capture of the one graph Dynamo makes of `fn(*args)` (for tests and debugging)."""
    captured = []

    def backend(gm, example_inputs):
        captured.append(capture(gm, example_inputs))
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (result,) = captured
    return result
