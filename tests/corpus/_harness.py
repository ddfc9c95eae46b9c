"""Run one corpus case under eager and under graphpass: parity of every output and gradient, and
what graphpass rewrote, as a `Result` (one compile per case and dtype, shared by the tests and the
summary table)."""

from __future__ import annotations

import dataclasses
import functools
import time
import traceback

import torch

import graphpass

from . import ANY, BY_NAME, DTYPES, Case

CHUNK_SIZE = 5
INNER = "aot_eager"
FP32_RTOL = 2e-5
"""fp32: |compiled - eager| <= FP32_RTOL x the largest |eager| of that output or gradient."""
BF16_FACTOR, BF16_ATOL = 2.0, 2.0 ** -7
"""bf16: error vs float64 <= BF16_FACTOR x eager's + BF16_ATOL (one bf16 epsilon), the errors relative
to the largest |float64 value|, for outputs at least 1 (a loss or a statistic near 0 is compared
absolutely: rounding one token differently moves a mean of cancelling terms by a few ulps)."""


@dataclasses.dataclass
class Result:
    case: str
    dtype: str
    error: str | None = None
    """An exception from the eager or the compiled run (a failure of both tests)."""
    parity_problems: list[str] = dataclasses.field(default_factory=list)
    max_err: float = 0.0
    """Worst relative error over outputs and gradients (vs eager for fp32, vs float64 for bf16)."""
    max_grad_err: float = 0.0
    n_grads: int = 0
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    found: tuple[str, ...] = ()
    outputs: list[tuple[str, bool, str | None]] = dataclasses.field(default_factory=list)
    rejected: list[str] = dataclasses.field(default_factory=list)
    coverage_problems: list[str] = dataclasses.field(default_factory=list)
    records: list = dataclasses.field(default_factory=list)
    """The backend's `GraphRecord`s."""
    seconds: float = 0.0

    @property
    def parity_ok(self) -> bool:
        return self.error is None and not self.parity_problems

    @property
    def coverage_ok(self) -> bool:
        return self.error is None and not self.coverage_problems


# ---- inputs --------------------------------------------------------------------------------------


def _clone(x, dtype=None):
    """A fresh copy of an input (tensor, list of tensors, or plain value); floats cast to `dtype`."""
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        if dtype is not None and y.is_floating_point():
            y = y.to(dtype)
        return y.requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v, dtype) for v in x)
    return x


def _leaves(inputs: dict) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, v in inputs.items():
        vs = v if isinstance(v, (list, tuple)) else [v]
        for i, t in enumerate(vs):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                out.append((name if len(vs) == 1 else f"{name}[{i}]", t))
    return out


def _run(fn, inputs: dict):
    out = fn(**inputs)
    out = out if isinstance(out, tuple) else (out,)
    leaves = _leaves(inputs)
    grads = None
    if leaves and isinstance(out[0], torch.Tensor) and out[0].requires_grad:
        grads = torch.autograd.grad(out[0], [t for _, t in leaves], allow_unused=True)
    return out, grads


# ---- comparisons ---------------------------------------------------------------------------------


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-6) -> float:
    """max |actual - expected| over the largest finite |expected| (at least `floor`); inf when
    non-finite entries differ."""
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    if not torch.equal(torch.isnan(a), torch.isnan(e)):
        return float("inf")
    ia, ie = torch.isinf(a), torch.isinf(e)
    if not torch.equal(ia, ie) or not torch.equal(a[ia], e[ie]):
        return float("inf")
    fa, fe = torch.isfinite(a), torch.isfinite(e)
    if not fe.any():
        return 0.0
    scale = max(e[fe].abs().max().item(), floor)
    return (a[fa] - e[fe]).abs().max().item() / scale


def _compare_fp32(res: Result, what: str, actual, expected, is_grad: bool):
    if not isinstance(expected, torch.Tensor):
        if actual != expected:
            res.parity_problems.append(f"{what}: {actual!r} != eager {expected!r}")
        return
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        res.parity_problems.append(f"{what}: {tuple(actual.shape)} {actual.dtype} != eager "
                                   f"{tuple(expected.shape)} {expected.dtype}")
        return
    if not expected.is_floating_point():
        if not torch.equal(actual, expected):
            res.parity_problems.append(f"{what}: differs from eager")
        return
    err = rel_err(actual, expected)
    res.max_err = max(res.max_err, err)
    if is_grad:
        res.max_grad_err = max(res.max_grad_err, err)
    if err > FP32_RTOL:
        res.parity_problems.append(f"{what}: relative error {err:.2e} vs eager (> {FP32_RTOL:g})")


def _compare_bf16(res: Result, what: str, actual, expected, reference, is_grad: bool):
    if not isinstance(expected, torch.Tensor) or not expected.is_floating_point():
        return  # rounding may rightly flip a comparison; only floating values are compared in bf16
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        res.parity_problems.append(f"{what}: {tuple(actual.shape)} {actual.dtype} != eager "
                                   f"{tuple(expected.shape)} {expected.dtype}")
        return
    floor = 1e-12 if is_grad else 1.0
    e_err, c_err = rel_err(expected, reference, floor), rel_err(actual, reference, floor)
    res.max_err = max(res.max_err, c_err)
    if is_grad:
        res.max_grad_err = max(res.max_grad_err, c_err)
    if c_err > BF16_FACTOR * e_err + BF16_ATOL:
        res.parity_problems.append(f"{what}: error vs float64 {c_err:.2e}, eager's {e_err:.2e} "
                                   f"(allowed {BF16_FACTOR:g} x + {BF16_ATOL:g})")


def _check_parity(res: Result, inputs, eager, compiled, reference):
    (e_out, e_grads), (c_out, c_grads) = eager, compiled
    ref_out, ref_grads = reference if reference is not None else (None, None)
    if len(c_out) != len(e_out):
        res.parity_problems.append(f"{len(c_out)} outputs, eager has {len(e_out)}")
        return
    names = [n for n, _ in _leaves(inputs)]
    pairs = [(f"output {i}", c, e, None if ref_out is None else ref_out[i], False)
             for i, (c, e) in enumerate(zip(c_out, e_out))]
    if e_grads is not None:
        if c_grads is None:
            res.parity_problems.append("the compiled loss has no gradient")
            return
        for i, (name, c, e) in enumerate(zip(names, c_grads, e_grads)):
            if e is None:
                continue
            res.n_grads += 1
            if c is None:
                res.parity_problems.append(f"grad of {name}: missing")
                continue
            pairs.append((f"grad of {name}", c, e, None if ref_grads is None else ref_grads[i], True))
    elif c_out and isinstance(c_out[0], torch.Tensor) and c_out[0].requires_grad:
        res.parity_problems.append("the compiled output 0 requires grad, eager's does not")
    for what, c, e, r, is_grad in pairs:
        if reference is None:
            _compare_fp32(res, what, c, e, is_grad)
        else:
            _compare_bf16(res, what, c, e, r, is_grad)


# ---- coverage ------------------------------------------------------------------------------------


def site_kind(site) -> str:
    """A site's distinct output labels, sorted and joined by "+"."""
    return "+".join(sorted({o.kind for o in site.outputs}))


def _check_coverage(res: Result, case: Case, backend):
    records = backend.records
    res.fallbacks = [f"graph {r.index}: {r.fallback_reason}" for r in records if r.fallback_reason]
    sites = [s for r in records for s in r.sites]
    res.found = tuple(sorted(site_kind(s) for s in sites))
    res.outputs = [(o.kind, o.keeps_grad, o.temperature) for s in sites for o in s.outputs]
    res.rejected = [c.reason for r in records for c in r.rejected]
    p = res.coverage_problems
    for f in res.fallbacks:
        p.append(f"ran unchanged: {f}")
    acceptable = case.acceptable(res.dtype)
    if res.found not in acceptable:
        p.append(f"sites {list(res.found)}, expected {' or '.join(str(list(a)) for a in acceptable)}"
                 + (f"; declined: {res.rejected}" if res.rejected else ""))
    for kind, keeps_grad, temperature in res.outputs:
        if kind in case.no_grad_kinds and keeps_grad:
            p.append(f"a {kind} output keeps its gradient (it cannot reach the loss)")
        if kind in case.grad_kinds and not keeps_grad:
            p.append(f"a {kind} output drops its gradient (it reaches the loss)")
        if kind in ("logprob", "entropy") and case.temperature != ANY and temperature != case.temperature:
            p.append(f"a {kind} output reports temperature {temperature!r}, expected {case.temperature!r}"
                     + (" (the scaling stayed outside the region: a scaled [rows, V] copy)"
                        if temperature is None else ""))


def sites_rewritten(case: Case, res: Result) -> int:
    """How many of the ideal answer's sites were rewritten: all when the answer is acceptable,
    else those whose every label appears among the sites found."""
    ideal = case.ideal(res.dtype)
    if res.error is None and res.found in case.acceptable(res.dtype):
        return len(ideal)
    found_labels = {lab for k in res.found for lab in k.split("+")}
    return sum(all(lab in found_labels for lab in s.split("+")) for s in ideal)


# ---- the run -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def run_case(name: str, dtype: str, chunk_size: int = CHUNK_SIZE, inner: str = INNER) -> Result:
    """Eager, graphpass (and for bf16 a float64 reference) on the same inputs; compared."""
    case = BY_NAME[name]
    res = Result(name, dtype)
    start = time.perf_counter()
    torch.compiler.reset()
    try:
        inputs = case.make_inputs(DTYPES[dtype])
        eager_in = {k: _clone(v) for k, v in inputs.items()}
        eager = _run(case.fn, eager_in)
        reference = None
        if dtype != "fp32":
            reference = _run(case.fn, {k: _clone(v, torch.float64) for k, v in inputs.items()})
    except Exception as e:  # a bug of the case itself
        res.error = f"eager run failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
        res.seconds = time.perf_counter() - start
        return res
    backend = graphpass.Backend(chunk_size=chunk_size, inner=inner)
    compiled_in = {k: _clone(v) for k, v in inputs.items()}
    try:
        compiled = _run(torch.compile(case.fn, backend=backend), compiled_in)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0]
        res.error = f"compiled run failed: {type(e).__name__}: {first_line}"
    else:
        _check_parity(res, compiled_in, eager, compiled, reference)
    _check_coverage(res, case, backend)
    res.records = list(backend.records)
    torch.compiler.reset()
    res.seconds = time.perf_counter() - start
    return res
