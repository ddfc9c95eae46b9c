"""Row-local programs as graphpass extracts them, for the generated kernels' tests (tests/ops/test_kernels.py)
and benchmark (`bench.gpu_kernels`).

Each is a module computing in `compute` (fp32 for the program, float64 for the reference), and a
function making its arguments: logits `[T, V]` first, then per-row or scalar inputs.
"""

from __future__ import annotations

import contextlib

import torch

from graphpass.ops.joint import ArgSpec, JointSplit


class Program(torch.nn.Module):
    def __init__(self, compute=torch.float32):
        super().__init__()
        self.compute = compute


class LogProb(Program):
    """The picked token's log-prob (cross-entropy's negative)."""

    def forward(self, logits, index):
        return (torch.log_softmax(logits.to(self.compute), -1).gather(-1, index),)


class LogProbEntropy(Program):
    """log-prob and entropy at a temperature: a 0-d tensor, or one per token `[T, 1]`."""

    def forward(self, logits, index, temperature):
        logp = torch.log_softmax(logits.to(self.compute) / temperature, -1)
        return logp.gather(-1, index), -(logp.exp() * logp).sum(-1, keepdim=True)


class SoftCapped(Program):
    """Gemma-2's soft-capping `cap * tanh(x / cap)` before the log-prob and entropy."""

    def forward(self, logits, index):
        x = logits.to(self.compute)
        x = 30.0 * torch.tanh(x / 30.0)
        logp = torch.log_softmax(x, -1)
        return logp.gather(-1, index), -(logp.exp() * logp).sum(-1, keepdim=True)


class Masked(Program):
    """A vocabulary mask `[1, V]` (padding columns) and a per-token mask `[T, 1]` on the log-prob."""

    def forward(self, logits, index, allowed, token_mask):
        x = logits.to(self.compute).masked_fill(~allowed, -1e30)
        logp = torch.log_softmax(x, -1)
        return logp.gather(-1, index) * token_mask, -(logp.exp() * logp).sum(-1, keepdim=True)


class RoundedTemperature(Program):
    """bf16 logits divided by the temperature in bf16 (eager's rounding), then upcast."""

    def forward(self, logits, index):
        logp = torch.log_softmax((logits / 0.7).to(self.compute), -1)
        return (logp.gather(-1, index),)


class TeacherKL(Program):
    """KL(teacher || student) per token, the teacher's logits gradient-free."""

    def forward(self, logits, teacher):
        logp = torch.log_softmax(logits.to(self.compute), -1)
        logq = torch.log_softmax(teacher.to(self.compute), -1)
        return ((logq.exp() * (logq - logp)).sum(-1, keepdim=True),)


class LabelSmoothing(Program):
    """Cross-entropy with label smoothing 0.1, per token."""

    def forward(self, logits, index):
        logp = torch.log_softmax(logits.to(self.compute), -1)
        return (-(0.9 * logp.gather(-1, index) + 0.1 * logp.mean(-1, keepdim=True)),)


def arguments(name: str, rows: int, vocab: int, dtype: torch.dtype, generator: torch.Generator) -> list:
    """The arguments of program `name` (a class above) at `[rows, vocab]` logits of `dtype`."""
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
    index = torch.randint(0, vocab, (rows, 1), generator=generator)
    if name == "LogProbEntropy":
        return [logits, index, torch.tensor(0.7)]
    if name == "LogProbEntropyPerToken":
        return [logits, index, torch.rand(rows, 1, generator=generator) + 0.5]
    if name == "Masked":
        allowed = torch.ones(1, vocab, dtype=torch.bool)
        allowed[0, vocab - vocab // 7:] = False
        index = torch.randint(0, vocab - vocab // 7, (rows, 1), generator=generator)
        token_mask = (torch.rand(rows, 1, generator=generator) > 0.3).float()
        return [logits, index, allowed, token_mask]
    if name == "TeacherKL":
        return [logits, (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)]
    return [logits, index]


def program_class(name: str) -> type:
    return LogProbEntropy if name == "LogProbEntropyPerToken" else globals()[name]


NAMES = ["LogProb", "LogProbEntropy", "LogProbEntropyPerToken", "SoftCapped", "Masked", "RoundedTemperature",
         "TeacherKL", "LabelSmoothing"]


@contextlib.contextmanager
def rounded_bf16_casts():
    """In Triton's interpreter (`TRITON_INTERPRET=1`), fp32 -> bf16 casts rounded to nearest even as
    on a GPU: the interpreter truncates them (1 ulp off). For tests and the CPU smoke only."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast = builder.cast_impl

    def rounded_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(src.data.copy()).to(torch.bfloat16).view(torch.int16).numpy().view("uint16")
            return interpreter.TensorHandle(bits, dst_type.scalar)
        return cast(self, src, dst_type)

    builder.cast_impl = rounded_cast
    try:
        yield
    finally:
        builder.cast_impl = cast


def split(name: str, args: list, keeps=None, wanted=(0,), device="cpu") -> tuple[JointSplit, int]:
    """Program `name` on `args` split as the op splits it (`JointSplit`, traced for `device`), and its
    number of outputs."""
    vocab = args[0].shape[-1]
    # Per row: every 2-D argument but the vocabulary mask `[1, V]` (`Masked`), whatever the rows.
    per_row = [a.ndim == 2 and a.dtype != torch.bool for a in args]
    specs = [ArgSpec(tuple(a.shape), a.dtype, per_row=p, wide=p and a.shape[-1] == vocab)
             for a, p in zip(args, per_row)]
    module = program_class(name)()
    n = len(module(*args))
    keeps = list(range(n)) if keeps is None else keeps
    return JointSplit(torch.fx.symbolic_trace(module), specs, keeps, list(wanted), device=device), n


def cross_compiled(names=NAMES, archs=(90, 100), vocab: int = 151936,
                   kinds=("forward", "backward")) -> list[dict]:
    """Each program's generated kernels of these `kinds` ("forward", "backward", "fused", "column_tile";
    "split": the forward's vocabulary-split `partial` and `combine`) for bf16 logits of width `vocab`,
    at the GPU's blocks, compiled for each `sm_<arch>` (Triton's interpreter off): one row per kernel
    and arch."""
    from graphpass.kernels.cross_compile import compile_for
    from graphpass.kernels.rowwise import GeneratedKernel

    rows = []
    for name in names:
        args = arguments(name, 2, vocab, torch.bfloat16, torch.Generator().manual_seed(0))
        program, n = split(name, args)
        active = tuple(range(n))
        graphs = {"forward": lambda: program.forward, "backward": lambda: program.backward(active, (0,)),
                  "fused": lambda: program.fused(active, (0,)),
                  "column_tile": lambda: program.column_tile(active, (0,))}
        for kind in kinds:
            graph_kind = "forward" if kind == "split" else kind
            kernel = GeneratedKernel(graphs[graph_kind](), graph_kind)
            for function in ("partial", "combine") if kind == "split" else ("kernel",):
                for arch in archs:
                    usage = compile_for(kernel, arch, function)
                    rows.append({"program": name, "kind": kind if kind != "split" else f"split_{function}",
                                 "arch": arch, "registers": usage.registers, "stack": usage.stack,
                                 "shared": usage.shared, "fits": usage.fits,
                                 "blocks": [kernel.blocks.rows, kernel.blocks.columns, kernel.blocks.warps]})
    return rows


if __name__ == "__main__":  # python -m bench.workloads.kernel_programs: the cross-compile table, as JSON
    import json

    print(json.dumps(cross_compiled()))
