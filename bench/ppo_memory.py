"""Issue 2, item 8: one PPO forward+backward at T=4096, V=32768, eager vs inductor vs graphpass.

    python -m bench.ppo_memory            # fp32 and bf16 logits, each method in its own process

PPO loss: log-prob of the sampled tokens and entropy at temperature 0.7, entropy coefficient 0,
clipped ratio loss (clip 0.2), masked token mean. Prints the peak bytes above the pre-step
baseline, the ratio to the floor (bytes of logits.grad), wall time, and graphpass / inductor time,
then checks the acceptance bar (graphpass <= 1.25 x floor and <= 1.0 x inductor's time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.harness import report
from bench.harness.isolate import run_isolated
from bench.harness.machine_info import machine_description
from bench.harness.spec import Spec

WORKLOAD = "ppo-t0.7-e0"
METHODS = ("eager", "inductor", "graphpass")
MAX_RATIO = 1.25
MAX_TIME_VS_INDUCTOR = 1.0


def verdicts(results: list[dict]) -> list[str]:
    """One line per dtype: graphpass's ratio to the floor and to inductor's time, against the bar."""
    lines = []
    for dtype in sorted({r["dtype"] for r in results}, reverse=True):
        by = {r["method"]: r for r in results if r["dtype"] == dtype}
        gp, ind = by.get("graphpass", {}), by.get("inductor", {})
        if gp.get("status") != "ok" or ind.get("status") != "ok":
            lines.append(f"{dtype}: n/a (graphpass {gp.get('status')}, inductor {ind.get('status')})")
            continue
        speed = gp["time_s"] / ind["time_s"]
        ok = gp["ratio"] <= MAX_RATIO and speed <= MAX_TIME_VS_INDUCTOR
        lines.append(f"{dtype}: graphpass {gp['ratio']:.2f} x floor (bar {MAX_RATIO}), "
                     f"{speed:.2f} x inductor's time (bar {MAX_TIME_VS_INDUCTOR}): {'PASS' if ok else 'FAIL'}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--V", type=int, default=32768)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=5, help="most timed steps")
    p.add_argument("--timeout", type=float, default=600, help="seconds per worker before it is killed")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)

    machine = machine_description()
    print(f"machine: {machine}", flush=True)
    results = []
    for dtype in args.dtypes:
        for method in args.methods:
            spec = Spec(WORKLOAD, method, args.T, args.V, dtype, device=args.device, steps=args.steps)
            results.append(r := run_isolated(spec, timeout_s=args.timeout))
            print(f"  {dtype} {method}: {r['status']}", flush=True)
    print()
    print(report.table(results))
    print()
    print("\n".join(verdicts(results)))
    if args.json:
        report.write_json(args.json, machine, results)
    return 1 if any(r["status"] in ("error", "timeout") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
