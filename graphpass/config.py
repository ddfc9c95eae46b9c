"""Configuration of the graphpass backend."""

from __future__ import annotations

import dataclasses

from graphpass.ops import chunk_sizes
from graphpass.passes import check_pass_names

INNER_COMPILERS = ("inductor", "aot_eager", "eager")


@dataclasses.dataclass(frozen=True)
class Config:
    """Options of `graphpass.Backend`; every field is validated on construction."""

    chunk_size: int | None = None
    """Rows (tokens) per chunk; None chooses it at run time from `chunk_budget_bytes`."""

    chunk_budget_bytes: int = chunk_sizes.DEFAULT_BUDGET_BYTES
    """Bytes of a chunk's temporaries when `chunk_size` is None: the least a one-device op's chunk
    gets (it grows with the floor), the most a vocab-parallel logits chunk gets on a CPU; the
    rule of each op is in `graphpass.ops.chunk_sizes`."""

    inner: str = "inductor"
    """Compiler for the rest of the graph and the per-chunk kernels: inductor, aot_eager or eager (with
    either of the last two the kernels run as their ATen graphs)."""

    strict: bool = False
    """Raise when a rewrite fails instead of running the graph unchanged."""

    report: bool = False
    """Print the memory-savings table for every compiled graph (also GRAPHPASS_REPORT=1)."""

    gradients_in_forward: bool = True
    """Where an lm_head site's loss is affine in sums of per-token terms (`graphpass.analysis.summed_loss`),
    compute its gradients in the forward pass, while each chunk's logits are at hand, instead of
    recomputing the logits in backward: three GEMMs instead of four. The gradients then exist from
    the forward on; False recomputes them in backward (a forward with grad that is never
    backpropagated then costs no GEMMs for them)."""

    generated_kernels: bool = True
    """On CUDA (with Triton installed), run the per-chunk kernels graphpass generates itself
    (`graphpass.kernels`: one read of each row forward, a 2-D tiled backward) wherever it can; a
    kernel it cannot generate is compiled by `inner`, the reason kept in the program's
    `kernel_notes`. False: `inner` compiles every kernel. No effect on the CPU."""

    never_worse: bool = True
    """Run a graph as written where the memory model (`graphpass.memory`) predicts its rewrite to
    peak above it (by more than an eighth and 1 MiB), the reason recorded. Graphs with tensor- or context-parallel sites are exempt:
    every rank must take the same decision, and their shapes may differ."""

    disable_passes: tuple[str, ...] = ()
    """Names of passes to skip, e.g. ("chunk_rowwise_regions_pass",) to run the graph unrewritten.

    The passes, in order: see `graphpass.passes.PASS_NAMES`. An unknown name is an error here.
    """

    @classmethod
    def from_options(cls, **options) -> "Config":
        """A Config from keyword options; an unknown one is a one-line error naming the valid ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in options if k not in names]
        if unknown:
            raise TypeError(f"graphpass: unknown option {unknown[0]!r}; the options are: {', '.join(names)}")
        return cls(**options)

    def __post_init__(self):
        if self.chunk_size is not None and (not _is_int(self.chunk_size) or self.chunk_size < 1):
            raise ValueError(f"graphpass: chunk_size must be a positive int or None, got {self.chunk_size!r}")
        if not _is_int(self.chunk_budget_bytes) or self.chunk_budget_bytes < 1:
            raise ValueError(
                f"graphpass: chunk_budget_bytes must be a positive int, got {self.chunk_budget_bytes!r}"
            )
        if self.inner not in INNER_COMPILERS:
            raise ValueError(
                f"graphpass: inner must be one of {', '.join(INNER_COMPILERS)}; got {self.inner!r}"
            )
        if not isinstance(self.never_worse, bool):
            raise ValueError(f"graphpass: never_worse must be True or False, got {self.never_worse!r}")
        if not isinstance(self.generated_kernels, bool):
            raise ValueError(f"graphpass: generated_kernels must be True or False, got {self.generated_kernels!r}")
        if not isinstance(self.gradients_in_forward, bool):
            raise ValueError(f"graphpass: gradients_in_forward must be True or False, got {self.gradients_in_forward!r}")
        object.__setattr__(self, "disable_passes", check_pass_names(self.disable_passes))


def _is_int(value) -> bool:
    """An int that is not a bool (`True` is an int to Python, never a chunk size)."""
    return isinstance(value, int) and not isinstance(value, bool)
