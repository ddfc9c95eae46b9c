"""The machine's speed of light for a log-prob/entropy loss over logits [T, V], measured.

    python -m bench.sol                     # the suite's grid, on this machine (cuda when present, else cpu)
    python -m bench.sol --T 4096 --V 32768 --dtypes fp32 --out /tmp/sol.json

No implementation of the loss can do less than two passes over the logits: forward, one read that
yields each row's log-sum-exp (an online max / sum-exp, whatever else the loss needs from the same
read); backward, one read of the logits and one write of their gradient. Both passes are compiled
by inductor into one fused kernel each (`forward_pass`, `backward_pass`) and timed like a method
(median over steps after a warm-up; CUDA events on a GPU), each configuration in its own forked
worker (`bench.harness.isolate.run_isolated`). Inductor's CPU kernel reads a row twice (its max, then its
sum): on a CPU the forward is also timed over row blocks that fit in the last-level cache, where
the second read is not from memory, and the faster of the two counts. A method's "x SoL" is its step time over `sol_s`, the sum
of the two, measured in the same run. The backward pass writes a new tensor each call, as a
training step's gradient is (on CPU that includes faulting in its pages); `--device cuda` times
the same kernels with CUDA events.

`python -m bench.suite` measures it in each method's worker, one SoL step right after each of the
method's steps on the same logits (`Passes`), and reports the method's "x SoL", the median of its
step time over the SoL step's, next to its "x floor" (`--no-sol` skips it): paired steps, so a
machine whose speed drifts (shared, its memory ballooned) moves both alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness.isolate import Spec, _timed, default_device, machine_description, provenance, run_isolated, torch_dtype

GRID_T = (1024, 4096, 16384)
GRID_V = (32768, 151936)
DTYPES = ("fp32", "bf16")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "sol.json"


def forward_pass(logits, temperature: float):
    """Each row's log-sum-exp of `logits / temperature`, in fp32: one read of the logits."""
    return (logits.float() / temperature).logsumexp(-1)


def backward_pass(logits, lse, target, grad_logprob, temperature: float):
    """The log-prob's gradient `(onehot - softmax) * g / temperature`, in the logits' dtype: one read
    of the logits, one write of the gradient."""
    x = logits.float() / temperature
    onehot = (target[:, None] == _columns(x)).float()
    return ((onehot - (x - lse[:, None]).exp()) * (grad_logprob / temperature)[:, None]).to(logits.dtype)


def _columns(x):
    import torch

    return torch.arange(x.shape[-1], device=x.device)[None, :]


class Passes:
    """The two passes over given logits `[T, V]`, compiled; `step()` times one of each."""

    TEMPERATURE = 0.7

    def __init__(self, logits, seed: int = 0):
        import torch

        g = torch.Generator(device="cpu").manual_seed(seed)
        self.logits = logits
        self.device = logits.device
        self.target = torch.randint(0, logits.shape[-1], (logits.shape[0],), generator=g).to(self.device)
        self.grad_logprob = torch.randn(logits.shape[0], generator=g).to(self.device)
        self.forward = torch.compile(forward_pass, dynamic=False)
        self.backward = torch.compile(backward_pass, dynamic=False)
        # On a CPU, the forward's two reads of a row (its max, then its sum of exponentials) cost
        # one from memory when the rows come in blocks that stay in the last-level cache: the
        # limit is the faster of the whole tensor and such blocks.
        rows = max(1, cache_bytes() // 4 // (logits.shape[-1] * 4))
        self.blocks = [logits] if self.device.type != "cpu" or rows >= logits.shape[0] else list(logits.split(rows))
        with torch.no_grad():
            self.lse = self.forward(logits, self.TEMPERATURE)
            self._forward_blocks()  # compiles the blocks' shapes

    def backward_max_abs_error(self, rows: int = 64) -> float:
        """The compiled backward pass against autograd's gradient, on the first rows."""
        import torch

        t, rows = self.TEMPERATURE, min(rows, self.logits.shape[0])
        with torch.no_grad():
            grad = self.backward(self.logits, self.lse, self.target, self.grad_logprob, t)[:rows]
        expected = torch.func.grad(lambda x: (torch.log_softmax(x.float() / t, -1).gather(
            1, self.target[:rows, None])[:, 0] * self.grad_logprob[:rows]).sum())(self.logits[:rows])
        return float((grad.float() - expected.float()).abs().max())

    def step(self) -> tuple[float, float]:
        """Seconds of one forward pass and one backward pass (its gradient dropped at once)."""
        import torch

        t = self.TEMPERATURE
        with torch.no_grad():
            forward_s = _timed(lambda: self.forward(self.logits, t), str(self.device))
            if len(self.blocks) > 1:
                forward_s = min(forward_s, _timed(self._forward_blocks, str(self.device)))
            backward_s = _timed(lambda: self.backward(self.logits, self.lse, self.target, self.grad_logprob, t),
                                str(self.device))
        return forward_s, backward_s


    def _forward_blocks(self):
        return [self.forward(block, self.TEMPERATURE) for block in self.blocks]


def cache_bytes() -> int:
    """This CPU's last-level cache (32 MiB where sysfs does not say)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"), reverse=True):
        try:
            size = (index / "size").read_text().strip()
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            continue
    return 32 * 2**20


def measure(spec: Spec) -> dict:
    """The worker: time the two passes at `spec`'s shape (the `measure_fn` of `run_isolated`)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(spec.seed)
    logits = torch.randn(spec.T, spec.V, generator=g).to(device=spec.device, dtype=torch_dtype(spec.dtype))
    passes = Passes(logits, spec.seed)
    error = passes.backward_max_abs_error()
    fwd, bwd = [], []
    started = time.monotonic()
    for step in range(max(spec.min_steps, spec.steps)):
        f, b = passes.step()
        fwd.append(f)
        bwd.append(b)
        if step + 1 >= spec.min_steps and time.monotonic() - started > spec.time_budget_s:
            break
    forward_s, backward_s = statistics.median(fwd), statistics.median(bwd)
    return dict(status="ok", forward_s=forward_s, backward_s=backward_s, sol_s=forward_s + backward_s,
                steps=len(fwd), backward_max_abs_error=error, load=os.getloadavg()[0])


def run(T=GRID_T, V=GRID_V, dtypes=DTYPES, device: str | None = None, steps: int = 5,
        timeout_s: float = 600) -> list[dict]:
    """SoL of every configuration (on `device`, None: `default_device()`, as the suite), each in
    its own worker; skipped where the logits and their gradient would not fit in half the RAM."""
    from bench.harness.isolate import DTYPE_BYTES, total_ram_bytes

    device = device or default_device()
    rows = []
    for t in T:
        for v in V:
            for dtype in dtypes:
                spec = Spec("sol", "sol", t, v, dtype, device=device, steps=steps, reference=False)
                if device == "cpu" and 2 * t * v * DTYPE_BYTES[dtype] + 8 * t * v > total_ram_bytes() / 2:
                    rows.append(dict(dataclasses.asdict(spec), status="skipped", note="does not fit in half the RAM"))
                    continue
                rows.append(run_isolated(spec, timeout_s, measure_fn=measure))
    return rows


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    lines = [[r["T"], r["V"], r["dtype"], r["device"],
              *((f"{1e3 * r['forward_s']:.1f}", f"{1e3 * r['backward_s']:.1f}", f"{1e3 * r['sol_s']:.1f}",
                 f"{r['backward_max_abs_error']:.1e}") if r.get("status") == "ok" else ("", "", "", "")),
              r.get("status") if r.get("status") == "ok" else f"{r.get('status')}: {r.get('note', '')}"]
             for r in rows]
    return tabulate(lines, headers=["T", "V", "dtype", "device", "forward ms", "backward ms", "SoL ms",
                                    "|grad err|", "status"], tablefmt="simple")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=list(GRID_T))
    parser.add_argument("--V", type=int, nargs="+", default=list(GRID_V))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, as bench.suite)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    started = time.monotonic()
    print(f"bench.sol: {machine_description()}", flush=True)
    rows = run(args.T, args.V, args.dtypes, args.device, args.steps)
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(machine=machine_description(), **provenance(), results=rows,
                                        wall_s=time.monotonic() - started), indent=1, default=str) + "\n")
    print(f"\nwrote {args.out} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
