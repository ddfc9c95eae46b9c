"""bench.sol at a tiny shape: both passes compile, run, time and compute the log-prob's gradient."""

from __future__ import annotations

import torch

from bench import sol


def test_the_two_passes_compute_the_lse_and_the_logprob_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g, dtype=torch.float64)
    target = torch.randint(0, 11, (5,), generator=g)
    weight = torch.randn(5, generator=g, dtype=torch.float64)
    lse = sol.forward_pass(logits, 0.7)
    torch.testing.assert_close(lse, (logits.float() / 0.7).logsumexp(-1))
    x = logits.clone().requires_grad_()
    (torch.log_softmax(x / 0.7, -1).gather(1, target[:, None])[:, 0] * weight).sum().backward()
    torch.testing.assert_close(sol.backward_pass(logits, lse, target, weight, 0.7), x.grad, rtol=1e-5, atol=1e-6)


def test_bench_sol_measures_a_tiny_configuration_in_a_worker():
    [row] = sol.run(T=(64,), V=(512,), dtypes=("fp32",), steps=2, timeout_s=300)
    assert row["status"] == "ok", row
    assert 0 < row["forward_s"] and 0 < row["backward_s"] and row["sol_s"] == row["forward_s"] + row["backward_s"]
    assert row["backward_max_abs_error"] < 1e-5
    assert "SoL ms" in sol.table([row])


def test_the_suite_reports_each_result_as_a_multiple_of_the_sol():
    from bench import report, suite

    results = [dict(workload="ppo", method="graphpass", T=64, V=512, dtype="fp32", status="ok", time_s=0.5,
                    peak_bytes=2 ** 17, floor_bytes=2 ** 17, first_call_s=1.0),
               dict(workload="ppo", method="eager", T=64, V=1024, dtype="fp32", status="oom_predicted", note="predicted",
                    floor_bytes=2 ** 18)]
    suite.add_sol(results, "cpu", steps=2)
    assert 0 < results[0]["sol_s"] and results[0]["x_sol"] == 0.5 / results[0]["sol_s"]
    assert "x_sol" not in results[1]  # only configurations that ran are measured
    assert "x SoL" in report.table(results)
