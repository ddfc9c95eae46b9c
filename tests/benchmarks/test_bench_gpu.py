"""bench.gpu's CPU smoke (tiny shapes, aot_eager): every method runs or says why not, parity is
checked against float64, a spent budget and an OOM are recorded, the JSON is written."""

from __future__ import annotations

import json

import torch

from bench import gpu, lm_head


def test_cpu_smoke_measures_every_method_of_both_kinds(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--cpu-smoke", "--cases", "lm_head_ce", "logits_ppo", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["complete"] and data["cpu_smoke"] and data["compiler"] == "aot_eager"
    rows = {(r["case"], r["method"]): r for r in data["results"]}
    assert set(rows) == {(c, m) for c in ("lm_head_ce", "logits_ppo") for m in gpu.METHODS}
    for case in ("lm_head_ce", "logits_ppo"):
        for method in ("eager", "inductor", "graphpass"):
            r = rows[case, method]
            assert r["status"] == "ok" and r["parity_ok"] and r["peak_bytes"] >= 0 and r["time_s"] > 0, r
            assert len(r["times"]) >= 2 and r["first_call_s"] is not None  # the warm-up is timed apart
        assert gpu.graphpass_note(rows[case, "graphpass"])[1] is False
    assert {"hidden_grad_rel", "weight_grad_rel", "loss_rel"} <= set(rows["lm_head_ce", "eager"])
    assert {"logits_grad_rel", "loss_rel"} <= set(rows["logits_ppo", "eager"])
    assert rows["logits_ppo", "liger"]["status"] == "n/a"
    assert rows["lm_head_ce", "cce"]["status"] in ("ok", "unavailable")  # CCE needs Triton here
    assert "graphpass" in gpu.table(data["results"])


def test_a_spent_budget_skips_the_rest_and_still_writes(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--cpu-smoke", "--cases", "gemma2_ce", "--methods", "eager", "--budget-s", "0",
                     "--out", str(out)]) == 1
    (row,) = json.loads(out.read_text())["results"]
    assert row["status"] == "skipped" and "--budget-s" in row["note"]


def test_an_out_of_memory_error_is_recorded_as_oom(monkeypatch):
    def out_of_memory(spec):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 93.00 GiB")

    monkeypatch.setattr(lm_head, "measure", out_of_memory)
    result = gpu.measure(lm_head.HeadSpec("ce", "eager", 8, 4, 16, "bf16"))
    assert result["status"] == "OOM" and "Tried to allocate" in result["note"]


# The fork server's imports, with torch.cuda pretending a GPU: every function that would reach the
# CUDA driver records its call (the workers are forked from that server, so none may run there).
_PROBE = """
import sys
import torch
calls = []
def probe(name, value):
    def fn(*args, **kwargs):
        calls.append(name)
        return value
    return fn
for name, value in dict(is_available=True, device_count=1, is_initialized=False, _lazy_init=None, init=None,
                        get_device_properties=None, get_device_capability=(9, 0), get_device_name="GPU",
                        current_device=0, set_device=None, synchronize=None, mem_get_info=(0, 0),
                        is_bf16_supported=True, current_stream=None).items():
    setattr(torch.cuda, name, probe(name, value))
import bench.harness.preload
print([m for m in bench.harness.preload.PRELOAD if m not in sys.modules], calls)  # nothing missing, no call
"""


def test_the_fork_server_never_touches_cuda():
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[] []", done.stdout


def test_the_profile_smoke_times_each_chunk_size_and_writes_its_tables(tmp_path, capsys):
    from bench import gpu_profile

    assert gpu_profile.main(["--cpu-smoke", "--case", "logits_ppo", "--chunk-sizes", "0", "16", "--steps", "1",
                             "--out", str(tmp_path)]) == 0
    text = (tmp_path / "profile_logits_ppo.txt").read_text()
    headers = [line for line in text.splitlines() if line.startswith("== logits_ppo graphpass")]
    assert len(headers) == 2 and "chunk_size=own" in headers[0] and "chunk rows [16]" in headers[1], headers
    assert "graphpass::rowwise_chunked" in text  # the op's own rows in the profiler's table
    assert gpu_profile.main(["--cpu-smoke", "--case", "lm_head_ce", "--tile-layouts", "width-rows", "rows-width",
                             "--steps", "1", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "profile_lm_head_ce.txt").read_text()
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("==")] == \
        [f"== lm_head_ce graphpass chunk_size=own tiles {layout}" for layout in ("width-rows", "rows-width")]


def test_a_worker_error_carries_its_traceback():
    from bench.harness.isolate import _measure_or_error

    def failing(spec):
        raise ValueError("no such shape")

    row = _measure_or_error(None, failing)
    assert row["status"] == "error" and row["note"] == "ValueError: no such shape"
    assert "in failing" in row["traceback"] and row["traceback"].rstrip().endswith("ValueError: no such shape")


def test_gpu_kernels_cpu_smoke_writes_a_row_per_kernel_and_gemm(tmp_path):
    """bench.gpu_kernels' CPU smoke (Triton's interpreter): each logits case's kernels per method, forward
    and backward, with time, bandwidth, x the copy bandwidth's time and parity against float64 within
    bf16's; each GEMM shape with its FLOP rate."""
    from bench import gpu_kernels

    out = tmp_path / "gpu_kernels.json"
    assert gpu_kernels.main(["--cpu-smoke", "--parts", "kernels", "gemm", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    kernels = {(r["case"], r["method"], r["direction"]) for r in rows if r["case"].startswith("logits")}
    assert kernels == {(c, m, d) for c in gpu_kernels.KERNEL_CASES for m in gpu_kernels.KERNEL_METHODS
                       for d in ("forward", "backward")}
    for r in rows:
        assert r["status"] == "ok" and r["time_ms"] > 0 and {"case", "method", "x_floor", "x_sol"} <= set(r), r
        if r["case"].startswith("logits"):
            assert r["x_sol"] > 0 and r["tb_s"] > 0 and r["parity"] <= gpu.PARITY_TOLERANCE["bf16"], r
    assert {r["case"] for r in rows if "tf_s" in r} == {"gemm_logits", "gemm_dh", "gemm_dw"}
