"""Meters of one step: peak bytes above a baseline (`CpuMeter`: RSS, `VmHWM` after `clear_refs`;
`CudaMeter`: `max_memory_allocated`) and wall time (`timed`, with CUDA events on a GPU;
`timed_steps`, a first call then steps each with its own peak), used by the harness's workers and by
the benchmarks that time their own steps (lm_head, tp, megatron, trl, distill).
"""

from __future__ import annotations

import time
from pathlib import Path


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


def timed(fn, device: str) -> float:
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

    first_s = timed(synced, device) if first_call else None
    times, peaks = [], []
    for _ in range(steps):
        clear()
        meter.reset()
        times.append(timed(synced, device))
        peaks.append(meter.peak())
    return first_s, times, peaks
