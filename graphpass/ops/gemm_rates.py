"""How fast this CPU multiplies a narrower-than-fp32 dtype: the measured rates the lm_head's schedule is chosen by.

A bf16 (or fp16) lm_head on the CPU computes its gradients either in two passes of GEMMs in the
weight's dtype, or in one pass whose accumulating product is computed from fp32 copies of its
operands (the CPU's mm has no fp32 output for bf16 operands: `devices.mm_into`). Which is faster
depends on the processor: on a Xeon with AMX a bf16 product ran 9 x faster than the fp32 one of its
copies; a processor without bf16 arithmetic may run bf16 no faster than fp32. So the op reads two
rates, measured on this machine (`GemmRates`):

- `native`: flop/s of `a @ b` with bf16 operands and result;
- `upcast`: flop/s of the same product from fp32 copies of the operands, the copies included.

Each is the best of `_REPEATS` products of `_SHAPE`, the two alternating (fair on a shared CPU);
about 0.1 s on a 2-core AMD EPYC. They are measured once per process and dtype, and kept on disk
in `$XDG_CACHE_HOME/graphpass/gemm_rates.json` (default `~/.cache`), keyed by the processor, the
torch version and the thread count (`machine_key`), so a machine's schedule is the same in every
process: deterministic given the cache. `GRAPHPASS_GEMM_RATES="native=2e11,upcast=8e10"` fixes both
rates for every dtype (tests; a machine one has measured), and nothing is measured or written.
Accelerators never come here: their bf16 products accumulate in fp32 (`out_dtype`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch

ENVIRONMENT_VARIABLE = "GRAPHPASS_GEMM_RATES"
# M, K, N of the measured product (1.07 GFLOP): an accumulating product of the one pass,
# `dW[tile] += dlogits[block, tile].T @ hidden[block]` for a 256-row block, a 2048-entry tile and
# H=1024, whose copies are as many elements per flop (1 / 2H) as the op's are.
_SHAPE = (2048, 256, 1024)
_REPEATS = 3
# CPU flags that decide how the BLAS multiplies bf16 and fp16 (AMX tiles, AVX512 dot products).
_KEY_FLAGS = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2")


@dataclasses.dataclass(frozen=True)
class GemmRates:
    """Flop/s of a product with narrow operands on this CPU: in their dtype, and from fp32 copies."""

    native: float
    upcast: float


_MEASURED: dict[str, GemmRates] = {}  # dtype name -> rates, this process's


def measured(dtype: torch.dtype) -> GemmRates:
    """The rates for `dtype` operands: fixed by the environment variable, else this process's,
    else the disk cache's for this machine, else measured now (and written to the cache)."""
    fixed = os.environ.get(ENVIRONMENT_VARIABLE)
    if fixed:
        return parse(fixed)
    name = str(dtype).removeprefix("torch.")
    if name not in _MEASURED:
        key = f"{machine_key()}|{name}"
        cache = _read_cache()
        try:
            _MEASURED[name] = GemmRates(native=float(cache[key]["native"]), upcast=float(cache[key]["upcast"]))
        except (KeyError, TypeError, ValueError):  # not cached for this machine, or an entry of another form

            _MEASURED[name] = measure(dtype)
            cache[key] = dataclasses.asdict(_MEASURED[name])
            _write_cache(cache)
    return _MEASURED[name]


def parse(text: str) -> GemmRates:
    """`GemmRates` from "native=2e11,upcast=8e10"; a one-line error for anything else."""
    try:
        fields = dict(part.split("=") for part in text.replace(" ", "").split(","))
        return GemmRates(native=float(fields.pop("native")), upcast=float(fields.pop("upcast")))
    except (KeyError, ValueError) as e:
        raise ValueError(f"graphpass: {ENVIRONMENT_VARIABLE} must read 'native=FLOPS,upcast=FLOPS', "
                         f"got {text!r}") from e


def measure(dtype: torch.dtype) -> GemmRates:
    """Time `_SHAPE`'s product with `dtype` operands, natively and from fp32 copies."""
    m, k, n = _SHAPE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(k, m, generator=generator).to(dtype).t()  # dlogits.T, as the op multiplies it
    b = torch.randn(k, n, generator=generator).to(dtype)
    ways = (lambda: torch.mm(a, b), lambda: torch.mm(a.float(), b.float()))
    best = [float("inf")] * len(ways)
    for counted in [False] + [True] * _REPEATS:  # the first round warms the BLAS up
        for i, way in enumerate(ways):
            start = time.perf_counter()
            way()
            if counted:
                best[i] = min(best[i], time.perf_counter() - start)
    flops = 2 * m * k * n
    return GemmRates(native=flops / best[0], upcast=flops / best[1])


def machine_key() -> str:
    """What the rates depend on: the processor's model and flags, torch's version, the threads."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                model = value.strip()
            elif name.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    present = ",".join(f for f in _KEY_FLAGS if f in flags)
    return f"{model}|{present}|torch {torch.__version__}|threads {torch.get_num_threads()}"


def cache_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "graphpass" / "gemm_rates.json"


def _read_cache() -> dict:
    try:
        cache = json.loads(cache_path().read_text())
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, unreadable or not JSON: measured again


def _write_cache(cache: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
        partial.replace(path)  # atomic: a process reading it sees the old file or the new one
    except OSError:
        pass  # a read-only home: measured again in the next process
