"""Per-chunk forward and backward kernels of a region program, split from one joint trace.

The program's per-chunk math is traced together with its vector-Jacobian product (`make_fx`,
rows symbolic, widths static, the softmax family decomposed into max / sum / exp). The joint
graph is then split as a rematerializing partitioner would, with one policy: the forward keeps
every *narrow* value the backward reads that it computed from a wide input (row statistics
such as the max and the log-sum-exp, `[rows, w]` with w far below the vocabulary), and the
backward recomputes everything wide from the inputs in one pass. So the backward never re-runs
the forward's reductions, and what the op saves across forward and backward is O(rows).

Each trace's row sums have their row constants taken out first (`row_sums`), so the forward
computes every sum in one pass and the backward reads the forward's instead of summing again;
two peephole rewrites keep each kernel a single fused pass (see `peephole`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.fx_utils import hashable, transitive_users
from graphpass.analysis.catalogue import is_deterministic_pointwise
from graphpass.ops import peephole, row_sums

aten = torch.ops.aten

# A value is narrow (worth saving instead of recomputing) when each row holds at most this
# fraction of a wide input's row.
_NARROW_FRACTION = 16


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One per-chunk argument: `[rows, width]` if `per_row`, else its fixed shape."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    per_row: bool
    wide: bool


@dataclasses.dataclass(frozen=True)
class SavedSpec:
    """A row statistic the forward saves: per-row shape `tail` ([rows, *tail] in all) and dtype."""

    tail: tuple[int, ...]
    dtype: torch.dtype


class JointSplit:
    """The forward kernel graph of a program and, per gradient pattern, its backward graph.

    forward:  (args...) -> (outputs..., saved...)
    backward(active, wanted): (args..., saved..., grad of each active output...,
              out slice of each wanted per-row input...) -> (grad of each wanted fixed-shape input...)
              writing each per-row input's gradient into its out slice.
    fused(active, wanted): both at once, without the saved values in between.
    fused_saving(active, wanted, tile_wanted): fused, also writing the row values a column-tile
              backward reads (see there).
    column_tile(active, wanted): backward on a column tile of the wide inputs (`on_column_tile`),
              reading the backward's own row values too (`carried`).

    An argument in `overwritten` is a temporary its gradient may replace: the gradient graphs read
    it from its out slice, which they overwrite with its gradient, and take no argument for it
    (every read of it comes before that write). The forward reads it as an argument.
    """

    def __init__(self, program: torch.fx.GraphModule, args: list[ArgSpec], differentiable_outputs, differentiable_inputs,
                 device: torch.device):
        self.program = program
        self.args = list(args)
        # Traced on the device the kernels run on: a factory node the trace writes (the gather
        # backward's `arange`, a user's `torch.full(..., device=x.device)`) names that device.
        self.device = torch.device(device)
        self.n_outputs = len(program.graph.output_node().args[0])
        self.overwritten: tuple[int, ...] = ()
        self._ids = _StructuralIds()
        # (active, wanted) -> each row value of the backward a column tile reads (`carried`), in the
        # order of its arguments: its structural id and its spec.
        self._carried: dict[tuple, list[tuple[int, SavedSpec]]] = {}
        # (active, wanted) -> the joint trace: each gradient graph is built from it, and the carried
        # values are found by name in the backward built from the same trace.
        self._traces: dict[tuple, torch.fx.GraphModule] = {}
        self._split_forward(self._trace(tuple(differentiable_outputs), tuple(differentiable_inputs)))

    # ---- tracing -------------------------------------------------------------------------
    def _trace(self, active, wanted) -> torch.fx.GraphModule:
        """make_fx of (args, grads of active outputs) -> (all outputs..., grads of wanted args...),
        traced once per pattern (the graphs built from it only read it)."""
        if (active, wanted) not in self._traces:
            self._traces[(active, wanted)] = self._traced_joint(active, wanted)
        return self._traces[(active, wanted)]

    def _traced_joint(self, active, wanted) -> torch.fx.GraphModule:
        program, n_args = self.program, len(self.args)

        def joint(*flat):
            primals, cotangents = list(flat[:n_args]), flat[n_args:]
            if not (active and wanted):  # nothing to differentiate: the forward alone
                return tuple(program(*primals))

            def selected(*chosen):
                full = list(primals)
                for i, p in zip(wanted, chosen):
                    full[i] = p
                outs = program(*full)
                return tuple(outs[j] for j in active), tuple(outs)

            _, vjp, outs = torch.func.vjp(selected, *[primals[i] for i in wanted], has_aux=True)
            return (*outs, *vjp(tuple(cotangents)))

        fake_mode, rows = _torch_api.symbolic_rows_mode()
        # Traced the same wherever it is first needed (inside autograd's backward, too).
        with torch.inference_mode(False), torch.enable_grad(), fake_mode:
            primals = [torch.empty((rows, *spec.shape[1:]) if spec.per_row else spec.shape, dtype=spec.dtype,
                                   device=self.device)
                       for spec in self.args]
            outs = program(*primals)
            cotangents = [torch.empty_like(outs[j]) for j in active]
            # Functional (the decompositions' in-place ops removed), so that rewriting the row
            # sums and merging common subexpressions may read any node's value anywhere.
            traced = _torch_api.trace_decomposed(torch.func.functionalize(joint), primals + cotangents)
            if row_sums.factor_row_sums(traced, gradients=len(cotangents)):
                traced = _torch_api.trace_decomposed(traced, primals + cotangents)  # example values
        _torch_api.check_no_guards_on(fake_mode, rows)
        return traced

    def _placeholders(self, joint: torch.fx.GraphModule) -> tuple[list, list]:
        """The joint's inputs: (one per program argument, one per active output's gradient)."""
        placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
        return placeholders[:len(self.args)], placeholders[len(self.args):]

    # ---- forward ------------------------------------------------------------------------------
    def _split_forward(self, joint: torch.fx.GraphModule) -> None:
        """Set `forward` (the joint's forward part, returning the saved values too) and `saved`."""
        graph = torch.fx.Graph()
        env = {}
        primals, cotangents = self._placeholders(joint)
        for i, node in enumerate(primals):
            env[node] = _placeholder(graph, f"arg{i}", node)
        backward_nodes = {*cotangents} | transitive_users(cotangents)
        results = _output_nodes(joint)
        saved = self._values_to_save(joint, backward_nodes, results[self.n_outputs:])
        for node in joint.graph.nodes:
            if node.op == "call_function" and node not in backward_nodes:
                env[node] = graph.node_copy(node, lambda a: env[a])
        graph.output(tuple(env[n] for n in results[:self.n_outputs] + saved))
        graph.eliminate_dead_code()
        peephole.optimize(graph)
        self.forward = torch.fx.GraphModule(torch.nn.Module(), graph)
        self.saved = [SavedSpec(tuple(n.meta["val"].shape[1:]), n.meta["val"].dtype) for n in saved]
        self._saved_examples = saved
        ids = self._ids.of_graph(joint.graph)
        self._saved_ids = {ids[n]: i for i, n in enumerate(saved)}  # structural id -> saved position

    def _values_to_save(self, joint, backward_nodes, grads):
        """The narrow values, computed from a wide input, that the backward would otherwise recompute.

        Walks back from what the backward reads: a narrow value is saved (and its inputs are not
        needed); anything else is recomputed, so its inputs are needed in turn.
        """
        primals, _ = self._placeholders(joint)
        wide = [n for n, spec in zip(primals, self.args) if spec.wide]
        from_wide = {*wide} | transitive_users(wide)
        vocab = min(spec.shape[-1] for spec in self.args if spec.wide)
        stack = [a for b in backward_nodes if b.op == "call_function"
                 for a in b.all_input_nodes if a not in backward_nodes]
        stack += [g for g in grads if isinstance(g, torch.fx.Node) and g not in backward_nodes]
        saved, seen = set(), set()
        while stack:
            node = stack.pop()
            if node in seen or node.op != "call_function":
                continue
            seen.add(node)
            if node in from_wide and _is_narrow(node, vocab):
                saved.add(node)
            else:
                stack.extend(node.all_input_nodes)
        return [n for n in joint.graph.nodes if n in saved]

    # ---- backward -----------------------------------------------------------------------------
    def backward(self, active: tuple[int, ...], wanted: tuple[int, ...]) -> torch.fx.GraphModule:
        """The backward graph for these active outputs and wanted inputs (see the class doc)."""
        return self._gradient_graph(active, wanted, with_forward=False)

    def backward_in_two(self, active: tuple[int, ...], wanted: tuple[int, ...]):
        """`backward` as two graphs, for an inner compiler that cannot compile it as one (inductor's
        CPU outer-loop fusion of a row sum with the write over the row it read,
        pytorch/pytorch#196570): `reductions`, with `backward`'s arguments, returns its row
        reductions over the vocabulary (`carried`); `rest` takes them after the active outputs'
        gradients and does the rest, with no reduction along the row."""
        reductions = self._gradient_graph(active, wanted, with_forward=False, carry=True, reductions_only=True)
        return reductions, self._gradient_graph(active, wanted, with_forward=False, carry=True)

    def fused(self, active: tuple[int, ...], wanted: tuple[int, ...]) -> torch.fx.GraphModule:
        """Forward and backward as one graph, for a gradient known in forward:
        (args..., grad of each active output..., out slice of each wanted per-row input...)
        -> (outputs..., grad of each wanted fixed-shape input...). One kernel reads each wide row
        once for both, where the split kernels read it twice."""
        return self._gradient_graph(active, wanted, with_forward=True)

    def fused_saving(self, active: tuple[int, ...], wanted: tuple[int, ...],
                     tile_wanted: tuple[int, ...]) -> torch.fx.GraphModule:
        """`fused`, also writing what `column_tile(active, tile_wanted)` reads besides the arguments:
        each saved row statistic, each active output's gradient and each carried row value
        (`carried`), into out slices after the arguments: (args..., out slice of each saved
        value..., of each active output's gradient..., of each carried value..., grad of each
        active output..., out slice of each wanted per-row input...) -> as `fused`. So a second
        pass can compute more gradients from a column tile without any reduction over the
        vocabulary. Raises RuntimeError if the fused trace does not compute every value the tile
        reads (its row sums factored differently)."""
        carried = [k for k, _ in self._carried_values(active, tile_wanted)]
        return self._gradient_graph(active, wanted, with_forward=True, saving=carried)

    def carried(self, active: tuple[int, ...], wanted: tuple[int, ...]) -> list[SavedSpec]:
        """The row values `column_tile(active, wanted)` reads after the active outputs' gradients:
        the backward's own reductions over the vocabulary (a log-softmax's backward sums its
        incoming gradient along the row: a KL's `sum(p_teacher)` times each row's seed), which a
        tile cannot compute and a pass over whole rows before it (`fused_saving`) writes."""
        return [spec for _, spec in self._carried_values(active, wanted)]

    def _carried_values(self, active, wanted) -> list[tuple[int, SavedSpec]]:
        if (active, wanted) not in self._carried:
            self.column_tile(active, wanted)
        return self._carried[(active, wanted)]

    def column_tile(self, active: tuple[int, ...], wanted: tuple[int, ...]) -> torch.fx.GraphModule:
        """`backward(active, wanted)` on a column tile of the wide inputs (see `on_column_tile`),
        its reductions over the vocabulary read as arguments after the active outputs' gradients
        (`carried`); NotTileable if anything else reduces or moves values along the vocabulary."""
        widths = {spec.shape[-1] for spec in self.args if spec.wide}
        if len(widths) != 1:
            raise NotTileable(f"its wide inputs differ in width ({sorted(widths)})")
        vocab = widths.pop()
        tiled = on_column_tile(self._gradient_graph(active, wanted, with_forward=False, carry=True), vocab)
        self._check_on_a_tile(tiled, vocab)
        return tiled

    def _check_on_a_tile(self, tiled: torch.fx.GraphModule, vocab: int) -> None:
        """Trace `tiled` on fake inputs one column narrower than the vocabulary: a shape the
        rewrite missed fails here (NotTileable), never in a backward."""
        fake_mode, rows = _torch_api.symbolic_rows_mode()
        *placeholders, offset = tiled.graph.find_nodes(op="placeholder")
        with fake_mode:
            args = []
            for node in placeholders:
                val = node.meta["val"]
                shape = [d if isinstance(d, int) else rows for d in val.shape]
                if val.ndim == 2 and shape[-1] == vocab:
                    shape[-1] = vocab - 1
                args.append(torch.empty(shape, dtype=val.dtype, device=self.device))
            args.append(torch.zeros((), dtype=torch.int64, device=self.device))
            try:
                _torch_api.trace_decomposed(tiled, args)
            except Exception as e:  # noqa: BLE001 - any failure means: not on a tile
                raise NotTileable(f"it does not run on a tile: {type(e).__name__}: {e}") from None
        _torch_api.check_no_guards_on(fake_mode, rows)

    def _gradient_graph(self, active, wanted, with_forward: bool, saving: list[int] | None = None,
                        carry: bool = False, reductions_only: bool = False) -> torch.fx.GraphModule:
        """The graphs of `backward`, `fused`, `fused_saving` (`saving`: the carried values' ids to
        write too) and, with `carry`, the backward that reads its own row reductions (`carried`),
        or with `reductions_only` too, the backward's graph that computes them and writes nothing."""
        joint = self._trace(active, wanted)
        graph = torch.fx.Graph()
        primals, cotangents = self._placeholders(joint)
        in_place = [i for i in wanted if self.args[i].per_row]
        overwritten = [i for i in self.overwritten if i in in_place]
        env = {n: _placeholder(graph, f"arg{i}", n) for i, n in enumerate(primals) if i not in overwritten}
        backward_nodes = {*cotangents} | transitive_users(cotangents)
        ids = self._ids.of_graph(joint.graph)
        if saving is not None:
            saved_slots = [_placeholder(graph, f"saved_out{i}", n) for i, n in enumerate(self._saved_examples)]
            grad_slots = [_placeholder(graph, f"grad_out_copy{j}", n) for j, n in zip(active, cotangents)]
            by_id = {ids[n]: n for n in joint.graph.nodes if n in backward_nodes and n.op == "call_function"}
            missing = [k for k in saving if k not in by_id]
            if missing:
                raise RuntimeError("graphpass: the fused trace does not compute the backward's row sums")
            carried_from = [by_id[k] for k in saving]
            carried_slots = [_placeholder(graph, f"carried_out{k}", n) for k, n in enumerate(carried_from)]
        if not with_forward:
            saved = [_placeholder(graph, f"saved{i}", n) for i, n in enumerate(self._saved_examples)]
        env.update({n: _placeholder(graph, f"grad_out{j}", n) for j, n in zip(active, cotangents)})
        if carry:
            # Those the peephole rewrites leave (a one-hot gradient's row sum is its one value).
            kept = {n.name for n in self.backward(active, wanted).graph.nodes}
            carried = [n for n in self._row_reductions(joint, backward_nodes) if n.name in kept]
            if not reductions_only:
                env.update({n: _placeholder(graph, f"carried{k}", n) for k, n in enumerate(carried)})
            self._carried[(active, wanted)] = [
                (ids[n], SavedSpec(tuple(n.meta["val"].shape[1:]), n.meta["val"].dtype)) for n in carried]
        out_slices = {i: _placeholder(graph, f"grad_in{i}", primals[i]) for i in in_place}
        env.update({primals[i]: out_slices[i] for i in overwritten})
        for node in joint.graph.nodes:
            if node.op != "call_function" or node in env:
                continue
            position = None if with_forward else self._saved_ids.get(ids[node])
            if position is not None and node not in backward_nodes:
                env[node] = saved[position]  # the forward's value: skip recomputing it
            else:
                env[node] = graph.node_copy(node, lambda a: env[a])
        if reductions_only:
            graph.output(tuple(env[n] for n in carried))
            graph.eliminate_dead_code()
            return torch.fx.GraphModule(torch.nn.Module(), graph)
        results = _output_nodes(joint)
        grads = dict(zip(wanted, results[self.n_outputs:]))
        for i in in_place:
            if i not in overwritten:
                graph.call_function(aten.copy_.default, (out_slices[i], env[grads[i]]))
        if saving is not None:
            computed = {}
            for node in joint.graph.nodes:
                position = self._saved_ids.get(ids[node]) if node.op == "call_function" else None
                if position is not None and node not in backward_nodes:
                    computed.setdefault(position, node)
            missing = [k for k in range(len(saved_slots)) if k not in computed]
            if missing:
                raise RuntimeError(f"graphpass: the fused trace does not compute the saved values {missing}")
            for k, slot in enumerate(saved_slots):
                graph.call_function(aten.copy_.default, (slot, env[computed[k]]))
            for slot, cotangent in zip(grad_slots, cotangents):
                graph.call_function(aten.copy_.default, (slot, env[cotangent]))
            for slot, node in zip(carried_slots, carried_from):
                graph.call_function(aten.copy_.default, (slot, env[node]))
        outputs = [env[n] for n in results[:self.n_outputs]] if with_forward else []
        outputs = _copies_of_views(graph, outputs + [env[grads[i]] for i in wanted if i not in out_slices],
                                   [out_slices[i] for i in overwritten])
        # Last, after every read: the overwritten arguments' gradients.
        for i in overwritten:
            graph.call_function(aten.copy_.default, (out_slices[i], env[grads[i]]))
        graph.output(tuple(outputs))
        graph.eliminate_dead_code()
        peephole.optimize(graph)
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    def _row_reductions(self, joint, backward_nodes) -> list:
        """The backward's narrow per-row values read directly from a `[rows, V]` value (its sums,
        maxima or gathers along the vocabulary), in graph order."""
        vocab = min(spec.shape[-1] for spec in self.args if spec.wide)

        def spans_vocabulary(node):
            val = node.meta.get("val")
            return isinstance(val, torch.Tensor) and val.ndim == 2 and val.shape[-1] == vocab

        return [n for n in joint.graph.nodes
                if n in backward_nodes and n.op == "call_function" and _is_narrow(n, vocab)
                and any(spans_vocabulary(a) for a in n.all_input_nodes)]


def _copies_of_views(graph, values, bases) -> list:
    """`values`, each a view of one of `bases` (which are about to be overwritten) replaced by a
    clone of it, taken now."""
    views = set(bases)
    for node in graph.nodes:
        if (node.op == "call_function" and getattr(node.target, "is_view", False) and node.args
                and node.args[0] in views):
            views.add(node)
    return [graph.call_function(aten.clone.default, (v,)) if v in views else v for v in values]


class NotTileable(Exception):
    """A gradient graph that cannot run on a column tile of its wide inputs; the message says why."""


# Ops that give each column of their output from the same column of their inputs (with
# broadcasting over rows), besides the pointwise-tagged ones.
_COLUMN_WISE = frozenset({aten.where.ScalarOther, aten.where.Scalar, aten.masked_fill.Tensor, aten.detach.default,
                          aten.alias.default})
# Ops whose shape argument may name the vocabulary: retargeted to the tile's width.
_SHAPED = frozenset({aten.expand.default, aten.full.default})


def on_column_tile(graph_module: torch.fx.GraphModule, vocab: int) -> torch.fx.GraphModule:
    """The gradient graph `graph_module`, whose wide values are `[rows, vocab]`, on one column tile:
    each placeholder whose last dim is `vocab` takes the tile's columns instead, a last placeholder
    `column_offset` (a 0-d int64 tensor) is the tile's first column, and the width is the tile's.

    Sound only when every value indexed by column is computed column by column, so this checks it
    on every node, with no exception: from a column-indexed value, only pointwise ops, `where`,
    `detach`, casts (`_to_copy`) and the copy into an out slice; `arange(vocab)` (the gather's backward,
    `peephole`) becomes `arange(width) + column_offset`; `expand` and `full` to `[*, vocab]` take
    the width. Anything else that reads a column (a reduction, a gather, a view) or names the
    vocabulary in a shape raises NotTileable, as does a graph that returns a value (a gradient
    summed over rows). The row values the graph reads (its saved statistics and the sums it
    carries, `JointSplit.carried`) make every reduction over the vocabulary unnecessary; one that
    remains is refused here, never computed per tile.
    """
    if vocab < 2:
        raise NotTileable("a vocabulary of one column")
    graph = torch.fx.Graph()
    env, column = {}, set()
    for node in graph_module.graph.find_nodes(op="placeholder"):
        env[node] = _placeholder(graph, node.name, node)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.ndim == 2 and val.shape[-1] == vocab:
            column.add(node)
    if not column:
        raise NotTileable("no input is indexed by column")
    offset = graph.placeholder("column_offset")
    width = graph.call_function(aten.sym_size.int, (env[next(iter(column))], 1))
    for node in graph_module.graph.nodes:
        if node.op == "output":
            if any(isinstance(a, torch.fx.Node) for a in node.all_input_nodes):
                raise NotTileable("it returns a gradient summed over rows")
            graph.output(())
        elif node.op == "call_function":
            env[node] = _tile_node(graph, node, env, column, vocab, width, offset)
    graph.lint()
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _tile_node(graph, node, env, column, vocab, width, offset):
    """`node` copied into the tile's graph (adding it to `column` if its value is indexed by column)."""
    target, reads = node.target, any(a in column for a in node.all_input_nodes)
    if target is aten.arange.default and node.args == (vocab,):
        if not node.kwargs.get("dtype", torch.int64) in (torch.int64, torch.int32):
            raise NotTileable(f"{node.name} is a non-integer arange over the vocabulary")
        column.add(node)
        return graph.call_function(aten.add.Tensor, (graph.call_function(target, (width,), dict(node.kwargs)), offset))
    sizes = [i for i, a in enumerate(node.args) if isinstance(a, (list, tuple)) and vocab in a]
    if sizes:
        if target not in _SHAPED or len(sizes) > 1 or vocab in node.args[sizes[0]][:-1]:
            raise NotTileable(f"{node.name} ({target}) has the vocabulary in its shape")
        column.add(node)
        args = list(torch.fx.node.map_arg(node.args, env.__getitem__))
        args[sizes[0]] = [*args[sizes[0]][:-1], width]
        return graph.call_function(target, tuple(args), dict(node.kwargs))
    if reads:
        if target is aten.sym_size.int and node.args[1] == 0:
            return graph.node_copy(node, lambda a: env[a])
        out_slice = target is aten.copy_.default and node.args[0] in column and node.args[0].op == "placeholder"
        cast = target is aten._to_copy.default and node.kwargs.get("layout") in (None, torch.strided)
        if not (out_slice or cast or target in _COLUMN_WISE or is_deterministic_pointwise(target)):
            raise NotTileable(f"{node.name} ({target}) reduces or moves values along the vocabulary")
        column.add(node)
    elif torch.Tag.nondeterministic_seeded in getattr(target, "tags", ()):
        raise NotTileable(f"{node.name} ({target}) draws random numbers: each tile would draw others")
    return graph.node_copy(node, lambda a: env[a])


def _placeholder(graph, name, like):
    """A placeholder carrying the example value of node `like`."""
    node = graph.placeholder(name)
    if "val" in like.meta:
        node.meta["val"] = like.meta["val"]
    return node


def _output_nodes(gm: torch.fx.GraphModule) -> list:
    return list(gm.graph.output_node().args[0])




def _is_narrow(node, vocab: int) -> bool:
    """A per-row tensor whose row is far smaller than a wide input's row."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.ndim == 0 or isinstance(val.shape[0], int):
        return False  # rows are the one symbolic size: a static dim 0 is not per-row
    tail = val.shape[1:]
    return all(isinstance(s, int) for s in tail) and math.prod(tail) * _NARROW_FRACTION <= vocab


class _StructuralIds:
    """Numbers nodes by what they compute: equal ids in two traces of one program, equal values.

    An id is the op plus the ids of its arguments (inputs by position), so a forward value of a
    backward trace can be matched with the value the forward kernel saved, and only then reused.
    """

    def __init__(self):
        self._table: dict = {}

    def of_graph(self, graph: torch.fx.Graph) -> dict:
        ids = {}

        def key(node):
            return ("node", ids[node])

        for position, node in enumerate(n for n in graph.nodes if n.op == "placeholder"):
            ids[node] = self._intern(("input", position))
        for node in graph.nodes:
            if node.op == "call_function":
                ids[node] = self._intern((node.target, hashable(node.args, key), hashable(node.kwargs, key)))
        return ids

    def _intern(self, key) -> int:
        try:
            return self._table.setdefault(key, len(self._table))
        except TypeError:  # an unhashable constant: give it an id nothing else shares
            self._table[object()] = len(self._table)
            return len(self._table) - 1
