"""Where a step's time goes on a GPU: one `bench.gpu` case under torch's profiler, per chunk size.

    python -m bench.gpu_profile --case logits_ppo --chunk-sizes 0 2048 4096 --out DIR
    python -m bench.gpu_profile --case lm_head_ce --chunk-sizes 0 4096 --tile-layouts width-rows rows-width
    python -m bench.gpu_profile --case lm_head_ce --methods graphpass inductor --cpu-smoke

For each (method, chunk size: 0 is graphpass's own choice, tile layout) in one process: compile and
warm up, time a few steps with CUDA events, take one step's peak above the inputs, then profile one
step: the GPU's busy time (the sum of its kernels' times) against the step's, and the kernels that
took the most. A step much longer than its kernels is the host's: launches, Python chunk loops.
The tables go to stdout and to `DIR/profile_<case>.txt`; no parity here (`bench.gpu` checks it).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

from bench import gpu, lm_head
from bench.harness.meters import timed
from graphpass.ops.lm_head import LinearHeadProgram


def step_function(case: gpu.Case, method: str, chunk_size: int | None, device: str, compiler: str):
    """(a zero-argument step, loss and backward, of `method` on `case`'s inputs; the method's notes),
    built as `bench.gpu`'s workers build them (`bench.lm_head.build`, `bench.workloads.methods`)."""
    from bench.harness.spec import torch_dtype
    from bench.workloads import losses
    from bench.workloads.methods import METHODS

    if case.kind == "lm_head":
        spec = lm_head.HeadSpec(case.workload, method, case.T, case.H, case.V, case.dtype, device=device,
                                inner=compiler, chunk_size=chunk_size)
        fn, notes = lm_head.build(spec)
        batch = lm_head.make_inputs(spec)
        args, leaves = [batch[k] for k in lm_head.FIELDS], [batch["hidden"], batch["weight"]]
    else:
        workload = losses.Workload.parse(case.workload)
        fn, notes = METHODS[method].build(workload, compiler, chunk_size)
        batch = losses.make_batch(case.T, case.V, torch_dtype(case.dtype), device, workload.temperature)
        args, leaves = [batch[k] for k in losses.BATCH_FIELDS], [batch["logits"]]

    def step():
        for leaf in leaves:
            leaf.grad = None
        fn(*args).backward()

    return step, notes


def _peak_bytes(step, device: str) -> int | None:
    """Bytes one step allocates above what is allocated before it, on a GPU (None on the CPU)."""
    if device != "cuda":
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def profile(step, device: str, rows: int = 12) -> tuple[float, float, str]:
    """(the step's seconds, its kernels' busy seconds, the table of its costliest kernels)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        seconds = timed(step, device)
    events = prof.key_averages()
    # Self time: the kernels themselves, not the ops and compiled regions around them.
    attribute = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    # The kernels' own rows (a CPU op's device time counts the kernels it launched again).
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6 if device == "cuda" else seconds
    table = events.table(sort_by=attribute, row_limit=rows, max_name_column_width=60)
    return seconds, busy, table


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="logits_ppo", choices=[c.name for c in gpu.CASES])
    p.add_argument("--methods", nargs="+", default=["graphpass"], choices=["graphpass", "inductor", "eager"])
    p.add_argument("--chunk-sizes", nargs="+", type=int, default=[0], help="graphpass's rows per chunk (0: its own)")
    p.add_argument("--tile-layouts", nargs="+", default=["width-rows"], choices=["width-rows", "rows-width"],
                   help="lm_head cases: how a vocabulary tile's logits are stored (LinearHeadProgram.tiles_column_major)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cpu-smoke", action="store_true", help=f"the case at {gpu.SMOKE_SHAPES} on the CPU")
    p.add_argument("--out", type=Path, default=None, help="folder for profile_<case>.txt")
    args = p.parse_args(argv)
    device, compiler = ("cpu", "aot_eager") if args.cpu_smoke else ("cuda", "inductor")
    case = next(c for c in gpu.CASES if c.name == args.case)
    if args.cpu_smoke:
        case = dataclasses.replace(case, **gpu.SMOKE_SHAPES[case.kind])
    lines = []
    layouts = args.tile_layouts if case.kind == "lm_head" else ["width-rows"]
    configurations = [(method, chunk, layout) for method in args.methods
                      for chunk in (args.chunk_sizes if method == "graphpass" else [0])
                      for layout in (layouts if method == "graphpass" else ["width-rows"])]
    for method, chunk, layout in configurations:
        LinearHeadProgram.tiles_column_major = layout == "width-rows"
        step, notes = step_function(case, method, chunk or None, device, compiler)
        first = timed(step, device)
        times = [timed(step, device) for _ in range(args.steps)]
        peak = _peak_bytes(step, device)
        seconds, busy, table = profile(step, device)
        chunk_rows = notes().get("chunk_rows")
        floor = f" = {peak / case.floor_bytes:.2f} x floor" if peak is not None else ""
        head = (f"== {case.name} {method} chunk_size={chunk or 'own'}"
                + (f" tiles {layout}" if method == "graphpass" and case.kind == "lm_head" else "")
                + f": {statistics.median(times) * 1e3:.1f} ms/step (first {first:.1f} s); "
                + (f"peak {peak / 2**20:,.0f} MiB above the inputs{floor}; " if peak is not None else "")
                + f"profiled step {seconds * 1e3:.1f} ms, kernels busy {busy * 1e3:.1f} ms"
                + (f"; chunk rows {chunk_rows}" if chunk_rows else ""))
        print(head, table, sep="\n", flush=True)
        lines += [head, table]
        del step, notes
        if device == "cuda":
            torch.cuda.empty_cache()
    LinearHeadProgram.tiles_column_major = True
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"profile_{case.name}.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
