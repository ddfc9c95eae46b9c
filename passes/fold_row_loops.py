"""Fold a Python loop over rows, unrolled by Dynamo, back into one computation over all rows.

Before (TRL's per-row log-sum-exp, verl's `logprobs_from_logits_v2`)::

    lse = torch.stack([torch.logsumexp(row, -1) for row in logits])        # one op per row

    stack([logsumexp(select(x, 0, 0), [-1]), logsumexp(select(x, 0, 1), [-1]), ...])

After::

    logsumexp(x, [-1])

Three loop shapes fold, each when every iteration computes the same ops on its own rows of a
loop dim `d` (the first dim, or the sequence dim of `[B, S, V]`):

- `stack([f(x[0]), f(x[1]), ..., f(x[n-1])], d)`, the selects covering `x`'s dim `d`;
- `cat([f(x[0:16]), f(x[16:32]), ...], d)`, the slices tiling it (a `split` chunk loop), and
  `cat([f(x[0]), f(x[1]), ...], d)`, a flattened stack (a per-sequence loop);
- a buffer filled chunk by chunk, `buf[:, s:e] = f(x[:, s:e])`, which functionalization made a
  chain of `slice_scatter`s: when the slices tile the whole buffer it is the `cat` of the chunks.

`f` folds when each of its ops treats the loop dim as a batch dim: elementwise ops, reductions,
softmaxes, gathers and scatters over other dims, squeeze/unsqueeze elsewhere (`x[:, 0]` of a
one-wide dim too), an lm_head's product of the hidden states' rows (`sink_row_slices` moves the
loop's picks onto them), with loop-invariant operands that broadcast along it. Values are unchanged: slice `i` of `f(x)` along `d` is
`f(x[i])`. Then the region passes see one region over all rows: no
per-iteration op, and a temperature applied before the loop is inside it. Anything else (an op
that mixes rows, a gap between chunks, iterations that differ) leaves the loop as it is; each
iteration is still its own region.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from graphpass._torch_api import (detect_fake_mode, fake_node, functional_collectives, same_shape, same_size,
                                  schema_of)
from graphpass.fx_utils import hashable
from graphpass.analysis import catalogue
from graphpass.analysis.grad_flow import grad_modes
from graphpass.analysis.rowlocal import clamp_index, slice_span

aten = torch.ops.aten

__all__ = ["fold_row_loops_pass", "fold_function_body_loops"]


def fold_row_loops_pass(gm: torch.fx.GraphModule, example_inputs, *, config, record) -> torch.fx.GraphModule:
    """Replace each unrolled row loop (`stack`, `cat`, a tiled `slice_scatter` chain) by one `f(x)`."""
    _fold_loops(gm.graph, collectives=False)
    return gm


def fold_function_body_loops(gm: torch.fx.GraphModule, example_inputs, *, config, record) -> torch.fx.GraphModule:
    """`fold_row_loops_pass` on an `autograd.Function`'s captured body (`graphpass.passes.fold_function_body`):
    its iterations may all-reduce their rows' values, and a weight gradient summed over its chunks
    is one product."""
    _fold_loops(gm.graph, collectives=True)
    return gm


def _fold_loops(graph, collectives: bool) -> None:
    """Fold each loop; with `collectives`, iterations may all-reduce their rows' values."""
    for node in list(graph.nodes):
        if node.target is aten.slice.Tensor and _whole(node):
            node.replace_all_uses_with(node.args[0])  # a loop of one chunk reads all rows
        elif node.target is aten.slice_scatter.default and not _continues_chain(node):
            _chain_as_cat(graph, node)
    if collectives:  # a Function body: its weight gradient summed over chunks is one product
        for node in reversed(list(graph.nodes)):
            if node.target in _ACCUMULATES and node.users and not any(u.target in _ACCUMULATES for u in node.users):
                _sum_chain_as_product(graph, node)
    # Functionalization re-derives a view from its base after each write into a buffer, and
    # `sink_row_slices` gives each reader its own slice: iterations that read one `x` through
    # copies of the same view are one loop.
    _merge_duplicates(graph, lambda node: node.target in _PICKS)
    folder = _Folder(graph, collectives)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (aten.cat.default, aten.stack.default):
            folder.fold(node)
    graph.eliminate_dead_code()
    # A fold rebuilds the loop's body over all rows, which the code may already compute outside
    # the loop (the lm_head product a gather reads, the log-softmax another buffer's loop folds).
    _merge_duplicates(graph, folder.built.__contains__)


#: Ops that pick or rearrange a value's elements.
_PICKS = catalogue.VIEWS | {aten.slice.Tensor, aten.select.int, aten.permute.default, aten.t.default,
                            aten.transpose.int}


def _merge_duplicates(graph, merge) -> None:
    """Each node for which `merge(node)` holds replaced by an earlier node that computes the same op
    of the same operands in the same grad mode: one value, so that its readers are one region.
    Ops that draw random numbers or write into their inputs are never the same op twice."""
    modes, seen = grad_modes(graph), {}
    for node in list(graph.nodes):
        if node.op != "call_function" or not _pure(node.target):
            continue
        key = (node.target, hashable(node.args), hashable(node.kwargs), modes[node])
        if key not in seen:
            seen[key] = node
        elif merge(node):
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)


def _pure(target) -> bool:
    schema = schema_of(target)
    return (schema is not None and not schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()))


# ---- a buffer filled chunk by chunk --------------------------------------------------------------
def _continues_chain(node) -> bool:
    return any(u.target is aten.slice_scatter.default and u.args[0] is node for u in node.users)


def _chain_as_cat(graph, end) -> None:
    """`slice_scatter(...slice_scatter(buf, v0, d, s0, e0)..., vn, d, sn, en)` -> `cat([v...], d)`
    when the slices tile `buf`'s dim `d` (every value of `buf` overwritten)."""
    writes, dims, node = [], set(), end
    while node.op == "call_function" and node.target is aten.slice_scatter.default:
        dim, start, stop, step = slice_span(node)
        if step != 1 or not all(isinstance(v, (int, type(None))) for v in (start, stop)):
            return
        writes.append((start, stop, node.args[1]))
        dims.add(dim % node.meta["val"].ndim)
        node = node.args[0]
    buf = node.meta.get("val")
    if len(dims) != 1 or not isinstance(buf, torch.Tensor):
        return
    dim = dims.pop()
    size = buf.shape[dim]
    if not isinstance(size, int):
        return
    spans = sorted((clamp_index(s or 0, size), clamp_index(e, size), v) for s, e, v in writes)
    if [s for s, _, _ in spans] != [0] + [e for _, e, _ in spans[:-1]] or spans[-1][1] != size:
        return  # a gap or an overlap: the buffer's own values (or an earlier write) survive
    pieces = [_written_value(v) for _, _, v in spans]
    with graph.inserting_before(end):
        cat = graph.call_function(aten.cat.default, (pieces, dim))
    cat.meta.update(end.meta)
    end.replace_all_uses_with(cat)


# ---- a product summed over chunks ------------------------------------------------------------------
_ACCUMULATES = {aten.add.Tensor, aten.addmm.default}


def _sum_chain_as_product(graph, end) -> None:
    """`Z + t(a0) @ b0 + t(a1) @ b1 + ...` (a zero start `Z`, or none; `+=` or `addmm`) ->
    `t(cat([a0, a1, ...])) @ cat([b0, b1, ...])`: the same sum over the chunks' rows, whose cats
    then fold like any loop's (a weight's gradient accumulated chunk by chunk)."""
    terms, scales, node = [], set(), end
    while node.op == "call_function" and node.target in _ACCUMULATES and not node.kwargs:
        if node.target is aten.addmm.default:
            terms.append(tuple(node.args[1:3]))
            scales.add(None)
            node = node.args[0]
            continue
        x, y = node.args
        if not (isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node)):
            return
        product, node = (y, x) if _is_product(_unscaled(y)[0]) else (x, y)
        product, scale = _unscaled(product)
        if not _is_product(product):
            return
        terms.append(tuple(product.args))
        scales.add(scale)
    if _is_product(_unscaled(node)[0]):
        node, scale = _unscaled(node)
        terms.append(tuple(node.args))
        scales.add(scale)
    elif node.target not in catalogue.ZEROS:
        return
    if len(terms) < 2 or len(scales) != 1 or not all(a.target in (aten.t.default, aten.permute.default)
                                                      for a, _ in terms):
        return
    if any(a.target is aten.permute.default and list(a.args[1]) != [1, 0] for a, _ in terms):
        return
    terms.reverse()
    fake_mode = detect_fake_mode([end.meta["val"]])
    with graph.inserting_before(end):
        lefts = fake_node(graph, fake_mode, aten.cat.default, ([a.args[0] for a, _ in terms], 0), {}, end)
        rights = fake_node(graph, fake_mode, aten.cat.default, ([b for _, b in terms], 0), {}, end)
        product = fake_node(graph, fake_mode, aten.mm.default,
                            (fake_node(graph, fake_mode, aten.t.default, (lefts,), {}, end), rights), {}, end)
        scale = scales.pop()
        if scale is not None:  # each term `(a.T @ b) op c`, the same `op c`: the sum's
            product = fake_node(graph, fake_mode, scale[0], (product, scale[1]), {}, end)
    if product.meta["val"].dtype == end.meta["val"].dtype and same_shape(product.meta["val"].shape,
                                                                        end.meta["val"].shape):
        end.replace_all_uses_with(product)


def _unscaled(node):
    """(`x`, (op, c)) for `node` = `x * c` or `x / c` of a constant `c`; else (`node`, None)."""
    if node.target in (aten.mul.Tensor, aten.div.Tensor) and isinstance(node.args[1], (int, float)) \
            and isinstance(node.args[0], torch.fx.Node):
        return node.args[0], (node.target, node.args[1])
    return node, None


def _is_product(node) -> bool:
    """A matrix product of two 2-d values (`a @ b` of matrices is `mm`)."""
    return node.target in catalogue.MATRIX_PRODUCTS and all(
        isinstance(a, torch.fx.Node) and a.meta["val"].ndim == 2 for a in node.args[:2])


def _tiled_source(pieces, dim):
    """`x` if `pieces` are slices of `x` along `dim` that tile it in order, else None."""
    if not all(p.target is aten.slice.Tensor for p in pieces):
        return None
    source = pieces[0].args[0]
    size = source.meta["val"].shape[dim] if isinstance(dim, int) else None
    if not isinstance(size, int) or any(p.args[0] is not source for p in pieces):
        return None
    spans = []
    for p in pieces:
        d, start, stop, step = slice_span(p)
        if d % source.meta["val"].ndim != dim % source.meta["val"].ndim or step != 1 or not all(
                isinstance(v, (int, type(None))) for v in (start, stop)):
            return None
        spans.append((clamp_index(start or 0, size), clamp_index(stop, size)))
    starts, stops = [s for s, _ in spans], [e for _, e in spans]
    return source if starts == [0, *stops[:-1]] and stops[-1] == size else None


def _whole(node) -> bool:
    """Whether a slice keeps every element of its source (`x[0:n]` of `n` rows): it is its source."""
    dim, start, stop, step = slice_span(node)
    size = node.args[0].meta["val"].shape[dim]
    return (step == 1 and isinstance(size, int) and isinstance(start, (int, type(None)))
            and isinstance(stop, (int, type(None))) and clamp_index(start or 0, size) == 0 and clamp_index(stop, size) == size)



def _written_value(value):
    """The chunk a write stores: the functional `copy_`'s `clone(expand_as(v, dst))` is `v` when
    `v` already has `dst`'s shape."""
    while value.op == "call_function" and (
            value.target is aten.clone.default
            or (value.target is aten.expand_as.default
                and same_shape(value.args[0].meta["val"].shape, value.meta["val"].shape))):
        value = value.args[0]
    return value


# ---- stack / cat of identical iterations -------------------------------------------------------------
class _Folder:
    """Folds loops, remembering the nodes it builds."""

    def __init__(self, graph, collectives: bool):
        self.graph, self.collectives = graph, collectives
        self.modes = grad_modes(graph)
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        # New nodes go before the node that followed a loop's last node in the original graph:
        # after it, in its grad mode.
        self.successor = {n: n.next for n in graph.nodes}
        self.built: set = set()

    def fold(self, node) -> None:
        pieces = node.args[0]
        if not pieces or not all(isinstance(p, torch.fx.Node) for p in pieces):
            return
        if node.target is aten.cat.default and len(pieces) == 1:
            # One chunk covers every row (Dynamo may have dropped the no-op slices): it is the loop.
            if self.modes[pieces[0]] == self.modes[node] and pieces[0].meta["val"].dtype == node.meta["val"].dtype:
                node.replace_all_uses_with(pieces[0])
            return
        if node.target is aten.cat.default:
            source = _tiled_source(pieces, node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
            if source is not None and source.meta["val"].dtype == node.meta["val"].dtype:
                node.replace_all_uses_with(source)  # the slices put back together
                return
        kinds = ["stack"] if node.target is aten.stack.default else ["cat", "stack"]
        for kind in kinds:  # a cat of per-row results (`cat([f(x[b]) for b ...])`) is a flattened stack
            folded = self._fold_as(kind, node, pieces)
            if folded is not None:
                node.replace_all_uses_with(folded)
                return

    def _fold_as(self, kind, node, pieces):
        """The node that computes `node` (a `stack`/`cat` of `pieces`) as one loop of `kind`, or None."""
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        loop = _Loop(kind, len(pieces))
        if not all(loop.match(pieces[0], p, i) for i, p in enumerate(pieces)) or not loop.covers_rows():
            return None
        body = loop.body(self.order)
        computing = [n for i in range(len(pieces)) for n in loop.piece_nodes(body, i)]
        if not body or {self.modes[n] for n in computing} != {self.modes[node]}:
            return None  # the loop ran in another grad mode than the stack/cat reads it in
        last = max(computing, key=self.order.__getitem__)
        batcher = _Batcher(self.graph, loop, self.built, self.collectives)
        folded = batcher.build(body, pieces[0], self.successor[last])
        if folded is None:
            return None
        want, got = node.meta["val"], folded.meta["val"]
        dim %= want.ndim
        if batcher.batch_dim.get(pieces[0]) != dim or got.dtype != want.dtype:
            return None  # (its nodes are dead and go with the pass's final clean-up)
        if node.target is aten.cat.default and kind == "stack":
            if got.ndim != want.ndim + 1:
                return None
            with self.graph.inserting_before(self.successor[last]):
                folded = batcher.node(aten.flatten.using_ints, (folded, dim, dim + 1), {}, node)
        return folded if same_shape(folded.meta["val"].shape, want.shape) else None


class _Loop:
    """The iterations of one loop: piece 0's nodes matched with each piece's, and the rows each
    iteration picks (`select(x, d, i)` for a stack, `slice(x, d, s, e)` for a cat)."""

    def __init__(self, kind: str, n: int):
        self.kind, self.n = kind, n
        self.matched = [dict() for _ in range(n)]  # piece-0 node -> piece-i node
        self.picks = [dict() for _ in range(n)]  # piece-0 pick node -> (source, dim, index or span)

    def match(self, a, b, i: int) -> bool:
        """Whether piece i's node `b` computes what piece 0's `a` does, on its own rows. (Piece 0
        matches itself, which records its picks.)"""
        if a is b and i > 0:
            return True  # the same node in both: a loop-invariant value
        if a in self.matched[i]:
            return self.matched[i][a] is b
        if _is_copy(a) != _is_copy(b):
            # `.contiguous()` copies only where a chunk's layout needs it (not a one-row chunk's).
            if _is_copy(b):
                return self.match(a, b.args[0], i)
            self.matched[i][a] = b
            return self.match(a.args[0], b, i)
        pa, pb = self._pick(a), self._pick(b)
        if pa is not None or pb is not None:
            if pa is None or pb is None or pa[:2] != pb[:2]:
                return False
            self.matched[i][a] = b
            self.picks[i][a] = pb
            return True
        if a.op == "get_attr" and b.op == "get_attr":
            return _same_constant(a, b)  # `x[mask] = 0`'s 0, made once per iteration
        if a.op != "call_function":
            return a is b  # an input of the graph: loop-invariant
        if b.op != "call_function" or a.target is not b.target:
            return False
        if len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
            return False
        self.matched[i][a] = b
        return all(self._match_arg(x, y, i) for x, y in zip((*a.args, *a.kwargs.values()),
                                                             (*b.args, *b.kwargs.values())))

    def _match_arg(self, x, y, i) -> bool:
        if isinstance(x, torch.fx.Node) or isinstance(y, torch.fx.Node):
            return isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node) and self.match(x, y, i)
        if isinstance(x, (list, tuple)):
            return (isinstance(y, (list, tuple)) and len(x) == len(y)
                    and all(self._match_arg(p, q, i) for p, q in zip(x, y)))
        return type(x) is type(y) and x == y

    def _pick(self, node):
        """(source, dim, which rows) if `node` picks rows of its source along `dim`, else None."""
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return None
        src = node.args[0]
        if self.kind == "stack" and node.target is operator.getitem and src.target is aten.unbind.int:
            dim, index, src = (src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0)), node.args[1], src.args[0]
        elif self.kind == "stack" and node.target is aten.select.int:
            dim, index = node.args[1:3]
        elif self.kind == "cat" and node.target is aten.slice.Tensor:
            dim, start, stop, step = slice_span(node)
            if step != 1 or not all(isinstance(v, (int, type(None))) for v in (start, stop)):
                return None
            index = (start, stop)
        else:
            return None
        val = src.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.ndim == 0 or not isinstance(dim, int):
            return None
        dim %= val.ndim
        if not isinstance(val.shape[dim], int):
            return None
        return src, dim, index

    def covers_rows(self) -> bool:
        """Every piece picks its own rows, all its picks agree, and together they cover each
        source's loop dim exactly, in order."""
        if not self.picks[0] or any(set(self.picks[i]) != set(self.picks[0]) for i in range(self.n)):
            return False
        sizes = {src.meta["val"].shape[dim] for src, dim, _ in self.picks[0].values()}
        if len(sizes) != 1:
            return False
        size = sizes.pop()
        rows = []
        for picks in self.picks:
            which = {w % size if self.kind == "stack" else (clamp_index(w[0] or 0, size), clamp_index(w[1], size))
                     for _, _, w in picks.values()}
            if len(which) != 1:
                return False  # one iteration reads different rows of two sources
            rows.append(which.pop())
        if self.kind == "stack":
            return rows == list(range(size))
        return ([s for s, _ in rows] == [0] + [e for _, e in rows[:-1]] and rows[-1][1] == size
                and all(s < e for s, e in rows))

    def piece_nodes(self, body, i: int) -> list:
        """Piece i's nodes that compute what `body` (piece 0's) does."""
        return [self.matched[i][a] for a in body]

    def body(self, order: dict) -> list:
        """Piece 0's nodes that depend on its picks, in graph order; the rest is loop-invariant."""
        picks, batched = set(self.picks[0]), set(self.picks[0])
        for n in sorted(set(self.matched[0]) - picks, key=order.__getitem__):  # inputs come first
            if any(a in batched for a in n.all_input_nodes):
                batched.add(n)
        return sorted(batched - picks, key=order.__getitem__)


def _is_vector_matmul(node) -> bool:
    """`linear(h, W[, b])` or `matmul(h, W)` of one row `h` (a vector) and a 2-D `W`: one
    iteration of a loop over an lm_head's rows (`for row in hidden: row @ W.T`)."""
    if node.target not in catalogue.ROW_MATMULS or node.kwargs:
        return False
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    return (len(vals) >= 2 and all(isinstance(v, torch.Tensor) for v in vals[:2]) and vals[0].ndim == 1
            and vals[1].ndim == 2 and node.meta["val"].ndim == 1
            and all(v is None or (isinstance(v, torch.Tensor) and v.ndim == 1) for v in vals[2:]))


class _Batcher:
    """Rebuilds piece 0's body over all rows. Each batched node's loop dim (`batch_dim`, in the
    batched node's own dims) is tracked, so each op's dim arguments can be moved past it."""

    def __init__(self, graph, loop: _Loop, built: set, collectives: bool):
        self.graph, self.loop, self.built, self.collectives = graph, loop, built, collectives
        self.stack = loop.kind == "stack"
        self.env = {pick: src for pick, (src, _, _) in loop.picks[0].items()}
        self.batch_dim = {pick: dim for pick, (_, dim, _) in loop.picks[0].items()}

    def build(self, body, out, before):
        """The batched node of piece 0's `out`, new nodes inserted before `before`; None if an op
        does not fold."""
        fake_mode = detect_fake_mode([n.meta["val"] for n in body if isinstance(n.meta.get("val"), torch.Tensor)])
        try:
            with self.graph.inserting_before(before):
                for node in body:
                    if not self._fold_node(node, fake_mode):
                        return None
        except (RuntimeError, TypeError, ValueError, IndexError):
            return None  # a shape the batched op rejects: leave the loop
        return self.env.get(out)

    def _fold_node(self, node, fake_mode) -> bool:
        target, args, kwargs = node.target, list(node.args), dict(node.kwargs)
        val = node.meta.get("val")
        if not isinstance(val, (torch.Tensor, tuple, list)):
            return False
        if target is aten.expand_as.default and same_shape(args[0].meta["val"].shape, val.shape):
            self.env[node], self.batch_dim[node] = self.env[args[0]], self.batch_dim[args[0]]
            return True  # a no-op expand (a functional copy_ of a same-shape chunk)
        if target is operator.getitem:
            b = self.batch_dim[args[0]]
        elif target in _DIM_ARG and (target is not aten.select.int or _selects_a_unit_dim(node)):
            b = self._move_dims(node, args, kwargs)
        elif (_is_elementwise(target) or (self.collectives and target in _ROW_COLLECTIVES)
              or _is_masked_write(node)):
            b = self._broadcast_batch_dim(node)
        elif catalogue.is_row_matmul(node) or (self.stack and _is_vector_matmul(node)):
            b = self._row_matmul_batch_dim(node)
        elif target is aten.transpose.int:
            b = self._transposed_batch_dim(node, args)
        else:
            b = None
        if b is None:
            return False
        new = self.node(target, tuple(self._read(a) for a in args), {k: self._read(v) for k, v in kwargs.items()},
                        node, fake_mode)
        self.env[node], self.batch_dim[node] = new, b
        return True

    def _read(self, arg):
        if isinstance(arg, torch.fx.Node):
            return self.env.get(arg, arg)
        if isinstance(arg, (list, tuple)):
            return type(arg)(self._read(a) for a in arg)
        return arg

    def _move_dims(self, node, args, kwargs):
        """Point the op's dims at the batched input (in place in `args`/`kwargs`); the output's
        loop dim, or None if the op reads along the loop dim itself."""
        target = node.target
        position, counted_in = _DIM_ARG[target]
        x = args[0]
        b = self.batch_dim.get(x)
        others = [a for a in args[1:] if isinstance(a, torch.fx.Node)]
        if b is None or (others and target not in catalogue.GATHERS and target not in _SCATTERS):
            return None
        dims = args[position] if position < len(args) else kwargs.get("dim")
        many = isinstance(dims, (list, tuple))
        if dims is None or (many and not dims) or not all(isinstance(d, int) for d in (dims if many else [dims])):
            return None  # every dim: reduces the loop dim too
        rank = x.meta["val"].ndim + (1 if counted_in == "out" else 0)  # in the piece's dims
        given = list(dims) if many else [dims]
        piece_dims = [d % rank for d in given]
        if self.stack:
            # The piece lacks the loop dim: piece dim p is batched dim p, or p + 1 from b on
            # (where a negative dim, counted from the end, still means the same dim).
            moved = [d if d < 0 and p >= b else p + (p >= b) for d, p in zip(given, piece_dims)]
        else:
            if b in piece_dims:
                return None
            moved = given
        batched = [p + (p >= b) for p in piece_dims] if self.stack else piece_dims
        if target is aten.unsqueeze.default:
            out_b = b + (batched[0] <= b)
        elif target in (aten.squeeze.dim, aten.squeeze.dims, aten.select.int) or (
                target in catalogue.REDUCTIONS | catalogue.REDUCTIONS_INT_DIM and not _keepdim(node)):
            out_b = b - sum(m < b for m in batched)
        else:
            out_b = b
        new_dims = type(dims)(moved) if many else moved[0]
        if position < len(args):
            args[position] = new_dims
        else:
            kwargs["dim"] = new_dims
        if target in catalogue.GATHERS:
            index = args[2] if target is aten.gather.default else args[1]
            if self.batch_dim.get(index) != b or index.meta["val"].ndim != x.meta["val"].ndim:
                return None
        if target in _SCATTERS:  # each row's entries written from its own index and source rows
            for operand in args[2:4]:
                if isinstance(operand, torch.fx.Node) and (
                        self.batch_dim.get(operand) != b or operand.meta["val"].ndim != x.meta["val"].ndim):
                    return None
        return out_b

    def _transposed_batch_dim(self, node, args):
        """The loop dim of `x.transpose(d0, d1)` (its dims pointed at the batched `x`, in place in
        `args`): the loop dim moves with the dim it is swapped with, or stays."""
        x, d0, d1 = node.args[:3]
        b = self.batch_dim.get(x)
        rank = x.meta["val"].ndim  # the piece's
        if b is None or not isinstance(d0, int) or not isinstance(d1, int):
            return None
        d0, d1 = d0 % rank, d1 % rank
        if self.stack:  # the piece lacks the loop dim: its dim p is the batched p, or p + 1 from b on
            args[1], args[2] = d0 + (d0 >= b), d1 + (d1 >= b)
            return b
        return {d0: d1, d1: d0}.get(b, b)

    def _row_matmul_batch_dim(self, node):
        """The loop dim of an lm_head's output (`catalogue.is_row_matmul`: each output row is its
        hidden row times a loop-invariant weight), as the hidden states': any dim but their last,
        which the product contracts. After `sink_row_slices` moved a loop's row picks onto the
        hidden states, every iteration multiplies its own rows."""
        h = node.args[0]
        b = self.batch_dim.get(h)
        invariant = all(a not in self.env for a in node.all_input_nodes if a is not h)
        rank = h.meta["val"].ndim + (1 if self.stack else 0)  # the batched hidden states'
        return b if b is not None and invariant and b < rank - 1 else None

    def _broadcast_batch_dim(self, node):
        """The loop dim of an elementwise op's output: its batched operands have the output's rank
        and agree on it; loop-invariant operands broadcast along it, as they did in each piece."""
        out_rank = node.meta["val"].ndim + (1 if self.stack else 0)  # the batched output's rank
        dims = set()
        for a in node.all_input_nodes:
            val = a.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            if a in self.env:
                if val.ndim + (1 if self.stack else 0) != out_rank:
                    return None
                dims.add(self.batch_dim[a])
        if len(dims) != 1:
            return None
        b = dims.pop()
        for a in node.all_input_nodes:
            val = a.meta.get("val")
            if a in self.env or not isinstance(val, torch.Tensor):
                continue
            aligned = b - (out_rank - val.ndim)  # the invariant's dim that lines up with the loop dim
            if self.stack and aligned >= 0:
                return None  # it would line up with the new loop dim, not with what it met per piece
            if not self.stack and aligned >= 0 and not same_size(val.shape[aligned], 1):
                return None  # it varies along the loop dim: each piece met other rows of it
        return b

    def node(self, target, args, kwargs, like, fake_mode=None):
        """A new node `target(*args, **kwargs)` with `like`'s meta and its own fake value."""
        new = fake_node(self.graph, fake_mode or detect_fake_mode([like.meta["val"]]), target, args, kwargs, like)
        self.built.add(new)
        return new


#: An all-reduce of per-row values and its wait: elementwise, across ranks.
_ROW_COLLECTIVES = {functional_collectives.all_reduce.default, functional_collectives.wait_tensor.default}
#: Writes of entries along a dim, from an index (and a source) with the input's rows.
_SCATTERS = {aten.scatter.src, aten.scatter.value, aten.scatter_add.default}
#: Ops with a dim argument that fold: target -> (its position, the rank it counts in).
_DIM_ARG = {
    **{op: (1, "in") for op in catalogue.REDUCTIONS | catalogue.REDUCTIONS_INT_DIM | catalogue.SOFTMAX},
    aten.gather.default: (1, "in"), aten.take_along_dim.default: (2, "in"),
    aten.squeeze.dim: (1, "in"), aten.squeeze.dims: (1, "in"), aten.unsqueeze.default: (1, "out"),
    aten.select.int: (1, "in"),  # of a one-wide dim (`_selects_a_unit_dim`): a squeeze written `x[:, 0]`
    **{op: (1, "in") for op in _SCATTERS},
}


def _is_copy(node) -> bool:
    """`x.clone()` (or the copy `.contiguous()` makes): the values of `x`."""
    return node.op == "call_function" and node.target is aten.clone.default and set(node.kwargs) <= {"memory_format"}


def _same_constant(a, b) -> bool:
    """Whether two constants of the graph are one tensor's value: the same dtype, shape and values."""
    module = a.graph.owning_module
    x, y = getattr(module, a.target, None), getattr(module, b.target, None)
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
            and x.shape == y.shape and x.device == y.device and bool(torch.equal(x, y)))


def _is_masked_write(node) -> bool:
    """`x[mask] = v` for a boolean `mask` of `x`'s shape and one value `v`: a masked_fill."""
    if node.target is not aten.index_put.default or len(node.args[1]) != 1:
        return False
    x, (mask,), value = node.args[:3]
    mask_val, value_val = getattr(mask, "meta", {}).get("val"), getattr(value, "meta", {}).get("val")
    return (isinstance(mask_val, torch.Tensor) and mask_val.dtype == torch.bool
            and same_shape(mask_val.shape, x.meta["val"].shape)
            and isinstance(value_val, torch.Tensor) and value_val.ndim == 0)


def _selects_a_unit_dim(node) -> bool:
    """`x[:, 0]` of a one-wide dim: the squeeze of it, which folds as squeeze does."""
    x, dim, index = node.args[:3]
    shape = x.meta["val"].shape
    return isinstance(dim, int) and same_size(shape[dim], 1) and index in (0, -1)


def _keepdim(node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


def _is_elementwise(target) -> bool:
    return target in catalogue.ELEMENTWISE or catalogue.is_deterministic_pointwise(target)
