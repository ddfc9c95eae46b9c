"""Run one (workload, method, shape, dtype) in a fresh process and measure it.

Parent side: `run_isolated(spec)` forks a worker from a server that has imported torch and the
compilers once, with a timeout, and returns the worker's result (`python -m bench.harness.isolate
--worker SPEC` runs one by hand). Worker side: build inputs, warm up (compile), then per timed
step measure the peak bytes above the pre-step baseline and the wall time, then compare the last
step's loss and logits.grad with an eager fp32 reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
RESULT_TAG = "BENCH_RESULT "
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one worker measures."""

    workload: str
    method: str
    T: int
    V: int
    dtype: str
    device: str = "cpu"
    steps: int = 5
    """Most timed steps; fewer when one step is slow (see `time_budget_s`)."""
    time_budget_s: float = 20.0
    """Timed steps stop once they would exceed this (at least `min_steps` run)."""
    min_steps: int = 2
    reference: bool = True
    reference_cache: str | None = None
    """A directory where the eager reference of this configuration is kept for the next method."""
    seed: int = 0
    sol: bool = True
    """Time the machine's speed of light (`bench.sol.Passes`) after each step, on the same logits."""
    warmup: bool = False
    """Time every method's first call apart, not only a compiled method's (a GPU's first eager
    step also pays for cuBLAS's set-up and the caching allocator's first cudaMallocs)."""
    compiler: str = "inductor"
    """The `inductor` method's backend and graphpass's inner compiler (`aot_eager`: a quick smoke)."""
    reference_dtype: str = "fp32"
    """The dtype of the blockwise reference (`fp64`: against float64, as `bench.gpu` compares)."""

    @property
    def reference_key(self) -> str:
        """What the eager reference depends on (not the method)."""
        return f"{self.workload}_T{self.T}_V{self.V}_{self.dtype}_{self.device}_seed{self.seed}_ref{self.reference_dtype}"

    @property
    def floor_bytes(self) -> int:
        return self.T * self.V * DTYPE_BYTES[self.dtype]

    @property
    def input_bytes(self) -> int:
        return self.floor_bytes + self.T * 4 * 6  # logits + the [T] side inputs


DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def torch_dtype(name: str):
    """The torch dtype of a bench dtype name (fp32, bf16, fp16, fp64)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[name]


# Parent side -------------------------------------------------------------------------------------


# Modules every worker needs: importing torch, Dynamo and inductor costs ~10 s per process on a
# small CPU, so a fork server imports them once and each worker is forked from it.
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "graphpass.backend", "bench.workloads.methods")
_server = None


def _fork_server():
    """The multiprocessing context whose fork server has PRELOAD imported (started on first use)."""
    global _server
    if _server is None:
        import multiprocessing

        # Read by glibc when the fork server starts, so every worker inherits it. A fixed mmap
        # threshold keeps glibc from serving freed multi-MiB tensors out of its heap (its dynamic
        # threshold grows up to 32 MiB), where they would stay resident and inflate RSS at small
        # shapes; every buffer >= 1 MiB is then mapped on allocation and unmapped on free.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))
        # Workers are forked from the server, so the server must never initialise CUDA: none of
        # PRELOAD's imports calls into torch.cuda (checked by importing them with torch.cuda
        # pretending a GPU and every driver-touching function recording its calls: none was
        # called), and should one ever ask `torch.cuda.is_available()`, this makes it ask NVML,
        # which leaves the forked workers able to initialise CUDA themselves.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        _server = multiprocessing.get_context("forkserver")
        _server.set_forkserver_preload(["bench.harness.preload"])  # PRELOAD, each import's failure left to the worker
    return _server


def run_isolated(spec: Spec, timeout_s: float, cache_dir: str | None = None, measure_fn=None) -> dict:
    """Run `spec` in its own process; a timeout or crash becomes a result with that status.

    `cache_dir`: the worker's inductor cache (an empty one: its first call compiles from scratch;
    one an earlier worker filled: a warm cache).
    `measure_fn(spec) -> dict` (a module-level function) replaces `measure` for other specs
    (`bench.lm_head`).
    """
    import tempfile

    base = dict(dataclasses.asdict(spec), floor_bytes=spec.floor_bytes)
    base.pop("reference_cache", None)
    context = _fork_server()
    receive, send = context.Pipe(duplex=False)
    with tempfile.NamedTemporaryFile(prefix="bench_worker_", suffix=".log") as log:
        worker = context.Process(target=_forked_worker, args=(spec, cache_dir, log.name, send, measure_fn))
        worker.start()
        send.close()
        try:
            if receive.poll(timeout_s):
                return dict(base, **receive.recv())
            status, why = "timeout", f"killed after {timeout_s:.0f} s"
        except EOFError:  # the worker died without a result
            worker.join()
            status = "error"
            why = ("killed by SIGKILL (out of memory?)" if worker.exitcode == -signal.SIGKILL
                   else f"exit {worker.exitcode}")
        finally:
            _kill_group(worker)
        tail = " | ".join(Path(log.name).read_text(errors="replace").strip().splitlines()[-3:])
    return dict(base, status=status, note=f"{why}: {tail}"[:500] if status == "error" else why)


def _kill_group(worker) -> None:
    """Kill the worker and its children (inductor's compile workers), which share its session."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    worker.join()


def _forked_worker(spec: Spec, cache_dir: str | None, log_path: str, send, measure_fn=None) -> None:
    """Worker body in a fresh fork: own session, output to `log_path`, result through `send`."""
    os.setsid()
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    if cache_dir is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    send.send(_measure_or_error(spec, measure_fn or measure))


def default_device() -> str:
    """The benchmarks' device when none is given: cuda when present, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def fill_device_and_memory_limit(args) -> None:
    """`args.device` (None: `default_device()`) and `args.mem_limit_gib` (None: 80 % of RAM or GPU memory)."""
    import torch

    if args.device is None:
        args.device = default_device()
    if args.mem_limit_gib is None:
        total = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else total_ram_bytes()
        args.mem_limit_gib = 0.8 * total / GiB


def provenance() -> dict:
    """The commit measured and the files that differed from it (graphpass, passes, bench)."""
    import subprocess

    repo = Path(__file__).resolve().parent.parent.parent

    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--", "graphpass", "passes", "bench")
    return dict(commit=git("rev-parse", "HEAD"), uncommitted=status.splitlines() if status else [])


def machine_description() -> str:
    """One line: CPU model, cores, RAM, torch version (and GPU when present)."""
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [cpu, f"{os.cpu_count()} cores", f"{total_ram_bytes() / GiB:.0f} GiB RAM", f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    return ", ".join(parts)


def total_ram_bytes() -> int:
    """MemTotal from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


# Worker side -------------------------------------------------------------------------------------


class CpuMeter:
    """Peak RSS above a baseline: large tensors are mmap-backed, so RSS tracks live tensor bytes."""

    def __init__(self):
        import ctypes

        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:
            self._trim = lambda _pad: None

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field} in /proc/self/status")

    def reset(self) -> int:
        """Return freed heap to the OS, reset VmHWM to the current RSS, and return that baseline."""
        import gc

        gc.collect()
        # Freed small blocks stay resident in malloc's heap; trimming them keeps the baseline
        # honest (otherwise the step could reuse them without raising RSS).
        self._trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        self.base = self._status("VmRSS:")
        return self.base

    def peak(self) -> int:
        return self._status("VmHWM:") - self.base

    @staticmethod
    def sync():
        pass


class CudaMeter:
    """Peak allocated CUDA bytes above the allocated bytes before the step."""

    def __init__(self):
        import torch

        self.torch = torch

    def reset(self) -> int:
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        self.base = self.torch.cuda.memory_allocated()
        return self.base

    def peak(self) -> int:
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated() - self.base

    def sync(self):
        self.torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    """Seconds of `fn()`; CUDA events on a GPU."""
    import torch

    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed_steps(step, clear, device: str, steps: int, first_call: bool = True) -> tuple[float | None, list, list]:
    """(seconds of a first call, not counted for the peak, or None; each of `steps` steps' seconds;
    each step's peak bytes above its start). `step()` runs one forward+backward; `clear()` drops
    what the last one left (its gradients, its loss) before the next step's baseline is taken."""
    meter = CudaMeter() if device.startswith("cuda") else CpuMeter()

    def synced():
        step()
        meter.sync()

    first_s = _timed(synced, device) if first_call else None
    times, peaks = [], []
    for _ in range(steps):
        clear()
        meter.reset()
        times.append(_timed(synced, device))
        peaks.append(meter.peak())
    return first_s, times, peaks


def measure(spec: Spec) -> dict:
    """The worker's measurement of one configuration."""
    import torch

    from bench.workloads import losses
    from bench.workloads.methods import METHODS, warning

    torch.manual_seed(spec.seed)
    workload = losses.Workload.parse(spec.workload)
    method = METHODS[spec.method]
    if (why := method.available()) is not None:
        return dict(status="unavailable", note=why)
    batch = losses.make_batch(spec.T, spec.V, torch_dtype(spec.dtype), spec.device, workload.temperature, spec.seed)
    args = [batch[k] for k in losses.BATCH_FIELDS]
    logits = batch["logits"]
    fn, notes = method.build(workload, spec.compiler)
    meter = CudaMeter() if spec.device.startswith("cuda") else CpuMeter()
    loss = None

    def step():
        nonlocal loss
        logits.grad = None
        loss = fn(*args)
        loss.backward()
        meter.sync()

    # A compiled method's first call compiles: it is the warm-up, timed apart. An eager method has
    # nothing to warm up, so its first call is already a measured step.
    first_call_s = _timed(step, spec.device) if method.compiled or spec.warmup else None
    passes = None
    if spec.sol:
        from bench.sol import Passes

        passes = Passes(logits.detach(), spec.seed)
        passes.step()  # compiles the backward pass
    times, peaks, sol_times = [], [], []
    while len(times) < spec.min_steps or (
        len(times) < spec.steps and sum(times) + statistics.median(times) <= spec.time_budget_s
    ):
        # Drop the previous step's outputs before the baseline: the baseline is inputs only.
        logits.grad, loss = None, None
        if passes is not None:  # before the baseline: its memory is not the method's
            sol_times.append(sum(passes.step()))
        baseline = meter.reset()
        times.append(_timed(step, spec.device))
        peaks.append(meter.peak())
    if first_call_s is None:
        first_call_s = times[0]
    result = dict(
        status="ok",
        peak_bytes=max(peaks),
        peaks=peaks,
        ratio=max(peaks) / spec.floor_bytes,
        time_s=statistics.median(times),
        times=times,
        first_call_s=first_call_s,
        baseline_bytes=baseline,
        loss=float(loss),
    )
    if sol_times:
        # Paired: each step over the SoL step right before it, so a drifting machine cancels out.
        result.update(sol_s=statistics.median(sol_times), sol_times=sol_times,
                      x_sol=statistics.median(t / s for t, s in zip(times, sol_times)))
    result["notes"] = notes()
    result["warning"] = warning(result["notes"])
    if spec.reference:
        grad, loss_value = logits.grad.detach(), float(loss)
        loss = None
        cache = os.path.join(spec.reference_cache, spec.reference_key + ".pt") if spec.reference_cache else None
        if spec.method == "eager" and spec.dtype == spec.reference_dtype == "fp32":  # it is the reference
            result.update(losses.eager_fp32_as_reference(batch, loss_value, grad, cache))
        else:
            result.update(losses.reference_diffs(workload, batch, loss_value, grad, cache,
                                                 torch_dtype(spec.reference_dtype)))
    return result


def _measure_or_error(spec: Spec, measure_fn=None) -> dict:
    try:
        return (measure_fn or measure)(spec)
    except Exception as exc:  # reported to the parent as a result, not a crash
        return dict(status="error", note=f"{type(exc).__name__}: {exc}"[:500])


def _worker_main(spec_json: str):
    result = _measure_or_error(Spec(**json.loads(spec_json)))
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", required=True, help="JSON Spec; prints one BENCH_RESULT line")
    _worker_main(parser.parse_args().worker)
