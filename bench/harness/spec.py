"""What one worker measures: `Spec`, a (workload, method, shape, dtype) and how to time it, the
configuration that `bench.harness.measure` runs and `bench.harness.isolate.run_isolated` forks a
worker for (other benchmarks reuse it or bring their own); and the benchmarks' dtype names,
`DTYPE_BYTES` and `torch_dtype`.
"""

from __future__ import annotations

import dataclasses


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
    """Time the machine's speed of light (`bench.harness.sol_passes.Passes`) after each step, on the same logits."""
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
