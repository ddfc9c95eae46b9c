"""Benchmark suite: peak memory and time of RL losses over logits [T, V], per method, each run isolated.

    python -m bench.suite                 # full grid; table on stdout, JSON + PNGs in bench/results/
    python -m bench.suite --quick         # one small configuration per method (CI), into a temporary directory

The grid (T x V x dtype x method) runs the PPO loss of issue 2; the other workloads (GRPO, entropy
coefficient 0.01, temperature 1.0) run at one shape and the first dtype. Configurations that cannot fit this machine's
memory are reported as "OOM (predicted)" and not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import report
from bench.harness.isolate import run_isolated
from bench.harness.machine_info import GiB, fill_device_and_memory_limit, machine_description
from bench.harness.spec import Spec
from bench.workloads.losses import Workload
from bench.workloads.methods import METHODS

MAIN_WORKLOAD = "ppo-t0.7-e0"
RESULTS = Path(__file__).parent / "results"
GRID_T = (1024, 4096, 16384)
GRID_V = (32768, 151936)
DTYPES = ("fp32", "bf16")
# Each workload and each value of temperature and entropy coefficient appears at least once; the
# full cross (--variants all) costs twice as many compilations.
VARIANTS = ("ppo-t0.7-e0.01", "grpo-t1-e0")
ALL_VARIANTS = tuple(f"{k}-t{t}-e{e}" for k in ("ppo", "grpo") for t in ("0.7", "1") for e in ("0", "0.01"))
VARIANT_SHAPE = (1024, 32768)
QUICK_SHAPE = (512, 8192)
# Per-process overhead (interpreter, torch, inductor) when nothing was measured yet.
DEFAULT_OVERHEAD = int(0.5 * GiB)


def plan(args) -> list[Spec]:
    """Specs in increasing size, so every prediction can lean on a smaller measured configuration."""
    common = dict(device=args.device, steps=args.steps, time_budget_s=args.step_budget, sol=not args.no_sol)
    if args.quick:
        T, V = QUICK_SHAPE
        return [Spec(MAIN_WORKLOAD, m, T, V, "fp32", steps=3, time_budget_s=5, device=args.device, sol=not args.no_sol)
                for m in args.methods]
    specs = [Spec(w, m, T, V, d, **common)
             for w in args.workloads for T in args.T for V in args.V for d in args.dtypes for m in args.methods]
    T, V = VARIANT_SHAPE
    variants = ALL_VARIANTS if args.variants == "all" else () if args.variants == "none" else VARIANTS
    # The variants change the loss, not the data: one dtype (the grid covers both).
    specs += [Spec(w, m, T, V, args.dtypes[0], **common)
              for w in variants if w not in args.workloads for m in args.methods]
    # Big configurations: one step costs up to tens of seconds on a small CPU, so time fewer of them.
    return sorted((dataclasses.replace(s, min_steps=1) if s.T * s.V >= 2**27 else s for s in specs),
                  key=lambda s: (s.workload not in args.workloads, s.T * s.V))


@functools.lru_cache(maxsize=None)
def model_peaks(workload: str, T: int, V: int, dtype: str) -> dict[str, int]:
    """graphpass.memory's estimate for eager and graphpass, from fake tensors (empty if unavailable)."""
    try:
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        from bench.workloads import losses
        from graphpass.config import Config
        from graphpass.memory import estimate_rewrite
        from graphpass.pipeline import rewrite_graph
        from graphpass.records import GraphRecord

        loss = Workload.parse(workload).loss_fn(losses.logprob_entropy)

        def fn(logits, targets, mask, advantages, old_logp, ref_logp):  # a tuple out, as Dynamo's graphs
            return (loss(logits, targets, mask, advantages, old_logp, ref_logp),)

        with FakeTensorMode():
            batch = losses.make_batch(T, V, getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]),
                                      "cpu", Workload.parse(workload).temperature)
        inputs = [batch[k] for k in losses.BATCH_FIELDS]
        est = estimate_rewrite(rewrite_graph(torch.fx.symbolic_trace(fn), inputs, Config(), GraphRecord(0)))
        return {"eager": est.before.peak_bytes, "graphpass": est.after.peak_bytes}
    except Exception as exc:  # the model is optional: fall back to measured ratios
        print(f"  (memory model unavailable for {workload} T={T} V={V} {dtype}: {type(exc).__name__}: {exc})"[:300],
              file=sys.stderr)
        return {}


def predict(spec: Spec, done: list[dict], use_model: bool) -> tuple[int, str] | None:
    """Predicted peak above baseline and where it came from; None when nothing to predict from."""
    if use_model and (peak := model_peaks(spec.workload, spec.T, spec.V, spec.dtype).get(spec.method)):
        return peak, "memory model"
    same = [r for r in done if r["status"] == "ok" and r["method"] == spec.method and r["dtype"] == spec.dtype
            and r["floor_bytes"] <= spec.floor_bytes]
    if not same:
        return None
    # Nearest smaller measured configuration; the same workload if possible.
    near = max(same, key=lambda r: (r["floor_bytes"], r["workload"] == spec.workload))
    return int(near["ratio"] * spec.floor_bytes), f"{near['ratio']:.2f} x floor measured at T={near['T']} V={near['V']}"


def overhead(method: str, done: list[dict]) -> int:
    """Resident bytes of a worker besides its inputs, as measured for this method."""
    seen = [r["baseline_bytes"] - Spec(r["workload"], r["method"], r["T"], r["V"], r["dtype"]).input_bytes
            for r in done if r["status"] == "ok" and r["method"] == method]
    return max(seen, default=DEFAULT_OVERHEAD)


def run(args) -> list[dict]:
    """Run or predict every planned spec, printing one line per result."""
    # The methods of one configuration share its eager reference: the first computes it.
    with tempfile.TemporaryDirectory(prefix="bench_reference_") as reference_dir:
        return _run(args, reference_dir)


def _run(args, reference_dir: str) -> list[dict]:
    done: list[dict] = []
    limit = int(args.mem_limit_gib * GiB)
    for spec in plan(args):
        if (inert := _inert(spec, done)) is not None:
            done.append(dict(dataclasses.asdict(spec), floor_bytes=spec.floor_bytes, status="skipped", note=inert))
            print(f"{_label(spec)}: skipped ({inert})", flush=True)
            continue
        pred = predict(spec, done, use_model=not args.no_model and spec.device == "cpu")
        if pred is not None:
            peak, source = pred
            # The reference check after the step holds logits.grad plus ~1 GiB of fp32 blocks.
            ref_bytes = min(spec.T * spec.V * 4 * 6, GiB)  # reference_diffs' fp32 block
            need = spec.input_bytes + overhead(spec.method, done) + max(peak, spec.floor_bytes + ref_bytes)
            if need > limit:
                done.append(dict(dataclasses.asdict(spec), floor_bytes=spec.floor_bytes, status="oom_predicted",
                                 predicted_peak_bytes=peak,
                                 note=f"{need / GiB:.1f} GiB > {args.mem_limit_gib:.1f} GiB limit, peak from {source}"))
                print(f"{_label(spec)}: OOM (predicted, {source})", flush=True)
                continue
        t0 = time.time()
        # Generous: the timeout guards against hangs, not slowness (~60 ns per element-step).
        timeout_s = args.timeout + 6e-7 * spec.T * spec.V * (spec.steps + 4)
        cache = tempfile.mkdtemp(prefix="bench_inductor_") if args.cold_compile else None
        r = run_isolated(dataclasses.replace(spec, reference_cache=reference_dir), timeout_s=timeout_s,
                         cache_dir=cache)
        if cache is not None:
            if r["status"] == "ok" and METHODS[spec.method].compiled:
                # The same compile in a new process, from the cache the cold one filled.
                warm = run_isolated(dataclasses.replace(spec, steps=1, min_steps=1, reference=False, sol=False),
                                    timeout_s=timeout_s, cache_dir=cache)
                if warm["status"] == "ok":
                    r["warm_first_call_s"] = warm["first_call_s"]
            shutil.rmtree(cache, ignore_errors=True)
        done.append(r)
        if r["status"] == "ok":
            print(f"{_label(spec)}: {r['ratio']:.2f} x floor, {r['time_s'] * 1e3:.0f} ms"
                  f" [{time.time() - t0:.0f} s]" + (f" WARNING {r['warning']}" if r.get("warning") else ""), flush=True)
        else:
            print(f"{_label(spec)}: {r['status']}: {r.get('note', '')[:300]}", flush=True)
    return done


def _inert(spec: Spec, done: list[dict]) -> str | None:
    """Why running `spec` would only repeat inductor, or None.

    The auto-chunker starts from an "amplifier" node (an op whose output dwarfs its inputs, such as
    the lm_head matmul); a loss over given logits has none, whatever its shape, dtype or loss
    terms, so once it declined on one configuration its other runs are inductor's, minus the time.
    """
    for r in done:
        if (r["status"] == "ok" and r["method"] == spec.method == "autochunk"
                and r.get("warning") == "auto-chunker did not apply"):
            return f"auto-chunker did not apply to {r['workload']} at T={r['T']} V={r['V']} {r['dtype']}: same graph as inductor"
    return None


def _label(s: Spec) -> str:
    return f"{s.workload} T={s.T} V={s.V} {s.dtype} {s.method}"


def _workload_key(key: str) -> str:
    try:
        return Workload.parse(key).key
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"one {QUICK_SHAPE} fp32 configuration per method (CI)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for JSON + PNGs (default bench/results; with --quick a new temporary directory)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--T", nargs="+", type=int, default=list(GRID_T))
    p.add_argument("--V", nargs="+", type=int, default=list(GRID_V))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--workloads", nargs="+", default=[MAIN_WORKLOAD], type=_workload_key,
                   help=f"losses run over the whole grid (default {MAIN_WORKLOAD}: PPO, entropy logged; "
                        "e.g. ppo-t0.7-e0.01 keeps the entropy's gradient)")
    p.add_argument("--variants", choices=("some", "all", "none"), default="some",
                   help=f"other workloads at T,V={VARIANT_SHAPE}: some={VARIANTS}, all=every combination")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--steps", type=int, default=5, help="most timed steps per configuration")
    p.add_argument("--step-budget", type=float, default=5,
                   help="seconds of timed steps per configuration (at least 2 steps; 1 from 2^27 elements)")
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="predicted resident bytes above this are not run (default: 80%% of RAM / GPU memory)")
    p.add_argument("--cold-compile", action="store_true",
                   help="empty inductor cache per worker: first-call times are full compiles, then a second "
                        "worker's first call from that cache (warm) (slower run)")
    p.add_argument("--no-model", action="store_true", help="predict from measured ratios only")
    p.add_argument("--no-sol", action="store_true",
                   help="do not time the speed of light (bench.harness.sol_passes) after each step for x SoL")
    p.add_argument("--timeout", type=float, default=300, help="base seconds per worker before it is killed")
    args = p.parse_args(argv)
    fill_device_and_memory_limit(args)
    if args.out is None:  # a quick run is a check: it writes nothing into the checkout
        args.out = Path(tempfile.mkdtemp(prefix="graphpass-suite-quick-")) if args.quick else RESULTS
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    machine = machine_description()
    print(f"machine: {machine}; memory limit {args.mem_limit_gib:.1f} GiB", flush=True)
    t0 = time.time()
    results = run(args)
    elapsed = time.time() - t0
    print()
    print(report.table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "quick" if args.quick else "suite"
    report.write_json(args.out / f"{name}.json", machine, results, elapsed_s=round(elapsed),
                      command=" ".join(["python -m bench.suite", *(argv if argv is not None else sys.argv[1:])]))
    made = report.plots(results, MAIN_WORKLOAD, args.out, args.methods, prefix=f"{name}_" if args.quick else "")
    print(f"\nJSON: {args.out / f'{name}.json'}")
    print(made if isinstance(made, str) else "plots: " + ", ".join(map(str, made)))
    print(f"elapsed: {elapsed / 60:.1f} min")
    failed = [r for r in results if r["status"] in ("error", "timeout")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
