"""Eager vs graphpass parity over the loss idioms of `tests/idioms.py`.

Every case compares the values of all outputs and the gradient of the loss w.r.t. the logits
with eager, and checks `backend.records`: exact site counts and output labels. The default run
covers every idiom once (fp32, [N, V], T=13 in chunks of 4) plus a spread of dtypes, layouts and
odd chunkings; the full cross product and the inductor cases are marked `slow`
(run them with `--runslow` or GRAPHPASS_SLOW=1). At each idiom's default point, `graphpass.explain`
must decide as the backend did.
"""

from __future__ import annotations

import pytest
import torch

import graphpass
from tests import idioms
from bench.fuzz import run as fuzz
from graphpass.config import Config
from tests.helpers import decisions, explained_records

pytestmark = pytest.mark.heavy  # a minute or more: xdist starts it early (tests/conftest.py)

IDIOMS = idioms.IDIOMS

V = 37
SHAPES = {  # layout -> {rows: logits shape}
    "2d": {13: (13, V), 1: (1, V)},
    "3d": {13: (3, 5, V), 1: (1, 1, V)},  # 15 rows in the 3-D layout: not a multiple of 4 either
}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(layout: str, rows: int, dtype: torch.dtype, seed: int = 0, shape=None):
    g = torch.Generator().manual_seed(seed)
    shape = shape or SHAPES[layout][rows]
    logits = (torch.randn(shape, generator=g) * 2.0).to(dtype).requires_grad_()
    tokens = torch.randint(0, V, shape[:-1], generator=g)
    return logits, tokens, idioms.make_extra(logits, tokens, seed)


def assert_close_rel(actual, expected, rtol: float, what: str):
    """Close within `rtol` of the reference's largest magnitude (bf16 rounding is absolute-ish)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    scale = expected.detach().float().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), rtol=rtol,
                               atol=max(rtol * scale, 1e-6), msg=lambda m: f"{what}: {m}")


def assert_as_accurate_as_eager(fn, args, kwargs, actual, actual_grad, expected, expected_grad):
    """Every output and the logits' gradient at most twice as far from float64 as eager's, plus a
    dtype's slack (`bench.fuzz`'s rule: at the largest element and over the whole tensor)."""
    logits = args[0]
    as_float64 = lambda v: v.detach().double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    ref_logits = as_float64(logits).requires_grad_()
    with fuzz.Float64():  # `.float()` inside the idiom keeps float64
        reference = fn(ref_logits, *args[1:], **{k: as_float64(v) for k, v in kwargs.items()})
        (ref_grad,) = torch.autograd.grad(reference[0], ref_logits)
    rtol = fuzz.RTOL[logits.dtype]
    for i, (a, e, r) in enumerate(zip(actual, expected, reference)):
        why = fuzz.compare(f"output {i}", a.detach(), e.detach(), r.detach(), rtol, min_scale=1.0)
        assert why is None, why
    why = fuzz.compare("grad wrt logits", actual_grad, expected_grad, ref_grad, rtol)
    assert why is None, why


def site_kind(site) -> str:
    """A site's distinct output labels, sorted and joined by "+".

    Distinct, because a region may rightly output one quantity twice (bf16 `logp` and its
    `.float()` upcast, both used outside): that is one log-prob, not two.
    """
    return "+".join(sorted({o.kind for o in site.outputs}))


def site_kinds(backend) -> tuple[str, ...]:
    """Every rewritten site of every graph, as `site_kind`s, sorted."""
    return tuple(sorted(site_kind(s) for r in backend.records for s in r.sites))


def all_outputs(backend):
    return [o for r in backend.records for s in r.sites for o in s.outputs]


def run_parity(idiom, layout, rows, dtype, chunk_size, inner="aot_eager", shape=None, **kwargs):
    """Compile `idiom` with graphpass, compare with eager, check the records; returns the backend.

    `shape` overrides the logits shape that `layout` and `rows` choose."""
    logits, tokens, extra = make_inputs(layout, rows, dtype, shape=shape)
    extra.update(kwargs)
    backend = graphpass.Backend(chunk_size=chunk_size, inner=inner)
    compiled = torch.compile(idiom.fn, backend=backend)

    expected = idiom.fn(logits, tokens, **extra)
    (expected_grad,) = torch.autograd.grad(expected[0], logits)
    actual = compiled(logits, tokens, **extra)
    (actual_grad,) = torch.autograd.grad(actual[0], logits)

    fallbacks = [r.fallback_reason for r in backend.records if r.fallback_reason]
    assert not fallbacks, f"graph ran unchanged: {fallbacks}"
    rtol = RTOL[dtype]
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close_rel(a, e, rtol, f"output {i}")
    assert_close_rel(actual_grad, expected_grad, rtol, "grad wrt logits")
    assert_as_accurate_as_eager(idiom.fn, (logits, tokens), extra, actual, actual_grad, expected, expected_grad)

    got = site_kinds(backend)
    assert got in idiom.acceptable_sites(logits[..., 0].numel()), (
        f"sites {got}, expected one of {idiom.acceptable_sites(logits[..., 0].numel())}; "
        f"rejected: {[c.reason for r in backend.records for c in r.rejected]}"
    )
    for out in all_outputs(backend):
        assert out.kind not in idiom.forbidden_kinds, f"an output was labelled {out.kind}"
        if out.kind in ("logprob", "entropy"):
            assert out.temperature == idiom.temperature, f"{out.kind}: temperature {out.temperature!r}"
    return backend


# ---- the grid ------------------------------------------------------------------------------------

# Beyond every idiom at fp32 / its first layout / T=13, chunk 4: these also run by default.
DEFAULT_EXTRA = {
    ("log_softmax_gather", "bf16", "2d", 13),
    ("float_upcast", "bf16", "2d", 13),
    ("top_p_masked_fill", "bf16", "2d", 13),
    ("entropy_categorical", "fp32", "3d", 13),
    ("entropy_shared_log_softmax", "fp32", "2d", 1),
    ("python_chunk_loop", "bf16", "3d", 1),
}


# Known failures of the core, not of the idioms: strict, so a fix shows up as XPASS.
CORE_BUGS = {
}


def core_bug(name: str):
    """The strict xfail mark for an idiom the core gets wrong, or no mark."""
    reason = CORE_BUGS.get(name)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def _grid():
    for idiom in IDIOMS:
        for dtype in DTYPES:
            for layout in idiom.layouts:
                for rows in (13, 1):
                    default = (dtype, layout, rows) == ("fp32", idiom.layouts[0], 13)
                    default = default or (idiom.name, dtype, layout, rows) in DEFAULT_EXTRA
                    marks = ([] if default else [pytest.mark.slow]) + core_bug(idiom.name)
                    yield pytest.param(idiom, dtype, layout, rows, marks=marks,
                                       id=f"{idiom.name}-{dtype}-{layout}-T{rows}")


_BACKENDS: dict = {}  # the parity runs' backends by grid point, for the explain test (one worker runs a module)


@pytest.mark.parametrize("idiom,dtype,layout,rows", list(_grid()))
def test_idiom_parity(idiom, dtype, layout, rows):
    _BACKENDS[idiom.name, dtype, layout, rows] = run_parity(idiom, layout, rows, DTYPES[dtype], chunk_size=4)


@pytest.mark.parametrize("idiom", IDIOMS, ids=lambda i: i.name)
def test_explain_decides_every_idiom_as_the_backend(idiom):
    """`graphpass.explain` and `graphpass inspect` decide as the backend does (`pipeline.decide`: the
    rewrite, its memory veto, lint): each graph runs rewritten or unchanged alike, with the same
    sites and warnings. The backend's is test_idiom_parity's run at the idiom's default point.
    (The library corpus's cases: test_corpus.)"""
    layout = idiom.layouts[0]
    backend = _BACKENDS.get((idiom.name, "fp32", layout, 13)) or run_parity(idiom, layout, 13, torch.float32,
                                                                             chunk_size=4)
    logits, tokens, extra = make_inputs(layout, 13, torch.float32)
    explained = explained_records(idiom.fn, (logits, tokens), extra, Config(chunk_size=4, inner="aot_eager"))
    assert decisions(explained) == decisions(backend.records)


def test_catalog_is_complete():
    assert len(IDIOMS) >= 14
    assert len({i.name for i in IDIOMS}) == len(IDIOMS)
    assert any(i.expected_kinds == () for i in IDIOMS), "needs a no-softmax idiom"
    assert any("entropy" in i.forbidden_kinds for i in IDIOMS), "needs a must-not-be-entropy idiom"


@pytest.mark.parametrize("name", ["neg_cross_entropy_transposed", "neg_nll_loss_transposed",
                                  "transposed_logits_used_elsewhere", "log_softmax_gather"])
def test_sequence_as_long_as_vocab(name):
    """[B, S, V] with S == V: shapes alone cannot tell transposed logits from logits."""
    run_parity(idioms.BY_NAME[name], "3d", 13, torch.float32, chunk_size=4, shape=(2, V, V))


@pytest.mark.parametrize("name", ["per_vocab_bias", "top_p_masked_fill"])
def test_rows_as_many_as_vocab(name):
    """[V, V] logits: a [V] operand still broadcasts along the vocabulary, not along the rows."""
    run_parity(idioms.BY_NAME[name], "2d", 13, torch.float32, chunk_size=4, shape=(V, V))


def test_chunk_size_chosen_at_run_time():
    run_parity(idioms.BY_NAME["entropy_shared_log_softmax"], "2d", 13, torch.float32, chunk_size=None)


@pytest.mark.slow
def test_chunk_larger_than_rows():
    run_parity(idioms.BY_NAME["entropy_categorical"], "2d", 13, torch.float32, chunk_size=64)


# ---- gradients only where they flow --------------------------------------------------------------


def _keeps_grad_by_kind(backend) -> dict[str, list[bool]]:
    out: dict[str, list[bool]] = {}
    for o in all_outputs(backend):
        out.setdefault(o.kind, []).append(o.keeps_grad)
    return out


@pytest.mark.parametrize("coef,entropy_grad", [(0.0, False), (0.01, True)], ids=["coef0", "coef0.01"])
def test_entropy_coefficient_decides_entropy_grad(coef, entropy_grad):
    backend = run_parity(idioms.BY_NAME["entropy_shared_log_softmax"], "2d", 13, torch.float32,
                         chunk_size=4, ent_coef=coef)
    assert _keeps_grad_by_kind(backend) == {"logprob": [True], "entropy": [entropy_grad]}


@pytest.mark.parametrize("name", [pytest.param(n, marks=core_bug(n)) for n in
                                  ("entropy_detached", "entropy_no_grad_block")])
def test_detached_entropy_keeps_no_grad(name):
    backend = run_parity(idioms.BY_NAME[name], "2d", 13, torch.float32, chunk_size=4)
    assert _keeps_grad_by_kind(backend) == {"logprob": [True], "entropy": [False]}


def test_no_grad_block_without_grad_flow_tags():
    """Without tag_grad_flow_pass an output computed under no_grad gets no gradient all the same:
    the op's program detaches every value the region computes under no_grad."""
    idiom = idioms.BY_NAME["entropy_no_grad_block"]
    logits, tokens, extra = make_inputs("2d", 13, torch.float32)
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager", disable_passes=("tag_grad_flow_pass",))
    actual = torch.compile(idiom.fn, backend=backend)(logits, tokens, **extra)
    expected = idiom.fn(logits, tokens, **extra)
    assert site_kinds(backend) == ("entropy+logprob",)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close_rel(a, e, 1e-5, f"output {i}")
    (ga,) = torch.autograd.grad(actual[0] + actual[-1].sum(), logits, allow_unused=True)
    (ge,) = torch.autograd.grad(expected[0] + expected[-1].sum(), logits, allow_unused=True)
    assert_close_rel(ga, ge, 1e-5, "grad")


# ---- a temperature that becomes a runtime scalar -------------------------------------------------


def test_runtime_temperature_after_recompile():
    """A second float recompiles with the temperature read through .item(): still rewritten."""
    idiom = idioms.BY_NAME["temperature_div"]
    logits, tokens, extra = make_inputs("2d", 13, torch.float32)
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    compiled = torch.compile(idiom.fn, backend=backend)
    for temp in (0.7, 0.9):
        actual = compiled(logits, tokens, temp=temp, **extra)
        expected = idiom.fn(logits, tokens, temp=temp, **extra)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close_rel(a, e, 1e-5, f"temp={temp} output {i}")
        (ga,) = torch.autograd.grad(actual[0], logits)
        (ge,) = torch.autograd.grad(expected[0], logits)
        assert_close_rel(ga, ge, 1e-5, f"temp={temp} grad")
    last = backend.records[-1]
    assert last.fallback_reason is None
    assert [site_kind(s) for s in last.sites] == ["entropy+logprob"]
    temps = {o.temperature for s in last.sites for o in s.outputs}
    assert len(temps) == 1 and temps.pop().startswith("/ ") and "0.9" not in str(temps)


# ---- inductor --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", [pytest.param(n, d, marks=core_bug(n)) for n, d in
                                        (("entropy_shared_log_softmax", torch.float32),
                                         ("log_softmax_gather", torch.bfloat16))])
def test_inductor_parity(name, dtype):
    run_parity(idioms.BY_NAME[name], "2d", 13, dtype, chunk_size=4, inner="inductor")
