"""The one catalogue of ATen ops graphpass knows, by what they do.

Every analysis reads its op families from here: the row-local check (`rowlocal`), region growth
(`regions`), grad flow (`passes.tag_grad_flow`) and the labels (`recognize`, by overload packet).
An op in no family is not understood, and is therefore a region boundary.
"""

from __future__ import annotations

import operator

import torch

from graphpass._torch_api import is_aten_overload

aten = torch.ops.aten

# ---- values unchanged in meaning ----------------------------------------------------------------
#: Casts and copies: same values (dtype aside), same layout.
CASTS = {
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default, aten.detach.default,
    aten.alias.default, aten.contiguous.default, aten.type_as.default, aten.lift_fresh_copy.default,
}
#: Views and reshapes: same values, another shape.
VIEWS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.expand.default, aten.view_as.default, aten.reshape_as.default,
    aten.expand_as.default,
}
#: Ops whose second argument contributes only its shape or dtype, never its values.
SHAPE_ONLY_SECOND_ARG = {aten.view_as.default, aten.reshape_as.default, aten.expand_as.default,
                         aten.type_as.default}

# ---- elementwise ops the pointwise tag misses ----------------------------------------------------
#: Masks: `where(mask, x, fill)`, `masked_fill(x, mask, fill)`; value -> the position of the mask.
MASK_ARG = {aten.where.self: 0, aten.where.ScalarSelf: 0, aten.where.ScalarOther: 0, aten.where.Scalar: 0,
            aten.masked_fill.Scalar: 1, aten.masked_fill.Tensor: 1}
#: Elementwise in effect (one output element per input element), besides casts and masks.
ELEMENTWISE = CASTS | set(MASK_ARG) | {
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
    aten.special_entr.default, aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other,
    aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
    # Python's `|`, `&`, `^` on masks (`(t < first) | (t >= last)`): bitwise ops without the tag.
    aten.__or__.Tensor, aten.__and__.Tensor, aten.__xor__.Tensor,
}
#: Broadcasting of a list of operands, one output each (Categorical.log_prob's index).
BROADCASTS = {aten.broadcast_tensors.default}

# ---- over the vocabulary (the last dim) ------------------------------------------------------------
#: Reductions whose `dim` is a list.
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
              aten.logsumexp.default, aten.any.dims, aten.all.dims}
#: Reductions whose `dim` is an int.
REDUCTIONS_INT_DIM = {aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim,
                      aten.any.dim, aten.all.dim, aten.prod.dim_int}
SOFTMAX = {aten.log_softmax.int, aten.softmax.int, aten._log_softmax.default, aten._softmax.default}
GATHERS = {aten.gather.default, aten.take_along_dim.default}
#: Per-token losses; their class dim is 1 ([N, V] or a transposed [B, V, S]).
LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default}
#: Ops that index the vocabulary with token ids (gather's `index`, the losses' `target`).
TOKEN_ID_OPS = GATHERS | LOSSES
#: Ops that normalise a distribution over the vocabulary; a region must contain one (or an exp).
NORMALISERS = SOFTMAX | {aten.logsumexp.default} | LOSSES
#: Ops that start a region: the normalisers, and the reductions over the vocabulary a softmax
#: written out by hand begins with (`x - x.max(-1)`, then `exp`, then `e / e.sum(-1)`).
ANCHORS = NORMALISERS | {aten.amax.default, aten.max.dim, aten.sum.dim_IntList}


def normalises(node) -> bool:
    """Whether `node` is a normaliser or an exp: what a log-prob or entropy's math goes through."""
    return node.target in NORMALISERS or node.target is aten.exp.default

# ---- narrow ops that finish a quantity --------------------------------------------------------------
#: A sign flip, views, casts, and the log of a hand-written softmax's sum or picked probability
#: (`log(sum(exp(x - m)))`, `log(p.gather(...))`).
FINISHING = {
    aten.neg.default, aten.log.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.view_as.default,
    aten.reshape_as.default, aten.to.dtype, aten._to_copy.default, operator.getitem,
    # `x.gather(-1, t[:, None])[:, 0]`: a squeeze written as an index (`rowlocal.check` admits a
    # select only of a one-wide last dim).
    aten.select.int,
}
#: Finishing only as the sole reader of their input (`-x.sum(-1).detach()`); beside other readers
#: they make a logged copy, which stays outside rather than becoming a second output.
FINISHING_IF_ONLY_READER = {aten.detach.default, aten.alias.default}


# ---- gradients ------------------------------------------------------------------------------------------
#: Ops whose result carries no gradient to their inputs (or a zero one).
BLOCKS_GRAD = {
    aten.detach.default, aten.argmax.default, aten.argmin.default, aten.sign.default,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
    aten.isnan.default, aten.isinf.default, aten.isfinite.default, aten.logical_not.default,
    aten.logical_and.default, aten.logical_or.default, aten.floor.default, aten.ceil.default,
    aten.round.default, aten.trunc.default, aten.zeros_like.default, aten.ones_like.default,
    aten.empty_like.default, aten.full_like.default, aten.item.default,
}
MULTIPLIES = {aten.mul.Tensor, aten.mul.Scalar}


def non_float_normaliser(graph: torch.fx.Graph):
    """A normaliser (softmax, log-sum-exp, a loss) of integer or bool values, which eager refuses
    and a compiler may well compute: the first such node, or None."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target in NORMALISERS and node.args:
            val = getattr(node.args[0], "meta", {}).get("val")
            if isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex()):
                return node
    return None


def is_row_matmul(node) -> bool:
    """`linear(h, W[, b])` or `matmul(h, W)` with a 2-D `W` (an lm_head): each output row is the
    same row of `h` times `W`, so picking rows of the output is the product of the picked rows."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in ROW_MATMULS:
        return False
    out, h = node.meta.get("val"), node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    others = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args[1:]]
    weight = others[0] if others else None
    return (isinstance(out, torch.Tensor) and isinstance(h, torch.Tensor) and isinstance(weight, torch.Tensor)
            and out.ndim == h.ndim >= 2 and weight.ndim == 2 and not node.kwargs
            and all(o is None or (isinstance(o, torch.Tensor) and o.ndim == 1) for o in others[1:]))


ROW_MATMULS = {aten.linear.default, aten.matmul.default}
#: Products of two matrices (`a @ b` of 2-d values is `matmul`, or `mm` once decomposed).
MATRIX_PRODUCTS = {aten.mm.default, aten.matmul.default}
#: A buffer of zeros (a gradient accumulated into, chunk by chunk).
ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
#: Fills of one value, and the position of the value among their arguments (None: zero).
FILLS = {aten.zeros: None, aten.zeros_like: None, aten.new_zeros: None, aten.full: 1, aten.full_like: 1,
         aten.new_full: 2}


def is_deterministic_pointwise(target) -> bool:
    """An ATen op tagged pointwise that draws no random numbers (so it may be moved or batched)."""
    return (is_aten_overload(target) and torch.Tag.pointwise in target.tags
            and torch.Tag.nondeterministic_seeded not in target.tags)


def packets(ops) -> set:
    """The overload packets of `ops` (`aten.view` for `aten.view.default`), for the labeller,
    which reads any overload of an op alike."""
    return {op.overloadpacket for op in ops if hasattr(op, "overloadpacket")}
