"""One GPU run at the anchors' shapes: eager, inductor, graphpass, and Liger-Kernel / cut-cross-entropy where they import.

    python -m bench.gpu                       # one CUDA GPU, <= 8 minutes: table, bench/results/gpu.json
    python -m bench.gpu --cpu-smoke           # the same code at tiny shapes on the CPU (CI); a temp JSON
    python -m bench.gpu --cases logits_ppo --methods graphpass inductor --budget-s 120

Cases (bf16): `lm_head_ppo` and `lm_head_ce`, the loss from hidden states `[16384, 2048]` and an
output layer of V = 248320 (a public TRL comparison on an H100: reference 47.6 GB, Liger 6.05 GB,
CCE 3.09 GB); `gemma2_ce`, Gemma-2's 8192 x 256000 x 2304 (CCE's paper: 28 GB -> 1.16 GB; plain
cross-entropy here, without Gemma's logit soft-cap); `logits_ppo`, the PPO step over given logits
`[32768, 151936]`. The lm_head cases run `bench.lm_head`'s worker (floor: `hidden.grad +
W.grad`; the loss and both whole gradients against float64), the logits case
`bench.harness.measure`'s (floor: `logits.grad`; the loss over all rows and `logits.grad` on the
first and last row blocks against float64). Methods: `eager`, `inductor`, `graphpass`
(`--compiler` is inductor's stand-in and graphpass's inner compiler), `liger` (Liger-Kernel's
fused linear cross-entropy, or its fused linear GRPO loss for PPO), `cce` (cut-cross-entropy,
cross-entropy only); a method that does not import or apply is recorded with the reason.

Each (case, method) runs in its own forked worker (`bench.harness.isolate.run_isolated`): peak =
`max_memory_allocated` above the inputs after `reset_peak_memory_stats` (and as a multiple of the
floor), time = median of a few steps timed with CUDA events after one warm-up step, parity =
relative error (max abs difference over the reference's max abs value) of the loss and each
gradient. An OOM is recorded as "OOM" (the worker frees its memory before it reports; its exit
frees the rest). Results go to `--out` after every measurement, so a run killed at its deadline
still leaves what it measured; `--budget-s` stops starting workers (and cuts the running one's
timeout) when the wall-clock budget is spent, the rest recorded as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import bench.harness.measure
from bench import lm_head
from bench.harness import machine_info
from bench.harness.isolate import run_isolated
from bench.harness.spec import DTYPE_BYTES, Spec

RESULTS = Path(__file__).parent / "results" / "gpu.json"


@dataclasses.dataclass(frozen=True)
class Case:
    """One anchor shape: `kind` "lm_head" (hidden states and W) or "logits" (logits given)."""

    name: str
    kind: str
    workload: str
    """`bench.lm_head`'s loss (ppo, ce) or `bench.workloads.losses`' key (e.g. ppo-t0.7-e0)."""
    T: int
    V: int
    H: int | None = None
    dtype: str = "bf16"
    anchor: str = ""

    @property
    def floor_bytes(self) -> int:
        itemsize = DTYPE_BYTES[self.dtype]
        return (self.T + self.V) * self.H * itemsize if self.kind == "lm_head" else self.T * self.V * itemsize


CASES = (
    Case("lm_head_ppo", "lm_head", "ppo", 16384, 248320, 2048, anchor="PPO from hidden states at the TRL comparison's shape"),
    Case("lm_head_ce", "lm_head", "ce", 16384, 248320, 2048,
         anchor="TRL comparison (H100): reference 47.6 GB, Liger 6.05 GB, CCE 3.09 GB"),
    Case("gemma2_ce", "lm_head", "ce", 8192, 256000, 2304, anchor="Gemma-2 (CCE paper: 28 GB -> 1.16 GB)"),
    Case("logits_ppo", "logits", "ppo-t0.7-e0", 32768, 151936, anchor="PPO over given logits, Qwen's vocabulary"),
)
SMOKE_SHAPES = {"lm_head": dict(T=64, V=256, H=32), "logits": dict(T=64, V=512)}
METHODS = ("graphpass", "inductor", "eager", "liger", "cce")
# Workers run in this order, each tier over every case, so that a spent budget cuts the
# libraries' rows before any case loses its baselines.
TIERS = (("graphpass", "inductor", "eager"), ("liger", "cce"))
# Relative error against float64 above which a result's parity is off: fp32 arithmetic, or bf16
# inputs whose logits and gradients are rounded to bf16 (8 bits of mantissa: 2^-8 relative per
# value, a few of them in a row).
PARITY_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}
# Less budget than this left: do not start another worker (CUDA start, inputs and a compile).
MIN_WORKER_S = 30.0
FAILED = ("error", "timeout", "OOM", "skipped")
PACKAGES = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}


def spec_for(case: Case, method: str, args):
    """The worker's spec, or a string saying why `method` cannot run on `case` here."""
    common = dict(device=args.device, steps=args.steps, min_steps=2, time_budget_s=args.step_budget, warmup=True)
    if method in PACKAGES and case.kind == "logits":
        return f"{method} fuses the lm_head: it takes hidden states and W, not logits"
    if method in PACKAGES and importlib.util.find_spec(PACKAGES[method]) is None:
        return f"{PACKAGES[method]} is not installed"
    if case.kind == "lm_head":
        return lm_head.HeadSpec(case.workload, method, case.T, case.H, case.V, case.dtype, inner=args.compiler,
                                **common)
    return Spec(case.workload, method, case.T, case.V, case.dtype, sol=args.sol, compiler=args.compiler,
                reference_dtype="fp64", **common)


def measure(spec) -> dict:
    """The worker: `bench.lm_head`'s or `bench.harness.measure`'s measurement; an OOM becomes status "OOM"."""
    import torch

    try:
        return (lm_head.measure if isinstance(spec, lm_head.HeadSpec) else bench.harness.measure.measure)(spec)
    except Exception as exc:
        # Raised inside a compiled call, the allocator's error can arrive wrapped by Dynamo.
        if not isinstance(exc, torch.OutOfMemoryError) and "out of memory" not in str(exc):
            raise
        note = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    # Outside the except block: the traceback (and the tensors its frames hold) is gone.
    gc.collect()
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        note += f" (max_memory_allocated {peak / machine_info.GiB:.1f} GiB when it failed)"
    return dict(status="OOM", note=note)


def parity(row: dict) -> dict:
    """Relative errors of the loss and gradients against float64, the worst, and whether it is within tolerance."""
    if "parity" not in row and "ref_loss" in row:  # bench.harness.measure reports absolute differences
        row["loss_rel"] = row["loss_diff"] / max(abs(row["ref_loss"]), 1e-30)
        row["logits_grad_rel"] = row["grad_diff"] / max(row["ref_grad_max"], 1e-30)
        row["parity"] = max(row["loss_rel"], row["logits_grad_rel"])
    if "parity" in row:
        row["parity_ok"] = row["parity"] <= PARITY_TOLERANCE[row["dtype"]]
    return row


def graphpass_note(r: dict) -> tuple[str | None, bool]:
    """For a graphpass row that ran: (the sites it rewrote, or that it fell back or rewrote
    nothing; whether that is a problem). (None, False) for other rows."""
    if r["method"] != "graphpass" or r["status"] != "ok":
        return None, False
    notes = r.get("notes") or {}  # bench.lm_head's and bench.workloads.methods' spellings
    sites = notes.get("sites", notes.get("graphpass_sites", 0))
    fallbacks = notes.get("fallbacks", notes.get("graphpass_fallbacks")) or []
    if fallbacks:
        return "FELL BACK: " + "; ".join(fallbacks), True
    if not sites:
        return "REWROTE NOTHING", True
    return f"{sites} site(s)" + (f", {notes['lm_head_sites']} with the lm_head" if "lm_head_sites" in notes else ""), False


def plan(args) -> list[tuple[Case, str]]:
    cases = [c for c in CASES if c.name in args.cases]
    if args.cpu_smoke:
        cases = [dataclasses.replace(c, **SMOKE_SHAPES[c.kind]) for c in cases]
    return [(c, m) for tier in TIERS for c in cases for m in tier if m in args.methods]


def run(args, write) -> list[dict]:
    """Every planned (case, method), each result handed to `write(results)` as soon as it is known."""
    deadline = time.monotonic() + args.budget_s
    results = []
    for case, method in plan(args):
        row = dict(case=case.name, kind=case.kind, workload=case.workload, T=case.T, H=case.H, V=case.V,
                   dtype=case.dtype, method=method, floor_bytes=case.floor_bytes, anchor=case.anchor)
        left = deadline - time.monotonic()
        started = time.monotonic()
        try:
            spec = spec_for(case, method, args)
            if isinstance(spec, str):
                row.update(status="unavailable" if spec.endswith("not installed") else "n/a", note=spec)
            elif left < MIN_WORKER_S:
                row.update(status="skipped", note=f"--budget-s {args.budget_s:g} spent ({left:.0f} s left)")
            else:
                timeout = min(args.timeout, left)
                got = run_isolated(spec, timeout_s=timeout, measure_fn=measure)
                row.update({k: v for k, v in got.items() if k not in row}, status=got["status"])
                if got["status"] == "timeout" and timeout < args.timeout:
                    row["note"] += " (the rest of --budget-s)"
                parity(row)
        except Exception as exc:  # noqa: BLE001 - one failed configuration must not end the run
            row.update(status="error", note=f"{type(exc).__name__}: {exc}"[:500])
        row["wall_s"] = round(time.monotonic() - started, 1)
        results.append(row)
        write(results)
        print(_line(row), flush=True)
        if "traceback" in row:
            print(row["traceback"], flush=True)
    return results


def _line(r: dict) -> str:
    shape = f"T={r['T']} H={r['H']} V={r['V']}" if r["H"] else f"T={r['T']} V={r['V']}"
    label = f"{r['case']} {shape} {r['dtype']} {r['method']}"
    if r["status"] != "ok":
        return f"{label}: {r['status']}: {str(r.get('note', ''))[:300]}"
    text = (f"{label}: {r['peak_bytes'] / 2**20:,.0f} MiB above the inputs = {r['ratio']:.2f} x floor, "
            f"{r['time_s'] * 1e3:.1f} ms/step (first call {r['first_call_s']:.1f} s)")
    if "parity" in r:
        text += f", |rel| {r['parity']:.1e}{'' if r['parity_ok'] else ' PARITY OFF'}"
    if (note := graphpass_note(r)[0]) is not None:
        text += f"; graphpass: {note}"
    return text + f" [{r['wall_s']:.0f} s]"


def table(results: list[dict]) -> str:
    from tabulate import tabulate

    def inductor_of(r):
        return next((o for o in results if o["case"] == r["case"] and o["method"] == "inductor"
                     and o["status"] == "ok"), None)

    rows = []
    for r in sorted(results, key=lambda r: ([c.name for c in CASES].index(r["case"]), METHODS.index(r["method"]))):
        ok, ind = r["status"] == "ok", inductor_of(r)
        grads = [r[k] for k in ("hidden_grad_rel", "weight_grad_rel", "logits_grad_rel") if k in r]
        rows.append([r["case"], r["T"], r["H"] or "", r["V"], r["dtype"], r["method"],
                     f"{r['peak_bytes'] / 2**20:,.0f}" if ok else "", f"{r['ratio']:.2f}" if ok else "",
                     f"{r['time_s'] * 1e3:,.1f}" if ok else "",
                     f"{r['time_s'] / ind['time_s']:.2f}" if ok and ind else "",
                     f"{r['first_call_s']:.1f}" if ok else "",
                     f"{r['loss_rel']:.1e}" if "loss_rel" in r else "", f"{max(grads):.1e}" if grads else "",
                     "; ".join(filter(None, ["ok" if r.get("parity_ok", True) else "PARITY OFF", graphpass_note(r)[0]]))
                     if ok else f"{r['status']}: {str(r.get('note', ''))[:70]}"])
    return tabulate(rows, headers=["case", "T", "H", "V", "dtype", "method", "peak MiB", "x floor", "step ms",
                                   "x inductor", "1st call s", "loss rel", "grad rel", "status"],
                    disable_numparse=True)


def failures(results: list[dict], smoke: bool) -> list[dict]:
    """What makes the run fail: a method that did not run (on a GPU an OOM or a spent budget is a
    measurement, not a failure), parity off, or graphpass rewriting nothing."""
    bad = FAILED if smoke else ("error", "timeout")
    return [r for r in results if r["status"] in bad or r.get("parity_ok") is False
            or graphpass_note(r)[1]]


def versions() -> dict:
    """Versions of torch (and its CUDA) and of the libraries compared, where installed."""
    import importlib.metadata

    import torch

    out = dict(torch=torch.__version__, cuda=torch.version.cuda)
    for name in ("triton", "liger-kernel", "cut-cross-entropy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true",
                   help=f"tiny shapes {SMOKE_SHAPES} on the CPU, --compiler aot_eager unless given; exit 1 on any failure")
    p.add_argument("--cases", nargs="+", default=[c.name for c in CASES], choices=[c.name for c in CASES])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--budget-s", type=float, default=None, help="wall-clock seconds for all workers (default 420; smoke 600)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per worker before it is killed")
    p.add_argument("--steps", type=int, default=5, help="most timed steps per method (after the warm-up)")
    p.add_argument("--step-budget", type=float, default=10.0, help="seconds of timed steps per method")
    p.add_argument("--compiler", default=None, help="the inductor method's backend and graphpass's inner compiler "
                                                    "(default inductor; smoke aot_eager)")
    p.add_argument("--sol", action="store_true", help="logits case: time the speed of light after each step (x SoL)")
    p.add_argument("--out", type=Path, default=None, help=f"JSON (default {RESULTS}; smoke: a temporary file)")
    p.add_argument("--commit", default=None, help="the commit measured, recorded where git cannot say (a copied tree)")
    args = p.parse_args(argv)
    args.device = "cpu" if args.cpu_smoke else "cuda"
    args.compiler = args.compiler or ("aot_eager" if args.cpu_smoke else "inductor")
    if args.budget_s is None:
        args.budget_s = 600.0 if args.cpu_smoke else 420.0
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="bench_gpu_smoke_")) / "gpu.json" if args.cpu_smoke else RESULTS
    return args


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here (python -m bench.gpu --cpu-smoke runs the same code on the CPU)")
        return 2
    machine = machine_info.machine_description()
    provenance = machine_info.provenance()
    provenance["commit"] = args.commit or provenance["commit"]
    header = dict(machine=machine, versions=versions(), **provenance,
                  command=" ".join(["python -m bench.gpu", *(argv if argv is not None else sys.argv[1:])]),
                  started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  cpu_smoke=args.cpu_smoke, compiler=args.compiler, budget_s=args.budget_s,
                  parity_tolerance=PARITY_TOLERANCE)
    print(f"bench.gpu: {machine}; {header['versions']}; budget {args.budget_s:.0f} s; -> {args.out}", flush=True)
    t0 = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write(results, complete=False):
        tmp = args.out.with_suffix(".tmp")  # a reader (or a kill mid-write) never sees half a file
        tmp.write_text(json.dumps(dict(header, elapsed_s=round(time.monotonic() - t0), complete=complete,
                                       results=results), indent=1, default=str) + "\n")
        os.replace(tmp, args.out)

    results = run(args, write)
    write(results, complete=True)
    print()
    print(table(results))
    bad = failures(results, args.cpu_smoke)
    for r in bad:
        print(f"FAILED {_line(r)}")
    print(f"\nJSON: {args.out} ({time.monotonic() - t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
