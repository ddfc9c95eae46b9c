"""What the ops do differently on the CPU and on an accelerator: reading a value on the host.

On the CPU a tensor's value is on the host already. On CUDA reading one (`bool(t)`, `.item()`,
`nonzero`) waits for every queued kernel and cannot be captured in a CUDA graph, so the ops'
hot paths never do it there: checks become device-side asserts, and a gradient is not tested
for being all zero. Every device but the CPU takes the accelerator's path, `meta` included,
which is how the CPU-only test machines exercise it (reading a meta tensor's value raises).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from graphpass import _torch_api


def host_reads_are_free(device: torch.device) -> bool:
    """True where reading a tensor's value costs no synchronisation: the CPU."""
    return device.type == "cpu"


def mm_into(acc: torch.Tensor, left: torch.Tensor, right: torch.Tensor, *, accumulate: bool) -> None:
    """`acc = left @ right`, or `acc += left @ right`, computed in `acc`'s dtype (fp32 for bf16
    operands). On an accelerator the operands stay as they are (bf16 on tensor cores) with the
    accumulation in `acc`'s dtype (`out_dtype`); the CPU's mm has no `out_dtype`, so there they are
    upcast first (a block-sized copy)."""
    if left.dtype != acc.dtype and host_reads_are_free(acc.device):
        left, right = left.to(acc.dtype), right.to(acc.dtype)
    if left.dtype == acc.dtype:
        if accumulate:
            acc.addmm_(left, right)
        else:
            torch.mm(left, right, out=acc)
    elif accumulate:
        torch.addmm(acc, left, right, out_dtype=acc.dtype, out=acc)
    else:
        torch.mm(left, right, out_dtype=acc.dtype, out=acc)


_FASTEST: dict = {}  # key -> index of the way `fastest` chose
_clock = time.perf_counter


def fastest(key, ways: tuple[Callable[[], torch.Tensor], ...]) -> torch.Tensor:
    """Run the fastest of `ways`, equivalent computations of one result (the same product,
    associated differently), timed at the first call for `key` on the host: which form of a
    product the CPU's BLAS runs fastest depends on the processor (on an AMD EPYC the weight as the
    left operand ran 30 % faster, on a Xeon 16 % slower). Then each way runs twice, alternating
    (the least time counts), and the result returned is the chosen way's."""
    if key not in _FASTEST:
        times = [float("inf")] * len(ways)
        for _ in range(2):
            for i, way in enumerate(ways):
                start = _clock()
                way()
                times[i] = min(times[i], _clock() - start)
        _FASTEST[key] = times.index(min(times))
    return ways[_FASTEST[key]]()


def check(ok: torch.Tensor, describe: Callable[[], Exception], message: str) -> None:
    """Raise `describe()` where the 0-d bool `ok` is false: at once on the CPU (the exception may
    read values to say which); elsewhere a device-side assert with `message`, no host sync."""
    if host_reads_are_free(ok.device):
        if not bool(ok):
            raise describe()
    else:
        _torch_api.assert_async(ok, message)


def known_zero(grad: torch.Tensor | None) -> bool:
    """True when `grad` is absent, or known all zero without a host sync (on the CPU: checked), so
    its contribution can be skipped. On an accelerator a present gradient counts."""
    if grad is None:
        return True
    return host_reads_are_free(grad.device) and not bool(grad.any())


#: Tags of an op CUDA graphs must not capture: it runs a Python chunk loop, compiles its kernels at
#: its first call and keeps host state. Inductor partitions a graph around such an op and captures
#: the rest (with graph partitioning off it runs the graph without CUDA graphs and logs the op).
NOT_CUDAGRAPH_CAPTURABLE = tuple(tag for tag in (getattr(torch.Tag, "cudagraph_unsafe", None),) if tag is not None)
