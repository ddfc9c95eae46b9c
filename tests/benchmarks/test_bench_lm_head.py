"""Smoke test of `bench.lm_head`: its worker at a tiny shape, in this process.

Eager, F.linear_cross_entropy and graphpass (inner compiler aot_eager: inductor's compile would
dominate the test's time) on both losses at T=96, H=32, V=512: graphpass's site includes the
lm_head, the loss and both gradients match float64, and the table and acceptance lines render
from the same results.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench import lm_head


@pytest.mark.parametrize("workload", ["ppo", "ce"])
def test_worker_measures_every_method(workload):
    base = lm_head.HeadSpec(workload, "eager", T=96, H=32, V=512, dtype="fp32", steps=2, time_budget_s=2.0,
                            inner="aot_eager", chunk_size=40)
    results = []
    for method in ("eager", "linear_ce", "graphpass"):
        spec = dataclasses.replace(base, method=method)
        r = dict(dataclasses.asdict(spec), floor_bytes=spec.floor_bytes, **lm_head.measure(spec))
        results.append(r)
    eager, linear_ce, ours = results
    assert eager["status"] == ours["status"] == "ok"
    has_linear_ce = workload == "ce" and hasattr(torch.nn.functional, "linear_cross_entropy")  # torch >= 2.13
    assert linear_ce["status"] == ("ok" if has_linear_ce else "unavailable"), linear_ce
    assert ours["notes"]["lm_head_sites"] == 1 and ours["notes"]["fallbacks"] == []
    for r in (eager, ours) + ((linear_ce,) if has_linear_ce else ()):
        assert r["parity"] <= 1e-5, (r["method"], r["loss_rel"], r["hidden_grad_rel"], r["weight_grad_rel"])
        assert r["peak_bytes"] >= 0 and r["time_s"] > 0 and r["load_avg_1m"] >= 0

    text = lm_head.table(results)
    assert "graphpass" in text and "lm_head sites: 1" in text
    checks = lm_head.acceptance(results)
    if workload == "ce":
        (entry,) = checks
        assert entry["check"] == "ce" and "F.linear_cross_entropy" in entry["line"]
    else:
        assert checks == []  # not the acceptance shape


def test_plan_skips_what_this_machine_cannot_run():
    args = lm_head.parse_args(["--T", "8192", "--H", "4096", "--V", "151936", "--dtypes", "fp32",
                               "--methods", "eager", "--device", "cpu", "--workloads", "ppo"])
    (spec,) = lm_head.plan(args)
    assert lm_head._too_big(spec, args) is not None
    small = dataclasses.replace(spec, T=256, H=64, V=1024)
    assert lm_head._too_big(small, args) is None


def test_alternating_ab_times_both_in_one_worker():
    spec = lm_head.HeadSpec("ppo", "ab", T=64, H=16, V=128, dtype="fp32", steps=2)
    r = lm_head.measure_ab(spec)
    assert r["status"] == "ok" and len(r["pair_ratios"]["graphpass"]) == 2 and r["ratio"] > 0
    assert set(r["times"]) == {"inductor", "graphpass"} and r["notes"]["lm_head_sites"] == 1


def test_loss_outside_alternates_the_helper_alone_and_the_opt_in():
    spec = lm_head.HeadSpec("ppo_outside", "ab", T=64, H=16, V=128, dtype="fp32", steps=2, inner="aot_eager")
    r = lm_head.measure_ab(spec)
    assert set(r["times"]) == {"inductor", "graphpass", "graphpass_fused"}
    assert set(r["ratios"]) == {"graphpass", "graphpass_fused"} and r["ratios"]["graphpass"] == r["ratio"]
    alone, fused = r["notes_by_method"]["graphpass"], r["notes_by_method"]["graphpass_fused"]
    assert alone["lm_head_sites"] == fused["lm_head_sites"] == 1
    assert alone["gradients_in_forward_sites"] == 0 and fused["gradients_in_forward_sites"] == 1


def test_the_opt_in_matches_float64_and_is_what_the_loss_outside_check_reads():
    base = lm_head.HeadSpec("ppo_outside", "eager", T=96, H=32, V=512, dtype="fp32", steps=2, time_budget_s=2.0,
                            inner="aot_eager", chunk_size=40)
    results = [dict(dataclasses.asdict(s), floor_bytes=s.floor_bytes, **lm_head.measure(s))
               for s in (dataclasses.replace(base, method=m) for m in ("inductor", "graphpass", "graphpass_fused"))]
    assert all(r["status"] == "ok" and r["parity"] <= 1e-5 for r in results), results
    assert results[2]["notes"]["gradients_in_forward_sites"] == 1
    assert lm_head.build(dataclasses.replace(base, workload="ppo", method="graphpass_fused")).startswith("the loss")
    # At an acceptance shape (relabelled), the opt-in is checked and the helper alone is informational.
    shape = dict(T=4096, H=256, V=65536)
    checks = lm_head.acceptance([dict(r, **shape) for r in results])
    assert [c["check"] for c in checks] == ["ppo_outside_recompute", "ppo_outside"]
    assert checks[0]["passed"] is None and "graphpass_fused" in checks[1]["line"]
