"""bench.cp at a tiny size (aot_eager, cp = 2 run, cp = 8 counted): it runs, measures and accepts."""

from __future__ import annotations

import dataclasses

from bench import cp as bench_cp
from graphpass.ops.groups import ALL_GATHER


def test_bench_cp_quick_grid_measures_bytes_times_and_parity():
    spec = dataclasses.replace(bench_cp.QUICK, sequences=5, steps=1)
    rows = bench_cp.run(spec, kinds=("zigzag",), cps=(2,))
    measured = [r for r in rows if r["measured"]]
    assert {(r["loss"], r["method"]) for r in measured} == {(n, m) for n in bench_cp.LOSSES for m in bench_cp.METHODS}
    for r in measured:
        assert r["same_on_every_rank"] and r["step_ms"] > 0 and r["bytes_per_rank"] > 0, r
        assert r["grad_diff"] <= 1e-5 and r["loss_diff"] <= 1e-5, r
    by = {(r["loss"], r["method"], r["cp"]): r for r in rows}
    R = measured[0]["R"]
    assert by["gspo", "slime", 2]["bytes_per_rank"] == 2 * 4 * R  # fwd + bwd zero-padded all-reduce, fp32
    assert by["gspo", "graphpass", 2]["collectives"] == ["all_reduce"]
    assert by["ppo_logged", "graphpass", 2]["collectives"] == [ALL_GATHER]  # the unshard stays
    assert {r["cp"] for r in rows if not r["measured"]} == {8}
    accepted = bench_cp.acceptance(rows)
    assert len(accepted) == 2 * len(bench_cp.LOSSES) and all(e["passed"] for e in accepted), accepted
    assert "graphpass / slime" in bench_cp.table(rows)
