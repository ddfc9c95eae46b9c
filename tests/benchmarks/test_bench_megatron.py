"""Smoke test of `bench.megatron`: one spawn of 2 gloo ranks at a tiny shape, every method, aot_eager.

The `inductor` method (here aot_eager, as graphpass's inner compiler: inductor's compile would
dominate the test's time) compiles unmodified megatron-core before graphpass is imported in the
rank: Dynamo breaks its graph in the output layer. graphpass's one graph has an lm_head site that
computes its gradients in forward; its collectives (an all-gather per block, the hidden states'
gradient all-reduced) are the same on both ranks; loss and gradients match eager's. The table and the acceptance line render.
"""

from __future__ import annotations

import pytest

from bench import megatron


def test_every_method_runs_and_graphpass_fuses_the_output_layer():
    pytest.importorskip("megatron.core")
    spec = megatron.MegatronSpec("slime", 32, "fp32", V=2 * 64, S=16, B=2, H=16, compiler="aot_eager", steps=2,
                                 min_steps=2, time_budget_s=5.0, memory_steps=1)
    rows = {r["method"]: r for r in megatron.run(spec)}
    assert [r["status"] for r in rows.values()] == ["ok"] * 3, rows
    eager, inductor, ours = rows["eager"], rows["inductor"], rows["graphpass"]
    assert inductor["inductor_graphs"] >= 2  # unmodified megatron-core: the graph breaks in the layer
    summary = ours["graphpass"]
    assert summary["fallbacks"] == [] and summary["lm_head_sites"] == summary["tp_sites"] == 1, summary
    assert summary["gradients_in_forward_sites"] == 1, summary
    # One all-gather per block of rows, then the hidden states' gradient all-reduced in backward.
    blocks = len(summary["record_collectives"])
    assert ours["collectives"] == ["all_gather"] * blocks + ["all_reduce"] and blocks > 1, ours
    assert ours["collectives_same_on_all_ranks"], ours
    assert eager["parity"] == 0.0 and ours["parity"] <= 1e-5 and inductor["parity"] <= 1e-5
    assert ours["floor_bytes"] == 4 * (16 * 2 * 16 + 64 * 16) and ours["peak_bytes"] > 0

    text = megatron.table(list(rows.values()))
    assert "1 lm_head site(s) of 1 tp, 1 with gradients in forward" in text
    (entry,) = megatron.acceptance(list(rows.values()))
    assert entry["lm_head"] and entry["line"].startswith(("PASS slime", "FAIL slime"))
