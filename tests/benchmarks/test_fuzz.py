"""The differential fuzzer (`bench.fuzz`): its comparator catches wrong results, and fixed seeds pass."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz import run
from bench.fuzz.programs import generate, hypothesis_draw, random_draw

pytestmark = pytest.mark.heavy  # a minute or more: xdist starts it early (tests/conftest.py)


def _scripted(**fixed):
    """A `draw` that takes the first option, except for the named choices given."""
    return lambda name, options: fixed[name] if name in fixed else options[0]


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


class _BrokenBackend:
    """A backend that runs the graph eagerly with one deliberate defect."""

    def __init__(self, defect: str):
        self.defect = defect
        self.records = []

    def __call__(self, gm, example_inputs):
        def run(*args):
            args = list(args)
            grad_inputs = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
            if self.defect == "scale_grad":  # the first input's gradient comes back 5% too large
                args[grad_inputs[0]] = _Scale.apply(args[grad_inputs[0]], 1.05)
            if self.defect == "drop_grad":  # the last input's gradient goes missing
                args[grad_inputs[-1]] = args[grad_inputs[-1]].detach()
            if self.defect == "raise":
                raise RuntimeError("broken backend")
            outs = gm(*args)
            if self.defect == "scale_output":
                outs = (outs[0] * 1.05, *outs[1:])  # 5% off
            return outs

        return run


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("defect, expected", [
    ("scale_grad", "grad of logits: error"),
    ("drop_grad", "grad of w: missing in compiled"),
    ("raise", "compiled raised RuntimeError: broken backend"),
    # 5% on the loss: also 5% on every gradient (in bf16, a loss of 0.15 is within tolerance).
    ("scale_output", "error"),
])
def test_comparator_catches_a_broken_backend(dtype, defect, expected):
    # Logits and a value-head input `w` both need gradients.
    prog = generate(_scripted(dtype=dtype, value_head="plain", upcast=False))
    result = run.check_source(prog.source, backend_factory=lambda chunk_size: _BrokenBackend(defect))
    assert result.mismatch is not None and expected in result.mismatch, result.mismatch
    # The same program with the defect-free backend is not flagged.
    ok = run.check_source(prog.source, backend_factory=lambda chunk_size: _BrokenBackend("none"))
    assert ok.mismatch is None, ok.mismatch


def test_tolerance_catches_a_small_gradient_error_but_not_rounding():
    ref = torch.linspace(-1, 1, 50, dtype=torch.float64)
    eager = (ref + 1e-7).float()
    assert run.compare("g", (ref + 2e-7).float(), eager, ref, run.RTOL[torch.float32]) is None
    wrong = ref.float().clone()
    wrong[7] += 0.05
    assert "error" in run.compare("g", wrong, eager, ref, run.RTOL[torch.float32])
    # bf16: eager's rounding error sets the bound, yet 0.05 on a gradient of magnitude 1 is caught.
    eager16 = ref.bfloat16()
    assert run.compare("g", eager16.clone(), eager16, ref, run.RTOL[torch.bfloat16]) is None
    wrong16 = eager16.clone()
    wrong16[7] += 0.05
    assert "error" in run.compare("g", wrong16, eager16, ref, run.RTOL[torch.bfloat16])
    # NaN where eager has a number, or a NaN moved: caught.
    nan = ref.float().clone()
    nan[3] = float("nan")
    assert "non-finite" in run.compare("g", nan, eager, ref, run.RTOL[torch.float32])


def test_decomposed_run_widens_the_bound_to_its_rounding_only():
    ref = torch.linspace(-1, 1, 50, dtype=torch.float64)
    eager = ref.float()  # eager happens to round every value to nearest
    got = (ref + 3e-5).float()  # as far off as torch's decomposed graph is
    rtol = run.RTOL[torch.float32]
    assert "error" in run.compare("g", got, eager, ref, rtol)
    assert run.compare("g", got, eager, ref, rtol, peers=[(ref + 3e-5).float()]) is None
    # A peer whose error is smaller, missing, or of another shape leaves eager's bound; a wrong
    # value is caught whatever the peer.
    for peer in (eager, None, eager[:10]):
        assert "error" in run.compare("g", got, eager, ref, rtol, peers=[peer])
    wrong = (ref + 3e-5).float()
    wrong[7] += 0.05
    assert "error" in run.compare("g", wrong, eager, ref, rtol, peers=[(ref + 3e-5).float()])


def test_known_rounding_case_is_within_the_decomposed_graphs_error():
    # Seed 10025: graphpass's logits gradient is off float64 by 2.95e-6, torch's decomposed
    # graph's by the same to the last bit; eager's by 3.7e-8 (module comment of bench.fuzz.run).
    assert run.check_seed(10025, inner="eager").mismatch is None


@pytest.mark.parametrize("seed", [405, 814])
def test_a_temperature_gradient_through_a_max_shift_is_as_accurate_as_eager(seed):
    # `x - amax(x)` written out, a per-token temperature with a gradient: outside the region
    # (405: 3 x eager's error when the max shift's gradient read the forward's sum) and inside it
    # (814: 6 x when that sum alone kept the backward's terms). `graphpass.ops.row_sums`.
    assert run.check_seed(seed, inner="eager").mismatch is None


def test_programs_are_determined_by_their_seed_and_run_eagerly():
    # Every generated program is valid code whose eager run and float64 reference succeed
    # (forward and backward) with finite gradients: a mismatch is never the generator's fault.
    for seed in range(300):
        prog = run.program(seed)
        assert prog.source == run.program(seed).source
        ns = run.load(prog.source, f"seed {seed}")
        inputs = ns["make_inputs"]()
        for float64 in (False, True):
            outs, grads = run._run(ns["loss"], inputs, float64=float64)
            assert outs[0].ndim == 0 and grads["logits" if "logits" in grads else "hidden"] is not None, seed
            assert all(torch.isfinite(g).all() for g in grads.values()), seed


# The fixed seeds run with the eager inner compiler (the capture, the passes and the kernels are
# aot_eager's; only the rest of the graph runs uncompiled), the hypothesis test with aot_eager
# (`check_source`'s default); `python -m bench.fuzz` uses eager unless given --inner. Both are
# samples that keep the suite within its 15 minutes: the campaign that shows behaviour unchanged is
# `python -m bench.fuzz -n 2000`.
FIXED_SEEDS_INNER = "eager"
FIXED_SEEDS = range(30)


def test_fixed_seeds_match_eager():
    """Seeds 0..29 (about 40 s on a quiet core): every program's results equal eager's."""
    # Under pytest-xdist every CPU already runs a test module: more processes would only wait.
    workers = 1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1)
    results = run.run_seeds(FIXED_SEEDS, inner=FIXED_SEEDS_INNER, workers=workers)
    bad = [f"{r.name}: {r.mismatch}" for r in results if r.mismatch]
    assert not bad, (f"{len(bad)} mismatches (show one: python -m bench.fuzz --seed N -n 1 --show "
                     f"--inner {FIXED_SEEDS_INNER}):\n" + "\n".join(bad))
    # The fuzzer must exercise the rewrite, not only run graphs unchanged (98 of seeds 0..99 were
    # rewritten at the time of writing): fewer means lost coverage of real loss code.
    rewritten = sum(r.sites > 0 for r in results)
    assert rewritten >= 0.8 * len(results), f"only {rewritten} of {len(results)} programs were rewritten"


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_hypothesis_programs_match_eager(data):
    prog = generate(hypothesis_draw(data), data_seed=data.draw(st.integers(0, 3), label="data_seed"))
    result = run.check_source(prog.source, "hypothesis")
    assert result.mismatch is None, f"{result.mismatch}\n{prog.source}"
