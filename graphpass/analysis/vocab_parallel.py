"""Recognise a vocab-parallel log-prob / entropy computation: the forward of Megatron's, slime's or
any similar `autograd.Function`, from its functional ATen graph.

Such a forward runs on this rank's slice of the vocabulary (`[T, V/tp]` logits, global token ids)
and all-reduces row statistics over the tensor-parallel group. Its outputs are evaluated into the
normal forms of `recognize`, with the vocabulary split across the ranks:

* elementwise math on the local logits is the same math on the global logits, restricted to the
  slice, so wide forms keep their meaning;
* a sum over the local vocabulary is `Partial(f)`: this rank's share of the global sum `f`. Only a
  SUM all-reduce over the group makes it `f`, and only when the row constants in `f` are the same
  on every rank (computed from all-reduced values and constants alone);
* the target's logit is read where this rank owns the target:
  `x[rows, index_put(t - s, [(t < s) | (t >= e)], 0)]` with the rows not owned then zeroed is
  `Partial(gather(t))`, when `s` is this rank's first column and `e - s` the slice width;
* several shares concatenated (`cat`, `stack`), all-reduced in one SUM and cut back at the
  parts' boundaries (`split`, `chunk`, `unbind`, `slice`, `narrow`, `select`; megatron-core's
  fused loss) are each part's sum (`_Concat`);
* a mean (or a sum) over the slice alone of the logits plus row constants, not all-reduced, is
  the atom ("slicemean", L): this rank's own mean of the logits over its slice, different on
  each rank (never a share; megatron-core's label smoothing averages the log-probs `x - lse`
  over the slice: `slicemean - lse`);
* every other reduction over the vocabulary (a local softmax, log-sum-exp, gather, max, a mean
  over the slice alone of anything else) is not understood: a max only ever serves as a row
  constant, which cancels; a slice's own sum or mean of something else is named in the reason.

A forward matches when each output is exactly a log-prob or an entropy of the logits input (or
its negation), scaled by at most a constant temperature, an empty tensor, or a log-prob plus a
multiple of the slice's mean log-prob, `a * logprob + b * (slicemean - lse)` (`MIXES`: megatron-
core's `vocab_parallel_cross_entropy(..., label_smoothing)` is a = s - 1, b = -s, with
s = label_smoothing * Vl / (Vl - 1)). Anything else is reported as a reason and the Function
stays as it is.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis import catalogue, recognize, rowlocal
from graphpass.analysis.recognize import PW, Exp, OutputLabel
from graphpass.analysis.vocab_blocks import BlockEvaluator
from graphpass.fx_utils import arange_args, fake_value, transitive_inputs, transitive_users

aten = torch.ops.aten

NOT_PARALLEL = "no all-reduce: not vocab-parallel"
#: The kinds of an output that reads the mean of the log-probs over this rank's vocabulary slice
#: (`VocabParallelMatch.mixes`): `a * logprob + b * slice mean log-prob`, a != 0 ("smoothed-logprob",
#: megatron-core's label-smoothed cross-entropy) or a == 0 ("slice-mean-logprob").
SMOOTHED, SLICE_MEAN = "smoothed-logprob", "slice-mean-logprob"
MIXES = (SMOOTHED, SLICE_MEAN)
NO_LOGPROB = "no log-prob or entropy of one vocabulary slice"
#: What an output of a matched forward is, besides the four labels: an empty tensor (slime returns
#: `new_zeros((0,))` for an entropy it was not asked for).
EMPTY = "empty"


@dataclasses.dataclass(frozen=True)
class VocabParallelMatch:
    """A forward that computes vocab-parallel log-probs and/or entropies."""

    logits: torch.fx.Node
    """This rank's logits `[..., V/tp]`."""
    target: torch.fx.Node | None
    """The global token ids; None when no output is a log-prob."""
    group_name: str
    """The tensor-parallel group its all-reduces use."""
    group_size: int
    """Its number of ranks."""
    temperature: float
    """The logits are divided by it inside the forward (1.0: unscaled)."""
    outputs: tuple[str, ...]
    """Per output: "logprob", "-logprob", "entropy", "-entropy", "empty", or one of `MIXES`."""
    nodes: tuple = ()
    """The output nodes, in the order of `outputs`."""
    mixes: tuple = ()
    """Per output: (a, b) where its kind is one of `MIXES`, the value `a * logprob + b * m` with `m`
    the mean over this rank's vocabulary slice of the log-probs (local to the rank); else None."""


@dataclasses.dataclass(frozen=True)
class _Partial:
    """This rank's share of a sum over the vocabulary: summed over the ranks, it is `form`."""

    form: object


@dataclasses.dataclass(frozen=True)
class _Owned:
    """The target's logit form `form` on the rows whose target this rank owns, garbage elsewhere."""

    form: object
    target: torch.fx.Node


_COLLECTIVES = _torch_api.functional_collectives


def _constant(gm, x):
    """The Python number `x` stands for (a number, or a lifted 0-d constant tensor), else None."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x
    x = recognize.behind_views(x) if isinstance(x, torch.fx.Node) else x
    if isinstance(x, torch.fx.Node) and x.op == "get_attr":
        value = getattr(gm, x.target, None)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not _torch_api.is_fake(value):
            return value.item()
    return None


@dataclasses.dataclass(frozen=True)
class _Concat:
    """Values concatenated along `dim` (not the vocabulary): `parts`, pairs (form, length along
    `dim`), each form possibly a share; `shape` the whole's. Several shares all-reduced in one
    collective (megatron-core's fused loss: `cat((target_logit, sum_exp))`, one all-reduce, then
    `split`) are read part by part: a SUM all-reduce of shares is the concatenation of their sums,
    and a piece cut at the parts' boundaries is those parts."""

    parts: tuple
    dim: int
    shape: tuple


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """The list `split` / `unbind` makes of a `_Concat`: each piece's form, None where a piece is
    not whole parts of it."""

    forms: tuple


class _ShardEvaluator(recognize.Evaluator):
    """`recognize`'s evaluator for a forward that holds one slice of the vocabulary (module doc)."""

    eps = 0.0  # exact: this recognition replaces code, it does not only label it

    def __init__(self, gm: torch.fx.GraphModule, logits: torch.fx.Node, first_column: int, width: int):
        super().__init__()
        self.gm, self.logits, self.first_column, self.width = gm, logits, first_column, width
        self.after_collective = self._derived_from_collectives_only(gm.graph)

    def _eval(self, n):
        if n.op == "call_function" and n.target is operator.getitem and isinstance(self(n.args[0]), _Pieces):
            piece = self(n.args[0]).forms[n.args[1]] if isinstance(n.args[1], int) else None
            return self.unknown(n) if piece is None else piece
        # The forms of `recognize` do not know shares: an op that is not written for them and
        # reads one computes something this evaluator does not understand.
        if recognize.packet(n) not in _SHARE_AWARE and \
                any(isinstance(self(a), _NOT_FORMS) for a in n.all_input_nodes):
            return self.unknown(n)
        return super()._eval(n)

    @staticmethod
    def _derived_from_collectives_only(graph) -> set:
        """Nodes computed from all-reduce results and constants alone: the same on every rank."""
        same = set()
        for node in graph.nodes:
            if node.op == "get_attr" or recognize.packet(node) is _COLLECTIVES.all_reduce:
                same.add(node)
            elif node.op == "call_function":
                # `expand_as(x, like)` reads only the shape of `like`.
                inputs = node.args[:1] if node.target in catalogue.SHAPE_ONLY_SECOND_ARG else node.all_input_nodes
                if all(a in same for a in inputs if isinstance(a, torch.fx.Node)):
                    same.add(node)
        return same

    # -- forms that are the same on every rank ---------------------------------------------
    def _replicated_key(self, key) -> bool:
        if key is self.logits:
            return True
        if isinstance(key, tuple) and key[:1] == ("scale",):
            return self._replicated_key(key[1]) and isinstance(key[3], float)
        return False

    def replicated(self, form) -> bool:
        """Whether `form` means the same thing on every rank (its row constants, its logits)."""
        if isinstance(form, (PW, Exp)):
            return (not isinstance(form, PW) or self._replicated_key(form.logits)) and self.replicated(form.lin)
        if not isinstance(form, dict):
            return False
        for atom in form:
            kind = atom[0]
            if kind == "one":
                continue
            if kind == "c":
                if atom[1] not in self.after_collective:
                    return False
            elif kind in ("x", "lse", "sumpx"):
                if not self._replicated_key(atom[1]):
                    return False
            elif kind == "gather":
                if not self._replicated_key(atom[1]) or atom[2].op != "placeholder":
                    return False
            else:
                return False
        return True

    # -- the ownership pattern -------------------------------------------------------------
    def ownership_mask(self, node):
        """The target `t` if `node` is `(t < s) | (t >= e)` for this rank's columns [s, e), else None."""
        found = recognize.range_test(node, outside=True)
        if found is None or found[0].op != "placeholder":
            return None
        t, s, e = found
        if _constant(self.gm, s) != self.first_column or _constant(self.gm, e) != self.first_column + self.width:
            return None
        return t

    def _zero_where_mask(self, node):
        """(value, target) if `node` sets `value` to 0 where the target is not this rank's, else None."""
        p = recognize.packet(node)
        if p is aten.index_put and len(node.args[1]) == 1 and _constant(self.gm, node.args[2]) == 0:
            value, mask = node.args[0], node.args[1][0]
        elif p is aten.masked_fill and _constant(self.gm, node.args[2]) == 0:
            value, mask = node.args[0], node.args[1]
        elif p is aten.where and _constant(self.gm, node.args[1]) == 0:
            value, mask = node.args[2], node.args[0]
        else:
            return None
        if len(node.args) > 3 and node.args[3]:  # index_put(accumulate=True) adds, it does not set
            return None
        t = self.ownership_mask(mask) if isinstance(mask, torch.fx.Node) else None
        return None if t is None else (value, t)

    def local_index(self, node):
        """The target `t` if `node` is this rank's column of `t`, 0 where it does not own `t`."""
        found = self._zero_where_mask(_unwrapped(recognize.behind_views(node), self.width))
        if found is None:
            return None
        shifted, t = found
        shifted = recognize.behind_views(shifted)
        if recognize.packet(shifted) is not aten.sub or recognize.behind_views(shifted.args[0]) is not t or \
                _constant(self.gm, shifted.args[1]) != self.first_column or len(shifted.args) > 2:
            return None
        return t


def _unwrapped(node, width):
    """`i` behind `where(i < 0, i + width, i)`, the wrap of a negative index that indexing does
    (`index_rows_as_gather` writes it); else `node`. For a local index (in `[0, width)` where
    this rank owns the target, 0 elsewhere) the wrap changes nothing."""
    if recognize.packet(node) is not aten.where or len(node.args) != 3:
        return node
    test, wrapped, index = node.args
    if (recognize.packet(test) is aten.lt and test.args[0] is index and test.args[1] == 0
            and recognize.packet(wrapped) is aten.add and wrapped.args[0] is index and wrapped.args[1] == width):
        return index
    return node


def _all_reduce(ev: _ShardEvaluator, n):
    tensor, op = n.args[:2]
    f = ev(tensor)
    if op == "sum" and isinstance(f, _Partial) and ev.replicated(f.form):
        return f.form
    if op == "sum" and isinstance(f, _Concat) and \
            all(isinstance(part, _Partial) and ev.replicated(part.form) for part, _ in f.parts):
        return dataclasses.replace(f, parts=tuple((part.form, length) for part, length in f.parts))
    return None  # a max (or an unsummed value): a row constant, the same on every rank


def _wait(ev, n):
    return ev(n.args[0])


def _passes_shares(base):
    """A view or cast: of a share, a share of the view (summing over ranks commutes with both);
    of a concatenation, the same concatenation where the shape stays (a copy, a cast)."""

    def handler(ev, n):
        f = ev(n.args[0])
        if isinstance(f, (_Partial, _Owned)):
            return f
        if isinstance(f, _Concat):
            return f if recognize.shape_of(n) == f.shape else None
        return base(ev, n)

    return handler


# ---- concatenations: several values in one tensor, cut back into them ---------------------------
def _is_share(f) -> bool:
    return isinstance(f, (_Partial, _Owned)) or (isinstance(f, _Concat) and any(_is_share(p) for p, _ in f.parts))


def _is_narrow(f) -> bool:
    """Whether form `f` holds no value that varies along the vocabulary (a share is a row value)."""
    if isinstance(f, (_Partial, _Owned)):
        return True
    if isinstance(f, Exp):
        return _is_narrow(f.lin)
    return isinstance(f, dict) and not any(atom[0] == "x" for atom in f)


def _concatenation(ev, n, tensors, dim, lengths):
    """The `_Concat` of `tensors` along `dim` of `n` (each `lengths[i]` long there), where one of
    them is a share and none varies along the vocabulary; else None."""
    shape = recognize.shape_of(n)
    if shape is None or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        return None
    dim %= len(shape)  # any dim: values constant along the vocabulary have no vocabulary dim to keep
    parts = []
    for t, length in zip(tensors, lengths):
        f = ev(t)
        if not isinstance(length, int) or not isinstance(t, torch.fx.Node) or not _is_narrow(f) and \
                not isinstance(f, _Concat):
            return None
        if isinstance(f, _Concat):  # a concatenation of concatenations along the same dim is one
            if f.dim != dim or f.shape != recognize.shape_of(t):
                return None
            parts.extend(f.parts)
        else:
            parts.append((f, length))
    if not any(_is_share(f) for f, _ in parts) or sum(length for _, length in parts) != shape[dim]:
        return None
    return _Concat(tuple(parts), dim, tuple(shape))


def _cat(ev, n):
    tensors, dim = n.args[0], recognize.arg_of(n, 1, "dim", 0)
    shapes = [recognize.shape_of(t) for t in tensors]
    shape = recognize.shape_of(n)
    if shape is None or any(s is None or len(s) != len(shape) for s in shapes) or not isinstance(dim, int):
        return None
    return _concatenation(ev, n, tensors, dim, [s[dim % len(shape)] for s in shapes])


def _stack(ev, n):
    tensors = n.args[0]
    return _concatenation(ev, n, tensors, recognize.arg_of(n, 1, "dim", 0), [1] * len(tensors))


def _piece(f: _Concat, start: int, length: int):
    """The form of `f`'s elements [start, start + length) along its dim: whole parts only, else None."""
    at, parts = 0, []
    for part, part_length in f.parts:
        if start <= at and at + part_length <= start + length:
            parts.append((part, part_length))
        elif at < start + length and start < at + part_length:
            return None  # the piece cuts this part
        at += part_length
    if sum(part_length for _, part_length in parts) != length or not parts:
        return None
    if len(parts) == 1:
        return parts[0][0]
    shape = list(f.shape)
    shape[f.dim] = length
    return _Concat(tuple(parts), f.dim, tuple(shape))


def _along(f, n, dim) -> bool:
    return isinstance(f, _Concat) and isinstance(dim, int) and -len(f.shape) <= dim < len(f.shape) and \
        dim % len(f.shape) == f.dim


def _split(ev, n):
    """`split` / `split_with_sizes` / `chunk` of a concatenation along its dim: its pieces."""
    f, sizes, dim = ev(n.args[0]), n.args[1], recognize.arg_of(n, 2, "dim", 0)
    if not _along(f, n, dim):
        return None
    total = f.shape[f.dim]
    if recognize.packet(n) is aten.chunk:
        sizes = -(-total // sizes) if isinstance(sizes, int) and sizes > 0 else None
    if isinstance(sizes, int) and sizes > 0:
        sizes = [min(sizes, total - start) for start in range(0, total, sizes)]
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) for s in sizes) or sum(sizes) != total:
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return _Pieces(tuple(_piece(f, start, size) for start, size in zip(starts, sizes)))


def _unbind(ev, n):
    f, dim = ev(n.args[0]), recognize.arg_of(n, 1, "dim", 0)
    if not _along(f, n, dim):
        return None
    return _Pieces(tuple(_piece(f, i, 1) for i in range(f.shape[f.dim])))


def _slice(ev, n):
    """`x[s:e]` along a concatenation's dim (`slice`, `narrow`): the parts it holds whole."""
    f = ev(n.args[0])
    if recognize.packet(n) is aten.narrow:
        dim, start, length = n.args[1:4]
        end = start + length if isinstance(start, int) and isinstance(length, int) else None
        step = 1
    else:
        dim, start, end, step = (recognize.arg_of(n, i, name, default) for i, name, default in
                                 ((1, "dim", 0), (2, "start", None), (3, "end", None), (4, "step", 1)))
    if not _along(f, n, dim) or step != 1:
        return None
    total = f.shape[f.dim]
    start, end = (0 if start is None else start), (total if end is None else end)
    if not isinstance(start, int) or not isinstance(end, int):
        return None
    start, end = (min(max(i + total if i < 0 else i, 0), total) for i in (start, end))
    return _piece(f, start, end - start) if end > start else None


def _select(ev, n):
    """`x[i]` along a concatenation's dim where part i is one long; else a `[T, 1]` value's select."""
    f = ev(n.args[0])
    if isinstance(f, _Concat):
        dim, index = n.args[1:3]
        if not _along(f, n, dim) or not isinstance(index, int):
            return None
        total = f.shape[f.dim]
        return _piece(f, index % total, 1) if -total <= index < total else None
    return recognize.h_select_unit(ev, n)


def _slice_mean(ev, n):
    """`mean(x + c)` over the vocabulary slice, `x` the logits and `c` row constants:
    `slicemean(x) + c`, the atom ("slicemean", L) this rank's own mean of `x(L)` over its slice
    (not a share of anything: no all-reduce makes it global; `replicated` is False for it)."""
    if not recognize.is_vocab_dim(n.args[0], recognize.arg_of(n, 1, "dim")):
        return None
    split = recognize.split_row_logits(ev(n.args[0]))
    if split is None:
        return None
    return recognize.add_lin({("slicemean", split[0]): 1.0}, split[1])


def _local_sum(ev, n):
    f = recognize.h_sum(ev, n)
    if f is None:  # a sum of x + c over the slice of W columns: W (slicemean(x) + c), this rank's own
        mean = _slice_mean(ev, n)
        width = recognize.shape_of(n.args[0])
        return None if mean is None or width is None or not isinstance(width[-1], int) else \
            recognize.scale_lin(mean, float(width[-1]))
    return _Partial(f)


def _row_indexed(n):
    """(src, columns) if `n` is `src[arange(rows), columns]` of a 2-d `src`: one entry per row."""
    src, indices = n.args[0], n.args[1]
    shape = recognize.shape_of(src)
    if shape is None or len(shape) != 2 or len(indices) != 2 or any(i is None for i in indices):
        return None
    rows, columns = indices
    span = arange_args(rows)
    if span is None or span[0] != 0 or span[2] != 1:
        return None
    # With symbolic sizes the end is a node (a size the Function was passed): its value must be the rows'.
    end = span[1].meta.get("val") if isinstance(span[1], torch.fx.Node) else span[1]
    return (src, columns) if _torch_api.same_size(end, shape[0]) else None


def _index(ev, n):
    """`x[arange(rows), local_index(t)]`: the target's logit where this rank owns it."""
    picked = _row_indexed(n)
    return None if picked is None else _owned_gather(ev, *picked)


def _gather(ev, n):
    src, dim, idx = n.args[:3]
    if not recognize.is_vocab_dim(src, dim):
        return None
    return _owned_gather(ev, src, idx)


def _owned_gather(ev, src, idx):
    t = ev.local_index(idx)
    if t is None:
        return None
    g = ev.gathered(src, t)
    return None if g is None else _Owned(g, t)


def _zeroed(ev, n):
    """The owned target logit with the other rows set to 0: this rank's share of the global one."""
    found = ev._zero_where_mask(n)
    if found is None:
        return None
    f = ev(found[0])
    if isinstance(f, _Owned) and f.target is found[1]:
        return _Partial(f.form)
    return None


def _not_understood(ev, n):
    return None


_SHARE_AWARE = recognize.TRANSPARENT | {aten.select, aten.index_put, aten.masked_fill, aten.where,
                                          _COLLECTIVES.all_reduce, _COLLECTIVES.wait_tensor, aten.cat, aten.stack,
                                          aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.slice,
                                          aten.narrow}
#: What this evaluator's handlers make besides `recognize`'s forms; only they read them.
_NOT_FORMS = (_Partial, _Owned, _Concat, _Pieces)
_SHARD_HANDLERS = {
    **{p: _passes_shares(h) for p, h in recognize.HANDLERS.items() if p in recognize.TRANSPARENT},
    **{p: h for p, h in recognize.HANDLERS.items() if p not in recognize.TRANSPARENT},
    # On one slice these normalise, gather or reduce over the slice alone.
    **{p: _not_understood for p in (aten.log_softmax, aten._log_softmax, aten.softmax, aten._softmax,
                                    aten.logsumexp, aten.take_along_dim, aten.cross_entropy_loss,
                                    aten.nll_loss_nd, aten.nll_loss)},
    aten.select: _select,
    aten.cat: _cat,
    aten.stack: _stack,
    aten.split: _split,
    aten.split_with_sizes: _split,
    aten.chunk: _split,
    aten.unbind: _unbind,
    aten.slice: _slice,
    aten.narrow: _slice,
    aten.sum: _local_sum,
    aten.mean: _slice_mean,
    aten.gather: _gather,
    aten.index: _index,
    aten.index_put: _zeroed,
    aten.masked_fill: lambda ev, n: _zeroed(ev, n) or recognize.h_masked_fill(ev, n),
    aten.where: lambda ev, n: _zeroed(ev, n) or recognize.h_where(ev, n),
    _COLLECTIVES.all_reduce: _all_reduce,
    _COLLECTIVES.wait_tensor: _wait,
}
_ShardEvaluator.handlers = _SHARD_HANDLERS


def _temperature(key, logits) -> float | None:
    """The temperature a logits key divides by (1.0 for the logits themselves), None if not one."""
    t = 1.0
    while isinstance(key, tuple) and key[:1] == ("scale",) and isinstance(key[3], float) and key[3] != 0.0:
        t = t * key[3] if key[2] == "/" else t / key[3]
        key = key[1]
    return t if key is logits else None


def _label(ev: _ShardEvaluator, node) -> tuple[str, float | None, object, tuple | None] | str:
    """(kind, temperature, target node, mix) of one output, or the reason it is not understood;
    `mix` the (a, b) of a kind in `MIXES`, else None."""
    val = fake_value(node)
    if isinstance(val, torch.Tensor) and isinstance(val.numel(), int) and val.numel() == 0:
        return EMPTY, None, None, None  # no values, no gradient: what it was computed from does not matter
    form = ev(node)
    label: OutputLabel = recognize.classify(form)
    mix = _mixture(form) if label.kind == recognize.ROWWISE else None
    if label.kind == recognize.ROWWISE and mix is None:
        split = "" if isinstance(ev, _OneDeviceEvaluator) else "vocabulary-split "
        local = [] if isinstance(ev, _OneDeviceEvaluator) else _slice_reductions(form)
        if local:
            return (f"output {node.name} is not a log-prob or an entropy of the {split}logits: it reads "
                    f"{local[0].name} ({local[0].target}), a reduction over this rank's vocabulary slice alone, "
                    "different on each rank, of a value other than the logits or log-probs (their mean over the "
                    "slice, megatron-core's label smoothing, is read)")
        if isinstance(form, dict) and any(a[0] == "slicemean" for a in form):
            return (f"output {node.name} reads the mean over this rank's vocabulary slice of the logits, but is not "
                    "a log-prob plus a multiple of that slice's mean log-prob")
        return f"output {node.name} is not a log-prob or an entropy of the {split}logits"
    atoms = [a for a in form if a[0] in ("lse", "gather")]
    temperature = _temperature(atoms[0][1], ev.logits)
    if temperature is None:
        return f"output {node.name}: the logits are scaled or masked by more than a constant temperature"
    targets = [a[2] for a in form if a[0] == "gather"]
    kind = label.kind if mix is None else (SLICE_MEAN if mix[0] == 0.0 else SMOOTHED)
    return kind, temperature, targets[0] if targets else None, mix


def _mixture(form) -> tuple[float, float] | None:
    """(a, b) when `form` is `a * (gather(L) - lse(L)) + b * (slicemean(L) - lse(L))` with b != 0:
    a log-prob plus a multiple of the mean log-prob over this rank's slice (megatron-core's label
    smoothing: `(1 - s) * (lse - x_t) - s * mean(log p)`, a = s - 1, b = -s); else None. Exact:
    every atom on one logits key, the log-sum-exp's coefficient -(a + b)."""
    if not isinstance(form, dict) or not all(atom[0] in ("gather", "slicemean", "lse") for atom in form):
        return None
    kinds = [atom[0] for atom in form]
    if kinds.count("slicemean") != 1 or kinds.count("lse") != 1 or kinds.count("gather") > 1 or \
            len({atom[1] for atom in form}) != 1:
        return None
    coefficient = {atom[0]: k for atom, k in form.items()}
    a, b, lse = coefficient.get("gather", 0.0), coefficient["slicemean"], coefficient["lse"]
    if abs(lse + a + b) > 1e-12 * max(1.0, abs(a), abs(b)):
        return None
    return a, b


def _slice_reductions(form) -> list:
    """The sums and means over the vocabulary slice (of one rank) that `form` reads as unknown
    values, not all-reduced: each rank's differs."""
    if not isinstance(form, dict):
        return []
    found = []
    for atom in form:
        key = atom[1] if atom[0] in ("x", "c") else None
        while isinstance(key, tuple) and key[:1] == ("scale",):
            key = key[1]
        if recognize.packet(key) in (aten.sum, aten.mean) and \
                recognize.is_vocab_dim(key.args[0], recognize.arg_of(key, 1, "dim")):
            found.append(key)
    return found


def _group(gm) -> tuple[str, list] | str:
    """(the one group the graph's all-reduces use, its SUM all-reduces), or why not one."""
    reduces = [n for n in gm.graph.nodes if recognize.packet(n) is _COLLECTIVES.all_reduce]
    if not reduces:
        return NOT_PARALLEL
    group_names = {n.args[2] for n in reduces}
    if len(group_names) != 1:
        return f"all-reduces over {len(group_names)} different groups"
    return group_names.pop(), [n for n in reduces if n.args[1] == "sum"]


def _is_wide(node) -> bool:
    val = fake_value(node)
    return isinstance(val, torch.Tensor) and val.ndim >= 2 and val.is_floating_point()


def _per_row(node, logits) -> bool:
    """Whether `node` holds at most one value per row of `logits` (`[b, s]` or `[t, 1]` of `[b, s, v]`
    or `[t, v]` logits): what a log-prob or an entropy is, not a wide value."""
    val, wide = fake_value(node), fake_value(logits)
    return isinstance(val, torch.Tensor) and val.is_floating_point() and (
        val.ndim < wide.ndim or (val.ndim == wide.ndim and val.shape[-1] == 1))


def _evaluator(gm, logits, group_name, rank_and_size) -> _ShardEvaluator | None:
    """The evaluator for `logits` as this rank's slice of the group's vocabulary; None when the
    slice's width is symbolic (its first column would be too)."""
    rank, _ = rank_and_size(group_name)
    width = fake_value(logits).shape[-1]
    return _ShardEvaluator(gm, logits, rank * width, width) if isinstance(width, int) else None


def _match(ev: _ShardEvaluator, outputs, group_name, rank_and_size) -> VocabParallelMatch | str:
    """Label `outputs` as vocab-parallel functions of the evaluator's logits."""
    kinds, temperatures, targets, mixes = [], set(), set(), []
    for node in outputs:
        label = _label(ev, node)
        if isinstance(label, str):
            return label
        kind, temperature, target, mix = label
        kinds.append(kind)
        mixes.append(mix)
        if kind != EMPTY:
            temperatures.add(temperature)
        if target is not None:
            targets.add(target)
    if not temperatures:
        return "no output is a log-prob or an entropy"
    if len(temperatures) != 1 or len(targets) > 1:
        return "outputs at different temperatures or of different targets"
    return VocabParallelMatch(logits=ev.logits, target=targets.pop() if targets else None, group_name=group_name,
                              group_size=rank_and_size(group_name)[1], temperature=temperatures.pop(),
                              outputs=tuple(kinds), nodes=tuple(outputs), mixes=tuple(mixes))


def match_forward(gm: torch.fx.GraphModule, outputs: list, rank_and_size) -> VocabParallelMatch | str:
    """Match an autograd.Function's functional ATen forward `gm` whose user-visible outputs are
    `outputs`: each must be a log-prob, an entropy (or a negation) or empty.

    `rank_and_size(group_name) -> (rank, size)` reads this process's place in a group (the forward
    was traced on this rank: its first column is baked in as a constant). A forward without
    all-reduces that tests its targets against the columns [0, V) is such a forward run without a
    process group (slime's skips its all-reduces then): it is read as one rank's, group "".
    Returns the match, or the reason (one line) it is not a vocab-parallel log-prob/entropy.
    """
    group = _group(gm)
    wide = [p for p in gm.graph.find_nodes(op="placeholder") if _is_wide(p)]
    if group == NOT_PARALLEL and len(wide) == 1 and _tests_target_ownership(gm, fake_value(wide[0]).shape[-1]):
        # Its all-reduces skipped (no process group): one rank holding every column.
        return _match(_SingleRankEvaluator(gm, wide[0], 0, fake_value(wide[0]).shape[-1]), outputs, "",
                      lambda name: (0, 1))
    if isinstance(group, str):
        return group
    if len(wide) != 1:
        return f"{len(wide)} floating-point inputs of 2 or more dims (expected the logits alone)"
    ev = _evaluator(gm, wide[0], group[0], rank_and_size)
    if ev is None:
        return "the vocabulary slice has a symbolic width"
    return _match(ev, outputs, group[0], rank_and_size)


class _SingleRankEvaluator(_ShardEvaluator):
    """`_ShardEvaluator` for a vocab-parallel forward run without a process group, its all-reduces
    skipped: one rank owns every column, so its share of a sum is the sum, the same everywhere."""

    def _eval(self, n):
        form = super()._eval(n)
        return form.form if isinstance(form, _Partial) else form

    def replicated(self, form) -> bool:
        return True


class _OneDeviceEvaluator(BlockEvaluator):
    """`recognize`'s evaluator, exact, for a forward without collectives: its logits are the whole
    vocabulary it normalises over, whole or block by block (an online log-sum-exp, `vocab_blocks`;
    its running max is a row constant the result does not depend on)."""

    eps = 0.0

    def __init__(self, gm: torch.fx.GraphModule, logits: torch.fx.Node):
        super().__init__(tuple(fake_value(logits).shape[:-1]))
        self.gm, self.logits = gm, logits


def _full_index(ev, n):
    """`x[arange(rows), t]`: the target's logit."""
    picked = _row_indexed(n)
    return None if picked is None else ev.gathered(*picked)


_OneDeviceEvaluator.handlers = {**BlockEvaluator.handlers, aten.index: _full_index}


def match_single_device(gm: torch.fx.GraphModule, outputs: list) -> VocabParallelMatch | str | None:
    """The match of a Function's forward `gm` without collectives, when each of `outputs` is exactly
    a log-prob, an entropy (or a negation) of its one wide input, or empty (`group_size` 1, no
    group); the reason an output is not, for a forward with one wide input; else None."""
    wide = [p for p in gm.graph.find_nodes(op="placeholder") if _is_wide(p)]
    if len(wide) != 1 or any(recognize.packet(n) is _COLLECTIVES.all_reduce for n in gm.graph.nodes):
        return None
    match = _match(_OneDeviceEvaluator(gm, wide[0]), outputs, "", lambda name: (0, 1))
    if isinstance(match, str) and _tests_target_ownership(gm, fake_value(wide[0]).shape[-1]):
        return None  # a vocab-parallel forward without its all-reduces: `match_forward` reads it
    return match


def _tests_target_ownership(gm, width) -> bool:
    """Whether `gm` tests token ids against the columns [0, width): `(t < 0) | (t >= width)`."""
    for node in gm.graph.nodes:
        found = recognize.range_test(node, outside=True)
        if found is not None and _constant(gm, found[1]) == 0 and _constant(gm, found[2]) == width:
            return True
    return False


def match_graph(gm: torch.fx.GraphModule, rank_and_size) -> VocabParallelMatch | str:
    """Vocab-parallel log-probs/entropies computed in `gm` itself, with functional all-reduces: a
    Function Dynamo inlined (it does when no input requires grad) or code written that way.

    The outputs are every node whose value is a log-prob or an entropy of one wide node (tried
    in graph order among the ancestors of the SUM all-reduces), or the reason there are none.
    """
    group = _group(gm)
    if isinstance(group, str):
        return group
    group_name, sums = group
    if not sums:
        return NO_LOGPROB
    below, above = transitive_users(sums), transitive_inputs(sums)
    reason = NO_LOGPROB
    for logits in [n for n in gm.graph.nodes if n in above and _is_wide(n)]:
        ev = _evaluator(gm, logits, group_name, rank_and_size)
        if ev is None:
            continue
        labelled = {n for n in gm.graph.nodes if n in below and _per_row(n, logits) and _labelled(ev, n)}
        # The last of them: those read by something else (a log-prob's squeeze is the log-prob).
        outputs = [n for n in gm.graph.nodes if n in labelled and any(u not in labelled for u in n.users)]
        # Not those read only on the way to later ones (megatron-core's label smoothing scales its
        # cross-entropy, then adds the slice's mean log-prob: the scaled one is no output).
        outputs = [n for n in outputs if n not in _read_only_by(gm.graph, [o for o in outputs if o is not n])]
        if outputs:
            match = _match(ev, outputs, group_name, rank_and_size)
            if not isinstance(match, str):
                return match
            reason = match
    return reason


def _read_only_by(graph, outputs) -> set:
    """The nodes whose every reader is, transitively, one of `outputs` (or on the way to one)."""
    dead = set(outputs)
    for node in reversed(list(graph.nodes)):
        if node.users and all(u in dead for u in node.users):
            dead.add(node)
    return dead


def values_without_gradient(gm: torch.fx.GraphModule, match: VocabParallelMatch, requires: dict,
                            rank_and_size) -> list:
    """The nodes on the way from the logits to `match`'s outputs that hold a statistic of the whole
    vocabulary (a log-sum-exp, the target's logit, E[x], or a rank's share of one) but carry no
    gradient (detached, or computed under no_grad): where there are any, the code's gradient is not
    the gradient of its values, and the op cannot stand in for it."""
    ev = _evaluator(gm, match.logits, match.group_name, rank_and_size)
    between = (transitive_inputs(match.nodes) | set(match.nodes)) & transitive_users([match.logits])
    return [n for n in gm.graph.nodes if n in between and _has_statistic(ev(n)) and not requires.get(n, False)]


def _has_statistic(form) -> bool:
    if isinstance(form, (_Partial, _Owned)):
        return _has_statistic(form.form)
    if isinstance(form, _Concat):
        return any(_has_statistic(part) for part, _ in form.parts)
    if isinstance(form, _Pieces):
        return any(_has_statistic(piece) for piece in form.forms)
    if isinstance(form, (PW, Exp)):
        return isinstance(form, PW) or _has_statistic(form.lin)
    return isinstance(form, dict) and any(atom[0] in ("lse", "gather", "sumpx", "slicemean") for atom in form)


def _labelled(ev, node) -> bool:
    if not isinstance(fake_value(node), torch.Tensor):
        return False
    try:
        form = ev(node)
        return recognize.classify(form).kind != recognize.ROWWISE or _mixture(form) is not None
    except Exception:  # noqa: BLE001 - a node the evaluator cannot read is simply not labelled
        return False


# ---- the loss math after the op, per token ---------------------------------------------------------
#: Views that keep a value's elements in row-major order: a per-token value stays per-token, in
#: the op's row order (a transpose would reorder them).
_FLAT_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.default,
               aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, aten.flatten.using_ints,
               aten.alias.default, aten.clone.default}


@dataclasses.dataclass
class _OpOutputs:
    """A vocab-parallel op's per-token outputs, as `summed_loss.match_summed_loss` reads a region."""

    nodes: list
    outputs: list
    layouts: dict
    rows: object
    place: torch.fx.Node


@dataclasses.dataclass
class TokenLoss:
    """The loss after a vocab-parallel op: affine in sums over the rows of per-token math."""

    summed: object
    """The `summed_loss.SummedLoss`: the per-token nodes, their totals, the sink and coefficients."""
    program: torch.fx.GraphModule
    """`program(logprob, entropy, *sides) -> summands`, on values flattened to one per row."""
    sides: list
    """The outside nodes `program` reads after the op's outputs."""
    per_row: list
    """Per side: one value per row (True) or one value (False)."""


def match_token_loss(op: torch.fx.Node, items: list, entropy_grad: bool, modes, order) -> TokenLoss | str:
    """The loss math from the op's log-prob (and, with `entropy_grad`, entropy) items `items` on,
    where it is affine in sums over the rows of math that maps each token's values to the token's
    summands (`match_summed_loss`, and every value on the way one per row in the op's row order,
    or one value), or why not."""
    from graphpass.analysis.regions import source_of
    from graphpass.analysis.summed_loss import match_summed_loss

    outputs = items if entropy_grad else items[:1]
    rows = fake_value(outputs[0]).numel()
    region = _OpOutputs([op, *items], list(outputs), {o: rowlocal.layout_of(fake_value(o), rows)
                                                      for o in outputs}, rows, op)
    summed, why = match_summed_loss(region, modes, order)
    if summed is None:
        return why or "no output of the op carries a gradient"
    graph = torch.fx.Graph()
    env = {output: graph.placeholder(name) for output, name in zip(outputs, ("logprob", "entropy"))}
    if len(outputs) == 1:
        graph.placeholder("entropy")
    sides, per_row = [], []
    from_op = transitive_users([op])

    def per_token(val) -> bool:
        return isinstance(val, torch.Tensor) and _torch_api.known_equal(val.numel(), rows)

    def read(a):
        if a not in env:
            val = fake_value(a)
            if a in from_op:  # the entropy without its gradient, say: the op cannot read its own output
                raise _NotPerToken(f"its loss math reads {a.name} at {source_of(a)}, computed from the op's outputs "
                                   "without their gradient")
            if not isinstance(val, torch.Tensor) or not (per_token(val) or _torch_api.known_equal(val.numel(), 1)):
                raise _NotPerToken(f"its loss math reads {a.name} at {source_of(a)}, neither one value per token "
                                   "nor one value")
            env[a] = graph.placeholder(f"side{len(sides)}")
            sides.append(a)
            per_row.append(per_token(val))
        return env[a]

    try:
        for node in summed.nodes:
            val = fake_value(node)
            operands = [fake_value(a) for a in node.all_input_nodes]
            if not per_token(val) or not all(
                    isinstance(v, torch.Tensor) and (tuple(v.shape) == tuple(val.shape) or
                                                     _torch_api.known_equal(v.numel(), 1) or node.target in _FLAT_VIEWS)
                    for v in operands):
                raise _NotPerToken(f"{node.name} at {source_of(node)} is not token by token")
            if node.target in _FLAT_VIEWS:
                env[node] = read(node.args[0])
            elif rowlocal.is_pointwise(node.target):
                env[node] = graph.node_copy(node, read)
            else:
                raise _NotPerToken(f"its loss math computes {node.name} at {source_of(node)} with "
                                   f"{getattr(node.target, '__name__', node.target)}, not token by token")
    except _NotPerToken as e:
        return str(e)
    graph.output(tuple(env[s] for s in summed.summands))
    return TokenLoss(summed, torch.fx.GraphModule(torch.nn.Module(), graph), sides, per_row)


class _NotPerToken(Exception):
    """The loss math after the op is not per-token math (the message says where)."""
