"""Compile a generated kernel for a GPU that is not here, and read what it uses (registers, stack, SMEM).

Triton's own compiler and the `ptxas` / `cuobjdump` bundled with it build a cubin for any
`sm_XX` on a machine without a GPU (or driver). A kernel that spills (a stack frame), fails to
lower or needs more shared memory than the GPU has fails here, on every commit, rather than on a
lent GPU. Triton's interpreter must be off in the process that compiles (`TRITON_INTERPRET`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

import torch

#: Shared memory a block may use on an H100/H200 and a B200 (227 KB).
SMEM_LIMIT = 227 * 1024

_POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64",
            torch.int64: "*i64", torch.int32: "*i32", torch.bool: "*i1"}


@dataclasses.dataclass(frozen=True)
class Usage:
    """What one compiled kernel uses on one GPU architecture."""

    arch: int
    registers: int
    stack: int
    shared: int

    @property
    def fits(self) -> bool:
        """No spills (no stack frame) and shared memory within the GPU's."""
        return self.stack == 0 and self.shared <= SMEM_LIMIT


def compile_for(kernel, arch: int, function: str = "kernel") -> Usage:
    """Compile `kernel` (a `rowwise.GeneratedKernel`; its `function`: "kernel", or a vocabulary split's
    "partial" and "combine") for `sm_<arch>`, its arguments of its graph's dtypes, at its own blocks;
    what the cubin uses."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(kernel.module, function)
    if not hasattr(fn, "arg_names"):
        raise RuntimeError("graphpass: Triton's interpreter is on (TRITON_INTERPRET); nothing compiles")
    types = {"P_ptr": "*fp32"}
    for (name, kind), (_, dtype) in zip(kernel.placeholders, kernel.examples):
        types[f"{name}_ptr"] = _POINTER[dtype]
    for j, (_, dtype) in enumerate(kernel.out_specs):
        types[f"out{j}_ptr"] = _POINTER[dtype]
    signature = {name: types.get(name, "i64" if name.endswith(("_s0", "_s1")) else "i32") for name in fn.arg_names}
    b = kernel.blocks
    columns = min(b.columns, 1 << max(0, (kernel.vocab - 1).bit_length()))
    signature.update({"BM": "constexpr", "BV": "constexpr"})
    source = ASTSource(fn, signature, constexprs={"BM": b.rows, "BV": columns})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": b.warps})
    return Usage(arch, *_resources(compiled.asm["cubin"]), compiled.metadata.shared)


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of the kernel in `cubin`, by the bundled `cuobjdump -res-usage`."""
    from triton.backends.nvidia import compiler

    tool = os.path.join(os.path.dirname(compiler.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    registers = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    if registers is None or stack is None:
        raise RuntimeError(f"graphpass: cuobjdump reported no resource usage: {text!r}")
    return int(registers.group(1)), int(stack.group(1))
