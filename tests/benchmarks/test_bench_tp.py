"""Smoke test of `bench.tp`: its per-configuration rank function at a tiny shape on 2 gloo ranks.

Eager and graphpass only, graphpass's inner compiler aot_eager (inductor's compile would dominate
the test's time), T=64 and V=2*128: the Function is replaced by one vocab-parallel site with
tp_size 2, each step issues exactly one collective per Function call (the all-gather of row
statistics, none in backward), and the loss and gradient match eager's. The table and the
acceptance lines render from the same results.
"""

from __future__ import annotations

import pytest

from bench import tp
from bench.harness.ranks import run_ranks
from graphpass.ops.groups import ALL_GATHER


@pytest.mark.parametrize("code", ["slime", "megatron", "megatron_entropy"])
def test_graphpass_replaces_the_function_with_one_collective(code):
    if code.startswith("megatron"):
        pytest.importorskip("megatron.core")
    spec = tp.TpSpec(code, T=64, dtype="fp32", V=2 * 128, methods=("eager", "graphpass"), compiler="aot_eager",
                     steps=2, min_steps=2, time_budget_s=5.0)
    per_rank = run_ranks(tp.run_config, 2, args=(spec,), timeout_s=170)
    rows = {r["method"]: r for r in tp.rows_from_ranks(spec, per_rank)}

    eager, ours = rows["eager"], rows["graphpass"]
    assert eager["status"] == ours["status"] == "ok"
    summary = ours["graphpass"]
    assert summary["fallbacks"] == [] and summary["tp_sites"] == 1, summary
    assert summary["record_collectives"] == [("all_gather", 2, summary["collective_bytes"])], summary
    # One Function call per step: one collective, the same on both ranks and in every step, seen
    # both through torch.distributed's Python functions and at the process group.
    assert ours["logged_collectives"] == [ALL_GATHER], ours["logged_collectives"]
    assert ours["collectives"] == ["all_gather"], ours["collectives"]
    assert ours["collectives_same_on_all_ranks"] and ours["logged_constant"]
    # The code's own collectives: slime all-reduces 4 statistics (with entropy), megatron 3, and
    # megatron_entropy 3 + 3 (its two Functions, one op under graphpass).
    assert eager["collectives"] == ["all_reduce"] * {"slime": 4, "megatron": 3, "megatron_entropy": 6}[code], \
        eager["collectives"]
    assert ours["parity"] <= 1e-5, (ours["loss_diff"], ours["grad_diff"])
    assert eager["parity"] == 0.0
    # megatron-core writes its softmax into fp32 input logits (megatron_entropy hands it a clone);
    # graphpass's op does not.
    assert eager["input_overwritten"] == (code == "megatron") and not ours["input_overwritten"]
    assert ours["peak_bytes"] > 0 and ours["time_s"] > 0

    text = tp.table(list(rows.values()))
    assert code in text and "graphpass" in text
    (entry,) = tp.acceptance(list(rows.values()))
    assert entry["time_ratio"] is None and not entry["passed"]  # no inductor row to compare with
    assert entry["line"].startswith("FAIL") and "no inductor row" in entry["line"]
