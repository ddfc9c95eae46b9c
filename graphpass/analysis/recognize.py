"""Label what a narrow output of a row-local region computes: a log-prob, an entropy, or neither.

The recogniser does not match spellings. It evaluates the output's ATen expression into a small
normal form, in which every idiom of the same quantity looks the same:

* a *linear form* is a sum of coefficients times atoms, where an atom is
  ``("x", L)``           the logits row ``L`` itself (the only wide atom),
  ``("gather", L, i)``   ``L[y]``, the logit at index ``i``,
  ``("lse", L)``         ``logsumexp(L)`` over the vocabulary,
  ``("sumpx", L)``       ``sum_v softmax(L)_v * L_v``,
  ``("one",)``           the constant 1;
* a *probability-weighted form* ``PW(L, f)`` stands for ``softmax(L) * f`` with ``f`` linear;
* an *exponential form* ``Exp(f)`` stands for ``exp(f)`` with ``f`` linear: a softmax written out
  by hand (``e = exp(x - m); e / e.sum(-1)``) is ``Exp(x - m) / Exp(lse - m)``, which is
  ``PW(L, 1)``; ``log(Exp(f))`` is ``f`` again.

An unknown value with one entry per row (``[T, 1]``, 0-d) is a row constant ``("c", node)``, such
as the row max a hand-written softmax subtracts: it cancels wherever it is added and subtracted.

With the identities ``log_softmax(L) = x(L) - lse(L)`` and ``sum_v softmax(L)_v = 1``:

    logprob = gather(L, i) - lse(L)          (whatever the spelling, e.g. -cross_entropy)
    entropy = lse(L) - sumpx(L)              (-sum(p * logp), Categorical.entropy(), entr, ...)

and their negations, "-logprob" (a cross-entropy or NLL loss) and "-entropy" (``sum(p * logp)``).
Labels are for reports only: ``log(p + eps)`` with a tiny ``eps`` is read as ``log(p)``.

Anything the evaluator does not understand becomes a fresh logits leaf keyed by its node, which is
always sound: an unknown tensor can only be mislabelled if a normalizer is applied to it, and
then it *is* the logits. A leaf scaled by a scalar or a per-token ``[T, 1]`` tensor becomes a
structural ``("scale", base, op, factor)`` key; that is where the temperature is read from.

`analysis.vocab_parallel` extends the evaluator to a rank's share of sums over the vocabulary,
`analysis.vocab_blocks` to running sums over vocabulary blocks (an online log-sum-exp): they
subclass `Evaluator` and reuse its handlers (`HANDLERS`, `TRANSPARENT`, `h_sum`, `h_where`,
`h_masked_fill`), node helpers (`packet`, `behind_views`, `shape_of`, `arg_of`, `range_test`,
`classify`, `is_vocab_dim`, `broadcast_ok`) and linear-form helpers (`add_lin`, `scale_lin`,
`const_lin`, `leaf_lin`, `only_const`, `pure_leaf`, `split_row_logits`, `is_one`).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis import catalogue
from graphpass.fx_utils import fake_value

aten = torch.ops.aten

LOGPROB = "logprob"
ENTROPY = "entropy"
ROWWISE = "rowwise"
#: A constant this small added to a probability is a guard against log(0), not a change of meaning.
_EPS = 1e-4


@dataclasses.dataclass(frozen=True)
class OutputLabel:
    """What a narrow region output computes and how the logits were scaled before it."""

    kind: str
    """"logprob", "entropy", their negations "-logprob" and "-entropy", or "rowwise"."""
    temperature: str | None = None
    """The scaling of the logits, e.g. "/ 0.7", "* 1.43", "/ item", "/ per-token"; None if unscaled."""


# ----------------------------------------------------------------------------------------------
# Normal forms


ONE = ("one",)
Lin = dict  # atom -> coefficient; immutable by convention (every helper returns a new dict)


@dataclasses.dataclass(frozen=True)
class PW:
    """`softmax(L) * f`, with `f` a linear form: a summand of an expectation under softmax(L)."""

    logits: object
    f: tuple  # sorted items of a Lin, so that PW stays hashable

    @property
    def lin(self) -> Lin:
        return dict(self.f)


def _pw(logits, f: Lin) -> PW:
    return PW(logits, tuple(sorted(f.items(), key=repr)))


@dataclasses.dataclass(frozen=True)
class Exp:
    """`exp(f)` elementwise, with `f` a linear form (wide when f has a logits atom)."""

    f: tuple  # sorted items of a Lin

    @property
    def lin(self) -> Lin:
        return dict(self.f)


def _exp(f: Lin):
    """The form of `exp(f)`: a softmax `PW(L, 1)` when f is `x(L) - lse(L)`, else `Exp(f)`."""
    split = split_row_logits(f)
    if split is not None and split[1] == {("lse", split[0]): -1.0}:
        return _pw(split[0], const_lin(1.0))
    return Exp(tuple(sorted(f.items(), key=repr)))


def leaf_lin(key) -> Lin:
    return {("x", key): 1.0}


def const_lin(c: float) -> Lin:
    return {ONE: float(c)}


def is_one(c: float) -> bool:
    return abs(c - 1.0) < 1e-9


def scale_lin(f: Lin, c: float) -> Lin:
    return {a: k * c for a, k in f.items()}


def add_lin(f: Lin, g: Lin) -> Lin:
    out = dict(f)
    for a, k in g.items():
        out[a] = out.get(a, 0.0) + k
    # Drop cancelled atoms so that e.g. (x - lse) + lse compares equal to x.
    return {a: k for a, k in out.items() if abs(k) > 1e-12}


def pure_leaf(f) -> object | None:
    """The key L if `f` is exactly the logits leaf x(L), else None."""
    if isinstance(f, dict) and len(f) == 1:
        (atom, k), = f.items()
        if atom[0] == "x" and is_one(k):
            return atom[1]
    return None


def only_const(f) -> float | None:
    """The value if `f` is a constant, else None."""
    if isinstance(f, dict) and set(f) <= {ONE}:
        return f.get(ONE, 0.0)
    return None


def split_row_logits(f) -> tuple[object, Lin] | None:
    """(L, c) if `f` is x(L) plus row constants c (atoms that are constant along V), else None."""
    if not isinstance(f, dict):
        return None
    wide = [(a, k) for a, k in f.items() if a[0] == "x"]
    if len(wide) != 1 or not is_one(wide[0][1]):
        return None
    return wide[0][0][1], {a: k for a, k in f.items() if a[0] != "x"}


# ----------------------------------------------------------------------------------------------
# Small readers of nodes


def packet(node):
    """The aten overload packet of a call_function node (aten.gather for aten.gather.default)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    return getattr(node.target, "overloadpacket", None)


def arg_of(node: torch.fx.Node, i: int, name: str, default=None):
    """Positional-or-keyword argument `i`/`name` of `node`."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)




def shape_of(x) -> tuple | None:
    v = fake_value(x)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def is_vocab_dim(tensor_node, dim) -> bool:
    """True if `dim` (an int or a one-element list) is the last dimension of `tensor_node`."""
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    if not isinstance(dim, int):
        return False
    if dim == -1:
        return True
    shape = shape_of(tensor_node)
    return shape is not None and dim == len(shape) - 1


def broadcast_ok(node: torch.fx.Node, operands) -> bool:
    """True if every tensor operand is the output's shape, a scalar, or a keepdim row value.

    A narrow [T] value broadcast against [T, V] would run along V, not along the rows; only
    [T, 1] row constants (or same-shape operands) keep the algebra of row constants valid.
    """
    out = shape_of(node)
    if out is None:
        return False
    for x in operands:
        if not isinstance(x, torch.fx.Node):
            continue
        s = shape_of(x)
        if s is None:
            if isinstance(fake_value(x), torch.Tensor):
                return False
            continue  # a SymFloat/SymInt scalar
        if _torch_api.same_shape(s, out) or len(s) == 0:
            continue
        if len(s) == len(out) and isinstance(s[-1], int) and s[-1] == 1:
            continue
        return False
    return True


_RUNTIME_SCALAR_PACKETS = {aten.item, aten._local_scalar_dense}


def _scale_factor(x):
    """How `x` scales logits when used as a multiplier/divisor: a float, a node, or None if not a scalar."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if not isinstance(x, torch.fx.Node):
        return None
    val = fake_value(x)
    if packet(x) in _RUNTIME_SCALAR_PACKETS or isinstance(val, (torch.SymFloat, torch.SymInt, float, int)):
        return x
    if isinstance(val, torch.Tensor) and (val.dim() == 0 or (isinstance(val.shape[-1], int) and val.shape[-1] == 1)):
        return x  # a 0-d runtime scalar or a per-row [T, 1] temperature
    return None


def _factor_desc(op: str, factor) -> str:
    """Short text for scaling by `factor`: "/ 0.7", "* 1.43", "/ item", "/ per-token"."""
    if isinstance(factor, float):
        return f"{op} {factor:.3g}"
    node = factor
    # `x * (1 / t)` with a runtime t arrives as operator.truediv(1.0, item): report it as "/ t".
    if node.op == "call_function" and node.target is operator.truediv and node.args[0] in (1, 1.0):
        return _factor_desc("/" if op == "*" else "*", node.args[1])
    val = fake_value(node)
    # A tensor with any non-unit (or symbolic) dimension holds one temperature per row: [T, 1].
    if isinstance(val, torch.Tensor) and any(not (isinstance(s, int) and s == 1) for s in val.shape):
        return f"{op} per-token"
    return f"{op} {node.name}"


# ----------------------------------------------------------------------------------------------
# The evaluator


_VIEWS = catalogue.packets(catalogue.VIEWS)
# Ops that change neither values nor layout (dtype casts change precision, not meaning).
_CASTS = catalogue.packets(catalogue.CASTS)
TRANSPARENT = _VIEWS | _CASTS


def _broadcast_source(n: torch.fx.Node):
    """The input behind `broadcast_tensors(xs)[i]` when broadcasting left it unchanged, else None.

    Categorical.log_prob broadcasts the index against the log-probs; the log-probs come out as is.
    """
    if n.op != "call_function" or n.target is not operator.getitem:
        return None
    bt, i = n.args
    if packet(bt) is not aten.broadcast_tensors or not isinstance(i, int):
        return None
    source = bt.args[0][i]
    s_in, s_out = shape_of(source), shape_of(n)
    return source if s_in is not None and s_out is not None and _torch_api.same_shape(s_in, s_out) else None


def behind_views(node):
    """`node` behind view, cast and copy wrappers (they change neither values nor meaning): an
    index tensor keys alike in x.gather(-1, t[:, None]) and CE(x, t)."""
    while packet(node) in TRANSPARENT:
        node = node.args[0]
    return node


_AND = {aten.__and__, aten.bitwise_and, aten.logical_and}
_OR = {aten.__or__, aten.bitwise_or, aten.logical_or}


def range_test(node, outside: bool = False) -> tuple | None:
    """(t, s, e) if `node` tests token ids `t` against the columns [s, e): `(t >= s) & (t < e)`,
    or with `outside`, `(t < s) | (t >= e)` (either operand first); else None."""
    node = behind_views(node)
    low, high = (aten.lt, aten.ge) if outside else (aten.ge, aten.lt)
    if packet(node) not in (_OR if outside else _AND):
        return None
    first, second = (behind_views(a) for a in node.args[:2])
    if packet(first) is high:
        first, second = second, first
    if packet(first) is not low or packet(second) is not high:
        return None
    t = behind_views(first.args[0])
    return (t, first.args[1], second.args[1]) if behind_views(second.args[0]) is t else None


class Evaluator:
    """Evaluates nodes into normal forms (Lin or PW), memoised per node.

    `handlers` (by overload packet) and `eps` (the largest constant read as a guard against
    log(0)) are class attributes, so that a stricter evaluator can override them.
    """

    eps = _EPS

    def __init__(self):
        self.memo: dict[torch.fx.Node, object] = {}

    def __call__(self, x):
        if not isinstance(x, torch.fx.Node):
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                return const_lin(x)
            return leaf_lin(("value", repr(x)))
        if x not in self.memo:
            self.memo[x] = self._eval(x)
        return self.memo[x]

    def _eval(self, n: torch.fx.Node):
        source = _broadcast_source(n)
        if source is not None:
            return self(source)
        p = packet(n)
        handler = self.handlers.get(p)
        if handler is not None:
            out = handler(self, n)
            if out is not None:
                return out
        return self.unknown(n)

    def unknown(self, n: torch.fx.Node):
        """The form of a value not understood: a row constant if narrow, else a fresh logits leaf."""
        val = fake_value(n)
        if isinstance(val, torch.Tensor) and (val.ndim == 0 or _torch_api.same_size(val.shape[-1], 1)):
            return {("c", n): 1.0}  # one value per row: a row constant
        return leaf_lin(n)

    # -- helpers used by handlers ---------------------------------------------------------

    def normalizer_input(self, x, f=None) -> tuple[object, Lin]:
        """(L, c): the logits a softmax-like op normalises, and the row constants it cancels."""
        split = split_row_logits(self(x) if f is None else f)
        if split is not None:
            return split
        return x, {}

    def gathered(self, src, idx, f=None) -> Lin | None:
        """The form of `src[..., idx]` along V (`f`: src's form if already known), None if not linear."""
        f = self(src) if f is None else f
        if isinstance(f, Exp):  # exp(f)[y] = exp(f[y])
            g = self.gathered(src, idx, f.lin)
            return None if g is None else _exp(g)
        if isinstance(f, PW) and f.lin == const_lin(1.0):  # softmax(L)[y] = exp(x(L)[y] - lse(L))
            g = self.gathered(src, idx, {("x", f.logits): 1.0, ("lse", f.logits): -1.0})
            return None if g is None else Exp(tuple(sorted(g.items(), key=repr)))
        if not isinstance(f, dict):
            return None
        key = behind_views(idx)
        out: Lin = {}
        for a, k in f.items():
            # Row constants are the same at every vocabulary position, so gathering keeps them.
            atom = ("gather", a[1], key) if a[0] == "x" else a
            out = add_lin(out, {atom: k})
        return out


def _h_cast(ev, n):
    return ev(n.args[0])


def _h_view(ev, n):
    f = ev(n.args[0])
    in_shape, out_shape = shape_of(n.args[0]), shape_of(n)
    if not isinstance(f, (PW, Exp, dict)):  # an extension's form (`vocab_blocks`): kept by a same-shape view
        return f if in_shape is not None and _torch_api.same_shape(in_shape, out_shape) else None
    atoms = f.lin if isinstance(f, (PW, Exp)) else f
    wide = isinstance(f, PW) or any(a[0] == "x" for a in atoms)
    if not wide:
        return f
    # A wide value keeps its meaning only while V stays the last dimension.
    if in_shape and out_shape and _torch_api.same_size(in_shape[-1], out_shape[-1]):
        return f
    return None


def _h_neg(ev, n):
    f = ev(n.args[0])
    if isinstance(f, Exp):
        return None
    return _pw(f.logits, scale_lin(f.lin, -1.0)) if isinstance(f, PW) else scale_lin(f, -1.0)


def _h_add_sub(sign: float):
    def handler(ev, n):
        a, b = n.args[0], n.args[1]
        alpha = n.kwargs.get("alpha", 1)
        if not broadcast_ok(n, (a, b)):
            return None
        fa, fb = ev(a), ev(b)
        if isinstance(fa, dict) and isinstance(fb, dict):
            return add_lin(fa, scale_lin(fb, sign * alpha))
        for prob, other in ((fa, fb), (fb, fa)):
            c = only_const(other) if isinstance(prob, (PW, Exp)) else None
            if c is not None and abs(c) <= ev.eps:
                return prob  # p + eps, a guard against log(0)
        if isinstance(fa, PW) and isinstance(fb, PW) and fa.logits == fb.logits:
            return _pw(fa.logits, add_lin(fa.lin, scale_lin(fb.lin, sign * alpha)))
        return None

    return handler


def _h_rsub(ev, n):
    a, b = n.args[0], n.args[1]  # b - alpha * a
    alpha = n.kwargs.get("alpha", 1)
    if not broadcast_ok(n, (a, b)):
        return None
    fa, fb = ev(a), ev(b)
    if isinstance(fa, dict) and isinstance(fb, dict):
        return add_lin(fb, scale_lin(fa, -alpha))
    return None


def _scaled(ev, n, data, factor_arg, op: str):
    """x * s or x / s: a temperature when x is a logits leaf, a coefficient otherwise."""
    return _scale_form(ev(data), factor_arg, op)


def _scale_form(f, factor_arg, op: str):
    """The form `f * s` or `f / s`, or None when `s` is not a scalar or per-row factor."""
    factor = _scale_factor(factor_arg)
    if factor is None:
        return None
    base = pure_leaf(f)
    if base is not None:
        return leaf_lin(("scale", base, op, factor))
    if isinstance(factor, float) and factor != 0.0 and not isinstance(f, Exp):
        c = factor if op == "*" else 1.0 / factor
        return _pw(f.logits, scale_lin(f.lin, c)) if isinstance(f, PW) else scale_lin(f, c)
    return None


def _h_mul(ev, n):
    a, b = n.args[0], n.args[1]
    if not broadcast_ok(n, (a, b)):
        return None
    fa, fb = ev(a), ev(b)
    if isinstance(fa, Exp) and isinstance(fb, Exp):
        return _exp(add_lin(fa.lin, fb.lin))
    # Products of a probability with a linear form are the summands of expectations.
    for p, g in ((fa, fb), (fb, fa)):
        if isinstance(p, PW) and isinstance(g, dict):
            pc, gc = only_const(p.lin), only_const(g)
            if pc is not None:
                return _pw(p.logits, scale_lin(g, pc))
            if gc is not None:
                return _pw(p.logits, scale_lin(p.lin, gc))
            return None
    if isinstance(fa, dict) and isinstance(fb, dict):
        for data, other, f_other in ((a, b, fb), (b, a, fa)):
            if only_const(f_other) is not None and not isinstance(other, torch.fx.Node):
                return _scaled(ev, n, data, other, "*")
        for data, other in ((a, b), (b, a)):
            out = _scaled(ev, n, data, other, "*")
            if out is not None:
                return out
    return None


def _h_div(ev, n):
    if n.kwargs.get("rounding_mode") is not None or len(n.args) > 2:
        return None
    if not broadcast_ok(n, n.args[:2]):
        return None
    fa, fb = ev(n.args[0]), ev(n.args[1])
    if isinstance(fa, (Exp, PW)) and isinstance(fb, Exp):  # e / e.sum(-1): a softmax by hand
        top = fa.lin if isinstance(fa, Exp) else (
            {("x", fa.logits): 1.0, ("lse", fa.logits): -1.0} if fa.lin == const_lin(1.0) else None)
        return None if top is None else _exp(add_lin(top, scale_lin(fb.lin, -1.0)))
    return _scaled(ev, n, n.args[0], n.args[1], "/")


def _h_log_softmax(ev, n):
    if not is_vocab_dim(n.args[0], n.args[1]):
        return None
    L, _ = ev.normalizer_input(n.args[0])
    return {("x", L): 1.0, ("lse", L): -1.0}


def _h_softmax(ev, n):
    if not is_vocab_dim(n.args[0], n.args[1]):
        return None
    L, _ = ev.normalizer_input(n.args[0])
    return _pw(L, const_lin(1.0))


def _h_logsumexp(ev, n):
    if not is_vocab_dim(n.args[0], arg_of(n, 1, "dim")):
        return None
    L, row_consts = ev.normalizer_input(n.args[0])
    # logsumexp(x + c) = logsumexp(x) + c for a row constant c.
    return add_lin({("lse", L): 1.0}, row_consts)


def _h_gather(ev, n):
    src, dim, idx = n.args[0], n.args[1], n.args[2]
    if not is_vocab_dim(src, dim) or shape_of(idx) is None or shape_of(idx)[-1] != 1:
        return None
    return ev.gathered(src, idx)


def _h_take_along_dim(ev, n):
    src, idx, dim = n.args[0], n.args[1], arg_of(n, 2, "dim")
    if dim is None or not is_vocab_dim(src, dim) or shape_of(idx) is None or shape_of(idx)[-1] != 1:
        return None
    return ev.gathered(src, idx)


def h_sum(ev, n):
    if not is_vocab_dim(n.args[0], arg_of(n, 1, "dim")):
        return None
    f = ev(n.args[0])
    if isinstance(f, Exp):  # sum_v exp(x_v + c) = exp(lse + c) for row constants c
        split = split_row_logits(f.lin)
        return None if split is None else _exp(add_lin({("lse", split[0]): 1.0}, split[1]))
    if not isinstance(f, PW):
        return None  # a sum of logits or of log-probs is not an expectation
    out: Lin = {}
    for a, k in f.lin.items():
        if a[0] == "x" and a[1] != f.logits:
            return None
        # sum_v p_v x_v is the atom sumpx; sum_v p_v c = c for a row constant c.
        out = add_lin(out, {("sumpx", f.logits) if a[0] == "x" else a: k})
    return out


def _h_exp(ev, n):
    f = ev(n.args[0])
    return _exp(f) if isinstance(f, dict) else None  # exp(log_softmax(L)) = softmax(L)


def _h_log(ev, n):
    f = ev(n.args[0])
    if isinstance(f, Exp):
        return f.lin
    if isinstance(f, PW) and f.lin == const_lin(1.0):
        return {("x", f.logits): 1.0, ("lse", f.logits): -1.0}  # log(softmax(L))
    return None


def _h_entr(ev, n):
    f = ev(n.args[0])
    if isinstance(f, PW) and f.lin == const_lin(1.0):
        # entr(p) = -p * log(p) = p * (lse - x)
        return _pw(f.logits, {("x", f.logits): -1.0, ("lse", f.logits): 1.0})
    return None


def _h_clamp(ev, n):
    lo, hi = arg_of(n, 1, "min"), arg_of(n, 2, "max")
    val = fake_value(n)
    if hi is not None or not isinstance(lo, float) or not isinstance(val, torch.Tensor):
        return None
    if not val.dtype.is_floating_point or lo > torch.finfo(val.dtype).min:
        return None
    # Categorical clamps log-probs at finfo.min so that 0 * -inf is 0, not nan: same quantity.
    return ev(n.args[0])


def h_select_unit(ev, n):
    """`x[:, 0]` of a `[T, 1]` value: the same values, one dim fewer (a view); other selects
    are unknown. Not in `HANDLERS`: regions end a quantity at such a select (`catalogue.FINISHING`);
    the evaluators that read a Function's forward whole see through it."""
    shape = shape_of(n.args[0])
    return ev(n.args[0]) if shape is not None and _torch_api.same_size(shape[n.args[1]], 1) else None


def h_masked_fill(ev, n):
    base = pure_leaf(ev(n.args[0]))
    if base is None:
        return None
    # A masked leaf is new logits; keeping the base in its key keeps its temperature readable.
    return leaf_lin(("mask", base, n))


def h_where(ev, n):
    a, b = n.args[1], n.args[2]  # the condition: any per-element mask
    for data, fill in ((a, b), (b, a)):
        base = pure_leaf(ev(data)) if isinstance(data, torch.fx.Node) else None
        if base is not None and _scale_factor(fill) is not None and \
                _torch_api.same_shape(shape_of(data) or (), shape_of(n) or (None,)):
            return leaf_lin(("mask", base, n))
    return None


def _class_dim_form(ev, x):
    """The form of a loss input whose class dimension is 1, as if V were last; None if unknown.

    2-D input already has V last. For [B, V, S] input the transpose that moved V to dim 1 is
    undone, through the casts and scalar scalings (`x.transpose(1, 2) / 0.7`) applied after it.
    """
    shape = shape_of(x)
    if shape is None or len(shape) < 2:
        return None
    if len(shape) == 2:
        return ev(x)
    p = packet(x)
    if p is aten.transpose:
        d0, d1 = sorted(d % len(shape) for d in x.args[1:3])
        return ev(x.args[0]) if (d0, d1) == (1, len(shape) - 1) else None
    if p in _CASTS:
        return _class_dim_form(ev, x.args[0])
    if p in (aten.div, aten.mul) and not x.kwargs and _scale_factor(x.args[1]) is not None:
        inner = _class_dim_form(ev, x.args[0])
        return None if inner is None else _scale_form(inner, x.args[1], "/" if p is aten.div else "*")
    return None


def _h_cross_entropy(ev, n):
    weight, reduction = arg_of(n, 2, "weight"), arg_of(n, 3, "reduction", 1)
    smoothing = arg_of(n, 5, "label_smoothing", 0.0)
    f = _class_dim_form(ev, n.args[0])
    if weight is not None or reduction != 0 or smoothing != 0.0 or f is None:
        return None
    L, _ = ev.normalizer_input(n.args[0], f)
    return {("gather", L, behind_views(n.args[1])): -1.0, ("lse", L): 1.0}


def _h_nll_loss(ev, n):
    weight, reduction = arg_of(n, 2, "weight"), arg_of(n, 3, "reduction", 1)
    f = _class_dim_form(ev, n.args[0])
    if weight is not None or reduction != 0 or f is None:
        return None
    g = ev.gathered(n.args[0], n.args[1], f)
    return None if g is None else scale_lin(g, -1.0)


HANDLERS = {
    **{p: _h_cast for p in _CASTS},
    **{p: _h_view for p in _VIEWS},
    aten.neg: _h_neg,
    aten.add: _h_add_sub(1.0),
    aten.sub: _h_add_sub(-1.0),
    aten.rsub: _h_rsub,
    aten.mul: _h_mul,
    aten.mul_: _h_mul,
    aten.div: _h_div,
    aten.div_: _h_div,
    aten.log_softmax: _h_log_softmax,
    aten._log_softmax: _h_log_softmax,
    aten.softmax: _h_softmax,
    aten._softmax: _h_softmax,
    aten.logsumexp: _h_logsumexp,
    aten.gather: _h_gather,
    aten.take_along_dim: _h_take_along_dim,
    aten.sum: h_sum,
    aten.exp: _h_exp,
    aten.log: _h_log,
    aten.special_entr: _h_entr,
    aten.clamp: _h_clamp,
    aten.clamp_min: _h_clamp,
    aten.masked_fill: h_masked_fill,
    aten.where: h_where,
    aten.cross_entropy_loss: _h_cross_entropy,
    aten.nll_loss_nd: _h_nll_loss,
    aten.nll_loss: _h_nll_loss,
}


Evaluator.handlers = HANDLERS


# ----------------------------------------------------------------------------------------------
# Classification


def _temperature(key) -> str | None:
    """The scalings recorded in a logits key, innermost first, e.g. "/ 0.7"; None if unscaled."""
    parts = []
    while isinstance(key, tuple) and key and key[0] in ("scale", "mask", "cols"):
        if key[0] == "scale":
            parts.append(_factor_desc(key[2], key[3]))
        key = key[1]
    return " ".join(reversed(parts)) or None


def classify(f) -> OutputLabel:
    """Match a normal form against the log-prob and entropy forms and their negations."""
    label = _classify_positive(f)
    if label.kind == ROWWISE and isinstance(f, dict):
        negated = _classify_positive(scale_lin(f, -1.0))
        if negated.kind != ROWWISE:
            return OutputLabel("-" + negated.kind, negated.temperature)
    return label


def _classify_positive(f) -> OutputLabel:
    if not isinstance(f, dict) or len(f) != 2:
        return OutputLabel(ROWWISE)
    by_kind = {a[0]: (a, k) for a, k in f.items()}
    if set(by_kind) == {"gather", "lse"}:
        (g, kg), (l, kl) = by_kind["gather"], by_kind["lse"]
        if g[1] == l[1] and is_one(kg) and is_one(-kl):
            return OutputLabel(LOGPROB, _temperature(l[1]))
    if set(by_kind) == {"lse", "sumpx"}:
        (l, kl), (s, ks) = by_kind["lse"], by_kind["sumpx"]
        if l[1] == s[1] and is_one(kl) and is_one(-ks):
            return OutputLabel(ENTROPY, _temperature(l[1]))
    return OutputLabel(ROWWISE)


def _cat_parts(node: torch.fx.Node) -> list | None:
    """The parts of a row-wise concatenation of narrow outputs (a chunk loop Dynamo unrolled)."""
    while packet(node) in TRANSPARENT and packet(node) is not aten.expand:
        node = node.args[0]
    if packet(node) is not aten.cat:
        return None
    parts, dim = node.args[0], arg_of(node, 1, "dim", 0)
    shape = shape_of(node)
    if shape is None or (len(shape) > 1 and is_vocab_dim(node, dim)):
        return None
    return list(parts)


def label_output(node: torch.fx.Node) -> OutputLabel:
    """Label a narrow output ([T], [T, 1] or [B, S]) of a row-local region."""
    parts = _cat_parts(node)
    if parts:
        labels = {label_output(p) for p in parts}
        return labels.pop() if len(labels) == 1 else OutputLabel(ROWWISE)
    from graphpass.analysis.vocab_blocks import BlockEvaluator  # extends this module's evaluator

    shape = shape_of(node) or ()
    return classify(BlockEvaluator(shape[:-1] if shape and _torch_api.same_size(shape[-1], 1) else shape)(node))
