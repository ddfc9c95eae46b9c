"""Smoke test of `bench.lm_head`: its worker at a tiny shape, in this process.

Eager, F.linear_cross_entropy and graphpass (inner compiler aot_eager: inductor's compile would
dominate the test's time) on both losses at T=96, H=32, V=512: graphpass's site includes the
lm_head, the loss and both gradients match float64, and the table and acceptance lines render
from the same results.
"""

from __future__ import annotations

import dataclasses

import pytest

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
    assert linear_ce["status"] == ("ok" if workload == "ce" else "unavailable")
    assert ours["notes"]["lm_head_sites"] == 1 and ours["notes"]["fallbacks"] == []
    for r in (eager, ours) + ((linear_ce,) if workload == "ce" else ()):
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
    assert r["status"] == "ok" and len(r["pair_ratios"]) == 2 and r["ratio"] > 0
    assert set(r["times"]) == {"inductor", "graphpass"} and r["notes"]["lm_head_sites"] == 1
