"""What was measured where, for every result's header: this machine (`machine_description`,
`total_ram_bytes`, `GiB`), the benchmarks' default device and memory limit (`default_device`,
`fill_device_and_memory_limit`) and the code measured (`provenance`: the commit and the files that
differed from it).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

GiB = 2**30


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
