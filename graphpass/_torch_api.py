"""Every private PyTorch API graphpass uses, in one place, so a torch upgrade touches one file."""

from __future__ import annotations

import contextlib
import logging
import operator
import re

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode  # noqa: F401  (re-exported)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

try:  # torch >= 2.12 names a size's example value its guarding hint
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw, has_guarding_hint
except ImportError:  # torch 2.11 (the GPU images') and older
    from torch.fx.experimental.symbolic_shapes import has_hint as has_guarding_hint
    from torch.fx.experimental.symbolic_shapes import hint_int as guarding_hint_or_throw

log = logging.getLogger("graphpass")


def dynamo_control_flow_errors() -> tuple[type, ...]:
    """Exceptions Dynamo raises on purpose to restart its analysis; a backend must let them pass."""
    from torch._dynamo import exc

    return tuple(getattr(exc, name) for name in ("RestartAnalysis", "TensorifyScalarRestartAnalysis")
                 if hasattr(exc, name))


def fakify_inputs(example_inputs):
    """Dynamo's example inputs as fake tensors of Dynamo's own fake mode (shapes may be symbolic)."""
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise RuntimeError("graphpass: no fake mode found; the backend must be called by torch.compile")
    fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    return fake_mode, fakes


def capture_pre_dispatch(gm: torch.fx.GraphModule, example_inputs) -> tuple[torch.fx.GraphModule, list]:
    """Retrace a Dynamo graph into pre-dispatch ATen ops (grad-mode changes kept as nodes).

    Not functional and higher-order ops inlined: only for reporting a graph that
    `graphpass.capture` cannot model, never for analysis.
    """
    fake_mode, fakes = fakify_inputs(example_inputs)
    # Running through an Interpreter under preserve_node_meta carries each Dynamo node's
    # stack trace onto the ATen nodes it becomes, so sites can name the user's source line.
    with fake_mode, fx_traceback.preserve_node_meta():
        aten_gm = make_fx(torch.fx.Interpreter(gm).run, pre_dispatch=True)(*fakes)
    return aten_gm, fakes


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Reorder nodes minimally so every node follows its inputs (inductor's helper)."""
    from torch._inductor.pattern_matcher import stable_topological_sort as sort

    sort(graph)


def known_equal(a, b) -> bool:
    """True when two (possibly symbolic) sizes are equal for this graph.

    Provably equal sizes need nothing. Sizes whose current values are equal but that Dynamo
    traced as separate symbols (tokens and logits each get their own `T`) are made equal by a
    guard, so a later call where they differ recompiles instead of chunking mismatched rows.
    Unequal values add no guard: the caller then declines to rewrite, which is always safe.
    """
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if statically_known_true(a == b):
        return True
    try:
        if has_guarding_hint(a) and has_guarding_hint(b) and guarding_hint_or_throw(a) == guarding_hint_or_throw(b):
            return bool(a == b)  # evaluates with a guard
    except Exception:  # noqa: BLE001 - an unbacked size: treat as not equal
        pass
    return False


def inner_compile(name: str, gm: torch.fx.GraphModule, example_inputs):
    """Compile the rest of the graph with the configured inner compiler."""
    if name == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    if name == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    return gm.forward


def kernel_options(inner: str, device: torch.device | None) -> dict | None:
    """The inner compiler's options for a per-chunk kernel that runs on `device`.

    The kernel runs inside an op that CUDA graphs do not capture (`devices.NOT_CUDAGRAPH_CAPTURABLE`):
    a global `triton.cudagraphs=True` must not make each chunk's call a graph of its own. On CUDA a
    row of `[chunk, V]` is reduced by one program in one kernel (not split across programs, which
    reads it twice and launches four kernels), and pointwise kernels over `[chunk, V]` are tiled in
    2-D (each row value loaded once per tile, not once per element); the CPU's code is unchanged."""
    if inner != "inductor":
        return None
    options = {"triton.cudagraphs": False}
    if device is not None and torch.device(device).type == "cuda":
        options.update({"split_reductions": False, "triton.prefer_nd_tiling": True})
    return options


def compile_kernel(fn, inner: str, wide_width: int | None = None, fallback=None, rows: int | None = None):
    """Compile a per-chunk kernel, dynamic in the row count only (dim 0 of every tensor argument
    of rank 2), so a short last chunk reuses it while the vocabulary stays static for codegen.
    Its options follow the device of its first call's tensors (`kernel_options`).

    With `wide_width` (V) and inductor, the kernel is compiled now, on zeros shaped as its
    placeholders' example values with 2 rows (on CUDA with `rows`, the chunk's rows where the caller
    knows them: inductor chooses its block sizes for the rows it first sees), and
    `run.temporary_bytes` is what its generated code allocates per element of `[rows, V]`
    (`_wide_buffer_bytes`); else None.

    Where the compiler fails on it, `fallback()` (a callable with `fn`'s arguments) runs instead,
    else `fn` itself, uncompiled."""
    if inner in ("eager", "aot_eager"):
        # A kernel runs below autograd: aot_eager would trace its ATen graph again and run the same
        # ops (no codegen), at a compile's cost for each kernel.
        return fn
    kernel = None  # compiled at the first call, for its tensors' device

    def run(*args):
        nonlocal kernel
        # Kernels run below autograd, as a custom op's body does. Detached arguments and a fixed
        # dispatch state keep what Dynamo guards on (requires_grad, dispatch keys) the same on
        # every call; the op's first call sees different ones, and would cost a recompile.
        args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        if kernel is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
            run.options = kernel_options(inner, device)
            kernel = torch.compile(fn, backend=inner, dynamic=False, fullgraph=True, options=run.options)
        for a in args:
            if isinstance(a, torch.Tensor) and a.ndim == 2:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            try:
                return kernel(*args)
            except _compiler_errors() as e:
                # Raised before the kernel ran (nothing written yet), and often in backward, where
                # no graph can fall back: the fallback, or the same ATen graph op by op, runs
                # instead, exact (inductor's CPU outer-loop fusion fails on some in-place row
                # kernels, pytorch/pytorch#196570).
                kernel = fn
                if fallback is not None:
                    log.info("graphpass: %s could not compile a per-chunk kernel (%s); its fallback runs instead",
                             inner, _compiler_message(e))
                    kernel = fallback()
                else:
                    log.warning("graphpass: %s could not compile a per-chunk kernel, which runs uncompiled "
                                "(slower, same values): %s", inner, _compiler_message(e))
            return kernel(*args)

    run.temporary_bytes = None
    run.options = None
    sample = _sample_arguments(fn, rows) if inner == "inductor" and wide_width is not None else None
    if sample is not None:
        from unittest import mock

        from torch._inductor.graph import GraphLowering

        codes = []  # inductor hands each graph's code here, compiled or loaded from its cache
        try:
            with mock.patch.object(GraphLowering, "save_output_code", codes.append), torch.no_grad():
                run(*sample)
        except Exception as e:  # noqa: BLE001 - zeros may not suit it: then it compiles at its first call
            log.debug("graphpass: a kernel did not run on zeros (%s); its temporaries are estimated", e)
            codes = []
        run.temporary_bytes = _wide_buffer_bytes(codes, wide_width) if codes else None
    return run


def _compiler_errors() -> tuple[type, ...]:
    """What `torch.compile` raises when its backend fails to compile a graph."""
    from torch._dynamo.exc import BackendCompilerFailed

    return (BackendCompilerFailed,)  # inductor's InductorError too


def _compiler_message(error: BaseException) -> str:
    """The compiler's own error, in one line."""
    inner = getattr(error, "inner_exception", None) or error.__cause__ or error
    return f"{type(inner).__name__}: {inner}".splitlines()[0]


def _sample_arguments(fn, rows: int | None = None) -> list | None:
    """Zeros shaped as `fn`'s placeholders' example values, each symbolic size (the rows) 2, or on
    CUDA `rows` where given; None where a placeholder has none."""
    sample = []
    for node in fn.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        sample_rows = rows if rows is not None and val.device.type == "cuda" else 2
        shape = [s if isinstance(s, int) else sample_rows for s in val.shape]
        sample.append(torch.zeros(shape, dtype=val.dtype, device=val.device))
    return sample


_ALLOCATION = re.compile(r"empty_strided_\w+\(\(([^()]*)\), \([^()]*\), torch\.(\w+)\)")


def _wide_buffer_bytes(codes: list[str], width: int) -> int:
    """Bytes per element of `[rows, width]` that the `[rows, width]` buffers allocated in inductor's
    generated `codes` take together: an upper bound of what one call keeps (a buffer freed early
    counts as alive throughout)."""
    total = 0
    for code in codes:
        for shape, dtype in _ALLOCATION.findall(code):
            sizes = [s.strip() for s in shape.split(",") if s.strip()]
            if len(sizes) == 2 and sizes[1] == str(width):
                total += getattr(torch, dtype).itemsize
    return total


def assert_async(ok: torch.Tensor, message: str) -> None:
    """A device-side assert that `ok` is true: no host synchronisation (`graphpass.ops.devices`)."""
    torch.ops.aten._assert_async.msg(ok, message)


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


# ---- per-chunk kernels (graphpass/joint.py) -----------------------------------------------------
def symbolic_rows_mode(example_rows: int = 8):
    """A fresh fake mode and one symbolic row count in it, for tracing per-chunk kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC])
    seed = mode.from_tensor(torch.empty(example_rows), symbolic_context=context)
    return mode, seed.shape[0]


def trace_decomposed(fn, args) -> torch.fx.GraphModule:
    """make_fx of `fn` on fake `args`, with the softmax family decomposed into max/sum/exp, so
    that its row statistics are separate nodes a partition can save, and nll_loss into a gather
    and a scatter."""
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    table = get_decompositions([aten._log_softmax, aten._softmax, aten.logsumexp, aten._log_softmax_backward_data,
                                aten._softmax_backward_data, aten.special_entr,
                                # cross-entropy's: a gather and a scatter of the picked entry,
                                # which the peephole makes a select (`ops.peephole`)
                                aten.nll_loss_forward, aten.nll_loss_backward])
    return make_fx(fn, decomposition_table=table)(*args)


def with_example_values(gm: torch.fx.GraphModule, scalars: dict | None = None) -> torch.fx.GraphModule:
    """A copy of a per-chunk graph whose every node has its example value (`meta["val"]`), rows
    symbolic: propagated on fakes shaped as its placeholders' values (rewrites such as the peephole's
    add nodes without one); `scalars` (name -> dtype) names placeholders that have none, 0-d (a
    column tile's `column_offset`)."""
    import copy

    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    copied = copy.deepcopy(gm)
    fake_mode, rows = symbolic_rows_mode()
    with fake_mode:
        fakes = []
        for node in copied.graph.find_nodes(op="placeholder"):
            if "val" not in node.meta and node.name in (scalars or {}):
                node.meta["val"] = torch.empty((), dtype=scalars[node.name])
            val = node.meta["val"]
            shape = [s if isinstance(s, int) else rows for s in val.shape]
            fakes.append(torch.empty(shape, dtype=val.dtype, device=val.device))
    FakeTensorProp(copied, fake_mode).propagate_dont_convert_inputs(*fakes)
    return copied


def check_no_guards_on(fake_mode, size) -> None:
    """Raise if tracing specialised on a symbolic `size` (the kernel would be wrong for others)."""
    symbol = size.node.expr
    for guard in fake_mode.shape_env.guards:
        if symbol in guard.expr.free_symbols:
            raise RuntimeError(f"the per-chunk kernel specialises on the row count ({guard.expr})")


def same_size(a, b) -> bool:
    """Two sizes are the same int or the same symbolic expression (no guard is added)."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return isinstance(a, int) and isinstance(b, int) and a == b


def same_shape(a, b) -> bool:
    """Two shapes of equal rank whose sizes are each `same_size`."""
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def fake_node(graph: torch.fx.Graph, fake_mode, target, args=(), kwargs=None, like=None) -> torch.fx.Node:
    """A new node `target(*args, **kwargs)` at the graph's insertion point, with `like`'s meta (but
    its value) and its own example value, computed on the arguments' fake values in `fake_mode`."""
    kwargs = kwargs or {}
    new = graph.call_function(target, tuple(args), kwargs)
    if like is not None:
        new.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    vals = torch.fx.node.map_arg((tuple(args), kwargs), lambda n: n.meta["val"])
    with fake_mode:
        new.meta["val"] = target(*vals[0], **vals[1])
    return new


def float64_tensor_node(graph: torch.fx.Graph, scalar: torch.fx.Node, fake_mode) -> torch.fx.Node:
    """A node holding the runtime float `scalar` (a SymFloat) as a 0-d float64 tensor; `fake_mode`
    is the graph's, for the new nodes' example values.

    Spelled `scalar_tensor(1.0) * scalar` because AOTAutograd's tensorify pass turns a float
    input back into tensor math only through ops it knows (mul, add, ...); a float it did not
    tensorify is specialised, and then every new value (a new temperature) would recompile.
    """
    one = graph.call_function(torch.ops.aten.scalar_tensor.default, (1.0,), {"dtype": torch.float64})
    node = graph.call_function(torch.ops.aten.mul.Tensor, (one, scalar))
    with fake_mode:
        one.meta["val"] = torch.empty((), dtype=torch.float64)
        node.meta["val"] = torch.empty((), dtype=torch.float64)
    return node


# ---- capture (graphpass/capture.py) ---------------------------------------------------------------
def export_functional(gm: torch.fx.GraphModule, fakes):
    """AOTAutograd's functional export of `gm` on `fakes`: (ATen graph, signature).

    pre_dispatch keeps `_set_grad_enabled` as nodes; preserve_node_meta carries each Dynamo node's
    stack trace onto the ATen nodes it becomes.
    """
    from torch._functorch.aot_autograd import aot_export_module

    with fx_traceback.preserve_node_meta():
        return aot_export_module(gm, fakes, trace_joint=False, pre_dispatch=True)


def inlinable_hops() -> tuple:
    """Higher-order ops that mean their body: checkpoint (changes only what autograd saves), wrap."""
    hop = torch.ops.higher_order
    return tuple(getattr(hop, name) for name in ("tag_activation_checkpoint", "wrap") if hasattr(hop, name))


# ---- memory model, inspection, CLI (graphpass/memory.py, inspection.py, cli.py) ------------------
def backend_failure_type() -> type:
    """The exception Dynamo raises when a backend (graphpass) fails while compiling a graph."""
    from torch._dynamo.exc import BackendCompilerFailed

    return BackendCompilerFailed


@contextlib.contextmanager
def quiet_fake_tensor_log():
    """No log of a failing fake-tensor call (torch logs each with its traceback; the CLI says it in one line)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def tree_leaves(tree) -> list:
    """The leaves of nested lists, tuples and dicts, in order (torch's pytree flattening)."""
    from torch.utils._pytree import tree_leaves as leaves

    return leaves(tree)


def new_fake_mode(allow_real_tensors: bool = False):
    """A fresh fake-tensor mode: tensors made under it (or by its `from_tensor`) have shapes,
    dtypes and requires_grad, and no data. With `allow_real_tensors`, an op that mixes its fake
    tensors with real ones (a constant the code makes as it runs) treats those as fake too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_real_tensors)


def any_symbolic(values) -> bool:
    """Whether one of `values` is a SymInt or a tensor with a symbolic size."""
    return any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and not all(
        isinstance(s, int) for s in v.shape)) for v in values)


def size_symbol(size):
    """The symbol a size is (`s27`), or None for an int or an expression of several symbols."""
    if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
        return size.node.expr
    return None


def size_at(size, at: dict | None = None) -> int:
    """A size (an int or a SymInt) as an int: its example value, with the symbols that are keys of
    `at` at the values given there; raises ValueError where it has no example value."""
    if isinstance(size, int):
        return size
    if not at:
        return int(guarding_hint_or_throw(size))
    import sympy

    env = size.node.shape_env  # torch >= 2.13 names the example values backed_var_to_val
    known = dict(getattr(env, "backed_var_to_val", None) or getattr(env, "var_to_val", {}))
    known.update({symbol: sympy.Integer(value) for symbol, value in at.items()})
    value = size.node.expr.xreplace(known)
    if not value.is_number:
        raise ValueError(f"the size {size} has no example value")
    return int(value)


def fakes_at_sizes(values, at: dict | None = None) -> list:
    """`values` (fake tensors and sizes, possibly symbolic) with every size an int (`size_at`):
    contiguous fake tensors of one fresh fake mode, of the same dtypes, devices and requires_grad."""
    mode = new_fake_mode()
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            with mode:
                t = torch.empty([size_at(s, at) for s in v.shape], dtype=v.dtype, device=v.device)
            out.append(t.requires_grad_(v.requires_grad))
        elif isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool):
            out.append(size_at(v, at))
        else:
            out.append(v)
    return out


def is_fake(x) -> bool:
    """True for a fake tensor (one that has no data)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


# ---- graph nodes (analysis) -------------------------------------------------------------------------
#: The function a pre-dispatch graph calls where grad mode changes (`with torch.no_grad():`).
set_grad_enabled = torch._C._set_grad_enabled


def is_aten_overload(target) -> bool:
    """True for an op overload such as `aten.add.Tensor` (it has a schema and tags)."""
    return isinstance(target, torch._ops.OpOverload)


def is_higher_order_op(target) -> bool:
    """True for a higher-order op such as `autograd_function_apply` (it calls subgraphs)."""
    return isinstance(target, torch._ops.HigherOrderOperator)


def schema_of(target) -> torch._C.FunctionSchema | None:
    """The schema of an op overload (its arguments' names, order and kinds, whether it mutates);
    None for any other target (a Python function, a higher-order op)."""
    return target._schema if is_aten_overload(target) else None


#: The ops of torch's functional collectives (`torch.distributed._functional_collectives`): the
#: forms Dynamo traces `dist.all_reduce` and friends into (`all_reduce`, `wait_tensor`, ...).
functional_collectives = torch.ops._c10d_functional


def autograd_function_apply():
    """The higher-order op Dynamo makes of a user `torch.autograd.Function` (forward, backward bodies)."""
    return torch.ops.higher_order.autograd_function_apply


def dynamo_loses_gradients_of_written_function_outputs() -> bool:
    """Whether this torch's Dynamo loses gradients through an autograd.Function whose forward writes
    in place into a tensor it returns, or into its input (`result.mul_(2)`, `dist.all_reduce(result)`,
    `mark_dirty`): torch 2.11's does, with any backend (its own "eager" included: the gradient through
    that output comes out zero, or without the Function's backward); 2.13's does not."""
    return torch.torch_version.TorchVersion(torch.__version__) < (2, 13)


def drop_function_intermediates(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str | None:
    """Make the autograd-Function op `node` return the Function's outputs alone, as torch 2.13's
    Dynamo makes it; None when it does (or now does), else why its outputs cannot be told.

    The backward body takes a gradient for each value of the forward body's first tuple, named
    `unused_<k>` where the value is not one of the Function's outputs. torch 2.11 and 2.12's Dynamo
    put every intermediate value of the forward there; torch 2.13 only tensors the Function returns
    inside other objects. The op is rewritten without the unused values (new bodies set on `gm`,
    the readers' indices and `non_differentiable_idx` renumbered) where that reading agrees with
    the graph: it reads the op's results item by item, none marked unused, and the backward reads
    no `unused_` gradient."""
    from graphpass.fx_utils import copy_graph_module

    forward_attr, backward_attr = node.args[0].target, node.args[1].target
    forward, backward = getattr(gm, forward_attr), getattr(gm, backward_attr)
    body_output = forward.graph.output_node().args[0]
    if not (isinstance(body_output, (tuple, list)) and len(body_output) == 2):
        return "its forward body does not return ((outputs), (saved values)) as Dynamo's does from torch 2.11 on"
    returned, saved = body_output
    grads = list(backward.graph.find_nodes(op="placeholder"))
    cannot = "Dynamo returns values that are not the Function's outputs with them, and "
    if len(grads) != len(returned) + len(saved):
        return cannot + "its backward does not take one gradient for each"
    unused = {i for i, g in enumerate(grads[:len(returned)]) if g.name.startswith("unused_")}
    if not unused:
        return None
    example = node.meta.get("example_value")
    if not isinstance(example, (tuple, list)) or len(example) != len(returned):
        return cannot + "its recorded outputs do not match its body"
    if any(grads[i].users for i in unused):
        return cannot + "its backward reads the gradient of a value Dynamo marks unused"
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)):
            return cannot + "the graph reads its results whole, not item by item"
        if user.args[1] in unused:
            return cannot + "the graph reads a value Dynamo marks unused"
    kept = [i for i in range(len(returned)) if i not in unused]

    new_forward = copy_graph_module(forward)
    output = new_forward.graph.output_node()
    new_returned, new_saved = output.args[0]
    output.args = ((tuple(new_returned[i] for i in kept), new_saved),)
    new_forward.recompile()
    new_backward = copy_graph_module(backward)
    for i, placeholder in enumerate(list(new_backward.graph.find_nodes(op="placeholder"))):
        if i in unused:
            new_backward.graph.erase_node(placeholder)
    new_backward.recompile()
    setattr(gm, forward_attr, new_forward)  # `gm`'s own attributes: Dynamo's graph keeps the old bodies
    setattr(gm, backward_attr, new_backward)

    for user in list(node.users):
        user.args = (node, kept.index(user.args[1]))
    node.meta["example_value"] = type(example)(example[i] for i in kept)
    kwargs = dict(node.kwargs)
    kwargs["non_differentiable_idx"] = [kept.index(i) for i in kwargs.get("non_differentiable_idx", ()) if i in kept]
    node.kwargs = kwargs
    return None


# ---- distributed (graphpass/ops/vocab_parallel.py) -------------------------------------------------
def all_gather_into_tensor():
    """torch.distributed's all-gather into one flat `[size * n, ...]` tensor: `all_gather_single` from
    torch 2.13 on (which deprecates `all_gather_into_tensor` in its favour), `all_gather_into_tensor`
    before (2.11 and 2.12 have no `all_gather_single`)."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def resolve_process_group(group_name: str):
    """The `ProcessGroup` named `group_name` (`group.group_name`): custom ops carry a group as its name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def torch_dispatch_mode():
    """The base class of a mode that sees every ATen call below autograd (tests use it to watch
    which tensors an op allocates)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


# ---- Dynamo stand-ins and graph breaks (graphpass/integrations, passes) -----------------------------
def graph_break(msg: str) -> None:
    """A graph break in traced code, with `msg` as its reason (a no-op outside tracing)."""
    torch._dynamo.graph_break(msg=msg)


def functional_all_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every rank's `x` concatenated along dim 0, as a traceable functional collective (its backward
    a reduce-scatter)."""
    return _functional_collective("all_gather_single", "all_gather_tensor")(x, 0, group_name)


def _functional_collective(name: str, before_2_13: str):
    """The functional collective `name`; torch 2.11 and 2.12 have it as `before_2_13` only (which 2.13
    deprecates in its favour)."""
    import torch.distributed._functional_collectives as funcol

    return getattr(funcol, name, None) or getattr(funcol, before_2_13)


def traces_list_reduce_scatter() -> bool:
    """Whether Dynamo traces torch.distributed's list-form `reduce_scatter` itself: from torch 2.14
    on it remaps it (any reduce op) to a functional collective; 2.11-2.13 trace into c10d's Python
    and break the graph."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import traceable_collective_remaps

    return dist.reduce_scatter in traceable_collective_remaps


def functional_reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's block of dim 0 of the sum of every rank's `x`, as a traceable functional collective
    (`group`: a process group or its name)."""
    return _functional_collective("reduce_scatter_single", "reduce_scatter_tensor")(x, "sum", 0, group)


def functional_reduce_scatter_into(output: torch.Tensor, x: torch.Tensor, group) -> None:
    """Write into `output` this rank's block of dim 0 of the sum of every rank's `x`, as a traceable
    functional collective (`group`: a process group, its name, or None for the default group)."""
    import torch.distributed._functional_collectives as funcol

    funcol.reduce_scatter_tensor_inplace(output, x, "sum", group)


def functional_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of every rank's `x`, as a traceable functional collective."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group_name)


def graph_break_before_this_graph() -> tuple[str, str | None] | None:
    """Called while Dynamo compiles a graph (in a backend): where and why Dynamo broke the graph it
    resumed after to make this one, as ("file.py:LINE" of the innermost frame, the reason's first
    line or None when Dynamo kept none), or None when this graph starts at the compiled function's
    entry. Dynamo names a resumption `torch_dynamo_resume_in_<fn>_at_<line>`, its first line the
    break's line in the frame; its break reasons (`graph_break_reasons`) hold each break's stack."""
    import os

    from torch._dynamo.resume_execution import TORCH_DYNAMO_RESUME_IN_PREFIX
    from torch._dynamo.utils import graph_break_reasons
    from torch._guards import TracingContext

    graphpass_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep
    context = TracingContext.try_get()
    code = context.traced_code[0] if context is not None and context.traced_code else None
    if code is None or not code.co_name.startswith(TORCH_DYNAMO_RESUME_IN_PREFIX):
        return None
    for reason in reversed(graph_break_reasons):
        stack = reason.user_stack
        if stack and stack[0].filename == code.co_filename and stack[0].lineno == code.co_firstlineno:
            # The innermost frame outside graphpass: a break in its stand-ins is at their caller's line.
            inner = next((f for f in reversed(stack) if not f.filename.startswith(graphpass_dir)), stack[-1])
            return f"{os.path.basename(inner.filename)}:{inner.lineno}", _first_line(reason.reason)
    return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}", None


def _first_line(reason: str) -> str:
    """A Dynamo break reason's first line, with a user's `graph_break(msg=...)` message."""
    lines = reason.strip().splitlines()
    message = next((line.split("Message: ", 1)[1] for line in lines if "User-inserted graph break. Message: " in line),
                   None)
    return lines[0] if message in (None, "None") else message


def substitute_in_graph_apply(function_cls: type, traceable) -> None:
    """Make Dynamo trace `traceable(*args)` wherever traced code calls `function_cls.apply(*args)`
    (an `autograd.Function`); eager calls, and every other use of the class, are unchanged.

    `torch.compiler.substitute_in_graph` takes functions only, and Dynamo turns `apply` into its
    autograd-Function op (the hand-written backward kept) before looking for polyfills: this is
    the same mechanism (Dynamo's dispatch by object id, a guard on the class) for a Function.
    Raises ValueError when the class already has a dispatch rule."""
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.builder import VariableBuilder
    from torch._dynamo.variables.misc import AutogradFunctionVariable

    class _StandInApply(AutogradFunctionVariable):
        def call_method(self, tx, name, args, kwargs):
            if name == "apply":
                return tx.inline_user_function_return(VariableTracker.build(tx, traceable), list(args), dict(kwargs))
            return super().call_method(tx, name, args, kwargs)

    def dispatch(builder, value):
        builder.install_guards(GuardBuilder.CLASS_MATCH)
        return _StandInApply(value, source=builder.source)

    rules = VariableBuilder._id_dispatch()
    if id(function_cls) in rules:
        raise ValueError(f"Duplicate dispatch rule for {function_cls}")
    rules[id(function_cls)] = dispatch
