"""How fast graphpass's per-chunk kernels run on one GPU, against the bandwidth limit and the libraries.

    python -m bench.gpu_kernels                 # one CUDA GPU, <= 4 minutes: bench/results/gpu_kernels.json
    python -m bench.gpu_kernels --cpu-smoke     # the same code at tiny shapes on the CPU (Triton's interpreter; CI)

Three parts, each row `{"case", "method", "time_ms", "x_floor", "x_sol", ...}` in the JSON's `results`:

1. **The logits op's kernels** (`logits_ppo`: log-prob and entropy at temperature 0.7; `logits_ce`;
   `logits_kl`: KL against a teacher's logits), bf16 `[T, V]`, forward and backward separately, each
   kernel called once over all rows: `inductor` (today's per-chunk kernels: compiled on a 2-row sample
   with the CPU's options), `step0` (compiled for the rows they run, rows reduced in one program,
   2-D tiles: `_torch_api.kernel_options`) and `generated` (`graphpass.kernels`). `tb_s` is the bytes
   the kernel must move (the wide inputs read; in backward also the gradient written) over its time;
   `x_sol` that time over the same bytes at the GPU's measured copy bandwidth (`copy_tb_s`). Parity:
   the outputs and the gradient on the first rows against float64 (relative to the largest value).
2. **cuBLAS at the lm_head's GEMM shapes** (`gemm_logits`, `gemm_dh`, `gemm_dw`): TF/s.
3. **Steps** (`ce_hidden`, `ppo_hidden`, `logits_ppo_step`): `bench.gpu`'s workers (graphpass with its
   generated kernels, inductor, eager, Liger-Kernel and cut-cross-entropy where they import), `x_floor`
   their peak over the floor.
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # before Triton is imported (importing torch's compiler imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

from bench import gpu  # noqa: E402
from bench.harness import machine_info  # noqa: E402
from bench.harness.meters import timed  # noqa: E402
from bench.workloads import kernel_programs as kp  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "gpu_kernels.json"
# case -> the program of `kernel_programs` it runs
KERNEL_CASES = {"logits_ppo": "LogProbEntropy", "logits_ce": "LogProb", "logits_kl": "TeacherKL"}
KERNEL_METHODS = ("inductor", "step0", "generated")
SHAPES = {"gpu": dict(T=8192, V=151936, gemm=(16384, 2048, 248320)),
          "smoke": dict(T=16, V=1000, gemm=(64, 32, 256))}
STEP_CASES = {"lm_head_ce": "ce_hidden", "lm_head_ppo": "ppo_hidden", "logits_ppo": "logits_ppo_step"}
PARITY_ROWS = 64


def _median_time(fn, device: str, repeats: int) -> float:
    fn()  # compiled and warm
    return statistics.median(timed(fn, device) for _ in range(repeats))


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (one read and one write per byte)."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = _median_time(lambda: dst.copy_(src), device, 5)
    return 2 * nbytes / seconds


def _kernels(method: str, program, n: int, rows: int, compiler: str, device: str):
    """The forward and backward kernels of `program` for `method`."""
    from graphpass import _torch_api
    from graphpass.kernels.rowwise import GeneratedKernel

    graphs = {"forward": program.forward, "backward": program.backward(tuple(range(n)), (0,))}
    if method == "generated":
        return {kind: GeneratedKernel(graph, kind) for kind, graph in graphs.items()}
    width = program.args[0].shape[-1]
    if method == "inductor":  # before step 0: the CPU's options everywhere, compiled on 2 rows
        with mock.patch.object(_torch_api, "kernel_options", lambda inner, device: {"triton.cudagraphs": False}):
            return {kind: _torch_api.compile_kernel(graph, compiler, wide_width=width)
                    for kind, graph in graphs.items()}
    return {kind: _torch_api.compile_kernel(graph, compiler, wide_width=width, rows=rows)
            for kind, graph in graphs.items()}


def _reference(name: str, args, grads):
    """Float64 outputs and logits' gradient of program `name` on `args` (the first rows)."""
    import torch

    module = kp.program_class(name)(torch.float64)
    args = [a.double() if a.is_floating_point() else a for a in args]
    logits = args[0].detach().clone().requires_grad_(True)
    outs = module(logits, *args[1:])
    torch.autograd.backward(list(outs), [g.double() for g in grads])
    return [o.detach() for o in outs], logits.grad


def _relative(value, exact) -> float:
    return ((value.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30)).item()


def kernel_rows(args, copy_bytes_per_s: float) -> list[dict]:
    """Part 1: each logits case's forward and backward kernels per method."""
    import torch

    shape = SHAPES["smoke" if args.cpu_smoke else "gpu"]
    rows_out = []
    for case, name in KERNEL_CASES.items():
        generator = torch.Generator().manual_seed(0)
        host = kp.arguments(name, shape["T"], shape["V"], torch.bfloat16, generator)
        inputs = [a.to(args.device) for a in host]
        program, n = kp.split(name, host, device=args.device)
        grads = [torch.randn(shape["T"], 1, generator=generator).to(args.device) for _ in range(n)]
        wide_bytes = sum(a.numel() * a.element_size() for a in inputs if a.ndim == 2 and a.shape[-1] == shape["V"])
        gradient_bytes = inputs[0].numel() * inputs[0].element_size()
        subset = min(PARITY_ROWS, shape["T"])
        exact_outs, exact_grad = _reference(name, [a[:subset] if a.ndim == 2 else a for a in host],
                                            [g[:subset].cpu() for g in grads])
        methods = KERNEL_METHODS if case == "logits_ppo" or args.cpu_smoke else ("generated",)
        for method in methods:
            base = dict(case=case, program=name, method=method, T=shape["T"], V=shape["V"], dtype="bf16",
                        x_floor=None, copy_tb_s=round(copy_bytes_per_s / 1e12, 3))
            try:
                kernels = _kernels(method, program, n, shape["T"], args.compiler, args.device)
                with torch.no_grad():
                    results = kernels["forward"](*inputs)
                    out = torch.empty_like(inputs[0])

                    def backward():
                        kernels["backward"](*inputs, *results[n:], *grads, out)

                    forward_s = _median_time(lambda: kernels["forward"](*inputs), args.device, args.repeats)
                    backward_s = _median_time(backward, args.device, args.repeats)
                parity = max([_relative(o[:subset].cpu(), e) for o, e in zip(results[:n], exact_outs)]
                             + [_relative(out[:subset].cpu(), exact_grad)])
                for direction, seconds, nbytes in (("forward", forward_s, wide_bytes),
                                                   ("backward", backward_s, wide_bytes + gradient_bytes)):
                    sol = nbytes / copy_bytes_per_s
                    rows_out.append(dict(base, direction=direction, status="ok", time_ms=seconds * 1e3,
                                         tb_s=nbytes / seconds / 1e12, x_sol=seconds / sol, parity=parity))
                    print(_line(rows_out[-1]), flush=True)
            except Exception as exc:  # noqa: BLE001 - one method failing must not end the run
                rows_out.append(dict(base, status="error", time_ms=None, x_sol=None,
                                     note=f"{type(exc).__name__}: {exc}"[:500]))
                print(_line(rows_out[-1]), flush=True)
    return rows_out


def gemm_rows(args) -> list[dict]:
    """Part 2: the lm_head's three GEMM shapes in bf16 (fp32 accumulation), as TF/s."""
    import torch

    t, h, v = SHAPES["smoke" if args.cpu_smoke else "gpu"]["gemm"]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    hidden = torch.randn(t, h, dtype=dtype, device=args.device)
    weight = torch.randn(v, h, dtype=dtype, device=args.device)
    logits = torch.randn(t, v, dtype=dtype, device=args.device)
    shapes = {"gemm_logits": lambda: hidden @ weight.T, "gemm_dh": lambda: logits @ weight,
              "gemm_dw": lambda: logits.T @ hidden}
    out = []
    for case, fn in shapes.items():
        seconds = _median_time(fn, args.device, args.repeats)
        out.append(dict(case=case, method="cublas" if args.device == "cuda" else "cpu", T=t, H=h, V=v,
                        status="ok", time_ms=seconds * 1e3, tf_s=2 * t * h * v / seconds / 1e12, x_floor=None,
                        x_sol=None))
        print(_line(out[-1]), flush=True)
    return out


def step_rows(args) -> list[dict]:
    """Part 3: `bench.gpu`'s steps, renamed into this file's cases."""
    argv = ["--cases", *args.step_cases, "--methods", *args.step_methods, "--budget-s", str(args.steps_budget_s),
            "--out", str(Path(tempfile.mkdtemp(prefix="bench_gpu_kernels_")) / "gpu.json")]
    gpu_args = gpu.parse_args((["--cpu-smoke"] if args.cpu_smoke else []) + argv)
    out = []
    for r in gpu.run(gpu_args, lambda results: None):
        ok = r["status"] == "ok"
        out.append(dict(case=STEP_CASES[r["case"]], method=r["method"], status=r["status"], T=r["T"], H=r["H"],
                        V=r["V"], dtype=r["dtype"], time_ms=r["time_s"] * 1e3 if ok else None,
                        x_floor=r.get("ratio"), x_sol=r.get("x_sol"), parity=r.get("parity"),
                        note=r.get("note") or gpu.graphpass_note(r)[0]))
    return out


def _line(r: dict) -> str:
    label = " ".join(str(r[k]) for k in ("case", "method", "direction") if r.get(k))
    if r.get("status") != "ok":
        return f"{label}: {r.get('status')}: {r.get('note', '')}"
    extra = "".join(f", {k} {r[k]:.3g}" for k in ("tb_s", "x_sol", "tf_s", "x_floor", "parity") if r.get(k) is not None)
    return f"{label}: {r['time_ms']:.3f} ms{extra}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true",
                   help=f"shapes {SHAPES['smoke']} on the CPU, Triton's interpreter")
    p.add_argument("--parts", nargs="+", default=["kernels", "gemm", "steps"], choices=["kernels", "gemm", "steps"])
    p.add_argument("--repeats", type=int, default=5, help="timed calls per kernel (the median counts)")
    p.add_argument("--steps-budget-s", type=float, default=None, help="seconds for part 3 (default 150; smoke 120)")
    p.add_argument("--out", type=Path, default=None, help=f"JSON (default {RESULTS}; smoke: a temporary file)")
    args = p.parse_args(argv)
    args.device = "cpu" if args.cpu_smoke else "cuda"
    args.compiler = "aot_eager" if args.cpu_smoke else "inductor"
    args.step_cases = ["logits_ppo"] if args.cpu_smoke else list(STEP_CASES)
    args.step_methods = ["graphpass", "eager"] if args.cpu_smoke else list(gpu.METHODS)
    if args.steps_budget_s is None:
        args.steps_budget_s = 120.0 if args.cpu_smoke else 150.0
    if args.cpu_smoke:
        args.repeats = 1
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="bench_gpu_kernels_smoke_")) / "gpu_kernels.json" \
            if args.cpu_smoke else RESULTS
    return args


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu_kernels: no CUDA device here (--cpu-smoke runs the same code on the CPU)")
        return 2
    started = time.monotonic()
    header = dict(machine=machine_info.machine_description(), versions=gpu.versions(), **machine_info.provenance(),
                  command=" ".join(["python -m bench.gpu_kernels", *(argv if argv is not None else sys.argv[1:])]),
                  started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  cpu_smoke=args.cpu_smoke)
    print(f"bench.gpu_kernels: {header['machine']}; {header['versions']} -> {args.out}", flush=True)
    shape = SHAPES["smoke" if args.cpu_smoke else "gpu"]
    bandwidth = copy_bandwidth(args.device, shape["T"] * shape["V"] * 2)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    results = []
    parts = {"kernels": lambda: kernel_rows(args, bandwidth), "gemm": lambda: gemm_rows(args),
             "steps": lambda: step_rows(args)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # The interpreter's bf16 casts as a GPU's (it truncates them).
    with kp.rounded_bf16_casts() if args.cpu_smoke else contextlib.nullcontext():
        for part in args.parts:
            results += parts[part]()
            document = dict(header, copy_tb_s=bandwidth / 1e12, results=results,
                            elapsed_s=round(time.monotonic() - started))
            args.out.write_text(json.dumps(document, indent=1, default=str) + "\n")
    bad = [r for r in results if r["status"] not in ("ok", "unavailable", "n/a")
           or (r.get("parity") is not None and r["parity"] > gpu.PARITY_TOLERANCE["bf16"])]
    for r in bad:
        print(f"FAILED {_line(r)}")
    print(f"JSON: {args.out} ({time.monotonic() - started:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
