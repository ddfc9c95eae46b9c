"""Replace each row-local region by one chunked, recomputing `graphpass::rowwise_chunked` op.

Before (the user's spelling, at ATen level)::

    to = aten.to.dtype(logits, float32); div = aten.div.Tensor(to, 0.7)
    lsm = aten.log_softmax.int(div, -1); lp = aten.gather(lsm, -1, idx).squeeze(-1)
    ent = aten.neg(aten.sum.dim_IntList(aten.mul(aten.exp(lsm), lsm), [-1]))

After::

    op = graphpass.rowwise_chunked("r<hash>", [logits, idx], [], [T, T])
    lp, ent = op[0], op[1]

The program behind the key runs the same ops on `[chunk, V]` slices; see `graphpass.ops.chunked_op`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator

import torch

from graphpass._torch_api import (detect_fake_mode, float64_tensor_node, known_equal, new_fake_mode,
                                  same_size, size_hint, stable_topological_sort)
from graphpass.analysis import rowlocal
from graphpass.analysis.grad_flow import grad_flows, grad_modes
from graphpass.analysis.lm_head import METADATA_CHECKS, LmHead, match_lm_head, not_computed_here
from graphpass.analysis.regions import Region, find_regions, source_of
from graphpass.analysis.summed_loss import SummedLoss, match_summed_loss
from graphpass.ops import chunked_op
from graphpass.ops.chunked_op import BCAST, ROW, SCALAR, WIDE, InputSpec, OutputSpec, RegionProgram
from graphpass.ops.head_matmul import HeadSpec
from graphpass.ops.lm_head import LinearHeadProgram
from graphpass.records import REPLACED_FUNCTION, OutputRecord, Rejection, SiteRecord, site_kind
from graphpass.rewrite.loss_gradients import add_gradient_carrier, loss_coefficients

log = logging.getLogger("graphpass")
aten = torch.ops.aten


class RegionRejected(Exception):
    """A region that cannot be expressed as a chunked program; the message says why."""


def chunk_rowwise_regions_pass(gm, example_inputs, *, config, record) -> torch.fx.GraphModule:
    """Rewrite every row-local region of `gm` into a chunked op; fill `record.sites/rejected`."""
    _drop_metadata_checks(gm.graph)
    regions, rejected = find_regions(gm)
    record.rejected.extend(rejected)
    modes = grad_modes(gm.graph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = [_lm_head(region, modes, record) for region in regions]
    heads = [head for head, _ in found]
    frozen = [_frozen_heads(region, head, record) for region, head in zip(regions, heads)]
    built, taken = {}, set()  # `taken`: the loss math (and sums) sites built before took in
    # Build and label every region before the graph changes under them; those with an lm_head
    # first: where two sites' gradients meet in one loss, taking it in saves an lm_head a GEMM.
    for i in sorted(range(len(regions)), key=lambda i: heads[i] is None):
        region = regions[i]
        try:
            built[i] = _build_site(region, heads[i], config, modes, order, record, taken, frozen[i])
            built[i].head_reason = built[i].head_reason or found[i][1]
        except RegionRejected as e:
            record.rejected.append(Rejection(source_of(region.anchor), str(e)))
            log.info("graphpass: not rewriting region at %s: %s", source_of(region.anchor), e)
            continue
        if built[i].loss is not None:
            taken.update(built[i].loss.nodes, built[i].loss.totals)
    replaced: dict = {}  # node -> the op output that replaced it: a later site may read it
    for i, site in sorted(built.items()):
        record.sites.append(_site_record(regions[i], site))
        _replace(gm.graph, site, replaced)
    # An output may be used before the region's last node; move such users after the op.
    stable_topological_sort(gm.graph)
    return gm


@dataclasses.dataclass
class _Site:
    """What replaces one region: its program, the op's input nodes, and what it took in."""

    region: Region
    """The nodes the op replaces (with `loss`, the region and its loss math)."""
    program: RegionProgram
    input_nodes: list
    head: LmHead | None = None
    frozen: tuple = ()
    """Heads of other wide inputs the op computes chunk by chunk, with no gradient (`_frozen_heads`)."""
    loss: SummedLoss | None = None
    """The per-token loss math and its sum, when the op computes its gradients in forward."""
    recompute_reason: str | None = None
    head_reason: str | None = None
    """Why the op reads the logits rather than computing them from the hidden states (`SiteRecord.lm_head_reason`)."""
    needs_grad: list | None = None
    """With `loss`: per op input, whether the op computes its gradient (`_needs_grad`)."""


def _build_site(region: Region, head: LmHead | None, config, modes, order, record, taken=frozenset(),
                frozen=()) -> _Site:
    """The richest rewrite of `region` that builds: with its lm_head `head` and its loss math, with
    its lm_head alone, or the region alone (each fallback's reason recorded). `taken`: nodes of
    the loss math another site already took in; `frozen`: gradient-free heads the op computes
    (`_frozen_heads`), in every rewrite (they need no gradient, so none changes the backward)."""
    loss, why = None, None
    if not config.gradients_in_forward:
        why = "gradients_in_forward=False"
    elif head is None:
        # Over given logits the recompute costs what it saves: the backward's one pass over the
        # logits (reading them, writing their gradient) is the pass a forward with gradients
        # would add; and a loss gradient other than 1 would cost one more, to scale them.
        why = "it reads the logits: its backward's one pass over them costs what computing it in forward would"
    else:
        loss, why = match_summed_loss(region, modes, order)
    if loss is not None and taken.intersection([*loss.nodes, *loss.totals]):
        loss, why = None, "its loss math is shared with another site's, which computes its gradients in forward"
    if loss is not None:
        extended = _with_loss(region, loss, order)
        try:
            program, input_nodes = _build_program(extended, config, head, loss, frozen)
            needs_grad = _needs_grad(input_nodes, program.gradient_free)
            try:
                program.prepare_gradients_in_forward(needs_grad)
            except Exception as e:  # noqa: BLE001 - a kernel that does not trace is not used
                raise RegionRejected(f"its backward kernel does not trace: {type(e).__name__}: {e}") from None
            return _Site(extended, program, input_nodes, head, frozen, loss, needs_grad=needs_grad)
        except RegionRejected as e:
            why = f"the region with its loss math does not build: {e}"
    if head is not None:
        try:
            return _Site(region, *_build_program(region, config, head, frozen=frozen), head, frozen, recompute_reason=why)
        except RegionRejected as e:
            # The region alone may still be rewritten, reading the logits as today.
            head_reason = f"the region with the lm_head is not rewritten: {e}"
            _keep_head(record, head, head_reason)
            return _Site(region, *_build_program(region, config, frozen=frozen), frozen=frozen, recompute_reason=why,
                         head_reason=head_reason)
    return _Site(region, *_build_program(region, config, frozen=frozen), frozen=frozen, recompute_reason=why)


def _with_loss(region: Region, loss: SummedLoss, order) -> Region:
    """`region` grown by its loss math: its first outputs the summands (summed by the op), then
    every value still read outside, gradient-free (`match_summed_loss` checked)."""
    nodes = sorted([*region.nodes, *loss.nodes], key=order.__getitem__)
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    totals = set(loss.totals)
    escapes = [n for n in nodes if any(u not in inside and u not in totals for u in n.users)]
    return Region(region.anchor, nodes, region.rows, loss.layouts, inputs, [*loss.summands, *escapes], loss.place,
                  region.detached)



def _drop_metadata_checks(graph: torch.fx.Graph) -> None:
    """Erase the `_assert_tensor_metadata` checks pre-dispatch export puts after a `.to(dtype)`:
    they assert a dtype and device the graph's fake values already fix (Dynamo guards on its
    inputs'), and as readers of a `[rows, V]` value they would keep it out of its region."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in METADATA_CHECKS and not node.users:
            graph.erase_node(node)


def _lm_head(region: Region, modes, record) -> tuple[LmHead | None, str | None]:
    """The lm_head the region's op can absorb, or (None, why not: the site's `lm_head_reason`;
    a matmul that could not be taken in is also recorded as rejected)."""
    wide = [n for n in region.inputs if _is_wide_input(region, n)]
    reason = None
    for node in wide:
        if grad_flows(node) is False and (modes[node] != modes[region.place]
                                          or any(grad_flows(n) is not False for n in wide)):
            continue  # a gradient-free head (beside logits that need one): a frozen head, `_frozen_heads`
        head, why = match_lm_head(region, node, modes)
        if why is not None:
            record.rejected.append(Rejection(source_of(node), f"lm_head not fused into the region at "
                                                              f"{source_of(region.anchor)}: {why}"))
        if head is None:
            reason = reason or (why if why is not None else not_computed_here(node))
            continue
        # Another wide input is read chunk by chunk beside the head's logits (a teacher's logits,
        # a vocabulary mask); one that needs a gradient would need its own [rows, V] gradient
        # next to the head's blocks: not supported.
        if any(n is not node and n.meta["val"].is_floating_point() and grad_flows(n) is True for n in wide):
            why = "the region reads another [rows, V] input that needs a gradient besides the lm_head's logits"
            _keep_head(record, head, why)
            return None, why
        return head, None
    return None, reason


def _frozen_heads(region: Region, head: LmHead | None, record) -> tuple:
    """The lm_heads of the region's other wide inputs that no gradient reaches (a teacher's, its
    matmul under no_grad), which the op can compute chunk by chunk as it does `head`'s: each
    `hidden @ W.T` with its hidden states over the region's rows, read by the region alone. The
    op gives their operands no gradient, which is theirs: none reaches the logits."""
    found = []
    for node in region.inputs:
        if (head is not None and node is head.logits) or not _is_wide_input(region, node) or grad_flows(node) is not False:
            continue
        frozen, why = match_lm_head(region, node, modes=None)  # any grad mode: no gradient
        if why is not None:
            record.rejected.append(Rejection(source_of(node), f"gradient-free lm_head not fused into the region at "
                                                              f"{source_of(region.anchor)}: {why}"))
        if frozen is not None:
            found.append(frozen)
    return tuple(found)


def _is_wide_input(region: Region, node) -> bool:
    lay = rowlocal.layout_of(node.meta.get("val"), region.rows)
    return lay is not None and lay.kind == ROW and not known_equal(lay.width, 1)


def _keep_head(record, head: LmHead, why: str) -> None:
    record.rejected.append(Rejection(source_of(head.logits), f"lm_head not fused: {why}"))


def _input_spec(node, rows) -> InputSpec:
    val = node.meta["val"]
    lay = rowlocal.layout_of(val, rows)
    if lay is None:
        raise RegionRejected(f"input {node.name} {tuple(val.shape)} neither spans nor broadcasts over the rows")
    if lay.kind == BCAST and val.ndim == 0:
        return InputSpec(SCALAR, 1, val.dtype)
    width, vocab = _width(lay.width)
    role = BCAST if lay.kind == BCAST else ROW if known_equal(lay.width, 1) else WIDE
    return InputSpec(role, width, val.dtype, vocab)


def _width(width) -> tuple[int, bool]:
    """(the width, or a symbolic one's example value; whether it is symbolic). Per-chunk kernels
    are generated for one vocabulary size (vectorised over it): a symbolic one is specialised to
    each size the op meets at run time (`RegionProgram.at_vocab`)."""
    if isinstance(width, int):
        return width, False
    return size_hint(width), True


def _one_symbolic_width(region: Region) -> None:
    """Reject a region whose symbolic widths are not one size (a program is specialised to one)."""
    widths = set()
    for node in [*region.inputs, *region.outputs]:
        lay = region.layouts.get(node) if node in region.layouts else rowlocal.layout_of(node.meta.get("val"), region.rows)
        width = getattr(lay, "width", None)
        if isinstance(width, torch.SymInt):
            widths.add(width.node.expr)
    if len(widths) > 1:
        raise RegionRejected(f"its widths {sorted(map(str, widths))} are symbolic and not known to be equal; "
                             "mark only the vocabulary dynamic (torch._dynamo.mark_dynamic(logits, 0) for the rows)")


def _build_program(region: Region, config, head: LmHead | None = None, loss: SummedLoss | None = None, frozen=()):
    """The region's canonical per-chunk GraphModule wrapped in a registered RegionProgram, or
    with `head` a LinearHeadProgram whose op reads the hidden states where the region reads the
    logits, and the weight and bias after the region's inputs. With `loss`, the region's first
    outputs are the summands of `loss.totals`, the only outputs that keep a gradient. Each `frozen`
    head's hidden states stand where the region reads its logits, its weight and bias after."""
    graph = torch.fx.Graph()
    env, specs, input_nodes = {}, [], []
    in_region = set(region.nodes)
    for node in region.inputs:
        if isinstance(node.meta.get("val"), torch.SymInt) and all(
                rowlocal.reads_only_as_shape(u, region.layouts) for u in node.users if u in in_region):
            continue  # a size only views name (the row count of `[B, S]` when S varies): chunks need none
        if isinstance(node.meta.get("val"), torch.Tensor):
            specs.append(_input_spec(node, region.rows))
        elif isinstance(node.meta.get("val"), torch.SymFloat):
            # A runtime float (a temperature Dynamo lifted to an input) travels as a 0-d float64
            # tensor: the compiler can keep it a graph input, and it rounds like a Python float.
            specs.append(InputSpec(SCALAR, 1, torch.float64))
        else:
            raise RegionRejected(f"it reads {node.name}, a runtime value that is not a float")
        env[node] = graph.placeholder(f"in{len(input_nodes)}_{node.name}")
        input_nodes.append(node)
    if not any(s.role == WIDE for s in specs):
        raise RegionRejected("it reads no [rows, V] input")
    _one_symbolic_width(region)
    for o in region.outputs[len(loss.totals) if loss is not None else 0:]:
        for size in o.meta["val"].shape:  # the op's outputs take these sizes from the outer graph
            _size_source(size, region.inputs)
    for node in region.nodes:
        env[node] = rowlocal.emit(graph, node, env, region.layouts)
        if node in region.detached and isinstance(node.meta.get("val"), torch.Tensor):
            env[node] = graph.call_function(aten.detach.default, (env[node],))  # computed under no_grad
    graph.output(tuple(env[o] for o in region.outputs))
    outputs = []
    for j, o in enumerate(region.outputs):
        val = o.meta["val"]
        lay = region.layouts[o]
        if not isinstance(val, torch.Tensor):
            raise RegionRejected(f"output {o.name} is not a tensor")
        width, vocab = _width(lay.width)
        if loss is None:
            outputs.append(OutputSpec(width, val.dtype, val.ndim, grad_flows(o) is not False, vocab=vocab))
        elif j < len(loss.totals):  # a summand: the op returns its total
            outputs.append(OutputSpec(width, val.dtype, 0, True, loss.reductions[j], vocab=vocab))
        else:
            outputs.append(OutputSpec(width, val.dtype, val.ndim, False, vocab=vocab))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    _validate(module, specs, outputs)
    wide = next(node for node, spec in zip(input_nodes, specs) if spec.role == WIDE)
    gradient_free = _gradient_free(region, input_nodes)
    index_checks = _index_checks(region, input_nodes)
    if head is not None:
        spec = _take_head(input_nodes, head)
    frozen_specs = [_take_head(input_nodes, f) for f in frozen]
    for f in frozen_specs:
        gradient_free += [f.position, f.weight] + ([f.bias] if f.bias is not None else [])
    options = dict(chunk_size=config.chunk_size, chunk_budget_bytes=config.chunk_budget_bytes, inner=config.inner,
                   generated_kernels=config.generated_kernels,
                   device=wide.meta["val"].device, index_checks=index_checks,
                   gradient_free=sorted(set(gradient_free)), frozen_heads=frozen_specs)
    try:
        if head is None:
            program = RegionProgram(module, specs, outputs, **options)
        else:
            program = LinearHeadProgram(module, specs, outputs, head=spec, **options)
    except Exception as e:  # noqa: BLE001 - a program whose joint does not trace is not rewritten
        raise RegionRejected(f"its per-chunk forward+backward does not trace: {type(e).__name__}: {e}") from None
    # The registered program: one built earlier from the same content is the one the op runs.
    return chunked_op.program(chunked_op.register(program)), input_nodes


def _take_head(input_nodes: list, head: LmHead) -> HeadSpec:
    """Put the head's hidden states where the region reads its logits, its weight (and bias) after
    the op's inputs so far; where they are now."""
    position = input_nodes.index(head.logits)
    input_nodes[position] = head.hidden
    input_nodes.append(head.weight)
    weight = len(input_nodes) - 1
    if head.bias is not None:
        input_nodes.append(head.bias)
    return HeadSpec(position, weight, len(input_nodes) - 1 if head.bias is not None else None,
                    head.weight_transposed, head.hidden_size)


def _gradient_free(region, input_nodes):
    """Positions of the inputs the region reads only under no_grad: the op gives them no gradient."""
    inside = set(region.nodes)
    return [i for i, node in enumerate(input_nodes)
            if all(u in region.detached for u in node.users if u in inside)]


def _index_checks(region, input_nodes):
    """(input position, ignore_index or None) for inputs used as token ids, to range-check."""
    checks = []
    for node in region.nodes:
        if node.target not in rowlocal.TOKEN_ID_OPS:
            continue
        args = rowlocal.normalized_args(node)
        index = args.get("index", args.get("indices", args.get("target")))
        if index in input_nodes:
            checks.append((input_nodes.index(index), args.get("ignore_index")))
    return checks


def _validate(module, inputs, outputs):
    """Run the per-chunk program on small fake chunks: shapes must come out as [rows, w]."""
    with new_fake_mode():
        shapes = {WIDE: (3,), ROW: (3,), BCAST: (1,), SCALAR: ()}
        args = [torch.empty(shapes[spec.role] + ((spec.width,) if spec.role != SCALAR else ()), dtype=spec.dtype)
                for spec in inputs]
        try:
            outs = module(*args)
        except Exception as e:  # noqa: BLE001 - any failure means the emission is not valid here
            raise RegionRejected(f"per-chunk program does not trace: {type(e).__name__}: {e}") from None
    for out, spec in zip(outs, outputs):
        if tuple(out.shape) != (3, spec.width) or out.dtype != spec.dtype:
            raise RegionRejected(f"per-chunk output {tuple(out.shape)} {out.dtype} != (3, {spec.width}) {spec.dtype}")


def _size_source(size, nodes):
    """Where the outer graph has `size`: an int; a symbolic size node among `nodes` (Dynamo's `s0`);
    or (tensor node, first dim, stop dim) whose dims multiply to it. Else RegionRejected."""
    if isinstance(size, int):
        return size
    for node in nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and same_size(val, size):
            return node
    for node in nodes:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        shape = node.meta["val"].shape
        for start in range(len(shape)):
            for stop in range(start + 1, len(shape) + 1):
                if known_equal(math.prod(shape[start:stop]), size):
                    return node, start, stop
    raise RegionRejected(f"cannot express output size {size} from the region's inputs")


def _size_node(graph, size, nodes):
    """An int, or a graph node computing a symbolic `size` (`_size_source`)."""
    source = _size_source(size, nodes)
    if not isinstance(source, tuple):
        return source
    node, start, stop = source
    shape = node.meta["val"].shape
    dims = [graph.call_function(aten.sym_size.int, (node, d)) for d in range(start, stop)]
    for d, s in zip(dims, range(start, stop)):
        d.meta["val"] = shape[s]
    total = dims[0]
    for d in dims[1:]:
        total = graph.call_function(operator.mul, (total, d))
        total.meta["val"] = size
    return total


def _replace(graph, site: _Site, replaced: dict):
    """Put the site's op in the graph in place of its nodes; `replaced` maps each node an earlier
    site replaced to the op output now standing for it (and gets this site's)."""
    region, program, head, loss = site.region, site.program, site.head, site.loss
    input_nodes = [replaced.get(n, n) for n in site.input_nodes]
    inside = set(region.nodes)
    per_row = region.outputs[len(loss.totals):] if loss is not None else region.outputs
    with graph.inserting_before(region.place.next):
        sizes = [_size_node(graph, s, [*input_nodes, *region.inputs]) for o in per_row for s in o.meta["val"].shape]
        wide = input_nodes[program.wide_input_positions[0]].meta["val"]
        fake_mode = detect_fake_mode([wide])
        tensors = [n if isinstance(n.meta["val"], torch.Tensor) else float64_tensor_node(graph, n, fake_mode)
                   for n in input_nodes]
        if loss is None:
            op = graph.call_function(torch.ops.graphpass.rowwise_chunked.default, (program.key, tensors, sizes))
            with fake_mode:
                op.meta["val"] = [o.meta["val"] for o in region.outputs] + program.empty_saved(wide)
        else:
            needs_grad = site.needs_grad  # the gradients its backward kernel was traced for
            seeds = loss_coefficients(graph, loss, fake_mode, replaced)
            op = graph.call_function(torch.ops.graphpass.rowwise_chunked_with_gradients.default,
                                     (program.key, tensors, sizes, needs_grad, seeds))
            with fake_mode:
                op.meta["val"] = [*[t.meta["val"] for t in loss.totals], *[o.meta["val"] for o in per_row],
                                  torch.empty_like(loss.totals[0].meta["val"]),
                                  *[torch.empty_like(n.meta["val"]) for n, need in zip(tensors, needs_grad) if need],
                                  torch.empty((), dtype=torch.int64)]
        if region.anchor.meta.get("stack_trace"):
            op.meta["stack_trace"] = region.anchor.meta["stack_trace"]
        op.meta["graphpass.program"] = program.key
        outs = [*loss.totals, *per_row] if loss is not None else region.outputs
        for i, out in enumerate(outs):
            item = graph.call_function(operator.getitem, (op, i))
            item.meta.update(out.meta)
            out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
            replaced[out] = item
        if loss is not None:
            gradient_carrier = graph.call_function(operator.getitem, (op, len(outs)))
            gradient_carrier.meta["val"] = op.meta["val"][len(outs)]
    if loss is not None:
        add_gradient_carrier(graph, replaced.get(loss.sink, loss.sink), gradient_carrier, fake_mode)
        for total in loss.totals:
            graph.erase_node(total)
    for node in reversed(region.nodes):
        graph.erase_node(node)
    for fused in ([head] if head is not None else []) + list(site.frozen):
        # the logits' metadata checks, then the matmul; the weight's `t` is dead code
        for node in reversed(fused.nodes):
            graph.erase_node(node)


def _needs_grad(nodes, gradient_free=()) -> list[bool]:
    """Per op input: whether a gradient from the graph's outputs reaches it through the op
    (`tag_grad_flow_pass`; none through a `gradient_free` position: a frozen head's hidden states
    may need one from elsewhere)."""
    return [grad_flows(n) is True and isinstance(n.meta["val"], torch.Tensor) and n.meta["val"].is_floating_point()
            and i not in gradient_free for i, n in enumerate(nodes)]


def _reads_detached(node, region: Region) -> bool:
    """Whether `node`, whose gradient is kept, reads (through the region) a value computed under no_grad."""
    if not region.detached or node in region.detached or grad_flows(node) is not True:
        return False
    inside, todo, seen = set(region.nodes), [node], set()
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in region.detached:
                return True
            if a in inside and a not in seen:
                seen.add(a)
                todo.append(a)
    return False


def _site_record(region: Region, site: _Site) -> SiteRecord:
    """`region`: the region as found (its outputs name the site); `site`: what replaces it."""
    from graphpass.analysis.recognize import ROWWISE, OutputLabel, label_output

    program, input_nodes, head, loss = site.program, site.input_nodes, site.head, site.loss
    # A value computed with grad from one computed under no_grad (`-(p.detach() * logp).sum(-1)`)
    # has a name's value but not its gradient: it is reported as plain row-wise math.
    labels = [OutputLabel(ROWWISE) if _reads_detached(node, region) else label_output(node) for node in region.outputs]
    # What the region computes (with `loss`, before the op took in the loss math after it).
    outputs = [OutputRecord(label.kind, grad_flows(node) is not False, label.temperature)
               for node, label in zip(region.outputs, labels)]
    position = program.wide_input_positions[0]
    frozen = {spec.position: f.logits for spec, f in zip(program.frozen_heads, site.frozen)}
    wide = (head.logits if head is not None else frozen.get(position, input_nodes[position])).meta["val"]
    vocab = size_hint(wide.shape[-1])
    rows = size_hint(wide.numel()) // vocab if vocab else 0
    itemsize = wide.dtype.itemsize
    replaced = sorted({n.meta[REPLACED_FUNCTION] for n in region.nodes if REPLACED_FUNCTION in n.meta})
    extra = dict(gradients_in_forward=loss is not None, recompute_reason=site.recompute_reason,
                 frozen_lm_heads=len(site.frozen), replaced_function=", ".join(replaced) or None)
    if head is not None:
        forward_workspace = program.workspace_bytes(rows, vocab, itemsize, backward=loss is not None)
        extra.update(lm_head=True, hidden_shape=tuple(head.hidden.meta["val"].shape),
                     forward_workspace_bytes=forward_workspace)
    else:
        extra.update(lm_head_reason=site.head_reason)
    return SiteRecord(
        kind=site_kind(label.kind for label in labels),
        source=source_of(region.anchor),
        shape=tuple(wide.shape),
        dtype=wide.dtype,
        chunk_size=program.chunk_size,
        outputs=outputs,
        program_key=program.key,
        wide_inputs=len(program.wide_input_positions),
        chunk_rows=(program.block_rows(rows, vocab, itemsize) if head is not None
                    else program.rows_per_chunk(rows, vocab, itemsize)),
        workspace_bytes=program.workspace_bytes(rows, vocab, itemsize),
        **extra,
    )
