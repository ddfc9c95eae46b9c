"""Every private PyTorch API graphpass uses, in one place, so a torch upgrade touches one file."""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode  # noqa: F401  (re-exported)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true


def fakify_inputs(example_inputs):
    """Dynamo's example inputs as fake tensors of Dynamo's own fake mode (shapes may be symbolic)."""
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise RuntimeError("graphpass: no fake mode found; the backend must be called by torch.compile")
    fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    return fake_mode, fakes


def capture_pre_dispatch(gm: torch.fx.GraphModule, example_inputs) -> tuple[torch.fx.GraphModule, list]:
    """Retrace a Dynamo graph into pre-dispatch ATen ops (grad-mode changes kept as nodes)."""
    fake_mode, fakes = fakify_inputs(example_inputs)
    # Running through an Interpreter under preserve_node_meta carries each Dynamo node's
    # stack trace onto the ATen nodes it becomes, so sites can name the user's source line.
    with fake_mode, fx_traceback.preserve_node_meta():
        aten_gm = make_fx(torch.fx.Interpreter(gm).run, pre_dispatch=True)(*fakes)
    return aten_gm, fakes


def known_equal(a, b) -> bool:
    """True when two (possibly symbolic) sizes are provably equal; never adds a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(statically_known_true(a == b))


def inner_compile(name: str, gm: torch.fx.GraphModule, example_inputs):
    """Compile the rest of the graph with the configured inner compiler."""
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    if name == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    return gm.forward


def compile_kernel(fn, inner: str):
    """Compile a per-chunk kernel: dynamic in the row count, so the last short chunk reuses it."""
    if inner == "eager":
        return fn
    return torch.compile(fn, backend=inner, dynamic=True, fullgraph=True)


# ---- memory model (graphpass/memory.py, report, CLI) -------------------------------------------
def storage_key(t: torch.Tensor):
    """Identity of a (fake) tensor's storage: views and in-place results share their base's key."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage()).cdata


def size_hint(x) -> int:
    """A concrete int for a size that may be symbolic (its example value); never adds a guard."""
    if isinstance(x, int):
        return x
    node = getattr(x, "node", None)
    if node is not None:
        if getattr(node, "hint", None) is not None:
            return int(node.hint)
        return int(node.shape_env.size_hint(node.expr))
    return int(x)
