"""Triton kernels generated from the per-chunk graphs of a `JointSplit` (`graphpass.ops.joint`).

Templates, by graph kind:

- **K1, the forward** (`forward`: args -> outputs and saved row statistics). One program per `BM`
  rows sweeps the row in blocks of `BV` columns. Its reductions over the row are running state: a
  max (and a count of NaNs, which make the max NaN as `amax` does); plain sums and picks (a
  `gather` of one column per row, as a sum of `where(column == index, value, 0)`); and *online*
  sums `sum(exp(a - max(a)) * (c0 + c1 (a - max(a))))` (`c0`, `c1` free of reductions, masks
  allowed around them: the log-sum-exp's and the entropy's sums as `row_sums` leaves them), kept
  about the running max and rescaled when it moves. So most programs read each row once; a sum of
  a value that needs another reduction otherwise (a log-softmax summed again) takes a second sweep.
  The row's tail (log, products of row values) runs after the sweeps and writes the outputs.
- **K2, the backward** (`backward`, and a column tile's, `column_tile`): column-wise math over row
  values on a 2-D grid of `[BM, BV]` tiles, each loading its row values once; a backward that sums
  along the row first (a KL's) sweeps the row for its sums, then again writing the gradient.
- **K2f, the gradient made in the forward** (`fused`, `fused_saving`): K1's sweeps, then a sweep
  writing the gradient (and row values into row out slices).

Every float value is computed in fp32 and rounded through bf16/fp16 where the graph rounds
(`emit`). A graph these templates cannot express raises `NotGenerated` with the reason, and the
caller runs the inner compiler's kernel for that graph alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import tempfile

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.kernels import emit
from graphpass.kernels.emit import NotGenerated

aten = torch.ops.aten

WIDE, ROW, COL, SCALAR, CONST = "wide", "row", "col", "scalar", "const"
_AMAX, _SUM, _MEAN, _PICK = aten.amax.default, aten.sum.dim_IntList, aten.mean.dim, aten.gather.default
_REDUCTIONS = {_AMAX, _SUM, _MEAN, _PICK}
_COMPUTED = (torch.float32, torch.bfloat16, torch.float16)  # float dtypes computed here (in fp32, rounded)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes and warps of one launch."""

    rows: int
    columns: int
    warps: int


#: Defaults per template for a GPU, chosen by cross-compiling every test program for sm_90 and sm_100
#: (`cross_compile`): a row sweep streams one row per program in blocks of 2048 columns; K2's tiles load
#: their row values once for 8 rows. Twice as many elements per thread spilled (223-255 registers).
FORWARD_BLOCKS = Blocks(rows=1, columns=2048, warps=8)
BACKWARD_BLOCKS = Blocks(rows=8, columns=256, warps=8)


# ---- what each node is ------------------------------------------------------------------------
def _kind(value, vocab: int) -> str:
    """How a value lies over a chunk `[rows, vocab]`: WIDE, ROW (one value per row), COL (one per
    column), SCALAR (0-d), CONST (a Python number)."""
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (bool, int, float)):
            return CONST
        raise NotGenerated(f"a value of type {type(value).__name__}")
    shape = tuple(value.shape)
    if not shape:
        return SCALAR
    symbolic_rows = not isinstance(shape[0], int)
    if symbolic_rows and len(shape) == 2 and shape[1] == vocab:
        return WIDE
    if symbolic_rows and all(s == 1 for s in shape[1:]):
        return ROW
    if shape in ((vocab,), (1, vocab)):
        return COL
    if all(s == 1 for s in shape):
        return SCALAR
    raise NotGenerated(f"a value of shape {list(shape)} (rows, a row of width {vocab}, or a scalar only)")


class _Program:
    """A graph's nodes, classified, and the expressions that compute them."""

    def __init__(self, gm: torch.fx.GraphModule, vocab: int):
        self.gm, self.vocab = gm, vocab
        self.kinds: dict = {}
        self.exprs: dict = {}  # node -> Triton expression (a variable name once assigned)
        self.depends: dict = {}  # node -> the reductions it depends on
        self.placeholders = list(gm.graph.find_nodes(op="placeholder"))
        for node in gm.graph.nodes:
            if node.op not in ("placeholder", "call_function"):
                continue
            self.kinds[node] = (self._call_kind(node) if node.op == "call_function"
                                else _kind(node.meta.get("val"), vocab))
            if self.kinds[node] not in (SCALAR, CONST) and node.meta["val"].dtype == torch.float64:
                # Computed in fp32 here; only a runtime scalar (a temperature) is cast to fp32 as it is read.
                raise NotGenerated(f"{node.name} is float64")
            if node.op == "placeholder":
                if self.kinds[node] == CONST:
                    raise NotGenerated(f"placeholder {node.name} is not a tensor")
                self.depends[node] = frozenset()
            else:
                inputs = [self.depends[a] for a in node.all_input_nodes if a in self.depends]
                own = frozenset({node}) if node.target in _REDUCTIONS else frozenset()
                self.depends[node] = own.union(*inputs)

    def _call_kind(self, node) -> str:
        if node.target is aten.sym_size.int:
            return CONST
        if node.target is aten.arange.default:
            return COL
        return _kind(node.meta.get("val"), self.vocab)

    def dtype(self, node) -> torch.dtype:
        return node.meta["val"].dtype

    def arg(self, a) -> str:
        """An argument of a node as an expression."""
        if isinstance(a, torch.fx.Node):
            if a not in self.exprs:
                raise NotGenerated(f"{a.name} is read before it is computed in this template")
            return self.exprs[a]
        if isinstance(a, torch.dtype) or a is None:
            return "None"
        return emit.literal(a)

    def expression(self, node) -> str:
        """The Triton expression of a column-wise or row-wise node, from its arguments' expressions."""
        target, args, kwargs = node.target, node.args, node.kwargs
        if target is aten.sym_size.int:
            return "0"  # only ever a shape argument, which broadcasting makes unnecessary
        if target is aten.arange.default:
            if _is_row_width(args[0] if args else None, self):  # a column tile's: arange(width) + offset
                return "cols"
            integer = kwargs.get("dtype", torch.int64) in (torch.int64, torch.int32)
            if (len(args) != 1 or args[0] != self.vocab or not integer
                    or kwargs.get("start", 0) != 0):
                raise NotGenerated(f"{node.name}: an arange other than over the row's columns")
            return "cols"
        if target in emit.CONSTANTS:
            return self._constant(node, args[emit.CONSTANTS[target]])
        if target in emit.ZEROS_ONES:
            return self._constant(node, emit.ZEROS_ONES[target])
        if target in emit.SAME_VALUES:
            return self._same_values(node)
        if target not in emit.POINTWISE:
            raise NotGenerated(f"{node.name} ({target}) is not in the emitter's table")
        if kwargs.get("alpha", 1) != 1:
            raise NotGenerated(f"{node.name}: {target} with alpha")
        if target in (aten.div.Tensor, aten.div.Scalar) and kwargs.get("rounding_mode") is not None:
            raise NotGenerated(f"{node.name}: a division with rounding mode {kwargs['rounding_mode']}")
        if set(kwargs) - {"alpha"}:
            raise NotGenerated(f"{node.name}: {target} with keyword arguments {sorted(kwargs)}")
        if self.dtype(node).is_floating_point and self.dtype(node) not in _COMPUTED:
            raise NotGenerated(f"{node.name} computes in {self.dtype(node)}")
        expr = emit.POINTWISE[target](*[self.arg(a) for a in args])
        return emit.rounded(expr, self.dtype(node))

    def _constant(self, node, value) -> str:
        dtype = self.dtype(node)
        if isinstance(value, torch.fx.Node):
            raise NotGenerated(f"{node.name}: a constant of a runtime value")
        if dtype.is_floating_point:
            return emit.rounded(emit.literal(float(value)), dtype)
        return emit.literal(bool(value) if dtype == torch.bool else int(value))

    def _same_values(self, node) -> str:
        source = node.args[0]
        if self.kinds.get(source) == WIDE and self.kinds[node] != WIDE:
            raise NotGenerated(f"{node.name} ({node.target}) reshapes a row of the vocabulary")
        if self.kinds[node] == WIDE and node.target is not aten.expand.default and self.kinds.get(source) != WIDE:
            raise NotGenerated(f"{node.name} ({node.target}) makes a row of the vocabulary")
        expr = self.arg(source)
        if node.target is aten._to_copy.default:
            if set(node.kwargs) - {"dtype", "layout", "device"} or node.kwargs.get("layout") not in (None,
                                                                                                    torch.strided):
                raise NotGenerated(f"{node.name}: a copy with {dict(node.kwargs)}")
            src, dst = self.dtype(source), self.dtype(node)
            if dst.is_floating_point:
                if dst not in (torch.float32, torch.bfloat16, torch.float16):
                    raise NotGenerated(f"{node.name}: a cast to {dst}")
                expr = f"({expr}).to(tl.float32)" if not src.is_floating_point else expr
                return emit.rounded(expr, dst)
            if dst == torch.bool:
                return f"({expr} != 0)"
            if src.is_floating_point:
                raise NotGenerated(f"{node.name}: a cast from {src} to {dst}")
            return expr
        return expr


def _is_row_width(a, program: _Program) -> bool:
    """`a` is `sym_size(x, 1)` of a wide value x: the width of the columns a kernel runs on."""
    return (isinstance(a, torch.fx.Node) and a.target is aten.sym_size.int and a.args[1] in (1, -1)
            and program.kinds.get(a.args[0]) == WIDE)


# ---- loads and stores ----------------------------------------------------------------------------
def _load(name: str, kind: str, dtype: torch.dtype, mask: str) -> str:
    """Triton source loading placeholder `name` as its kind lies (float values widened to fp32 at once:
    the interpreter holds bf16 as raw bits)."""
    widen = ".to(tl.float32)" if dtype.is_floating_point else ""
    if kind == WIDE:
        return f"tl.load({name}_ptr + r64 * {name}_s0 + c64 * {name}_s1, mask={mask}, other=0){widen}"
    if kind == ROW:
        return f"tl.load({name}_ptr + r64 * {name}_s0, mask=row_ok, other=0){widen}"
    if kind == COL:
        return f"tl.load({name}_ptr + c64 * {name}_s1, mask=col_ok, other=0){widen}"
    return f"tl.load({name}_ptr){widen}"


def _parameters(program: _Program) -> list[str]:
    params = []
    for p in program.placeholders:
        kind = program.kinds[p]
        params.append(f"{p.name}_ptr")
        params += {WIDE: [f"{p.name}_s0", f"{p.name}_s1"], ROW: [f"{p.name}_s0"], COL: [f"{p.name}_s1"]}.get(kind, [])
    return params


def _wide(expr: str, kind: str) -> str:
    """`expr` as a `[BM, BV]` block (a row value broadcast along the row, a column value down it)."""
    return _block(expr, kind, WIDE, "BV")


def _rows(expr: str, kind: str) -> str:
    """`expr` as a `[BM, 1]` block."""
    return _block(expr, kind, ROW, "1")


def _block(expr: str, kind: str, already: str, width: str) -> str:
    """`expr` (of `kind`) as a `[BM, width]` block: as it is when its kind is `already` that shape."""
    if kind == already:
        return expr
    if kind == CONST:
        return f"tl.full((BM, {width}), {expr}, tl.float32)"
    return f"tl.broadcast_to({expr}, (BM, {width}))"


_HEADER = """import triton
import triton.language as tl
{prelude}

@triton.jit
def kernel({params}, T, V, BM: tl.constexpr, BV: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]
    row_ok = rows < T
    r64 = rows.to(tl.int64)  # element offsets in int64: rows x V passes 2^31 (32768 x 151936)
"""


# ---- K2: the backward ------------------------------------------------------------------------------
def _backward_source(program: _Program) -> tuple[str, list, bool]:
    """The backward's source, the out slices it writes (placeholders) in the graph's order, and
    whether it runs on 2-D tiles (K2), or sweeps along rows because it sums along them first."""
    graph = program.gm.graph
    if any(n.target in _REDUCTIONS for n in graph.nodes if n.op == "call_function"):
        if any(isinstance(a, torch.fx.Node) for a in graph.output_node().all_input_nodes):
            raise NotGenerated("the backward returns a gradient summed over rows")
        copies = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.copy_.default]
        if not copies:
            raise NotGenerated("the backward writes no gradient")
        return _swept_source(program, [], copies), [c.args[0] for c in copies], False
    return (*_tile_source(program), True)


def _tile_source(program: _Program) -> tuple[str, list]:
    """K2's source and the out slices it writes (placeholders), in the graph's order."""
    body = ["    cols = tl.program_id(1) * BV + tl.arange(0, BV)[None, :]", "    col_ok = cols < V",
            "    c64 = cols.to(tl.int64)",
            "    mask = row_ok & col_ok"]
    stores = []
    for node in program.gm.graph.nodes:
        if node.op == "placeholder":
            program.exprs[node] = node.name
            if node.users and not all(u.target is aten.copy_.default and u.args[0] is node for u in node.users):
                body.append(f"    {node.name} = {_load(node.name, program.kinds[node], program.dtype(node), 'mask')}")
        elif node.op == "call_function":
            if node.target is aten.copy_.default:
                body.append("    " + _store(program, node))
                stores.append(node.args[0])
                continue
            program.exprs[node] = f"v_{node.name}"
            body.append(f"    v_{node.name} = {program.expression(node)}")
        elif node.op == "output":
            if any(isinstance(a, torch.fx.Node) for a in node.all_input_nodes):
                raise NotGenerated("the backward returns a gradient summed over rows")
    if not stores:
        raise NotGenerated("the backward writes no gradient")
    header = _HEADER.format(prelude=emit.PRELUDE, params=", ".join(_parameters(program)))
    return header + "\n".join(body) + "\n", stores


# ---- K1: the forward -----------------------------------------------------------------------------
@dataclasses.dataclass
class _Term:
    """`const * template(P)` where P is `exp(d)^e * d^k`, d = a - max(a) (`_Online`), and the template
    is linear in P (products with free values, `where(mask, ., 0)`); `masked` once a where is in it."""

    e: int
    k: int
    const: float
    template: str
    masked: bool = False


class _Online:
    """The sums over a row that depend on one max `m = amax(a)` as `sum(exp(a - m) * (c0 + c1 (a - m)))`:
    each node between `m` and such a sum as its terms (`_Term`), else NotGenerated."""

    def __init__(self, program: _Program, finished=frozenset()):
        self.program = program
        self.finished = frozenset(finished)  # reductions done in earlier sweeps: row constants here
        self.forms: dict = {}  # node -> (the amax node, [terms])

    def form(self, node):
        if node in self.forms:
            return self.forms[node]
        form = self._form(node)
        self.forms[node] = form
        return form

    def _free(self, a) -> bool:
        return not isinstance(a, torch.fx.Node) or self.program.depends[a] <= self.finished

    def _form(self, node):
        program, target, args = self.program, node.target, node.args
        why = f"{node.name} ({target}) depends on a reduction over the row in a way the one-pass form does not cover"
        if node.op != "call_function" or program.kinds[node] != WIDE:
            raise NotGenerated(why)
        if target in (aten.sub.Tensor,) and isinstance(args[1], torch.fx.Node) and args[1].target is _AMAX \
                and args[1].args[0] is args[0] and self._free(args[0]) and not node.kwargs:
            return self._first_alike(args[1]), [_Term(0, 1, 1.0, "{P}")]
        if target is aten.exp.default:
            m, terms = self.form(args[0])
            if len(terms) != 1 or (terms[0].e, terms[0].k, terms[0].const, terms[0].template) != (0, 1, 1.0, "{P}"):
                raise NotGenerated(why)
            return m, [_Term(1, 0, 1.0, "{P}")]
        if target is aten._to_copy.default and program.dtype(node) == program.dtype(args[0]) == torch.float32:
            return self.form(args[0])
        if target in (aten.clone.default, aten.alias.default, aten.detach.default):
            return self.form(args[0])
        if target is aten.neg.default:
            m, terms = self.form(args[0])
            return m, [dataclasses.replace(t, const=-t.const) for t in terms]
        if target in (aten.add.Tensor, aten.sub.Tensor) and not node.kwargs:
            (m1, t1), (m2, t2) = (self._plain(a) if self._free(a) else self.form(a) for a in args[:2])
            m1, m2 = m1 or m2, m2 or m1
            if m1 is not m2:
                raise NotGenerated(f"{node.name} mixes sums about two maxima")
            sign = 1.0 if target is aten.add.Tensor else -1.0
            return m1, t1 + [dataclasses.replace(t, const=sign * t.const) for t in t2]
        if target in (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar):
            return self._product(node, why)
        if target in (aten.where.self, aten.where.ScalarOther) and self._free(args[0]) and _is_zero(args[2]):
            m, terms = self.form(args[1])
            mask = program.arg(args[0])
            return m, [_Term(t.e, t.k, 1.0, f"tl.where({mask}, {t.const!r} * ({t.template}), 0.0)", True)
                       for t in terms]
        raise NotGenerated(why)

    def _first_alike(self, m):
        """The first amax in the graph that is `m`'s (same input and arguments): traces repeat a max."""
        return next(n for n in m.graph.nodes if n.target is _AMAX and n.args == m.args and n.kwargs == m.kwargs)

    def _plain(self, a):
        """A free value as a term of no max (a plain sum's summand)."""
        value = self.program.arg(a) if isinstance(a, torch.fx.Node) else emit.literal(a)
        return None, [_Term(0, 0, 1.0, f"({value}) * {{P}}")]

    def _product(self, node, why):
        program, (a, b) = self.program, node.args
        divide = node.target in (aten.div.Tensor, aten.div.Scalar)
        if node.kwargs:
            raise NotGenerated(why)
        if self._free(b):
            m, terms = self.form(a)
            if not isinstance(b, torch.fx.Node):
                factor = 1.0 / b if divide else float(b)
                return m, [dataclasses.replace(t, const=t.const * factor) for t in terms]
            value = program.arg(b)
            op = "tl.div_rn({}, %s)" % emit.as_float(value) if divide else "({}) * %s" % value
            return m, [dataclasses.replace(t, template=op.format(t.template)) for t in terms]
        if divide:
            raise NotGenerated(why)
        if self._free(a):
            m, terms = self.form(b)
            if not isinstance(a, torch.fx.Node):
                return m, [dataclasses.replace(t, const=t.const * float(a)) for t in terms]
            return m, [dataclasses.replace(t, template=f"{program.arg(a)} * ({t.template})") for t in terms]
        (m1, t1), (m2, t2) = self.form(a), self.form(b)
        if m1 is not m2:
            raise NotGenerated(f"{node.name} multiplies sums about two maxima")
        terms = []
        for x in t1:
            for y in t2:
                if x.masked or y.masked:  # where(mask, P1, 0) * P2 is NaN where P2 is, the where's form not
                    raise NotGenerated(f"{node.name} multiplies a masked value by one that depends on the max")
                # Each template is P times free factors: their product is P (the powers' product) times both.
                if y.template == "{P}":
                    both = x.template
                elif x.template == "{P}":
                    both = y.template
                else:
                    both = f"({x.template}) * ({y.template.replace('{P}', '1.0')})"
                terms.append(_Term(x.e + y.e, x.k + y.k, x.const * y.const, both))
        return m1, terms


def _is_zero(a) -> bool:
    """A zero: a number, or a scalar_tensor / full of one."""
    if isinstance(a, torch.fx.Node) and a.target in (aten.scalar_tensor.default, aten.full.default):
        a = a.args[0] if a.target is aten.scalar_tensor.default else a.args[1]
    return isinstance(a, (int, float)) and not isinstance(a, bool) and a == 0


def _forward_source(program: _Program) -> tuple[str, list, int]:
    """K1's source (with its vocabulary-split kernels where it sweeps once, `_split_source`), its
    outputs (nodes) in the graph's order, and the number of state values a split writes (0: none)."""
    graph = program.gm.graph
    outputs = list(graph.output_node().args[0])
    for o in outputs:
        if not isinstance(o, torch.fx.Node) or program.kinds[o] != ROW or o.op == "placeholder":
            raise NotGenerated(f"an output ({o}) that is not a row value computed here")
    source = _swept_source(program, outputs, [])
    split = _split_source(program, outputs)
    return (source, outputs, 0) if split is None else (source + split[0], outputs, split[1])


def _fused_source(program: _Program) -> tuple[str, list]:
    """K2f, the gradient made in the forward (`JointSplit.fused`, and `fused_saving`, which also writes row
    values into row out slices): K1's sweeps, its row values, then a last sweep writing the gradient;
    its source and its outputs (nodes)."""
    graph = program.gm.graph
    outputs = list(graph.output_node().args[0])
    for o in outputs:
        if not isinstance(o, torch.fx.Node) or program.kinds[o] != ROW or o.op == "placeholder":
            raise NotGenerated(f"an output ({o}) that is not a row value computed here (a gradient summed over rows?)")
    copies = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.copy_.default]
    if not copies:
        raise NotGenerated("the fused kernel writes no gradient")
    return _swept_source(program, outputs, copies), outputs


def _plan(program: _Program):
    """The reductions' sweeps (`_swept_source`): (nodes, reductions, sweep of each, online sums' forms,
    sweeps, ready(row value) -> the sweep after which it can be computed, -1 before any)."""
    graph = program.gm.graph
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is not aten.copy_.default]
    reductions = [n for n in nodes if n.target in _REDUCTIONS]
    if not reductions:
        raise NotGenerated("the forward has no reduction over the row")
    for node in program.placeholders:
        program.exprs[node] = node.name
    for node in nodes:
        program.exprs[node] = f"v_{node.name}"
    sweep_of: dict = {}  # reduction -> its sweep
    forms: dict = {}  # online sum -> (its max, terms)
    for node in reductions:
        _check_reduction(node, program)
        source = node.args[0]
        needed = program.depends[source] | (program.depends[node.args[2]] if node.target is _PICK else frozenset())
        if not needed:
            sweep_of[node] = 0
            continue
        last = max(sweep_of[r] for r in needed)
        if node.target is _SUM:
            online = _Online(program, finished={r for r in sweep_of if sweep_of[r] < last})
            try:
                m, terms = online.form(source)
                if sweep_of[m] == last and all((t.e, t.k) in ((1, 0), (1, 1), (0, 0)) for t in terms):
                    sweep_of[node], forms[node] = last, (m, terms)
                    continue
            except NotGenerated:
                pass
        sweep_of[node] = last + 1
    sweeps = max(sweep_of.values()) + 1
    if sweeps > 2:
        raise NotGenerated(f"its reductions need {sweeps} sweeps over the row (two at most)")

    def ready(node):
        return max((sweep_of[r] for r in program.depends[node]), default=-1)

    return nodes, reductions, sweep_of, forms, sweeps, ready


def _swept_source(program: _Program, outputs: list, stores: list) -> str:
    """The source of a kernel that sweeps over each row of `BM` rows: K1 (`outputs`, row values) and
    the backward that sums along the row before writing its gradient (`stores`: its copies into out
    slices, in a last sweep).

    Reductions go into sweeps over the row: sweep 0 takes those of values free of reductions (and
    the online sums about its maxima); a reduction of a value that needs another reduction's result
    otherwise goes into the sweep after that one, where that result is a row constant. Most
    programs need one sweep (one read of each row); a log-softmax summed again (a masked entropy
    that `row_sums` left unfactored, a KL, label smoothing) needs two."""
    nodes, reductions, sweep_of, forms, sweeps, ready = _plan(program)
    lines = [f"{p.name} = {_load(p.name, program.kinds[p], program.dtype(p), 'mask')}"
             for p in program.placeholders if program.kinds[p] in (ROW, SCALAR) and _read(p)]
    lines += _row_values(program, nodes, ready, -1)
    for sweep in range(sweeps):
        mine = [r for r in reductions if sweep_of[r] == sweep]
        finished = {r for r in reductions if sweep_of[r] < sweep}
        init, update, values, _, _ = _sweep_states(program, mine, forms)
        loop = [f"{p.name} = {_load(p.name, program.kinds[p], program.dtype(p), 'mask')}"
                for p in program.placeholders if program.kinds[p] in (WIDE, COL) and _read(p)]
        loop += [f"v_{n.name} = {program.expression(n)}" for n in nodes
                 if program.kinds[n] in (WIDE, COL) and n.target not in _REDUCTIONS
                 and program.depends[n] <= finished]
        lines += init + ["for start in range(0, V, BV):", "    cols = start + tl.arange(0, BV)[None, :]",
                  "    c64 = cols.to(tl.int64)",
                         "    col_ok = cols < V", "    mask = row_ok & col_ok"]
        lines += ["    " + line for line in loop + update] + values
        lines += _row_values(program, nodes, ready, sweep)
    row_stores = [c for c in stores if program.kinds[c.args[0]] != WIDE]
    # Row values into their out slices (`JointSplit.fused_saving`'s, for a later pass over column tiles).
    lines += [_row_store(program, copy) for copy in row_stores]
    stores = [c for c in stores if c not in row_stores]
    if stores:  # the last sweep: the gradient, from every row value
        loop = [f"{p.name} = {_load(p.name, program.kinds[p], program.dtype(p), 'mask')}"
                for p in program.placeholders if program.kinds[p] in (WIDE, COL) and _read(p)]
        loop += [f"v_{n.name} = {program.expression(n)}" for n in nodes
                 if program.kinds[n] in (WIDE, COL) and n.target not in _REDUCTIONS]
        loop += [_store(program, copy) for copy in stores]
        lines += ["for start in range(0, V, BV):", "    cols = start + tl.arange(0, BV)[None, :]",
                  "    c64 = cols.to(tl.int64)",
                  "    col_ok = cols < V", "    mask = row_ok & col_ok"] + ["    " + line for line in loop]
    lines += [f"tl.store(out{j}_ptr + r64 * out{j}_s0, {_rows(program.exprs[o], program.kinds[o])}"
              f".to({emit.tl_dtype(program.dtype(o))}), mask=row_ok)" for j, o in enumerate(outputs)]
    params = _parameters(program) + [p for j in range(len(outputs)) for p in (f"out{j}_ptr", f"out{j}_s0")]
    header = _HEADER.format(prelude=emit.PRELUDE, params=", ".join(params))
    return header + "\n".join("    " + line for line in lines) + "\n"


#: A program's block of BM rows, `row_ok` masking those past T, as `_HEADER` starts its kernel.
_ROW_BLOCK = """    rows = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]
    row_ok = rows < T
    r64 = rows.to(tl.int64)
"""
_SPLIT_HEADER = """

@triton.jit
def partial({params}, P_ptr, T, V, SPLIT_COLUMNS, BM: tl.constexpr, BV: tl.constexpr):
""" + _ROW_BLOCK + """    first = tl.program_id(1) * SPLIT_COLUMNS
"""
_COMBINE_HEADER = """

@triton.jit
def combine({params}, P_ptr, T, V, S, BM: tl.constexpr, BV: tl.constexpr):
""" + _ROW_BLOCK


def _split_source(program: _Program, outputs: list) -> str | None:
    """K1 over vocabulary splits, for too few rows to fill the GPU, or None where K1 takes more than
    one sweep: `partial` (grid rows x splits) writes each split's state to `P[split, row, state]`
    (fp32), `combine` (grid rows) merges the splits in their order (deterministic, no atomics) and
    runs the row's tail."""
    nodes, reductions, sweep_of, forms, sweeps, ready = _plan(program)
    if sweeps != 1:
        return None
    init, update, values, states, merge = _sweep_states(program, reductions, forms)
    pre = [f"{p.name} = {_load(p.name, program.kinds[p], program.dtype(p), 'mask')}"
           for p in program.placeholders if program.kinds[p] in (ROW, SCALAR) and _read(p)]
    pre += _row_values(program, nodes, ready, -1)
    loop = [f"{p.name} = {_load(p.name, program.kinds[p], program.dtype(p), 'mask')}"
            for p in program.placeholders if program.kinds[p] in (WIDE, COL) and _read(p)]
    loop += [f"v_{n.name} = {program.expression(n)}" for n in nodes
             if program.kinds[n] in (WIDE, COL) and n.target not in _REDUCTIONS and not program.depends[n]]
    k = len(states)
    partial = pre + init + ["for start in range(first, tl.minimum(V, first + SPLIT_COLUMNS), BV):",
                            "    cols = start + tl.arange(0, BV)[None, :]", "    c64 = cols.to(tl.int64)",
                            "    col_ok = cols < V", "    mask = row_ok & col_ok"]
    partial += ["    " + line for line in loop + update]
    partial += [f"tl.store(P_ptr + (tl.program_id(1) * T + r64) * {k} + {j}, ({var}).to(tl.float32), mask=row_ok)"
                for j, var in enumerate(states)]
    combine = pre + init + ["for split in range(0, S):"]
    combine += [f"    p_{var} = tl.load(P_ptr + (split * T + r64) * {k} + {j}, mask=row_ok, other=0.0)"
                for j, var in enumerate(states)]
    combine += ["    " + line for line in merge] + values + _row_values(program, nodes, ready, 0)
    combine += [f"tl.store(out{j}_ptr + r64 * out{j}_s0, {_rows(program.exprs[o], program.kinds[o])}"
                f".to({emit.tl_dtype(program.dtype(o))}), mask=row_ok)" for j, o in enumerate(outputs)]
    params = _parameters(program)
    out_params = [p for j in range(len(outputs)) for p in (f"out{j}_ptr", f"out{j}_s0")]
    return (_SPLIT_HEADER.format(params=", ".join(params)) + "\n".join("    " + line for line in partial) + "\n"
            + _COMBINE_HEADER.format(params=", ".join(params + out_params))
            + "\n".join("    " + line for line in combine) + "\n"), k


def _read(placeholder) -> bool:
    """A placeholder some node reads (an out slice is only written)."""
    return any(not (u.target is aten.copy_.default and u.args[0] is placeholder) for u in placeholder.users)


def _store(program: _Program, copy) -> str:
    """The store of a `copy_` into a wide out slice."""
    slot, value = copy.args
    if slot.op != "placeholder" or program.kinds[slot] != WIDE or copy.users:
        raise NotGenerated(f"{copy.name}: a copy into something other than a wide out slice")
    expr = _wide(program.arg(value), program.kinds[value])
    return (f"tl.store({slot.name}_ptr + r64 * {slot.name}_s0 + c64 * {slot.name}_s1, "
            f"({expr}).to({emit.tl_dtype(program.dtype(slot))}), mask=mask)")


def _row_store(program: _Program, copy) -> str:
    """The store of a `copy_` of a row value into a row out slice."""
    slot, value = copy.args
    if slot.op != "placeholder" or program.kinds[slot] != ROW or copy.users or program.kinds.get(value) == WIDE:
        raise NotGenerated(f"{copy.name}: a copy into something other than an out slice")
    return (f"tl.store({slot.name}_ptr + r64 * {slot.name}_s0, "
            f"{_rows(program.arg(value), program.kinds.get(value, CONST))}.to({emit.tl_dtype(program.dtype(slot))}), "
            "mask=row_ok)")


def _row_values(program: _Program, nodes, ready, sweep: int) -> list[str]:
    """The row (and scalar) values computable once `sweep` is done (-1: before the first)."""
    return [f"v_{n.name} = {program.expression(n)}" for n in nodes
            if program.kinds[n] in (ROW, SCALAR, CONST) and n.target not in _REDUCTIONS and ready(n) == sweep]


def _sweep_states(program: _Program, reductions: list, forms: dict) -> tuple[list, list, list, list, list]:
    """For one sweep's reductions: their states' initial values, their update in the loop (after
    every value of the block is computed), their values after the loop, the state's variables, and
    the merge of a vocabulary split's partial state (`p_<variable>`) into them (`_combine_source`)."""
    init, update, values, merge = [], [], [], []
    states = []
    maxima = {}
    moments: dict = {}  # (max, template, e, k) -> variable
    for node in reductions:
        source, name = node.args[0], f"s_{node.name}"
        dtype = program.dtype(node)
        src = _wide(program.arg(source), program.kinds[source])
        if node.target is _AMAX:
            maxima[node] = name
            init += [f'{name} = tl.full((BM, 1), float("-inf"), tl.float32)',
                     f"{name}_nan = tl.zeros((BM, 1), tl.int32)"]
            states += [name, f"{name}_nan"]
            update += [f'a_{node.name} = tl.where(mask, {src}, float("-inf"))',
                       f"nan_{node.name} = a_{node.name} != a_{node.name}",
                       f"{name}_nan = {name}_nan + tl.sum(nan_{node.name}.to(tl.int32), axis=1)[:, None]",
                       f'{name}_new = tl.maximum({name}, tl.max(tl.where(nan_{node.name}, float("-inf"), '
                       f"a_{node.name}), axis=1)[:, None])"]
            values.append(f"v_{node.name} = " + emit.rounded(f'tl.where({name}_nan > 0, float("nan"), {name})', dtype))
        elif node in forms:
            m, terms = forms[node]
            parts = []
            for t in terms:
                for k in range(t.k + 1):  # a first moment rescales with the zeroth
                    moments.setdefault((m, t.template, t.e, k), f"mom{len(moments)}_{m.name}")
                parts.append(f"{t.const!r} * {moments[(m, t.template, t.e, t.k)]}")
            # A row whose max is -inf: eager's exp(a - max) is NaN everywhere.
            values.append(f"v_{node.name} = " + emit.rounded(
                f'tl.where(s_{m.name} == float("-inf"), float("nan"), {" + ".join(parts)})', dtype))
        else:
            init.append(f"{name} = tl.zeros((BM, 1), tl.float32)")
            states.append(name)
            merge.append(f"{name} += p_{name}")
            if node.target is _PICK:
                update.append(f"{name} += tl.sum(tl.where(mask & (cols == {program.arg(node.args[2])}), {src}, 0.0), "
                              "axis=1)[:, None]")
            else:
                update.append(f"{name} += tl.sum(tl.where(mask, {src}, 0.0), axis=1)[:, None]")
            value = f"tl.div_rn({name}, {float(program.vocab)!r} + tl.zeros([1], tl.float32))" \
                if node.target is _MEAN else name
            values.append(f"v_{node.name} = {emit.rounded(value, dtype)}")
    init += [f"{var} = tl.zeros((BM, 1), tl.float32)" for var in moments.values()]
    states += list(moments.values())
    for m, name in maxima.items():
        mine = {key[1:]: v for key, v in moments.items() if key[0] is m}
        update += _moment_updates(program, m, name, mine)
        update.append(f"{name} = {name}_new")
        merge += _moment_merges(m.name, name, mine)
    return init, update, values, states, merge


def _moment_merges(n: str, name: str, moments: dict) -> list[str]:
    """A split's partial max `p_<name>` (its NaN count, its moments about it) merged into the running
    ones: both sets of moments rescaled about the new max, then added; as `_moment_updates`."""
    out = [f"{name}_nan = {name}_nan + p_{name}_nan.to(tl.int32)",
           f"{name}_new = tl.maximum({name}, p_{name})",
           f'old_{n} = tl.where({name} == float("-inf"), 0.0, {name})',
           f'new_{n} = tl.where({name}_new == float("-inf"), 0.0, {name}_new)',
           f'part_{n} = tl.where(p_{name} == float("-inf"), 0.0, p_{name})',
           f"delta_{n} = old_{n} - new_{n}", f"alpha_{n} = tl.exp(delta_{n})",
           f"pdelta_{n} = part_{n} - new_{n}", f"palpha_{n} = tl.exp(pdelta_{n})"]
    for (template, e, k), var in moments.items():
        zeroth = moments.get((template, e, 0))
        if e == 1 and k == 1:
            out.append(f"{var} = alpha_{n} * ({var} + delta_{n} * {zeroth}) "
                       f"+ palpha_{n} * (p_{var} + pdelta_{n} * p_{zeroth})")
    for (template, e, k), var in moments.items():
        if e == 1 and k == 0:
            out.append(f"{var} = alpha_{n} * {var} + palpha_{n} * p_{var}")
        elif e == 0:
            out.append(f"{var} = {var} + p_{var}")
    return out + [f"{name} = {name}_new"]


def _moment_updates(program: _Program, m, name: str, moments: dict) -> list[str]:
    """The online sums about max `m` (state `name`) in the loop: rescale the moments about the new max
    (`exp(old - new)`; a first moment shifts by the zeroth too), then add the block's. While the row is
    all -inf so far the max used is 0 (the block's terms are then 0 or NaN, as eager's)."""
    if not moments:
        return []
    a = _wide(program.arg(m.args[0]), program.kinds[m.args[0]])
    n = m.name
    out = [f'old_{n} = tl.where({name} == float("-inf"), 0.0, {name})',
           f'new_{n} = tl.where({name}_new == float("-inf"), 0.0, {name}_new)',
           f"delta_{n} = old_{n} - new_{n}", f"alpha_{n} = tl.exp(delta_{n})",
           f"d_{n} = {a} - new_{n}", f"e_{n} = tl.exp(d_{n})"]
    for (template, e, k), var in moments.items():
        if e == 1 and k == 1:
            out.append(f"{var} = alpha_{n} * ({var} + delta_{n} * {moments[(template, e, 0)]})")
    for (template, e, k), var in moments.items():
        if e == 1 and k == 0:
            out.append(f"{var} = alpha_{n} * {var}")
    powers = {(1, 0): f"e_{n}", (1, 1): f"e_{n} * d_{n}", (0, 0): "1.0"}
    for (template, e, k), var in moments.items():
        out.append(f"{var} += tl.sum(tl.where(mask, {template.replace('{P}', powers[(e, k)])}, 0.0), axis=1)[:, None]")
    return out


def _check_reduction(node, program: _Program) -> None:
    """A reduction over the last dim of a wide value, to one value per row."""
    if node.target is _PICK:
        if node.args[1] not in (-1, 1) or program.kinds[node.args[0]] != WIDE:
            raise NotGenerated(f"{node.name}: a gather other than along the row")
        return
    dims = node.args[1] if len(node.args) > 1 else None
    if dims not in ([-1], [1], (-1,), (1,)) or program.kinds[node.args[0]] not in (WIDE, COL):
        raise NotGenerated(f"{node.name}: a reduction other than over the row (dims {dims})")
    if program.kinds[node.args[0]] != WIDE:
        raise NotGenerated(f"{node.name}: a reduction of a value that is not a row of the vocabulary")
    if set(node.kwargs) - {"dtype"}:
        raise NotGenerated(f"{node.name}: a reduction with {dict(node.kwargs)}")


# ---- compiling and launching ----------------------------------------------------------------------
_MODULES: dict[str, object] = {}
_DIRECTORY: list[str] = []


def _module_of(source: str):
    """A generated module, imported from a file (Triton reads a kernel's source)."""
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    if key not in _MODULES:
        if not _DIRECTORY:
            _DIRECTORY.append(tempfile.mkdtemp(prefix="graphpass_kernels_"))
        path = os.path.join(_DIRECTORY[0], f"k{key}.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(f"graphpass_generated_k{key}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _MODULES[key] = module
    return _MODULES[key]


def _vocab_of(gm: torch.fx.GraphModule) -> int:
    widths = {n.meta["val"].shape[-1] for n in gm.graph.find_nodes(op="placeholder")
              if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].ndim == 2
              and not isinstance(n.meta["val"].shape[0], int)}
    widths = {w for w in widths if isinstance(w, int) and w > 1}
    if len(widths) != 1:
        raise NotGenerated(f"its inputs' rows have widths {sorted(widths)}: one vocabulary width only")
    return widths.pop()


class GeneratedKernel:
    """A generated Triton kernel with the calling convention of the graph it was made from."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str, blocks: Blocks | None = None):
        if kind not in ("forward", "backward", "fused", "fused_saving", "column_tile"):
            raise NotGenerated(f"the {kind} kernel is not generated")
        self.kind = kind
        self.tiled = False  # a 2-D grid of tiles (K2), else one program per BM rows
        self.vocab = _vocab_of(gm)
        program = _Program(_torch_api.with_example_values(gm, {"column_offset": torch.int64}), self.vocab)
        self.states = 0  # values of a vocabulary split's state; 0: K1 does not split the vocabulary
        self.splits = None  # vocabulary splits per call; None: as many as fill the GPU (`_splits`)
        if kind == "forward":
            self.source, self.outputs, self.states = _forward_source(program)
            self.blocks = blocks or FORWARD_BLOCKS
        elif kind in ("fused", "fused_saving"):
            self.source, self.outputs = _fused_source(program)
            self.blocks = blocks or FORWARD_BLOCKS
        else:
            self.source, self.outputs, self.tiled = _backward_source(program)
            self.blocks = blocks or (BACKWARD_BLOCKS if self.tiled else FORWARD_BLOCKS)
            if kind == "column_tile" and not self.tiled:
                raise NotGenerated("a column tile's backward that sums along the row")
        self.placeholders = [(p.name, program.kinds[p]) for p in program.placeholders]
        self.examples = [(tuple(p.meta["val"].shape), p.meta["val"].dtype) for p in program.placeholders]
        self.wide = next(i for i, (_, k) in enumerate(self.placeholders) if k == WIDE)
        self.out_specs = [(tuple(o.meta["val"].shape[1:]), o.meta["val"].dtype) for o in self.outputs] \
            if kind in ("forward", "fused", "fused_saving") else []
        self._module = None

    @property
    def module(self):
        """The generated module: `kernel`, and K1's `partial` and `combine` where it splits the vocabulary."""
        if self._module is None:
            self._module = _module_of(self.source)
        return self._module

    @property
    def kernel(self):
        return self.module.kernel

    def _splits(self, rows: int, width: int, device) -> int:
        """Vocabulary splits for `rows`: 1 where the rows' programs fill the GPU twice over, else enough
        that they do, each split at least 4 blocks wide."""
        if not self.states:
            return 1
        if self.splits is not None:
            return self.splits
        if device.type != "cuda":
            return 1
        programs = -(-rows // self.blocks.rows)
        fill = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(-(-fill // programs), width // (4 * self.blocks.columns)))

    def compile_now(self, device, rows: int = 16) -> None:
        """Compile and run the kernel once on zeros of `rows` rows on `device`, so that a kernel Triton
        cannot compile fails here, where its caller can take another, rather than in a later call."""
        zeros = [torch.zeros([s if isinstance(s, int) else rows for s in shape], dtype=dtype, device=device)
                 for shape, dtype in self.examples]
        self(*zeros)

    def signature_arguments(self, args, outs=()) -> list:
        """The kernel's arguments for the graph's `args` (and K1's outputs `outs`), before T and V."""
        flat = []
        for (name, kind), a in zip(self.placeholders, args):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"graphpass: generated kernel argument {name} is not a tensor")
            flat.append(a)
            if kind == WIDE:
                flat += [a.stride(0), a.stride(1)]
            elif kind == ROW:
                flat.append(a.stride(0) if a.ndim else 0)
            elif kind == COL:
                flat.append(a.stride(-1))
        for o in outs:
            flat += [o, o.stride(0) if o.ndim else 0]
        return flat

    def __call__(self, *args):
        rows = args[self.wide].shape[0]
        device = args[self.wide].device
        # A 0-d scalar left on the host (a temperature) is read by the kernel: it must be on the device.
        args = [a.to(device, non_blocking=True) if isinstance(a, torch.Tensor) and a.device != device and a.ndim == 0
                else a for a in args]
        outs = [torch.empty((rows, *tail), dtype=dtype, device=device) for tail, dtype in self.out_specs]
        # A column tile's kernel runs on the tile's columns (its graph reads their offset); any other on
        # the graph's vocabulary.
        width = args[self.wide].shape[-1]
        if self.kind != "column_tile" and width != self.vocab:
            raise ValueError(f"graphpass: a generated kernel for rows of {self.vocab} called on rows of {width}")
        if rows and width:
            b = self.blocks
            columns = min(b.columns, _next_power_of_2(width))
            grid = ((rows + b.rows - 1) // b.rows,)
            splits = self._splits(rows, width, device)
            if splits > 1:  # each split's state, then their merge in a fixed order
                split_columns = -(-width // (splits * columns)) * columns
                splits = -(-width // split_columns)
                state = torch.empty((splits, rows, self.states), dtype=torch.float32, device=device)
                self.module.partial[(grid[0], splits)](*self.signature_arguments(args), state, rows, width,
                                                       split_columns, BM=b.rows, BV=columns, num_warps=b.warps)
                self.module.combine[grid](*self.signature_arguments(args, outs), state, rows, width, splits,
                                     BM=b.rows, BV=columns, num_warps=b.warps)
                return tuple(outs)
            if self.tiled:
                grid = (grid[0], (width + columns - 1) // columns)
            self.kernel[grid](*self.signature_arguments(args, outs), rows, width, BM=b.rows, BV=columns,
                              num_warps=b.warps)
        return tuple(outs)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
