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
traceback text (the first rank to fail; the others' last lines follow); a rank still running at the deadline is killed, and the test fails saying which.

Inside a rank, every collective called through `torch.distributed` is logged (name, shapes,
dtypes, reduce op, group size): `collective_log()` is the list so far, `collectives()` a context
manager whose value is the list of those issued inside it, so that tests can assert that every
rank issued the same ones.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: The `torch.distributed` functions a rank logs (those that exist in this torch).
LOGGED_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                      "reduce_scatter", "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather",
                      "scatter", "barrier", "all_gather_object", "broadcast_object_list", "send", "recv")

_LOG: list[tuple] = []
_DEPTH = [0]  # a logged collective that calls another (a deprecated alias) is logged once


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
        if _DEPTH[0] == 0:
            group = kwargs.get("group")
            size = dist.get_world_size(group) if dist.is_initialized() else 1
            tensors = tuple(d for d in map(_describe, args) if d is not None)
            op = kwargs.get("op")
            _LOG.append((name, tensors, None if op is None else str(op), size))
        _DEPTH[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1

    wrapper.__graphpass_logged__ = True
    return wrapper


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


def _entry(rank, fn, world_size, port, args, out_dir, pg_timeout_s, backend="gloo"):
    """The spawned process: set up the group, run `fn`, write its result or traceback."""
    path = os.path.join(out_dir, f"rank{rank}.pt")
    failed_at = None
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), TORCH_DISTRIBUTED_DEBUG="DETAIL")
        _install_collective_log()
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
def run_ranks(fn, world_size: int, args: tuple = (), *, timeout_s: float = 60.0, grace_s: float = 5.0,
              backend: str = "gloo") -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks of a `backend` group; its results in rank order.

    Raises `RankFailed` naming the rank, with its traceback, if one raised or crashed, and naming the
    ranks still running (after killing them) if they did not all finish within `timeout_s`. A rank
    that raised leaves its peers `grace_s` to finish before they are killed (they may be waiting
    in a collective it never reached). NCCL needs a GPU per rank: fewer raise ValueError at once.
    """
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"{world_size} NCCL ranks need {world_size} GPUs; this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="graphpass-ranks-") as out_dir:
        # Each rank's process-group timeout ends before the deadline, so that a hang in a
        # collective surfaces as that rank's own error, with a traceback, where gloo allows.
        pg_timeout = max(5.0, timeout_s - 10.0)
        context = mp.start_processes(_entry, args=(fn, world_size, free_port(), args, out_dir, pg_timeout, backend),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
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
                if now > deadline or (failed_at is not None and now > failed_at + grace_s):
                    break
                time.sleep(0.05)
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
        raise RankFailed(f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s and were killed "
                         "(a hang: ranks issuing different collectives?)")
    return [results[rank][1] for rank in range(world_size)]
