"""Peak-memory model of one forward+backward, from fake-tensor metadata only.

`estimate_peak(gm, fake_inputs)` traces the graph's joint forward+backward on fake tensors
(the autograd engine runs, so the backward is exactly the ops eager would run, in eager's order,
saving exactly what eager's autograd formulas save) and walks it with storage liveness:

- a storage is allocated by the first node that produces it and freed after the last node that
  reads any tensor sharing it (views, `detach`, in-place ops share their input's storage);
- the graph's inputs (and backward tangents) are the baseline and never count;
- the graph's outputs (the loss, the gradients that become `.grad`) live to the end;
- in the backward, the autograd engine accumulates a gradient in place when it holds the last
  reference (`InputBuffer::accumulate`), and `gather`'s backward scatters into its fresh zeros in
  place; tracing records both out of place, so the walk re-applies eager's in-place reuse;
- a graphpass chunked op adds its site's per-chunk workspace while it runs, forward and
  backward. Its real backward loops over chunks in Python, so the joint trace replaces it by a
  stub that allocates exactly what the real one returns: one gradient buffer per input that
  needs one, in that input's dtype; outputs whose gradient is dropped get no backward.

What the model knows about a chunked op (its outputs' `keeps_grad`, its workspace) comes from the
`SiteRecord`s passed in (`GraphRecord.sites`), matched by program key: never from the op's registry
of programs, so reports work in a process that never built the programs.

Nothing is allocated: every tensor is a fake tensor. `estimate_rewrite(result)` compares the
graph before and after graphpass's rewrite and attributes the difference to the sites.
"""

from __future__ import annotations

import dataclasses

import torch

from graphpass import _torch_api
from graphpass.records import SiteRecord


@dataclasses.dataclass
class LiveTensor:
    """A storage alive at the peak."""

    node: str
    """Name of the node in the joint graph that allocated it."""
    nbytes: int
    shape: tuple
    dtype: torch.dtype
    phase: str
    """"forward" or "backward": which half of the step allocated it."""


@dataclasses.dataclass
class PeakEstimate:
    """Estimated peak bytes of one forward+backward of a graph, above its inputs."""

    peak_bytes: int
    """Peak bytes above the baseline, including any chunked op's per-chunk workspace."""
    baseline_bytes: int
    """Bytes of the graph's inputs (e.g. the logits): present before and after, never counted."""
    floor_bytes: int
    """Bytes of the input gradients the step must produce anyway (e.g. `logits.grad`)."""
    saved_bytes: int
    """Bytes alive between forward and backward: what the forward saved for backward."""
    peak_node: str
    """Node of the joint graph at which the peak is reached."""
    peak_phase: str
    """"forward" or "backward"."""
    live_at_peak: list[LiveTensor] = dataclasses.field(default_factory=list)
    """The storages alive at the peak, largest first."""
    workspace_bytes: int = 0
    """Transient bytes of a chunked op included in the peak (0 when the peak is elsewhere)."""


@dataclasses.dataclass
class MemoryEstimate:
    """Peak before and after graphpass's rewrite of one graph."""

    before: PeakEstimate
    after: PeakEstimate

    @property
    def bytes_saved(self) -> int:
        return self.before.peak_bytes - self.after.peak_bytes

    @property
    def fraction_saved(self) -> float:
        return self.bytes_saved / self.before.peak_bytes if self.before.peak_bytes else 0.0


# ---- joint trace --------------------------------------------------------------------------------
def _chunked_op():
    try:
        return torch.ops.graphpass.rowwise_chunked.default
    except (AttributeError, RuntimeError):
        return None


def _is_chunked_op(target) -> bool:
    """The chunked op or the memory model's stand-in for its backward (both take the key first;
    the other graphpass ops, such as the vocab-parallel op, do not)."""
    name = target.name() if _torch_api.is_aten_overload(target) else ""
    return name in ("graphpass::rowwise_chunked", "graphpass::rowwise_chunked_with_gradients",
                    "graphpass_memory::chunked_backward")


class _Sites:
    """The `SiteRecord`s of a graph, looked up by a chunked-op call's program key and inputs."""

    def __init__(self, sites=()):
        self._by_key: dict[str, list[SiteRecord]] = {}
        for site in sites or ():
            self._by_key.setdefault(site.program_key, []).append(site)

    def find(self, key: str, tensors=()) -> SiteRecord | None:
        sites = self._by_key.get(key, [])
        if len(sites) > 1:  # one program at several shapes: the site whose logits these are
            shapes = {_hinted(t.shape) for t in tensors if isinstance(t, torch.Tensor)}
            sites = [s for s in sites if _hinted(s.shape) in shapes] or sites
        return sites[0] if sites else None

    def keeps_grad(self, key: str) -> list[bool] | None:
        site = self.find(key)
        return [o.keeps_grad for o in site.outputs] if site is not None else None

    def workspace_bytes(self, key: str, tensors, backward: bool = True) -> int:
        """Per-chunk transient bytes of the chunked op `key` over these inputs (0 if unrecorded),
        in its forward or its backward."""
        site = self.find(key, tensors)
        if site is None:
            return 0
        if not backward and site.forward_workspace_bytes is not None:
            return int(site.forward_workspace_bytes)
        return int(site.workspace_bytes or 0)


def _hinted(shape) -> tuple:
    try:
        return tuple(_torch_api.size_hint(s) for s in shape)
    except (TypeError, ValueError):  # a size printed as a name in a hand-made record
        return tuple(shape)


@torch.library.custom_op("graphpass_memory::chunked_backward", mutates_args=())
def _chunked_backward(key: str, tensors: list[torch.Tensor], needs_grad: list[bool]) -> list[torch.Tensor]:
    """Stand-in for the chunked op's backward in the memory model; never runs on real data."""
    raise RuntimeError("graphpass.memory: the backward stub only runs on fake tensors")


@_chunked_backward.register_fake
def _(key, tensors, needs_grad):
    # The real backward returns one buffer per input needing a gradient, in the input's dtype
    # (the fp32 accumulators of broadcast inputs are tiny); unneeded ones are not allocated.
    return [torch.empty_like(t) if need else t.new_empty(0) for t, need in zip(tensors, needs_grad)]


class _ChunkedStub(torch.autograd.Function):
    """The chunked op with a backward the joint trace can record as one node."""

    @staticmethod
    def forward(ctx, key, scalars, extra, keeps_grad, *tensors):
        outs = _chunked_op()(key, list(tensors), scalars, *extra)
        ctx.key = key
        ctx.needs = [t.requires_grad and t.is_floating_point() for t in tensors]
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)
        frozen = [o for o, keep in zip(outs, keeps_grad) if not keep]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        tensors = ctx.saved_tensors
        if all(g is None for g in grad_outputs):
            return (None,) * (4 + len(tensors))
        grads = torch.ops.graphpass_memory.chunked_backward(ctx.key, list(tensors), ctx.needs)
        return (None, None, None, None, *[g if need else None for g, need in zip(grads, ctx.needs)])


def _chunked_stub(sites: _Sites):
    def stub(key, tensors, scalars, *extra):
        # An unrecorded site keeps every gradient: the model never under-counts a backward.
        keeps = sites.keeps_grad(key) or [True] * 64
        return list(_ChunkedStub.apply(key, scalars, extra, keeps, *tensors))

    return stub


def _with_stubs(gm: torch.fx.GraphModule, sites: _Sites) -> torch.fx.GraphModule:
    """A copy of `gm` whose chunked-op calls go through `_ChunkedStub` (same forward node)."""
    op = _chunked_op()
    if op is None or not any(n.target is op for n in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    stub = _chunked_stub(sites)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is op:
            node.target = stub
    return torch.fx.GraphModule(gm, graph)


def trace_joint(gm: torch.fx.GraphModule, fake_inputs, sites=()) -> tuple[torch.fx.GraphModule, int, int]:
    """The joint forward+backward of `gm` as an ATen graph on fake tensors.

    `sites` are the `SiteRecord`s of `gm`'s chunked ops (which outputs keep a gradient).
    Returns (joint graph, number of primal placeholders, number of tangent placeholders). The
    joint's outputs are (forward outputs, gradients of the inputs that require grad).
    """
    fake_mode = _torch_api.detect_fake_mode(fake_inputs)
    gm = _with_stubs(gm, _Sites(sites))
    primals = list(fake_inputs)
    with fake_mode, torch.enable_grad():
        outs = gm(*primals)
    flat_outs = _torch_api.tree_leaves(outs)
    diff_idx = [i for i, o in enumerate(flat_outs)
                if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
    params = [i for i, x in enumerate(primals) if isinstance(x, torch.Tensor) and x.requires_grad]
    with fake_mode:
        # The engine seeds `loss.backward()` with ones; they are inputs to the walk, like the primals.
        tangents = [torch.ones_like(flat_outs[i]) for i in diff_idx] if params else []
    n_primals = len(primals)

    def joint(*args):
        xs, ts = args[:n_primals], args[n_primals:]
        with torch.enable_grad():
            out = gm(*xs)
        flat = _torch_api.tree_leaves(out)
        grads = []
        if ts:
            grads = torch.autograd.grad([flat[i] for i in diff_idx], [xs[i] for i in params], list(ts),
                                        allow_unused=True)
        return out, list(grads)

    with fake_mode:
        joint_gm = _torch_api.make_fx(joint)(*primals, *tangents)
    return joint_gm, n_primals, len(tangents)


# ---- liveness walk -------------------------------------------------------------------------------
# Ops whose backward formula writes into a fresh zeros buffer in place in eager
# (e.g. gather_backward: new_zeros(...).scatter_add_(...)); tracing records them out of place.
_INPLACE_IN_EAGER = {"scatter_add", "scatter", "index_add", "index_put", "masked_scatter",
                     "slice_scatter", "select_scatter", "index_copy", "scatter_reduce"}
_FRESH_BUFFERS = {"new_zeros", "zeros", "zeros_like", "new_full", "full", "full_like", "new_empty",
                  "empty", "empty_like"}


def _op_name(target) -> str:
    name = getattr(target, "__name__", "")
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", name.split(".")[0])


def _tensors(val) -> list[torch.Tensor]:
    return [v for v in _torch_api.tree_leaves(val) if isinstance(v, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return _torch_api.size_hint(t.untyped_storage().nbytes())


@dataclasses.dataclass
class _Storages:
    """The storages a joint graph's values live in: which each node's value uses, their sizes and
    allocating nodes, those of the inputs (the baseline), and the last node that reads each."""

    keys: dict  # node -> storage keys of its value
    info: dict  # storage key -> (nbytes, allocating node, a tensor in it)
    baseline: set
    last_use: dict  # storage key -> index of the last node reading it (len(nodes): the graph's end)

    @classmethod
    def of(cls, nodes: list, index: dict) -> "_Storages":
        end = len(nodes)
        keys, info, baseline = {}, {}, set()
        for n in nodes:
            ts = _tensors(n.meta.get("val"))
            keys[n] = [_torch_api.storage_key(t) for t in ts]
            for k, t in zip(keys[n], ts):
                if k not in info:
                    info[k] = (_nbytes(t), n, t)
                if n.op == "placeholder":
                    baseline.add(k)
        last_use = {}
        for n in nodes:
            uses = [end if u.op == "output" else index[u] for u in n.users]
            if n.op == "output":
                continue
            for k in keys[n]:
                last_use[k] = max([last_use.get(k, index[n]), *uses])
        for k in _torch_api.tree_leaves([keys[a] for a in nodes[-1].all_input_nodes]):
            last_use[k] = end  # graph outputs live to the end
        return cls(keys, info, baseline, last_use)


def _eager_reuse(nodes: list, index: dict, bwd_start: int, st: _Storages) -> dict:
    """Eager's in-place reuse in backward (see the module docstring): a node's new storage -> the
    dying operand's storage it takes over (an `add` of gradients, a scatter into a fresh buffer).
    Extends the reused storage's last use to the new value's."""
    reuse: dict = {}
    for n in nodes[bwd_start:]:
        if n.op != "call_function" or len(st.keys[n]) != 1:
            continue
        name = _op_name(n.target)
        out_key = st.keys[n][0]
        candidates = []
        if name == "add":
            candidates = [a for a in n.args[:2] if isinstance(a, torch.fx.Node)]
        elif name in _INPLACE_IN_EAGER and isinstance(n.args[0], torch.fx.Node):
            if _op_name(getattr(n.args[0], "target", None)) in _FRESH_BUFFERS:
                candidates = [n.args[0]]
        for a in candidates:
            if len(st.keys.get(a, ())) != 1:
                continue
            k = reuse.get(st.keys[a][0], st.keys[a][0])
            if (k not in st.baseline and index[st.info[k][1]] >= bwd_start and st.last_use.get(k) == index[n]
                    and st.info[k][0] == st.info[out_key][0] and k != out_key):
                reuse[out_key] = k
                st.last_use[k] = max(st.last_use[k], st.last_use.get(out_key, index[n]))
                break
    return reuse


def walk(joint_gm: torch.fx.GraphModule, n_inputs: int, sites=()) -> PeakEstimate:
    """Storage liveness over a joint graph whose first `n_inputs` placeholders are the baseline;
    `sites` (`SiteRecord`s) give the workspace of its chunked ops."""
    sites = _Sites(sites)
    nodes = list(joint_gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    n_primals = min(n_inputs, len(placeholders))
    # Backward starts at the first node that reads a tangent.
    bwd_start = min((index[u] for t in placeholders[n_primals:] for u in t.users), default=len(nodes))
    st = _Storages.of(nodes, index)
    reuse = _eager_reuse(nodes, index, bwd_start, st)

    def canon(k):
        while k in reuse:
            k = reuse[k]
        return k

    frees: dict = {}
    for k, i in st.last_use.items():
        if k not in st.baseline and k not in reuse:
            frees.setdefault(i, []).append(k)

    live: dict = {}
    live_bytes = peak = saved = 0
    peak_node, peak_phase, peak_live, peak_ws = "", "forward", {}, 0
    for i, n in enumerate(nodes):
        if i == bwd_start:
            saved = live_bytes
        for k in map(canon, st.keys[n]):
            if k not in st.baseline and k not in live:
                live[k] = st.info[k]
                live_bytes += st.info[k][0]
        ws = 0
        if n.op == "call_function" and _is_chunked_op(n.target) and n.args and isinstance(n.args[0], str):
            args_tensors = [a.meta["val"] for a in n.args[1] if isinstance(a, torch.fx.Node)]
            ws = sites.workspace_bytes(n.args[0], args_tensors, backward=i >= bwd_start)
        if live_bytes + ws > peak:
            peak, peak_node, peak_live, peak_ws = live_bytes + ws, n.name, dict(live), ws
            peak_phase = "backward" if i >= bwd_start else "forward"
        for k in frees.get(i, ()):
            if k in live:
                live_bytes -= live.pop(k)[0]

    out_node = nodes[-1]
    grads = out_node.args[0][1] if out_node.args and isinstance(out_node.args[0], (tuple, list)) \
        and len(out_node.args[0]) == 2 else []
    floor = sum(st.info[canon(k)][0] for g in grads if isinstance(g, torch.fx.Node) for k in st.keys[g])
    live_list = sorted(
        (LiveTensor(node.name, nb, tuple(_torch_api.size_hint(s) for s in t.shape), t.dtype,
                    "backward" if index[node] >= bwd_start else "forward")
         for nb, node, t in peak_live.values()),
        key=lambda lt: -lt.nbytes)
    return PeakEstimate(peak_bytes=peak, baseline_bytes=sum(st.info[k][0] for k in st.baseline), floor_bytes=floor,
                        saved_bytes=saved, peak_node=peak_node, peak_phase=peak_phase,
                        live_at_peak=live_list, workspace_bytes=peak_ws)


def estimate_peak(gm: torch.fx.GraphModule, fake_inputs, sites=()) -> PeakEstimate:
    """Estimated peak bytes above the inputs of one forward+backward of `gm` (eager semantics).

    `sites`: the `SiteRecord`s of `gm`'s chunked ops, if it has any (`GraphRecord.sites`).
    """
    joint_gm, n_primals, _ = trace_joint(gm, fake_inputs, sites)
    return walk(joint_gm, n_primals, sites)


def estimate_rewrite(result) -> MemoryEstimate:
    """Before/after peaks of a `RewriteResult`: the graph's, not a site's (sites share one peak)."""
    before = estimate_peak(result.before, result.fake_inputs)
    sites = list(getattr(result.record, "sites", []) or [])
    rewritten = result.after is not None and result.after is not result.before and sites
    after = estimate_peak(result.after, result.fake_inputs, sites) if rewritten else before
    return MemoryEstimate(before=before, after=after)
