"""Run one (workload, method, shape, dtype) in a fresh process and measure it.

Parent side: `run_isolated(spec)` forks a worker from a server that has imported torch and the
compilers once, with a timeout, and returns the worker's result (`python -m bench.harness.isolate
--worker SPEC` runs one by hand). Worker side: the fork runs `measure_fn(spec)`, by default the
suite's `bench.harness.measure.measure`, and sends its result back (an exception becomes a result
with status "error").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import traceback
from pathlib import Path

from bench.harness.measure import measure
from bench.harness.spec import Spec

REPO = Path(__file__).resolve().parent.parent.parent
RESULT_TAG = "BENCH_RESULT "


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


# Worker side -------------------------------------------------------------------------------------


def _measure_or_error(spec: Spec, measure_fn=None) -> dict:
    try:
        return (measure_fn or measure)(spec)
    except Exception as exc:  # reported to the parent as a result, not a crash
        # The traceback's end too: a run on a lent GPU may be the only one for a while.
        return dict(status="error", note=f"{type(exc).__name__}: {exc}"[:500],
                    traceback=traceback.format_exc()[-3000:])


def _worker_main(spec_json: str):
    result = _measure_or_error(Spec(**json.loads(spec_json)))
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", required=True, help="JSON Spec; prints one BENCH_RESULT line")
    _worker_main(parser.parse_args().worker)
