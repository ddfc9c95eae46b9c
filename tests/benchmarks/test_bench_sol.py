"""bench.sol at a tiny shape: both passes compile, run, time and compute the log-prob's gradient."""

from __future__ import annotations

import dataclasses

import torch

from bench import sol
from bench.harness import sol_passes


def test_the_two_passes_compute_the_lse_and_the_logprob_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g, dtype=torch.float64)
    target = torch.randint(0, 11, (5,), generator=g)
    weight = torch.randn(5, generator=g, dtype=torch.float64)
    lse = sol_passes.forward_pass(logits, 0.7)
    torch.testing.assert_close(lse, (logits.float() / 0.7).logsumexp(-1))
    x = logits.clone().requires_grad_()
    (torch.log_softmax(x / 0.7, -1).gather(1, target[:, None])[:, 0] * weight).sum().backward()
    torch.testing.assert_close(sol_passes.backward_pass(logits, lse, target, weight, 0.7), x.grad, rtol=1e-5, atol=1e-6)


def test_bench_sol_measures_a_tiny_configuration_in_a_worker():
    [row] = sol.run(T=(64,), V=(512,), dtypes=("fp32",), steps=2, timeout_s=300)
    assert row["status"] == "ok", row
    assert 0 < row["forward_s"] and 0 < row["backward_s"] and row["sol_s"] == row["forward_s"] + row["backward_s"]
    assert row["backward_max_abs_error"] < 1e-5
    assert "SoL ms" in sol.table([row])


def test_each_step_is_paired_with_a_sol_step_in_the_same_worker():
    import statistics

    from bench.harness import report
    from bench.harness.isolate import run_isolated
    from bench.harness.spec import Spec

    spec = Spec("ppo-t0.7-e0", "eager", 64, 512, "fp32", steps=3, time_budget_s=5, reference=False)
    row = run_isolated(spec, timeout_s=300)
    assert row["status"] == "ok", row
    assert len(row["sol_times"]) == len(row["times"]) and all(t > 0 for t in row["sol_times"])
    assert row["sol_s"] == statistics.median(row["sol_times"])
    assert row["x_sol"] == statistics.median(t / s for t, s in zip(row["times"], row["sol_times"]))
    assert "x SoL" in report.table([dict(row, **spec.__dict__, floor_bytes=spec.floor_bytes)])
    row = run_isolated(dataclasses.replace(spec, sol=False), timeout_s=300)
    assert row["status"] == "ok" and "x_sol" not in row
