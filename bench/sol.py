"""The machine's speed of light for a log-prob/entropy loss over logits [T, V], measured.

    python -m bench.sol                     # the suite's grid, on this machine (cuda when present, else cpu)
    python -m bench.sol --T 4096 --V 32768 --dtypes fp32 --out /tmp/sol.json

No implementation of the loss can do less than two passes over the logits: forward, one read that
yields each row's log-sum-exp (an online max / sum-exp, whatever else the loss needs from the same
read); backward, one read of the logits and one write of their gradient. Both passes are compiled
by inductor into one fused kernel each (`bench.harness.sol_passes.forward_pass`, `backward_pass`)
and timed like a method (median over steps after a warm-up; CUDA events on a GPU), each
configuration in its own forked worker (`bench.harness.isolate.run_isolated`). Inductor's CPU
kernel reads a row twice (its max, then its sum): on a CPU the forward is also timed over row
blocks that fit in the last-level cache, where the second read is not from memory, and the faster
of the two counts. A method's "x SoL" is its step time over `sol_s`, the sum of the two, measured
in the same run. The backward pass writes a new tensor each call, as a
training step's gradient is (on CPU that includes faulting in its pages); `--device cuda` times
the same kernels with CUDA events.

`python -m bench.suite` measures it in each method's worker, one SoL step right after each of the
method's steps on the same logits (`bench.harness.sol_passes.Passes`), and reports the method's
"x SoL", the median of its step time over the SoL step's, next to its "x floor" (`--no-sol` skips
it): paired steps, so a machine whose speed drifts (shared, its memory ballooned) moves both alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness.isolate import run_isolated
from bench.harness.machine_info import default_device, machine_description, provenance
from bench.harness.sol_passes import Passes
from bench.harness.spec import Spec, torch_dtype

GRID_T = (1024, 4096, 16384)
GRID_V = (32768, 151936)
DTYPES = ("fp32", "bf16")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "sol.json"


def measure(spec: Spec) -> dict:
    """The worker: time the two passes at `spec`'s shape (the `measure_fn` of `run_isolated`)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(spec.seed)
    logits = torch.randn(spec.T, spec.V, generator=g).to(device=spec.device, dtype=torch_dtype(spec.dtype))
    passes = Passes(logits, spec.seed)
    error = passes.backward_max_abs_error()
    fwd, bwd = [], []
    started = time.monotonic()
    for step in range(max(spec.min_steps, spec.steps)):
        f, b = passes.step()
        fwd.append(f)
        bwd.append(b)
        if step + 1 >= spec.min_steps and time.monotonic() - started > spec.time_budget_s:
            break
    forward_s, backward_s = statistics.median(fwd), statistics.median(bwd)
    return dict(status="ok", forward_s=forward_s, backward_s=backward_s, sol_s=forward_s + backward_s,
                steps=len(fwd), backward_max_abs_error=error, load=os.getloadavg()[0])


def run(T=GRID_T, V=GRID_V, dtypes=DTYPES, device: str | None = None, steps: int = 5,
        timeout_s: float = 600) -> list[dict]:
    """SoL of every configuration (on `device`, None: `default_device()`, as the suite), each in
    its own worker; skipped where the logits and their gradient would not fit in half the RAM."""
    from bench.harness.machine_info import total_ram_bytes
    from bench.harness.spec import DTYPE_BYTES

    device = device or default_device()
    rows = []
    for t in T:
        for v in V:
            for dtype in dtypes:
                spec = Spec("sol", "sol", t, v, dtype, device=device, steps=steps, reference=False)
                if device == "cpu" and 2 * t * v * DTYPE_BYTES[dtype] + 8 * t * v > total_ram_bytes() / 2:
                    rows.append(dict(dataclasses.asdict(spec), status="skipped", note="does not fit in half the RAM"))
                    continue
                rows.append(run_isolated(spec, timeout_s, measure_fn=measure))
    return rows


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    lines = [[r["T"], r["V"], r["dtype"], r["device"],
              *((f"{1e3 * r['forward_s']:.1f}", f"{1e3 * r['backward_s']:.1f}", f"{1e3 * r['sol_s']:.1f}",
                 f"{r['backward_max_abs_error']:.1e}") if r.get("status") == "ok" else ("", "", "", "")),
              r.get("status") if r.get("status") == "ok" else f"{r.get('status')}: {r.get('note', '')}"]
             for r in rows]
    return tabulate(lines, headers=["T", "V", "dtype", "device", "forward ms", "backward ms", "SoL ms",
                                    "|grad err|", "status"], tablefmt="simple")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=list(GRID_T))
    parser.add_argument("--V", type=int, nargs="+", default=list(GRID_V))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, as bench.suite)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    started = time.monotonic()
    print(f"bench.sol: {machine_description()}", flush=True)
    rows = run(args.T, args.V, args.dtypes, args.device, args.steps)
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(machine=machine_description(), **provenance(), results=rows,
                                        wall_s=time.monotonic() - started), indent=1, default=str) + "\n")
    print(f"\nwrote {args.out} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
