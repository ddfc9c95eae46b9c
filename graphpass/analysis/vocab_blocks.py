"""Label the outputs of a loop over vocabulary blocks: an online log-sum-exp, written inline.

A hand-fused kernel's loop reads the logits block by block (`x = logits[:, a:b]`) and folds
each block's statistics into running values: the max `m`, the sum `s = sum(exp(x - m))`, the
sum `t = sum(exp(x - m) * x)`, rescaled by `exp(m_old - m)` at each step, and the target's
logit where the token falls in the block. `recognize`'s normal forms do not cover running sums;
this evaluator extends them (the row max is a row constant, as there):

* `x(("cols", L, a, b, V))`: the logits `L` (`V` wide) restricted to the columns `[a, b)`;
  scaling a block scales `L` (a temperature reads as usual);
* `Sum`: a sum of terms `exp(f) * w` with `f` and `w` linear row forms, e.g. a block's
  `sum(exp(x - m))` is `exp(lse(block) - m) * 1` and its `sum(exp(x - m) * x)` is
  `exp(lse(block) - m) * sumpx(block)`; a zero fill is the empty sum;
* the log of a sum over blocks that tile `[0, V)`, all shifted by the same row constant, is
  `lse(L)` plus that constant; `t / s` over the same blocks is `sumpx(L)`;
* `Picked`: the target's logit, block by block (`where((y >= a) & (y < b), x[y - a], ...)`),
  which is `gather(L, y)` once the blocks tile `[0, V)`.

`label_output` uses this evaluator, a superset of `recognize`'s, for reports; so does
`vocab_parallel.match_single_device`, to read a Function whose forward loops over vocabulary
blocks (its replacement is then checked in float64 by `backward_check`, forward and backward).
"""

from __future__ import annotations

import dataclasses

import torch

from graphpass._torch_api import same_shape
from graphpass.analysis import catalogue, recognize
from graphpass.analysis.recognize import ONE, Exp, Lin
from graphpass.fx_utils import fake_value

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Sum:
    """`sum_k exp(f_k) * w_k` per row, with `f_k` and `w_k` linear row forms (sorted items)."""

    terms: tuple

    @staticmethod
    def of(f) -> Sum | None:
        """`f` as a Sum: a narrow exp, a zero, or a Sum; None for anything else."""
        if isinstance(f, Sum):
            return f
        if isinstance(f, Exp) and not _wide(f.lin):
            return Sum(((f.f, _items({ONE: 1.0})),))
        if recognize.only_const(f) == 0.0:
            return Sum(())
        return None

    def shifted(self, g: Lin) -> Sum:
        return Sum(tuple((_items(recognize.add_lin(dict(f), g)), w) for f, w in self.terms))

    def scaled(self, c: float) -> Sum:
        return Sum(tuple((f, _items(recognize.scale_lin(dict(w), c))) for f, w in self.terms))


@dataclasses.dataclass(frozen=True)
class _ExpTimesX:
    """`exp(x(L) + c) * x(L)`, wide: a summand of `sum(exp(x - m) * x)`."""

    logits: object
    c: tuple


@dataclasses.dataclass(frozen=True)
class Picked:
    """The target's logit on the rows whose token `target` falls in `blocks` ((a, b) of `L`),
    `rest` (a linear row form) elsewhere."""

    logits: object
    width: int
    target: torch.fx.Node
    blocks: tuple
    rest: tuple


def _items(f: Lin) -> tuple:
    return tuple(sorted(f.items(), key=repr))


def _wide(f: Lin) -> bool:
    return any(a[0] == "x" for a in f)


def _cols(key):
    """(L, a, b, V) of a block key, else None."""
    return key[1:] if isinstance(key, tuple) and key[:1] == ("cols",) else None


def tiles(blocks, width) -> bool:
    """Whether the (a, b) blocks are disjoint and cover [0, width)."""
    end = 0
    for a, b in sorted(blocks):
        if a != end:
            return False
        end = b
    return end == width


class BlockEvaluator(recognize.Evaluator):
    """`recognize.Evaluator` plus the forms of the module doc. `row_shape`: the shape of one
    value per row (the output's), so that an unknown value of that shape (a running max) is a
    row constant."""

    def __init__(self, row_shape: tuple):
        super().__init__()
        self.row_shape = tuple(row_shape)

    def unknown(self, n):
        val = fake_value(n)
        if isinstance(val, torch.Tensor) and same_shape(tuple(val.shape), self.row_shape):
            return {("c", n): 1.0}
        return super().unknown(n)

    # -- the block-wise log-sum-exp ---------------------------------------------------------
    def log_of_sum(self, s: Sum) -> Lin | None:
        """log of a sum of one exp per block, every exp shifted by the same row constant."""
        if len(s.terms) == 1:
            (f, w), = s.terms
            return dict(f) if dict(w) == {ONE: 1.0} else None
        found = self._blocks(s)
        if found is None:
            return None
        key, shift = found
        return recognize.add_lin({("lse", key): 1.0}, shift)

    def ratio(self, top: Sum, bottom: Sum) -> Lin | None:
        """`sum(exp(x - m) * x) / sum(exp(x - m))` over the same blocks: sumpx of their union."""
        if len(top.terms) == len(bottom.terms) == 1:  # one block: the whole logits
            (f_top, w_top), (f, w) = top.terms[0], bottom.terms[0]
            lse = [a for a, k in f if a[0] == "lse" and recognize.is_one(k)]
            if f_top == f and dict(w) == {ONE: 1.0} and len(lse) == 1 and dict(w_top) == {("sumpx", lse[0][1]): 1.0}:
                return {("sumpx", lse[0][1]): 1.0}
        found = self._blocks(bottom)
        if found is None or len(top.terms) != len(bottom.terms):
            return None
        key, shift = found
        exponents = {f for f, _ in bottom.terms}
        if len({f for f, _ in top.terms}) != len(top.terms):
            return None
        for f, w in top.terms:
            block = [a[1] for a, k in dict(f).items() if a[0] == "lse" and recognize.is_one(k)]
            if f not in exponents or len(block) != 1 or dict(w) != {("sumpx", block[0]): 1.0}:
                return None
        return {("sumpx", key): 1.0}

    @staticmethod
    def _blocks(s: Sum):
        """(the key of the blocks' union, the common row shift) when each term of `s` is
        `exp(lse(block) + shift)` with weight 1, one shift for all, and the blocks of one logits
        tile a range of its columns (all of them: the key is the logits')."""
        logits, blocks, shifts = set(), [], set()
        for f, w in s.terms:
            f = dict(f)
            lse = [(a, k) for a, k in f.items() if a[0] == "lse"]
            if dict(w) != {ONE: 1.0} or len(lse) != 1 or not recognize.is_one(lse[0][1]) or _cols(lse[0][0][1]) is None:
                return None
            L, a, b, width = _cols(lse[0][0][1])
            logits.add((L, width))
            blocks.append((a, b))
            shift = {x: k for x, k in f.items() if x[0] != "lse"}
            if any(x[0] not in ("c", "one") for x in shift):
                return None
            shifts.add(_items(shift))
        if len(logits) != 1 or len(shifts) != 1:
            return None
        (L, width), = logits
        lo, hi = min(a for a, _ in blocks), max(b for _, b in blocks)
        if not tiles([(a - lo, b - lo) for a, b in blocks], hi - lo):
            return None
        return (L if (lo, hi) == (0, width) else ("cols", L, lo, hi, width)), dict(shifts.pop())


def _slice(ev, n):
    src, dim = n.args[0], recognize.arg_of(n, 1, "dim", 0)
    start, end, step = (recognize.arg_of(n, i, name, d) for i, name, d in ((2, "start", None), (3, "end", None),
                                                                         (4, "step", 1)))
    shape = recognize.shape_of(src)
    if shape is None or not recognize.is_vocab_dim(src, dim) or step != 1 or not isinstance(shape[-1], int):
        return None
    width = shape[-1]
    a = 0 if start is None else start
    b = width if end is None else end
    if not (isinstance(a, int) and isinstance(b, int)) or a < 0 or b < 0:
        return None
    a, b = min(a, width), min(b, width)
    base = recognize.pure_leaf(ev(src))
    if base is None or a >= b:
        return None
    inner = _cols(base)
    if inner is not None:  # a block of a block
        L, a0, _, full = inner
        return recognize.leaf_lin(("cols", L, a0 + a, a0 + b, full))
    return recognize.leaf_lin(base if (a, b) == (0, width) else ("cols", base, a, b, width))


def _scale_block(base_handler):
    """Scaling a block (`logits[:, a:b] / t`) is a block of the scaled logits."""

    def handler(ev, n):
        out = base_handler(ev, n)
        key = recognize.pure_leaf(out) if isinstance(out, dict) else None
        if isinstance(key, tuple) and key[:1] == ("scale",) and _cols(key[1]) is not None:
            L, a, b, width = _cols(key[1])
            return recognize.leaf_lin(("cols", ("scale", L, *key[2:]), a, b, width))
        return out

    return handler


def _fill(ev, n):
    """`torch.zeros(rows)`, `torch.full(rows, c)` with a finite c (or `zeros_like`, `full_like`,
    `new_zeros`, `new_full`): the constant."""
    position = catalogue.FILLS[recognize.packet(n)]
    value = 0.0 if position is None else recognize.arg_of(n, position, "fill_value")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) != float("inf"):
        return recognize.const_lin(float(value))
    return None


def _add_sub(sign: float):
    base = recognize.HANDLERS[aten.add if sign > 0 else aten.sub]

    def handler(ev, n):
        out = base(ev, n)
        if out is not None:
            return out
        if not recognize.broadcast_ok(n, n.args[:2]):
            return None
        sa, sb = Sum.of(ev(n.args[0])), Sum.of(ev(n.args[1]))
        if sa is None or sb is None or n.kwargs.get("alpha", 1) != 1:
            return None
        return Sum(sa.terms + sb.scaled(sign).terms)

    return handler


def _mul(ev, n):
    out = recognize.HANDLERS[aten.mul](ev, n)
    if out is not None or not recognize.broadcast_ok(n, n.args[:2]):
        return out
    fa, fb = ev(n.args[0]), ev(n.args[1])
    for e, x in ((fa, fb), (fb, fa)):
        split = recognize.split_row_logits(e.lin) if isinstance(e, Exp) else None
        if split is not None and recognize.pure_leaf(x) == split[0]:
            return _ExpTimesX(split[0], _items(split[1]))
        s = Sum.of(e)
        if s is not None and isinstance(x, Exp) and not _wide(x.lin):
            return s.shifted(x.lin)
        c = recognize.only_const(x)
        if s is not None and c is not None:
            return s.scaled(c)
    return None


def _sum(ev, n):
    f = ev(n.args[0])
    if isinstance(f, _ExpTimesX) and recognize.is_vocab_dim(n.args[0], recognize.arg_of(n, 1, "dim")):
        return Sum(((_items(recognize.add_lin({("lse", f.logits): 1.0}, dict(f.c))), _items({("sumpx", f.logits): 1.0})),))
    return recognize.h_sum(ev, n)


def _log(ev, n):
    f = ev(n.args[0])
    return ev.log_of_sum(f) if isinstance(f, Sum) else recognize.HANDLERS[aten.log](ev, n)


def _div(ev, n):
    fa, fb = ev(n.args[0]), ev(n.args[1])
    if (isinstance(fa, Sum) or isinstance(fb, Sum)) and Sum.of(fa) is not None and Sum.of(fb) is not None:
        return ev.ratio(Sum.of(fa), Sum.of(fb))  # a one-term sum may have been read as its exp
    return recognize.HANDLERS[aten.div](ev, n)


def _offset_index(index, y, a, b) -> bool:
    """Whether `index` is `y - a` on the rows where `a <= y < b` (clamped to the block or not)."""
    if recognize.packet(index) in (aten.clamp, aten.clamp_min, aten.clamp_max):
        lo, hi = recognize.arg_of(index, 1, "min"), recognize.arg_of(index, 2, "max")
        if (lo is not None and not (isinstance(lo, int) and lo <= 0)) or \
                (hi is not None and not (isinstance(hi, int) and hi >= b - a - 1)):
            return False
        index = recognize.behind_views(index.args[0])
    if a == 0 and index is y:
        return True
    return recognize.packet(index) is aten.sub and recognize.behind_views(index.args[0]) is y and index.args[1] == a \
        and "alpha" not in index.kwargs


def _whole(logits, picked):
    """`("cols", L, 0, V, V)` for the target's logit picked from all of `L` (`V` wide): a loop
    of one vocabulary block; None if the picked value's gather is not found."""
    node = picked
    while recognize.packet(node) in (*recognize.TRANSPARENT, aten.select, aten.squeeze):
        node = node.args[0]
    if recognize.packet(node) is not aten.gather:
        return None
    width = recognize.shape_of(node.args[0])[-1]
    return None if not isinstance(width, int) else (logits, 0, width, width)


def _where(ev, n):
    found = recognize.range_test(n.args[0])  # the token falls in the block
    picked, rest = ev(n.args[1]), ev(n.args[2])
    if found is None or not all(isinstance(v, int) for v in found[1:]) or not isinstance(picked, dict) \
            or len(picked) != 1:
        return recognize.h_where(ev, n)
    y, a, b = found
    (atom, k), = picked.items()
    block = (_cols(atom[1]) or _whole(atom[1], n.args[1])) if atom[0] == "gather" else None
    # The last block's slice stops at the vocabulary's end where the test does not (`t < a + block`).
    if block is None or not recognize.is_one(k) or block[1:3] != (a, min(b, block[3])) or \
            not _offset_index(atom[2], y, a, b):
        return recognize.h_where(ev, n)
    L, _, _, width = block
    if isinstance(rest, Picked) and (rest.logits, rest.width, rest.target) == (L, width, y):
        blocks, rest = rest.blocks + ((a, min(b, width)),), dict(rest.rest)
    elif isinstance(rest, dict) and not _wide(rest):
        blocks = ((a, min(b, width)),)
    else:
        return recognize.h_where(ev, n)
    if tiles(blocks, width):
        return {("gather", L, y): 1.0}  # every valid token id falls in one block
    return Picked(L, width, y, blocks, _items(rest))


BlockEvaluator.handlers = {
    **recognize.HANDLERS,
    aten.slice: _slice,
    aten.mul: _scale_block(_mul),
    aten.div: _scale_block(_div),
    **{fill: _fill for fill in catalogue.FILLS},
    aten.select: recognize.h_select_unit,
    aten.add: _add_sub(1.0),
    aten.sub: _add_sub(-1.0),
    aten.sum: _sum,
    aten.log: _log,
    aten.where: _where,
}
