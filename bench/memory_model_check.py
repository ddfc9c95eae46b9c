"""Estimated vs measured peak memory of one PPO forward+backward (the memory model's check).

    python bench/memory_model_check.py                   # T=4096 V=32768, eager and graphpass, fp32 and bf16
    python bench/memory_model_check.py --impl eager --T 1024 --V 16384

Each configuration is measured in its own process: peak RSS (`VmHWM`, reset by writing 5 to
/proc/self/clear_refs) minus the RSS with the inputs allocated and everything compiled. With
MALLOC_MMAP_THRESHOLD_ fixed at 1 MiB every tensor of 1 MiB or more is its own mmap, so this
tracks live tensor bytes (the per-chunk buffers too, which glibc would otherwise keep resident
from the warm-up). The estimate comes from
`graphpass.memory` on fake tensors. Exits 1 when any error exceeds --tolerance (15 %).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from examples.ppo_loss import example_inputs, ppo_loss  # noqa: E402

TEMPERATURE, ENT_COEF = 0.7, 0.0


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _loss_fn(impl: str, chunk_size):
    if impl == "eager":
        return ppo_loss
    import graphpass

    return torch.compile(ppo_loss, backend=graphpass.Backend(chunk_size=chunk_size))


def measure_one(impl: str, dtype: torch.dtype, T: int, V: int, chunk_size=None) -> dict:
    """Peak bytes above the inputs of one step, in this process (call it in a fresh one)."""
    torch.manual_seed(0)
    fn = _loss_fn(impl, chunk_size)
    inputs = example_inputs(T, V, dtype)
    logits = inputs[0]
    # Warm up at the measured shape: compiles, lazy library state, thread pools.
    fn(*inputs, temperature=TEMPERATURE, ent_coef=ENT_COEF).backward()
    logits.grad = None
    gc.collect()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    loss = fn(*inputs, temperature=TEMPERATURE, ent_coef=ENT_COEF)
    loss.backward()
    peak = _status("VmHWM") - base
    floor = logits.grad.numel() * logits.grad.element_size()
    return {"peak": peak, "floor": floor}


def estimate_one(impl: str, dtype: torch.dtype, T: int, V: int, chunk_size=None) -> dict:
    """The memory model's estimate for the same step, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphpass import memory
    from graphpass.config import Config
    from graphpass.inspection import rewrite_results

    with FakeTensorMode():
        logits = torch.empty(T, V, dtype=dtype, requires_grad=True)
        rest = (torch.empty(T, dtype=torch.int64), torch.empty(T), torch.empty(T), torch.empty(T))
    torch.compiler.reset()
    results = rewrite_results(ppo_loss, (logits, *rest), {"temperature": TEMPERATURE, "ent_coef": ENT_COEF},
                              Config(chunk_size=chunk_size))
    est = memory.estimate_rewrite(results[0])
    chosen = est.before if impl == "eager" else est.after
    return {"peak": chosen.peak_bytes, "floor": chosen.floor_bytes, "sites": len(results[0].record.sites),
            "fallback": results[0].record.fallback_reason}


def run_config(impl, dtype_name, T, V, chunk_size=None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--measure-one", impl, dtype_name, str(T), str(V)]
    if chunk_size:
        cmd += ["--chunk-size", str(chunk_size)]
    # A fixed mmap threshold: every allocation of 1 MiB or more is its own mapping, returned to
    # the OS when freed. Otherwise glibc raises its threshold to 32 MiB after the first frees and
    # keeps chunk-sized buffers resident in the heap from the warm-up, hiding them from VmHWM.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(2**20))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {impl} {dtype_name} failed:\n{proc.stderr[-2000:]}")
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    estimated = estimate_one(impl, getattr(torch, dtype_name), T, V, chunk_size)
    error = (estimated["peak"] - measured["peak"]) / measured["peak"]
    return {"impl": impl, "dtype": dtype_name, "T": T, "V": V, "estimated": estimated["peak"],
            "measured": measured["peak"], "floor": measured["floor"], "error": error,
            "sites": estimated["sites"], "fallback": estimated["fallback"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--V", type=int, default=32768)
    parser.add_argument("--impl", default="eager,graphpass")
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure-one", nargs=4, metavar=("IMPL", "DTYPE", "T", "V"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_one:
        impl, dtype_name, T, V = args.measure_one
        print(json.dumps(measure_one(impl, getattr(torch, dtype_name), int(T), int(V), args.chunk_size)))
        return 0

    from tabulate import tabulate

    from graphpass.report import human_bytes

    rows, worst = [], 0.0
    for impl in args.impl.split(","):
        for dtype_name in args.dtype.split(","):
            r = run_config(impl, dtype_name, args.T, args.V, args.chunk_size)
            worst = max(worst, abs(r["error"]))
            rows.append(r)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"one PPO forward+backward, T={args.T} V={args.V}, CPU; peak bytes above the inputs")
        print(tabulate([[r["impl"], r["dtype"], human_bytes(r["estimated"]), f"{r['estimated'] / r['floor']:.2f} x",
                         human_bytes(r["measured"]), f"{r['measured'] / r['floor']:.2f} x", f"{100 * r['error']:+.1f}%",
                         r["sites"] if r["impl"] != "eager" else ""]
                        for r in rows],
                       headers=["impl", "logits", "estimated", "est./floor", "measured", "meas./floor", "error",
                                "sites"]))
        for r in rows:
            if r["impl"] != "eager" and r["fallback"]:
                print(f"note: {r['impl']} {r['dtype']}: graph ran unchanged: {r['fallback']}")
        print(f"worst error {100 * worst:.1f}% (tolerance {100 * args.tolerance:.0f}%): "
              f"{'OK' if worst <= args.tolerance else 'FAIL'}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
