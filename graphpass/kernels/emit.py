"""ATen ops of a per-chunk program as Triton expressions: the emitter table of `graphpass.kernels`.

Every float value is computed in fp32, as eager computes a bf16 or fp16 op (in fp32, rounded
once); a node whose value is bf16 or fp16 in the graph is rounded through that dtype where the
graph rounds it (`rounded`). Division and square roots are the correctly rounded ones (eager's),
not Triton's approximate defaults. `tanh`, `log1p` and `expm1` are spelled with `exp`/`log` (no
libdevice, which Triton's CPU interpreter does not run), in forms accurate to a few ulp.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


class NotGenerated(Exception):
    """A graph (or node) the generator does not express; the message says why."""


#: Helpers the generated module defines before its kernel.
PRELUDE = '''
@triton.jit
def _expm1(x):
    # exp(x) - 1 without cancellation near 0 (Kahan): u - 1 rescaled by x / log(u).
    u = tl.exp(x)
    um1 = u - 1.0
    safe = tl.where((um1 == 0.0) | (u == float("inf")), 1.0, um1)
    r = tl.where(um1 == -1.0, -1.0, safe * tl.div_rn(x, tl.log(tl.where(um1 == 0.0, 2.0, u))))
    return tl.where(um1 == 0.0, x, tl.where(u == float("inf"), u, r))


@triton.jit
def _log1p(x):
    # log(1 + x) without cancellation near 0 (Goldberg): log(u) - ((u - 1) - x) / u.
    u = 1.0 + x
    r = tl.log(u) - tl.div_rn((u - 1.0) - x, tl.where(u == 0.0, 1.0, u))
    return tl.where(u == 1.0, x, tl.where((u == float("inf")) | (u == 0.0), tl.log(u), r))


@triton.jit
def _tanh(x):
    # tanh(x) = sign(x) t / (t + 2), t = expm1(2|x|): accurate near 0, exact +-1 far from it.
    a = tl.abs(x)
    t = _expm1(2.0 * tl.minimum(a, 20.0))
    r = tl.div_rn(t, t + 2.0)
    r = tl.where(a > 20.0, 1.0, r)
    return tl.where(x < 0.0, -r, tl.where(x == x, r, x))


@triton.jit
def _max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
'''

_TL_DTYPE = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16",
             torch.int64: "tl.int64", torch.int32: "tl.int32", torch.bool: "tl.int1"}
_SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def tl_dtype(dtype: torch.dtype) -> str:
    """The Triton dtype a value of `dtype` is stored as."""
    if dtype not in _TL_DTYPE:
        raise NotGenerated(f"a value of dtype {dtype}")
    return _TL_DTYPE[dtype]


def literal(value) -> str:
    """A Python scalar of the graph as Triton source."""
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else '(-float("inf"))'
        return repr(value)
    raise NotGenerated(f"a constant {value!r} of type {type(value).__name__}")


def as_float(expr: str) -> str:
    """`expr` (a value or literal) as an fp32 tensor, as `tl.div_rn` and `tl.sqrt_rn` need."""
    return f"({expr} + tl.zeros([1], tl.float32))" if _is_literal(expr) else f"({expr}).to(tl.float32)"


def _is_literal(expr: str) -> bool:
    try:
        float(expr.replace('float("', '').replace('")', '').strip("()"))
        return True
    except ValueError:
        return expr in ("True", "False")


def rounded(expr: str, dtype: torch.dtype) -> str:
    """`expr`, an fp32 value of a node whose dtype is `dtype`, rounded as the graph rounds it."""
    if dtype in _SIXTEEN_BITS:
        return f"({expr}).to({_TL_DTYPE[dtype]}).to(tl.float32)"
    return expr


def _binary(op):
    return lambda a, b: f"({a} {op} {b})"


def _div(a, b):
    return f"tl.div_rn({as_float(a)}, {as_float(b)})"


def _pow(a, exponent):
    forms = {"2": f"({a} * {a})", "2.0": f"({a} * {a})", "1": a, "1.0": a, "0.5": f"tl.sqrt_rn({as_float(a)})",
             "-1": _div("1.0", a), "-1.0": _div("1.0", a)}
    if exponent not in forms:
        raise NotGenerated(f"pow with exponent {exponent} (only 2, 1, 0.5 and -1 are exact here)")
    return forms[exponent]


def _clamp(x, lo="None", hi="None"):
    if lo != "None":
        x = f"_max({x}, {lo})"
    if hi != "None":
        x = f"_min({x}, {hi})"
    return x


def _sign(a):
    # torch's (0 < x) - (x < 0): 0 for NaN and for both zeros.
    return f"(({a} > 0).to(tl.float32) - ({a} < 0).to(tl.float32))"


#: aten op -> (argument expressions -> Triton expression); float math in fp32 (see the module doc).
POINTWISE = {
    aten.add.Tensor: _binary("+"), aten.add.Scalar: _binary("+"),
    aten.sub.Tensor: _binary("-"), aten.sub.Scalar: _binary("-"), aten.rsub.Scalar: lambda a, b: f"({b} - {a})",
    aten.mul.Tensor: _binary("*"), aten.mul.Scalar: _binary("*"),
    aten.div.Tensor: _div, aten.div.Scalar: _div,
    aten.neg.default: lambda a: f"(-{a})",
    aten.exp.default: lambda a: f"tl.exp({a})",
    aten.log.default: lambda a: f"tl.log({a})",
    aten.log1p.default: lambda a: f"_log1p({a})",
    aten.expm1.default: lambda a: f"_expm1({a})",
    aten.sigmoid.default: lambda a: f"tl.sigmoid({a})",
    aten.tanh.default: lambda a: f"_tanh({a})",
    aten.sqrt.default: lambda a: f"tl.sqrt_rn({as_float(a)})",
    aten.rsqrt.default: lambda a: _div("1.0", f"tl.sqrt_rn({as_float(a)})"),
    aten.reciprocal.default: lambda a: _div("1.0", a),
    aten.abs.default: lambda a: f"tl.abs({a})",
    aten.sign.default: _sign,
    aten.pow.Tensor_Scalar: _pow,
    aten.maximum.default: lambda a, b: f"_max({a}, {b})",
    aten.minimum.default: lambda a, b: f"_min({a}, {b})",
    aten.clamp.default: _clamp,
    aten.clamp_min.default: lambda a, lo: _clamp(a, lo=lo),
    aten.clamp_max.default: lambda a, hi: _clamp(a, hi=hi),
    aten.eq.Tensor: _binary("=="), aten.eq.Scalar: _binary("=="),
    aten.ne.Tensor: _binary("!="), aten.ne.Scalar: _binary("!="),
    aten.lt.Tensor: _binary("<"), aten.lt.Scalar: _binary("<"),
    aten.le.Tensor: _binary("<="), aten.le.Scalar: _binary("<="),
    aten.gt.Tensor: _binary(">"), aten.gt.Scalar: _binary(">"),
    aten.ge.Tensor: _binary(">="), aten.ge.Scalar: _binary(">="),
    aten.logical_and.default: _binary("&"), aten.logical_or.default: _binary("|"),
    aten.logical_xor.default: _binary("^"), aten.logical_not.default: lambda a: f"({a} == 0)",
    aten.bitwise_and.Tensor: _binary("&"), aten.bitwise_or.Tensor: _binary("|"),
    aten.__and__.Tensor: _binary("&"), aten.__or__.Tensor: _binary("|"), aten.__xor__.Tensor: _binary("^"),
    aten.bitwise_not.default: lambda a: f"({a} == 0)",
    aten.isnan.default: lambda a: f"({a} != {a})",
    aten.isinf.default: lambda a: f"(tl.abs({a}) == float(\"inf\"))",
    # Eager's formulas: grad * (1 - y * y) and grad * (1 - y) * y, from the forward's output y.
    aten.tanh_backward.default: lambda g, y: f"({g} * (1.0 - {y} * {y}))",
    aten.sigmoid_backward.default: lambda g, y: f"({g} * (1.0 - {y}) * {y})",
    aten.where.self: lambda c, a, b: f"tl.where({c}, {a}, {b})",
    aten.where.ScalarOther: lambda c, a, b: f"tl.where({c}, {a}, {b})",
    aten.where.ScalarSelf: lambda c, a, b: f"tl.where({c}, {a}, {b})",
    aten.where.Scalar: lambda c, a, b: f"tl.where({c}, {a}, {b})",
    aten.masked_fill.Scalar: lambda x, m, v: f"tl.where({m}, {v}, {x})",
    aten.masked_fill.Tensor: lambda x, m, v: f"tl.where({m}, {v}, {x})",
}

#: Ops that keep their input's values (a cast's rounding is the node's own, see `rounded`).
SAME_VALUES = {aten.clone.default, aten.alias.default, aten.detach.default, aten.expand.default,
               aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
               aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten._to_copy.default,
               aten.lift_fresh_copy.default}
#: Ops that make a constant of their argument's value (`value_of`).
CONSTANTS = {aten.scalar_tensor.default: 0, aten.full.default: 1, aten.full_like.default: 1}
ZEROS_ONES = {aten.zeros_like.default: 0.0, aten.ones_like.default: 1.0}
