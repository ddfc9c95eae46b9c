"""Run a function on N ranks of a gloo (or NCCL) process group, each its own process, and get its results (tests, `bench.tp`).

    results = run_ranks(check, world_size=2, args=(seed,), timeout_s=60)
    results = run_ranks(check, world_size=2, backend="nccl")   # one GPU per rank: cuda:<rank>

`check(rank, world_size, *args)` runs in a spawned process (so it must be a module-level function
of an importable module; spawned, never forked, so that each rank initialises CUDA itself) after
`init_process_group(backend)` on 127.0.0.1 with a free port,
`TORCH_DISTRIBUTED_DEBUG=DETAIL` (mismatched collectives raise at once instead of hanging) and
`torch.set_num_threads(1)`; under NCCL the rank's current CUDA device is `cuda:<rank>`
(`device()` inside the rank gives it, or the CPU under gloo). Its return value (anything `torch.save` takes) comes back to the parent
in rank order. An exception in a rank is re-raised in the parent as `RankFailed` with that rank's
traceback text (the first rank to fail; the others' last lines follow); a rank still running at the deadline is killed, and the test fails saying which,
where each was (inside which logged collective, or computing since its last), its Python stack, and whether that
looks like a hang. The deadline follows the machine: `timeout_s` is a quiet machine's, stretched by the load.

Inside a rank, every collective called through `torch.distributed` is logged (name, shapes,
dtypes, reduce op, group size): `collective_log()` is the list so far, `collectives()` a context
manager whose value is the list of those issued inside it, so that tests can assert that every
rank issued the same ones.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import os
import signal
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _functional_collectives
import torch.multiprocessing as mp

#: The `torch.distributed` functions a rank logs (those that exist in this torch).
LOGGED_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                      "reduce_scatter", "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather",
                      "scatter", "barrier", "all_gather_object", "broadcast_object_list", "send", "recv")

_LOG: list[tuple] = []
_DEPTH = [0]  # a logged collective that calls another (a deprecated alias) is logged once
_STATUS: list[str] = []  # inside a rank: the file saying which collective it is in, for the parent


class RankFailed(AssertionError):
    """A rank raised, crashed or overran the deadline; the message carries its traceback text."""


def backend_for(device: str) -> str:
    """The process-group backend for ranks on `device` ("cpu" or "cuda"): NCCL on CUDA, else gloo."""
    return "nccl" if device.startswith("cuda") else "gloo"


def device() -> torch.device:
    """Inside a rank: where its tensors live (its GPU under NCCL, the CPU under gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize() -> None:
    """Inside a rank: wait for its GPU's queued work (nothing under gloo); before every clock read."""
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- inside a rank ----------------------------------------------------------------------------
def collective_log() -> list[tuple]:
    """Every collective this rank issued so far: (name, shapes, dtypes, op, group size)."""
    return list(_LOG)


@contextlib.contextmanager
def collectives():
    """The collectives issued inside the block: `with collectives() as log: ...; log` is a list."""
    start = len(_LOG)
    issued: list[tuple] = []
    try:
        yield issued
    finally:
        issued.extend(_LOG[start:])


def _describe(value):
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype).replace("torch.", ""))
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    return None


def _logged(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():  # traced into a graph (one Dynamo does not remap): no log
            return fn(*args, **kwargs)
        if _DEPTH[0] == 0:
            group = kwargs.get("group")
            size = dist.get_world_size(group) if dist.is_initialized() else 1
            tensors = tuple(d for d in map(_describe, args) if d is not None)
            op = kwargs.get("op")
            _LOG.append((name, tensors, None if op is None else str(op), size))
            _write_status("in", name)
        _DEPTH[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                _write_status("after", name)

    wrapper.__graphpass_logged__ = True
    return wrapper


def _write_status(where: str, name: str) -> None:
    """"in NAME" or "after NAME", the collective's number and the time: what the parent can say of
    a rank still running at the deadline (a few microseconds per collective)."""
    if _STATUS:
        with open(_STATUS[0], "w") as f:
            f.write(f"{where} {name} {len(_LOG)} {time.time()}")


def _install_collective_log() -> None:
    """Wrap the collectives of `torch.distributed` (and of `distributed_c10d`, where code may import
    them from) so every call is logged before it runs."""
    c10d = dist.distributed_c10d
    for name in LOGGED_COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "__graphpass_logged__", False):
            continue
        wrapped = _logged(name, fn)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
        # Dynamo traces a collective it finds in this table as its functional form (the log is of
        # eager calls): so it must find the wrapper there too, whichever was imported first.
        remaps = _functional_collectives.traceable_collective_remaps
        if fn in remaps:
            remaps[wrapped] = remaps[fn]


def _entry(rank, fn, world_size, port, args, out_dir, pg_timeout_s, backend="gloo"):
    """The spawned process: set up the group, run `fn`, write its result or traceback."""
    path = os.path.join(out_dir, f"rank{rank}.pt")
    failed_at = None
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), TORCH_DISTRIBUTED_DEBUG="DETAIL")
        _install_collective_log()
        _STATUS[:] = [os.path.join(out_dir, f"rank{rank}.status")]
        # The parent asks for this rank's Python stack (SIGUSR1) before it kills it at the deadline.
        stack_file = open(os.path.join(out_dir, f"rank{rank}.stack"), "w")  # noqa: SIM115 - the process's lifetime
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, before NCCL binds its communicator
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            result = ("ok", fn(rank, world_size, *args))
        except BaseException:
            # When it failed, not when it reported: leaving the group below makes its peers fail.
            failed_at = time.time()
            raise
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
        result = ("error", traceback.format_exc(), failed_at or time.time())
    tmp = path + ".tmp"
    try:
        torch.save(result, tmp)
    except Exception:  # noqa: BLE001 - an unpicklable result is the rank's error
        torch.save(("error", "the rank's result could not be saved:\n" + traceback.format_exc(), time.time()), tmp)
    os.replace(tmp, path)  # the parent sees a complete file or none


# ---- the parent -------------------------------------------------------------------------------
# A loaded machine stretches a deadline by its load (1-minute load average over CPUs) up to this
# factor; DEADLINE_SCALE (environment) multiplies every deadline, for a machine known to be slow.
MAX_LOAD_STRETCH = 4.0


def load_stretch() -> float:
    """How much slower than a quiet machine this one runs now: load average / CPUs, in [1, MAX_LOAD_STRETCH]."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return min(MAX_LOAD_STRETCH, max(1.0, load / (os.cpu_count() or 1)))


def run_ranks(fn, world_size: int, args: tuple = (), *, timeout_s: float = 60.0, grace_s: float = 5.0,
              backend: str = "gloo") -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks of a `backend` group; its results in rank order.

    `timeout_s` is what the ranks may take on a quiet machine: the deadline follows the machine,
    each second of waiting counting 1 / `load_stretch()` (times `DEADLINE_SCALE` from the
    environment). Raises `RankFailed` naming the rank, with its traceback, if one raised or
    crashed, and naming the ranks still running (after killing them) if they did not all finish
    by the deadline, with what is known of each (in which logged collective, or computing since
    its last one). A rank that raised leaves its peers `grace_s` to finish before they are killed
    (they may be waiting in a collective it never reached). NCCL needs a GPU per rank: fewer raise
    ValueError at once.
    """
    timeout_s *= float(os.environ.get("DEADLINE_SCALE", "1") or 1)
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"{world_size} NCCL ranks need {world_size} GPUs; this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="graphpass-ranks-") as out_dir:
        # Each rank's process-group timeout ends after the longest deadline: a rank waiting for a
        # slow peer must not fail first; at the deadline the parent takes every rank's stack.
        pg_timeout = timeout_s * MAX_LOAD_STRETCH + 10.0
        context = mp.start_processes(_entry, args=(fn, world_size, free_port(), args, out_dir, pg_timeout, backend),
                                     nprocs=world_size, join=False, start_method="spawn")
        start = last = time.monotonic()
        budget_used, peak_stretch = 0.0, 1.0
        failed_at = None
        results: dict[int, tuple] = {}
        try:
            while True:
                for rank in range(world_size):
                    path = os.path.join(out_dir, f"rank{rank}.pt")
                    if rank not in results and os.path.exists(path):
                        results[rank] = torch.load(path, weights_only=False)
                        if results[rank][0] == "error" and failed_at is None:
                            failed_at = time.monotonic()
                for rank, process in enumerate(context.processes):
                    if rank not in results and process.exitcode is not None:
                        # Exited without a result file: killed or crashed (a segfault, os._exit).
                        results[rank] = ("error", f"process exited with code {process.exitcode} without a result",
                                         time.time())
                        failed_at = failed_at or time.monotonic()
                if len(results) == world_size:
                    break
                now = time.monotonic()
                stretch = load_stretch()
                budget_used, last, peak_stretch = budget_used + (now - last) / stretch, now, max(peak_stretch, stretch)
                if budget_used > timeout_s or (failed_at is not None and now > failed_at + grace_s):
                    break
                time.sleep(0.05)
            statuses = {rank: _read_status(out_dir, rank) for rank in range(world_size)}
            waited = time.monotonic() - start
            stacks = _stacks(context.processes, out_dir, [r for r in range(world_size) if r not in results])
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join(timeout=10)

    failed = sorted((results[rank][2], rank) for rank in results if results[rank][0] == "error")
    if failed:
        # The first rank to fail is the cause; its peers usually fail after it, waiting in a
        # collective it left.
        first = failed[0][1]
        others = "".join(f"\n(rank {rank} failed after it: {results[rank][1].strip().splitlines()[-1][:200]})"
                         for _, rank in failed[1:])
        raise RankFailed(f"rank {first} of {world_size} failed:\n{results[first][1]}{others}")
    missing = [rank for rank in range(world_size) if rank not in results]
    if missing:
        raise RankFailed(_overran(missing, world_size, timeout_s, waited, peak_stretch, statuses) + stacks)
    return [results[rank][1] for rank in range(world_size)]


def _stacks(processes, out_dir: str, ranks: list[int]) -> str:
    """The Python stacks of the ranks still running (faulthandler, on SIGUSR1), innermost frame first."""
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(processes[rank].pid, signal.SIGUSR1)
    time.sleep(0.5 if ranks else 0)
    text = ""
    for rank in ranks:
        with contextlib.suppress(OSError):
            with open(os.path.join(out_dir, f"rank{rank}.stack")) as f:
                frames = [line.strip() for line in f.read().splitlines() if line.strip().startswith("File ")]
            if frames:
                text += f"\nrank {rank}'s stack (innermost first): " + " <- ".join(frames[:6])
    return text


def _read_status(out_dir: str, rank: int) -> tuple | None:
    """(where, collective, number, time) of a rank's last logged collective, or None before any."""
    try:
        with open(os.path.join(out_dir, f"rank{rank}.status")) as f:
            where, name, number, at = f.read().split()
        return where, name, int(number), float(at)
    except (OSError, ValueError):
        return None


def _overran(missing: list[int], world_size: int, timeout_s: float, waited: float, stretch: float,
             statuses: dict) -> str:
    """What a deadline can tell: which ranks ran on, where each was, and whether that looks like a hang."""
    now = time.time()

    def where(rank):
        st = statuses.get(rank)
        if st is None:
            return f"rank {rank}: no torch.distributed collective yet"
        state, name, number, at = st
        if state == "in":
            return f"rank {rank}: inside {name} (collective #{number}) for {now - at:.0f} s"
        return f"rank {rank}: computing, {now - at:.0f} s after {name} (collective #{number})"

    waiting = [r for r in range(world_size) if statuses.get(r) and statuses[r][0] == "in"]
    others = [r for r in range(world_size) if r not in waiting]
    calls = {statuses[r][1:3] for r in waiting}
    if len(calls) > 1:
        verdict = "the ranks wait in different collectives: a hang (they issue different ones)"
    elif waiting and others:
        verdict = (f"ranks {waiting} wait in a collective ranks {others} have not reached: a hang if they never "
                   "do, else they compute slowly")
    elif waiting:
        verdict = "every rank waits in the same collective: a hang inside it, or a slow transport"
    else:
        verdict = ("no rank waits in a torch.distributed collective: slow computing, or a hang this cannot see "
                   "(functional collectives are not logged); rerun on a quiet machine or raise timeout_s "
                   "(DEADLINE_SCALE=2 doubles every deadline)")
    return (f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s on a quiet machine "
            f"({waited:.0f} s waited, load up to {stretch:.1f} x the CPUs) and were killed; "
            + "; ".join(where(r) for r in range(world_size)) + f". {verdict}")
