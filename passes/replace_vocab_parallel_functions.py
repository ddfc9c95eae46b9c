"""Replace a vocab-parallel log-prob/entropy `autograd.Function` by the vocab-parallel chunked op.

Megatron's `vocab_parallel_cross_entropy`, slime's `_VocabParallelLogProbEntropy` and their kind
reach the graph as one `autograd_function_apply` (a stub after capture) whose forward all-reduces
row statistics over the tensor-parallel group and whose backward is written by hand. When the
forward computes exactly log-probs and/or entropies of its vocabulary slice
(`graphpass.analysis.vocab_parallel`), the Function, forward and backward together, becomes one
`graphpass::vocab_parallel_logprob_entropy` call: one collective per call instead of one per
statistic, O(rows) saved instead of the softmax. The group is the one the forward names; a
Function run without a process group (its all-reduces skipped, its targets still tested against
its columns) becomes the op of one rank, which issues no collective.

megatron-core's label-smoothed loss, `(1 - s) * (lse - x_t) - s * mean(log p)` with the mean over
this rank's slice alone (each rank's loss differs), becomes the op with its slice mean of the
log-probs (`with_slice_mean`) and the same two products added in the graph; ops over the same
logits merge with it. The lm_head ops do not compute that mean: such an op keeps its logits (the
reason on the site, so no gradients in forward either); code with a gradient through functional
all-reduces that reads it is kept (their backward would sum that local mean's gradient).

Also moved into the op, where exact: an fp32 upcast of bf16/fp16 logits (the op upcasts one chunk
at a time) and a division of the logits by a constant temperature: of the compute-dtype logits
(the op divides each upcast chunk), or of bf16/fp16 logits in their own dtype, as verl's Megatron
actor divides (the op's `rounded_division`: each chunk divided in that dtype, rounding as eager
does, then upcast; its gradient divided in that dtype as eager's autograd divides it). Anything
else stays as it was; a Function with collectives that does not match is recorded with the reason.

A Function that multiplies by this rank's weight shard itself (NeMo-RL's
`ChunkedDistributedHiddenStatesToLogprobs`) is read at its logits
(`output_layer_function.cut_forward_at_logits`): it becomes the product (its hidden states' rows
all-gathered first where it gathers them) and the op on the product's cast and permuted rows.
A chunked Function's forward that Dynamo inlined on a rank where no input requires grad is
folded as its body is where it is replaced (`_fold_where_it_reads`), and the op reads logits
through permutations of their rows (`_read_through`): every rank gets the same op, in the same
row order, and issues the same collectives.

When the logits the op then reads are this rank's lm_head, `F.linear(hidden, W_shard (, b_shard))`
or `hidden @ W_shard.t()` in the same graph and grad mode, read by nothing else, the op becomes
`graphpass::vocab_parallel_lm_head_logprob_entropy(hidden, W_shard, b_shard, ...)`: each chunk's
logits computed (and recomputed in backward) from the hidden states, the `[*, V/tp]` logits and
their gradient never stored, the same one collective (`SiteRecord.lm_head`). Where the logits come
from a matmul that cannot be absorbed, the reason is recorded and the op reads the logits.

Where such an lm_head op's loss is affine in sums over the rows of per-token math of its outputs
(token-mean PPO, cross-entropy), the op becomes `graphpass::vocab_parallel_lm_head_with_gradients`:
it computes the gradients of the hidden states, weight and bias in its forward, block by block of
rows, with one all-gather of row statistics per block (three GEMMs instead of four;
`SiteRecord.gradients_in_forward`, else `recompute_reason` says why). The choice reads the graph
alone, so every rank that traces the same graph issues the same collectives whatever its grad mode.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis.regions import source_of
from graphpass.analysis.grad_flow import grad_modes, requires_grad
from graphpass.analysis.backward_check import joint_module
from graphpass.analysis.lm_head import (METADATA_CHECKS, LmHead, is_vocab_bias, match_matmul, not_computed_here,
                                        other_readers)
from graphpass.analysis.output_layer_function import (ForwardCut, cut_forward_at_logits, emit_product,
                                                      hidden_gradient_collective, output_layer_inside, read_transposes,
                                                      transposed_inputs)
from graphpass.analysis.vocab_parallel import (EMPTY, MIXES, NO_LOGPROB, NOT_PARALLEL, VocabParallelMatch,
                                                match_forward, match_graph, match_token_loss,
                                                values_without_gradient)
from graphpass.capture import CantCapture, capture, hop_of, later_reader, written_inputs
from graphpass.fx_utils import copy_graph_module
from graphpass.lint import INPLACE_ALL_REDUCE_FRAMES  # how lint knows them
from graphpass.ops.groups import rank_and_size
from graphpass.ops.vocab_parallel import collective_bytes
from graphpass.ops.vocab_parallel_gradients import block_rows, register_loss
from graphpass.records import CollectiveRecord, OutputRecord, Rejection, SiteRecord, site_kind
from graphpass.rewrite.loss_gradients import add_gradient_carrier, loss_coefficients
from graphpass.rewrite.replaced_function import as_the_output_was

from . import fold_function_body, read_folded

aten = torch.ops.aten

__all__ = ["replace_vocab_parallel_functions_pass"]


def replace_vocab_parallel_functions_pass(gm: torch.fx.GraphModule, example_inputs, *, config,
                                          record) -> torch.fx.GraphModule:
    """Each vocab-parallel log-prob/entropy Function -> one `vocab_parallel_logprob_entropy` call;
    so too the same math inlined in the graph, where no gradient flows through it; then each
    op whose logits are an lm_head matmul read by nothing else takes the matmul in."""
    built = []  # (site, op node)
    for stub in list(gm.graph.find_nodes(op="call_function", target=torch.ops.graphpass.opaque.default)):
        hop = hop_of(stub)
        if hop.target is not _torch_api.autograd_function_apply():
            continue
        match = _match_function(hop, stub, config)
        if not isinstance(match, (VocabParallelMatch, _OutputLayerFunction)):
            if match is not None:
                record.rejected.append(Rejection(source_of(stub), match))
            continue
        lost = _lost_write(gm.graph, stub, hop) if hop.mutates_inputs else None
        if lost is not None:
            record.rejected.append(Rejection(source_of(stub), f"vocab-parallel Function kept: {lost}"))
            continue
        if isinstance(match, _OutputLayerFunction):  # its product first, then the op reads it
            match = _emit_output_layer(gm.graph, stub, match)
        built.append(_replace_function(gm.graph, stub, hop, match, config))
    built = _merge_same_logits(gm.graph, built, record)
    built = [(*b, True) for b in built]  # (site, op node, whether its gradients may be computed in forward)
    inlined = _replace_inlined(gm, example_inputs, config, record)
    if inlined is not None:
        built = _merge_inlined(gm.graph, built, inlined, record)
    # The replaced code's readers of the logits (an upcast, a division moved into the op) are gone
    # before the fusion asks what else reads them.
    gm.graph.eliminate_dead_code()
    for site, op, _ in built:
        _note_kept_division(op, site, record)
    modes = grad_modes(gm.graph)
    heads = [(site, _fuse_lm_head(gm.graph, op, site, modes, record), may) for site, op, may in built]
    taken = set()  # the loss math an earlier site took in
    for site, head, may in heads:
        if head is not None and not may:
            # Functional all-reduces, or a gradient through them: a sum over the ranks in backward,
            # which the op computing its gradients in forward does not do.
            site.recompute_reason = "its code's all-reduces are functional collectives or carry a gradient"
        elif head is not None:
            _take_loss_math(gm, example_inputs, head, site, config, taken)
        _add_site(record, site)
    gm.graph.eliminate_dead_code()
    return gm


def _lost_write(graph: torch.fx.Graph, stub: torch.fx.Node, hop) -> str | None:
    """Why replacing the Function behind `stub` would lose a write its forward makes into one of
    its inputs that this graph reads afterwards (or returns), or None.

    megatron-core's loss writes its softmax into its logits: eager code that reads them after the
    call reads the softmax, and the op that replaces the Function writes nothing. On a clone read
    by the Function alone (as callers hand it) the write is invisible. A graph input it overwrites
    and nothing in the graph reads again is not reported: graphpass leaves the caller's tensor as
    it was (`bench.tp` records `input_overwritten` for eager)."""
    reader = later_reader(graph, stub, list(stub.args[1]), written_inputs(hop.bodies[0]))
    if reader is None:
        return None
    return f"its forward writes into {reader} after it (replacing it would lose the write); hand it a clone"


_OP = torch.ops.graphpass.vocab_parallel_logprob_entropy.default
_OTHER_LOGITS = "reads other logits"  # not a reason: ops over different logits have nothing to share


def _merge_same_logits(graph: torch.fx.Graph, built: list, record) -> list:
    """`built` ((site, op) per replaced Function) with the ops that read the same logits merged
    into one op where that is exact (`_merge_reason`): one collective, and one gradient of the
    logits instead of one per op, which autograd would add up in a second `[*, V/tp]` buffer.

    megatron-core's loss on a clone of the logits and an entropy Function on the logits themselves
    (verl's Megatron actor; slime with the entropy beside its own log-prob) are two such ops once
    the clone is absorbed. The merged op computes the log-prob of the one target that is used (an
    op whose log-prob nothing reads asks for none) and the entropy if either did; the outputs'
    readers read it, each as before (a detach where the Function's output had no gradient). The
    merged op then absorbs what now only it reads (a temperature's division, an upcast). Ops that
    read the same logits but cannot be merged stay apart, the reason among the candidates.

    The choice reads the graph alone, so every rank tracing the same code merges alike; a rank
    whose Functions Dynamo inlined (no input requires grad) computes every log-prob and entropy of
    the logits in one op too (`_replace_inlined`), with the same one collective."""
    if len(built) < 2:
        return built
    kept = []  # [site, op, whether merged], in graph order
    reasons = {}
    for site, op in sorted(built, key=lambda b: _position(graph, b[1])):
        for entry in kept:
            why = _merge_reason(graph, entry[1], op)
            if why is None:
                entry[:] = [*_merge(graph, entry[0], entry[1], site, op), True]
                reasons.pop(op, None)
                break
            if why is not _OTHER_LOGITS:
                reasons.setdefault(op, (entry[0], why))
        else:
            kept.append([site, op, False])
    for op, (other, why) in reasons.items():
        site = next(s for s, o in built if o is op)
        record.rejected.append(Rejection(site.source, f"vocab-parallel op not merged with the one at {other.source} "
                                                      f"over the same logits: {why}"))
    if any(m for _, _, m in kept):
        # The replaced ops' readers of the logits (an absorbed clone) go before the merged op
        # asks what else reads them.
        graph.eliminate_dead_code()
        for entry in kept:
            if entry[2]:
                _absorb_into(entry[0], entry[1])
    return [(site, op) for site, op, _ in kept]


def _position(graph, node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    raise KeyError(node)


#: The op's output that is the mean log-prob over this rank's vocabulary slice (`with_slice_mean`).
_SLICE_MEAN_ITEM = 4


def _with_slice_mean(op: torch.fx.Node) -> bool:
    """Whether the op computes the slice mean of the log-probs (its argument 12, `with_slice_mean`)."""
    return len(op.args) > 12 and bool(op.args[12])


def _log_prob_read(op: torch.fx.Node) -> bool:
    """Whether anything reads the op's log-prob (output 0)."""
    return any(u.target is not operator.getitem or (u.args[1] == 0 and u.users) for u in op.users)


def _entropy_read(op: torch.fx.Node) -> bool:
    return any(u.target is not operator.getitem or (u.args[1] == 1 and u.users) for u in op.users)


def _same_value(a, b) -> bool:
    """`a` and `b` are the same node, or the same reshape (or view) of the same node."""
    if a is b:
        return True
    return (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) and a.op == b.op == "call_function"
            and a.target is b.target and a.target in _RESHAPES and not a.kwargs and not b.kwargs
            and a.args[0] is b.args[0] and list(a.args[1]) == list(b.args[1]))


def _merge_reason(graph, a: torch.fx.Node, b: torch.fx.Node, place: torch.fx.Node | None = None):
    """None when ops `a` and `b` compute exactly what one op reading their logits computes, put
    before `place` (default: `a`, the earlier; else the one in grad mode where the other runs
    without grad); else why not (`_OTHER_LOGITS` when they read different logits)."""
    (la, ta, ka, ga, tempa, wea, _, iia, ca, kera), (lb, tb, kb, gb, tempb, web, _, iib, cb, kerb) = \
        a.args[:10], b.args[:10]
    if la is not lb:
        return _OTHER_LOGITS
    if ga != gb:
        return f"they all-reduce over different groups ({ga!r}, {gb!r})"
    if tempa != tempb:
        return f"they divide the logits by different temperatures ({tempa:g}, {tempb:g})"
    if _rounded(a) != _rounded(b):
        return "one divides the logits by the temperature in their dtype, the other in fp32"
    if ka is not None or kb is not None:
        return "a keep mask"
    if (ca, kera) != (cb, kerb):
        return "different chunking"
    if any(u.target is not operator.getitem or u.args[1] not in (0, 1, _SLICE_MEAN_ITEM) for u in (*a.users, *b.users)):
        return "an op's outputs are read whole"
    if (_entropy_read(a) and not wea) or (_entropy_read(b) and not web):
        return "an op's empty entropy is read"
    modes = grad_modes(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    explicit, place = place is not None, a if place is None else place
    if modes[a] != modes[b]:
        if not explicit:
            return "they run in different grad modes"
        # The op without grad reads the merged op's outputs detached, after it, in its own mode.
        other = b if place is a else a
        if modes[place] is not True or any(order[u] <= order[place] for g in other.users for u in g.users):
            return "they run in different grad modes, and the one without grad is read before the other"
    if _log_prob_read(a) and _log_prob_read(b):
        if not _same_value(ta, tb) or iia != iib:
            return "both log-probs are read, of different targets"
    for op, target in ((a, ta), (b, tb)):
        if op is not place and _log_prob_read(op) and any(order[n] >= order[place] for n in _target_inputs(target)):
            return "the log-prob's targets are computed after the other op"
    return None


def _target_inputs(target: torch.fx.Node) -> list:
    """The nodes the merged op needs before it to compute `target` there: its own inputs where it
    is a reshape (recreated), else itself."""
    if target.op == "call_function" and target.target in (*_RESHAPES, aten.zeros.default):
        return list(target.all_input_nodes)
    return [target]


def _merge(graph, site_a: SiteRecord, a: torch.fx.Node, site_b: SiteRecord, b: torch.fx.Node,
           place: torch.fx.Node | None = None):
    """(site, op) of one op before `place` (default `a`) computing what ops `a` and `b` computed;
    both erased. The outputs of one in another grad mode than `place` are read detached."""
    place = a if place is None else place
    (logits, target, keep_mask, group, temperature, with_a, grad_a, ignore_index, chunk, kernels) = a.args[:10]
    with_b, grad_b = b.args[5], b.args[6]
    fake_mode = _torch_api.detect_fake_mode([logits.meta["val"]])
    read_a, read_b = _log_prob_read(a), _log_prob_read(b)
    modes = grad_modes(graph)
    with graph.inserting_before(place):
        if read_b and not read_a:
            target, ignore_index = b.args[1], b.args[7]
        if target.op == "call_function" and target.target in (*_RESHAPES, aten.zeros.default) and \
                not _before(graph, target, place):
            target = _torch_api.fake_node(graph, fake_mode, target.target, target.args, target.kwargs, target)
        with_entropy = with_a or with_b
        entropy_grad = (with_a and grad_a) or (with_b and grad_b)
        with_slice_mean = _with_slice_mean(a) or _with_slice_mean(b)
        op = _torch_api.fake_node(graph, fake_mode, _OP, (logits, target, keep_mask, group, temperature, with_entropy,
                                                          entropy_grad, ignore_index, chunk, kernels, _rounded(a),
                                                          *(next(o for o in (a, b) if _with_slice_mean(o)).args[11:13]
                                                            if with_slice_mean else a.args[11:12])),
                                  {}, place)
        indices = (0, 1, _SLICE_MEAN_ITEM) if with_slice_mean else (0, 1)
        items = {i: _torch_api.fake_node(graph, fake_mode, operator.getitem, (op, i), {}, place) for i in indices}
        detached = {i: _torch_api.fake_node(graph, fake_mode, aten.detach.default, (item,), {}, place)
                    for i, item in items.items()}
    for old in (a, b):
        for user in list(old.users):
            user.replace_all_uses_with((items if modes[old] == modes[place] else detached)[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(old)
    # The log-prob of an op whose log-prob nothing read (and whose target the other's replaced) is gone.
    outputs = [o for site, read, other in ((site_a, read_a, read_b), (site_b, read_b, read_a)) for o in site.outputs
               if read or not other or o.kind.lstrip("-") != "logprob"]
    wide = logits.meta["val"]
    rows_hint = _torch_api.size_hint(wide.numel()) // max(1, _torch_api.size_hint(wide.shape[-1]))
    site = dataclasses.replace(
        site_a, kind=site_kind(o.kind for o in outputs), outputs=outputs,
        collectives=_all_gathers(site_a.tp_size, [collective_bytes(rows_hint, wide.dtype, with_entropy, masked=False)]))
    return site, op


def _before(graph, node, place) -> bool:
    for n in graph.nodes:
        if n is node:
            return True
        if n is place:
            return False
    return False


def _merge_inlined(graph: torch.fx.Graph, built: list, inlined: tuple, record) -> list:
    """`built` ((site, op, may) per replaced Function) with `inlined` (the op `_replace_inlined`
    built) merged into the Function op over the same logits where exact, else appended.

    An entropy computed under `torch.no_grad()` beside megatron-core's loss (a logged metric) is
    inlined by Dynamo, the loss stays a Function: two ops, two all-gathers, on a rank whose logits
    require grad, and one op (both inlined) on a rank whose do not. Merged, every rank issues the
    one all-gather; the no-grad code reads the merged op's outputs detached. Only an inlined
    Function forward (`function_forward`) with no gradient through it merges."""
    site, op, function_forward = inlined
    if not function_forward or any(c.op == "all_reduce in backward" for c in site.collectives):
        return [*built, inlined]
    modes = grad_modes(graph)
    for index, (other_site, other, may) in enumerate(built):
        place = other if modes[other] and not modes[op] else None
        first, second = (other, op) if _before(graph, other, op) else (op, other)
        sites = {other: other_site, op: site}
        why = _merge_reason(graph, first, second, place)
        if why is None:
            merged_site, merged = _merge(graph, sites[first], first, sites[second], second, place)
            graph.eliminate_dead_code()
            _absorb_into(merged_site, merged)
            built[index] = (merged_site, merged, may)
            return built
        if why is not _OTHER_LOGITS:
            record.rejected.append(Rejection(site.source, f"vocab-parallel op not merged with the one at "
                                                          f"{other_site.source} over the same logits: {why}"))
    return [*built, inlined]


def _absorb_into(site: SiteRecord, op: torch.fx.Node) -> None:
    """The merged `op` reading through what only it now reads (`_absorb_scaling`); the site updated."""
    logits, temperature, rounded = _absorb_scaling(op.args[0], op.args[4], _rounded(op))
    if logits is op.args[0]:
        return
    op.args = (logits, *op.args[1:4], float(temperature), *op.args[5:10], rounded, *op.args[11:])
    wide = logits.meta["val"]
    site.shape, site.dtype = tuple(wide.shape), wide.dtype
    for output in site.outputs:
        output.temperature = _temperature_text(temperature, rounded, wide.dtype)


def _rounded(op: torch.fx.Node) -> bool:
    """Whether the op divides its logits by the temperature in their own dtype (`rounded_division`)."""
    return len(op.args) > 10 and bool(op.args[10])


def _temperature_text(temperature: float, rounded: bool, dtype: torch.dtype) -> str | None:
    if temperature == 1.0:
        return None
    return f"/ {temperature:.3g}" + (f" in {str(dtype).removeprefix('torch.')}" if rounded else "")


def _note_kept_division(op: torch.fx.Node, site: SiteRecord, record) -> None:
    """Among the candidates: the op reads a temperature's division of bf16/fp16 logits that
    `_absorb_scaling` left outside it, so the quotient and its gradient exist whole."""
    logits = op.args[0]
    if not (isinstance(logits, torch.fx.Node) and logits.op == "call_function"
            and logits.target in (aten.div.Tensor, aten.div.Scalar) and isinstance(logits.args[1], float)):
        return
    val = logits.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype in (torch.bfloat16, torch.float16):
        dtype = str(val.dtype).removeprefix('torch.')
        checks = [u for u in logits.users if u.op == "call_function" and u.target in METADATA_CHECKS]
        if len(logits.users) - len(checks) > 1:
            why = "other code reads the quotient"
        elif op.args[4] != 1.0:
            why = (f"the op divides by {op.args[4]:g} after it (two roundings in {dtype} and fp32, "
                   "which one division in the op does not reproduce)")
        else:
            why = "its divisor or dtypes are not those of one constant division in the logits' dtype"
        record.rejected.append(Rejection(source_of(logits), f"the division of {dtype} logits by {logits.args[1]:g} "
                                                            f"stays outside the vocab-parallel op at {site.source}: "
                                                            f"{why}"))


def _add_site(record, site: SiteRecord) -> None:
    record.sites.append(site)
    record.collectives.extend(site.collectives)


_HEAD_OP = torch.ops.graphpass.vocab_parallel_lm_head_logprob_entropy.default


def _fuse_lm_head(graph: torch.fx.Graph, op: torch.fx.Node, site: SiteRecord, modes, record) -> torch.fx.Node | None:
    """`op` reading `hidden, W (, b)` instead of its logits where they are `hidden @ W.T (+ b)`
    (`graphpass.analysis.lm_head.match_matmul`) that nothing else reads, in the op's grad mode: the
    new op's node; else None, `op` as it is, with the reason on the site (and among the candidates
    where the logits are a matmul)."""
    logits = op.args[0]
    head, why = _match_head(logits) if isinstance(logits, torch.fx.Node) else (None, None)
    if head is not None and _rounded(op):
        dtype = str(logits.meta["val"].dtype).removeprefix("torch.")
        head, why = None, (f"the op divides its logits by the temperature in {dtype} (as the code does, between "
                           "the matmul and the loss); the lm_head ops divide in fp32")
    if head is not None and _with_slice_mean(op):
        head, why = None, ("the op computes the mean log-prob over this rank's vocabulary slice (megatron-core's label "
                           "smoothing), which the lm_head ops do not compute")
    if head is not None and head.weight_transposed:
        head, why = None, "its weight is [H, V/tp] (hidden @ W), not the [V/tp, H] shard of hidden @ W.T"
    checks = []
    if head is not None:
        checks, why = other_readers(logits, {op}, "the vocab-parallel op")
        if why is not None:
            head = None
    if head is not None and any(modes[n] != modes[op] for n in head.nodes):
        head, why = None, "the matmul runs in another grad mode than the vocab-parallel op"
    if head is None:
        if why is not None:
            record.rejected.append(Rejection(source_of(logits), f"lm_head not fused into the vocab-parallel op at "
                                                                f"{site.source}: {why}"))
        site.lm_head_reason = why or not_computed_here(logits)
        return None
    fake_mode = _torch_api.detect_fake_mode([logits.meta["val"]])
    with graph.inserting_before(op):
        hidden = head.hidden
        if any(n.op == "call_function" and n.target in _ROW_RESHAPES for n in head.nodes):
            # The logits' reshape, on the hidden states: the same rows in the same order.
            lead = list(logits.meta["val"].shape[:-1])
            hidden = _torch_api.fake_node(graph, fake_mode, aten.reshape.default, (hidden, [*lead, head.hidden_size]),
                                          {}, op)
        fused = _torch_api.fake_node(graph, fake_mode, _HEAD_OP, (hidden, head.weight, head.bias, *op.args[1:10]),
                                     {}, op)
    op.replace_all_uses_with(fused)
    graph.erase_node(op)
    # Metadata checks of the logits (and of the matmul under a bias's addition) that no longer exist.
    for check in [*checks, *(n for n in head.nodes if n.op == "call_function" and n.target in METADATA_CHECKS)]:
        graph.erase_node(check)
    site.lm_head = True
    site.hidden_shape = tuple(hidden.meta["val"].shape)
    return fused


_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
#: Reshapes of the logits that, keeping their last dim, keep their rows in order: the same reshape
#: of the hidden states gives the same rows (slime hands megatron-core's fused loss `logits[:, None]`).
_ROW_RESHAPES = _RESHAPES | {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims}
_WITH_GRADIENTS = torch.ops.graphpass.vocab_parallel_lm_head_with_gradients.default


def _take_loss_math(gm, example_inputs, op: torch.fx.Node, site: SiteRecord, config, taken: set) -> None:
    """The lm_head op `op` -> `vocab_parallel_lm_head_with_gradients`, which computes its inputs'
    gradients in forward, where the loss is affine in sums over the rows of per-token math of its
    outputs (`analysis.vocab_parallel.match_token_loss`); else `op` stays, the reason on the site.

    The new op's log-probs and entropies carry no gradient: the loss math stays in the graph and
    computes the loss's value from them, and the op's carrier, added to the loss, takes the loss's
    gradient to the op, which scales the gradients it computed by it."""
    graph = gm.graph
    hidden, weight, bias, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, \
        chunk, kernels = op.args
    outputs = sorted((u for u in op.users if u.target is operator.getitem and u.args[1] in (0, 1)),
                     key=lambda u: u.args[1])
    order = {n: i for i, n in enumerate(graph.nodes)}
    requires = requires_grad(gm, example_inputs, grad_modes(graph))
    needs = [requires[n] if isinstance(n, torch.fx.Node) else False for n in (hidden, weight, bias)]
    # The choice sets the collectives (one all-gather per block, or one per call): it reads the
    # graph alone, never this rank's grad mode or requires_grad, so every rank of the group makes
    # it alike. A rank that needs no gradient runs the same blocks without computing one.
    with torch.enable_grad():
        modes = grad_modes(graph)
    loss = why = None
    if not config.gradients_in_forward:
        why = "gradients_in_forward=False"
    elif keep_mask is not None or any(u.target is not operator.getitem or u.args[1] not in (0, 1) for u in op.users):
        why = "the op's outputs are read whole"
    else:
        loss = match_token_loss(op, outputs, with_entropy and entropy_grad, modes, order)
        if isinstance(loss, str):
            loss, why = None, loss
        elif taken.intersection([*loss.summed.nodes, *loss.summed.totals]):
            loss, why = None, "its loss math is shared with another site's, which computes its gradients in forward"
    if loss is None:
        site.recompute_reason = why
        return
    summed = loss.summed
    taken.update(summed.nodes, summed.totals)
    fake_mode = _torch_api.detect_fake_mode([hidden.meta["val"]])

    def node(target, *args, **kwargs):
        return _torch_api.fake_node(graph, fake_mode, target, args, kwargs, op)

    with graph.inserting_before(summed.place.next):
        seeds = loss_coefficients(graph, summed, fake_mode, {})
        sides = [node(aten.reshape.default, s, [-1] if per_row else []) for s, per_row in zip(loss.sides, loss.per_row)]
        dtype = outputs[0].meta["val"].dtype
        key = register_loss(loss.program, dtype, [(s.meta["val"].dtype, p) for s, p in zip(loss.sides, loss.per_row)],
                            [seed.meta["val"].dtype for seed in seeds], summed.reductions,
                            with_entropy and entropy_grad)
        fused = node(_WITH_GRADIENTS, hidden, weight, bias, target, sides, seeds, key, group_name, temperature,
                     with_entropy, entropy_grad, ignore_index, chunk, kernels, *needs)
        items = [node(operator.getitem, fused, i) for i in range(3)]
    for old in [u for u in op.users]:
        old.replace_all_uses_with(items[old.args[1]])
        graph.erase_node(old)
    graph.erase_node(op)
    add_gradient_carrier(graph, summed.sink, items[2], fake_mode)
    # The op goes after the last value its loss math reads; its readers come after it.
    _torch_api.stable_topological_sort(graph)
    val = hidden.meta["val"]
    rows, vocab = _torch_api.size_hint(val.numel()) // val.shape[-1], weight.meta["val"].shape[0]
    block = block_rows(chunk, rows, vocab, val.shape[-1], val.dtype.itemsize)
    blocks = -(-rows // block)
    site.gradients_in_forward, site.recompute_reason, site.chunk_rows = True, None, block
    site.collectives = _all_gathers(site.tp_size, [collective_bytes(min(block, rows - i * block), val.dtype,
                                                                    with_entropy, False) for i in range(blocks)])


def _match_head(logits: torch.fx.Node) -> tuple[LmHead | None, str | None]:
    """`match_matmul(logits)`, or `hidden @ W.T + b` written as an addition of a `[V/tp]` bias to
    an unbiased matmul that nothing else reads, or a reshape that keeps the last dim of either
    (`[B, S, V/tp]` to `[B * S, V/tp]`, `[T, V/tp]` to `[T, 1, V/tp]`: the same rows in the same order, as
    for the hidden states).
    `head.logits` is `logits`; `head.nodes` every node the op replaces, with their metadata checks."""
    head, why = match_matmul(logits)
    if head is not None or why is not None:
        return head, why
    if logits.op == "call_function" and logits.target in _ROW_RESHAPES and isinstance(logits.args[0], torch.fx.Node):
        source = logits.args[0]
        val, src_val = logits.meta.get("val"), source.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(src_val, torch.Tensor) and val.ndim >= 2
                and src_val.ndim >= 2 and _torch_api.known_equal(val.shape[-1], src_val.shape[-1])):
            return None, None
        head, why = _match_head(source)
        if head is None:
            return None, why
        checks, why = other_readers(source, {logits}, "the reshape of its logits")
        if why is not None:
            return None, why
        return dataclasses.replace(head, logits=logits, nodes=[logits, *head.nodes, *checks]), None
    if not (logits.op == "call_function" and logits.target is aten.add.Tensor and len(logits.args) == 2
            and not logits.kwargs):
        return None, None
    for matmul, bias in (logits.args, logits.args[::-1]):
        if isinstance(matmul, torch.fx.Node) and isinstance(bias, torch.fx.Node):
            head, why = match_matmul(matmul)
            if head is not None or why is not None:
                break
    else:
        return None, None
    if head is None:
        return None, why
    if head.bias is not None:
        return None, "its logits add a second bias to a biased matmul"
    if not is_vocab_bias(logits, matmul, bias):
        return None, "the value added to its matmul is not one bias per vocabulary entry in the logits' dtype"
    checks, why = other_readers(matmul, {logits}, "the bias's addition")
    if why is not None:
        return None, f"its matmul (before the bias) {why.removeprefix('its logits ')}"
    return dataclasses.replace(head, logits=logits, bias=bias, nodes=[logits, matmul, *checks]), None


def _match_function(hop, stub, config) -> VocabParallelMatch | _OutputLayerFunction | str | None:
    """The match of the Function behind `stub`, else why it is kept (one line), or None for a
    Function with no collective that computes no log-prob or entropy: none of this pass's business."""
    forward = hop.bodies[0]
    tensors = stub.args[1]
    n_outputs = len(forward.graph.output_node().args[0][0])  # Dynamo's forward: ((outputs), (saved))
    try:
        captured = capture(forward, [t.meta["val"] for t in tensors])
    except CantCapture as e:
        return f"vocab-parallel Function kept: its forward cannot be captured: {e}"

    def read(gm):
        outputs = list(gm.graph.output_node().args[0])[len(captured.mutated_inputs):][:n_outputs]
        return match_forward(gm, outputs, _rank_and_size)

    match = read_folded(captured.gm, [t.meta["val"] for t in tensors], read,
                        lambda m: not isinstance(m, str) or m == NOT_PARALLEL, config=config)
    if match == NOT_PARALLEL:
        return None  # one device: replace_hand_written_functions' business
    if hop.unread is not None:
        return f"vocab-parallel Function kept: {hop.unread}"
    if isinstance(match, str):
        product = output_layer_inside(captured.gm)
        if product is not None:
            return _match_output_layer(hop, stub, captured, product, n_outputs, config)
        return f"vocab-parallel Function kept: {match}"
    # The forward's inputs are the stub's tensors, in order.
    placeholders = list(captured.gm.graph.find_nodes(op="placeholder"))
    return dataclasses.replace(
        match, logits=tensors[placeholders.index(match.logits)],
        target=None if match.target is None else tensors[placeholders.index(match.target)])


@dataclasses.dataclass(frozen=True)
class _OutputLayerFunction:
    """A vocab-parallel Function that multiplies by this rank's weight shard itself (NeMo-RL's
    `ChunkedDistributedHiddenStatesToLogprobs`), read at its logits."""

    match: VocabParallelMatch
    """The math from its logits on (`logits` None until they are emitted; `target` the caller's)."""
    cut: ForwardCut
    hidden_gradient: str
    """What its backward does with the hidden states' gradient: "reduce_scatter", "all_reduce", "local"."""


_OUTPUT_LAYER_KEPT = "vocab-parallel Function kept: it multiplies by the output layer itself (at {}), but {}"


def _match_output_layer(hop, stub, captured, product, n_outputs, config) -> _OutputLayerFunction | str:
    """The Function behind `stub`, whose forward computes its logits itself (`product`), read at
    those logits (`output_layer_function.cut_forward_at_logits`), else why it is kept.

    Its forward from the logits on must be vocab-parallel log-probs/entropies, as a logits
    Function's must; its backward is trusted as a logits Function's is, once it returns gradients
    for the hidden states and the weight alone and communicates the hidden states' gradient as
    the forward implies (reduce-scattered where their rows were all-gathered)."""
    forward, backward = hop.bodies[0], hop.bodies[1]
    tensors = stub.args[1]
    vals = [t.meta["val"] for t in tensors]
    where = source_of(product)
    if hop.mutates_inputs or captured.mutated_inputs:
        return _OUTPUT_LAYER_KEPT.format(where, "it writes into its inputs")
    read = capture(forward, vals).gm
    read_transposes(read, transposed_inputs(tensors))
    fold_function_body(read, vals, config=config)
    cut = cut_forward_at_logits(read, n_outputs)
    if isinstance(cut, str):
        return _OUTPUT_LAYER_KEPT.format(where, cut)
    logits_forward = cut.logits_forward
    match = match_forward(logits_forward, list(logits_forward.graph.output_node().args[0]), _rank_and_size)
    if isinstance(match, str):
        return _OUTPUT_LAYER_KEPT.format(where, f"its math on those logits is not read: {match}")
    if cut.gathered_over not in (None, match.group_name):
        return _OUTPUT_LAYER_KEPT.format(where, "it gathers the hidden states over another group than it reduces over")
    outputs = list(captured.gm.graph.output_node().args[0])[:n_outputs]
    grads = [torch.empty_like(o.meta["val"]) for o in outputs]
    n_saved = len(forward.graph.output_node().args[0][1])
    try:
        joint = capture(joint_module(forward, backward, len(tensors), n_outputs, n_saved), vals + grads)
    except Exception as e:  # noqa: BLE001 - a backward that does not trace cannot be read
        return _OUTPUT_LAYER_KEPT.format(where, f"its backward does not trace on fake values ({type(e).__name__})")
    kind, why = hidden_gradient_collective(joint.gm, n_outputs, cut, match.group_name)
    if why is not None:
        return _OUTPUT_LAYER_KEPT.format(where, why)
    placeholders = list(logits_forward.graph.find_nodes(op="placeholder"))
    target = None if match.target is None else tensors[cut.other_positions[placeholders.index(match.target) - 1]]
    return _OutputLayerFunction(dataclasses.replace(match, logits=None, target=target), cut, kind)


def _emit_output_layer(graph: torch.fx.Graph, stub, read: _OutputLayerFunction) -> VocabParallelMatch:
    """The Function's logits in the caller's graph, before `stub`: this rank's product of the
    hidden states (their rows all-gathered first where the Function gathers them: their gradient
    then reduce-scattered, as its backward does) and the weight shard, cast and its rows permuted
    as the Function does; the match reading them. The op reads through the cast and the
    permutation (`_read_through`) and the lm_head fusion takes the product in."""
    tensors, cut = stub.args[1], read.cut
    hidden, weight = tensors[cut.hidden_position], tensors[cut.weight_position]
    group = read.match.group_name
    fake_mode = _torch_api.detect_fake_mode([hidden.meta["val"]])

    def node(target, *args):
        return _torch_api.fake_node(graph, fake_mode, target, args, {}, like=stub)

    with graph.inserting_before(stub):
        if cut.gathered_over is not None:
            gathered = node(_torch_api.functional_collectives.all_gather_into_tensor.default, hidden,
                            _rank_and_size(group)[1], group)
            hidden = node(_torch_api.functional_collectives.wait_tensor.default, gathered)
        elif read.hidden_gradient == "all_reduce":
            hidden = node(torch.ops.graphpass.sum_grads_over_group.default, hidden, group)
    logits = emit_product(graph, cut.logits, {cut.head.hidden: hidden, cut.head.weight: weight}, stub)
    return dataclasses.replace(read.match, logits=logits)


def _replace_inlined(gm, example_inputs, config, record) -> tuple | None:
    """The vocab-parallel math of a Function Dynamo inlined (it does so when no input requires
    grad), or written with functional all-reduces, where no gradient flows through it: the same
    one collective as where the Function is replaced, whatever the grad mode of each rank.
    Returns (site, op node, whether it is a Function's inlined forward), or None.

    Where a gradient flows, a functional all-reduce's backward sums it over the ranks: the op's
    outputs then do too (`sum_grads_over_group`). Code with a detached statistic (its gradient is
    not that of its values) stays as it is; so does code whose all-reduced values anything else
    reads (its collectives would still run beside the op's)."""
    match = match_graph(gm, _rank_and_size)
    if isinstance(match, str) and match != NOT_PARALLEL and _fold_where_it_reads(gm, example_inputs, config):
        match = match_graph(gm, _rank_and_size)
    if isinstance(match, str):
        # Collectives that compute no log-prob or entropy are none of this pass's business.
        if match not in (NOT_PARALLEL, NO_LOGPROB):
            collective = next(gm.graph.find_nodes(op="call_function", target=_ALL_REDUCE))
            record.rejected.append(Rejection(source_of(collective), f"vocab-parallel code kept: {match}"))
        return None
    source = source_of(match.nodes[0])
    requires = requires_grad(gm, example_inputs)
    with_gradient = any(requires[n] for n in match.nodes)
    if with_gradient and any(kind in MIXES for kind in match.outputs):
        record.rejected.append(Rejection(source, "vocab-parallel code kept: it reads the mean log-prob over this rank's "
                                                 "vocabulary slice, and a gradient flows through its all-reduces "
                                                 "(their backward sums over the ranks, which that local mean's does not)"))
        return None
    if with_gradient and values_without_gradient(gm, match, requires, _rank_and_size):
        record.rejected.append(Rejection(source, "vocab-parallel code kept: part of its statistics is detached, "
                                                 "so its gradient is not that of its values"))
        return None
    dead = _dead_after_replacing(gm.graph, match.nodes)
    collectives = [n for n in gm.graph.nodes if n.target in _COLLECTIVE_OPS]
    if any(n not in dead for n in collectives):
        record.rejected.append(Rejection(source, "vocab-parallel code kept: its all-reduced values are read "
                                                 "by other code"))
        return None
    no_gradient = {i for i, n in enumerate(match.nodes) if not requires[n]}
    # A Function's forward Dynamo inlined (no input required grad) all-reduces in place; on a rank
    # where an input requires grad the same code is the Function, whose lm_head op may compute its
    # gradients in forward, block by block: so may this one, to issue the same collectives.
    function_forward = not with_gradient and all(
        any(frame in (n.meta.get("stack_trace") or "") for frame in INPLACE_ALL_REDUCE_FRAMES)
        for n in collectives if n.target is _ALL_REDUCE)
    # Where a gradient flows, the code's all-reduces sum it over the ranks in backward: so does the op's stand-in.
    built = _replace_outputs(gm.graph, match, list(match.nodes), no_gradient, config, like=match.nodes[0],
                             sum_grads=with_gradient)
    # Erased here, not left to dead-code elimination, which keeps collectives (they look impure).
    for node in reversed(list(gm.graph.nodes)):
        if node in dead and not node.users:
            gm.graph.erase_node(node)
    return (*built, function_forward)


def _fold_where_it_reads(gm: torch.fx.GraphModule, example_inputs, config) -> bool:
    """Fold `gm`'s loops over chunks of rows, each chunk's all-reduces with them, where the folded
    graph reads as vocab-parallel math; True when folded, else `gm` is left as it is.

    A chunked Function's forward that Dynamo inlined (no input required grad on this rank) is the
    same code whose folded body `_match_function` reads on a rank where one did: both must become
    the op, or the ranks would issue different collectives. The chunks' own all-reduces, read by
    nothing once folded, go with them."""
    folded = copy_graph_module(gm)
    fold_function_body(folded, example_inputs, config=config)
    if isinstance(match_graph(folded, _rank_and_size), str):
        return False
    fold_function_body(gm, example_inputs, config=config)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output") or (
        n.is_impure() and n.target not in _FOLDED_COLLECTIVES))
    gm.recompile()
    return True


_ALL_REDUCE = _torch_api.functional_collectives.all_reduce.default
_COLLECTIVE_OPS = {_ALL_REDUCE, _torch_api.functional_collectives.wait_tensor.default}
#: What a fold leaves unread of the chunks it folded: their all-reduces (and all-gathers), and waits.
_FOLDED_COLLECTIVES = _COLLECTIVE_OPS | {_torch_api.functional_collectives.all_gather_into_tensor.default}


def _dead_after_replacing(graph, outputs) -> set:
    """The nodes nothing reads once every use of `outputs` reads a replacement instead."""
    dead = set(outputs)
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.users and all(u in dead for u in node.users):
            dead.add(node)
    return dead


def _rank_and_size(group_name: str) -> tuple[int, int]:
    return rank_and_size(group_name)[1:]  # "": a forward run without a process group


def _replace_function(graph: torch.fx.Graph, stub, hop, match: VocabParallelMatch, config):
    """(site, op node) of the op that replaces the Function's `stub`."""
    users = list(stub.users)
    if any(user.target is not operator.getitem for user in users):
        raise CantCapture("a vocab-parallel Function's result is used whole, not item by item")
    built = _replace_outputs(graph, match, [(u, u.args[1]) for u in users],
                             set(hop.kwargs.get("non_differentiable_idx", ())), config, like=stub)
    graph.erase_node(stub)
    return built


def _mixed(node, results: dict, mix: tuple, want, non_differentiable: bool) -> torch.fx.Node:
    """An output `a * logprob + b * slice mean log-prob` (`VocabParallelMatch.mixes`) from the op's
    results, as `as_the_output_was` makes the others. megatron-core's label smoothing computes
    `(1 - s) * loss - s * mean` in fp32: with a = s - 1 and b = -s the same products (up to their
    sign, exact) added once."""
    a, b = mix
    new = node(aten.mul.Tensor, results["slice-mean"], b)
    if a != 0.0:
        new = node(aten.add.Tensor, node(aten.mul.Tensor, results["logprob"], a), new)
    new = node(aten.reshape.default, new, list(want.shape))
    if new.meta["val"].dtype != want.dtype:
        new = node(aten._to_copy.default, new, dtype=want.dtype)
    return node(aten.detach.default, new) if non_differentiable else new


def _replace_outputs(graph: torch.fx.Graph, match: VocabParallelMatch, replaced, non_differentiable: set, config,
                     like, sum_grads: bool = False) -> tuple[SiteRecord, torch.fx.Node]:
    """One op call before `like`; each of `replaced` (a node, or (node, index into match.outputs))
    reads it instead. `non_differentiable`: the output indices that carry no gradient. `sum_grads`:
    the outputs' gradients are summed over the group in backward (one all-reduce). Returns the
    site and the op's node."""
    replaced = [r if isinstance(r, tuple) else (r, i) for i, r in enumerate(replaced)]
    logits, temperature, rounded, row_order = _read_through(match.logits, match.temperature, match.target)
    fake_mode = _torch_api.detect_fake_mode([logits.meta["val"]])
    with_entropy = any(k.endswith("entropy") for k in match.outputs)
    entropy_grad = with_entropy and not any(
        k.endswith("entropy") and i in non_differentiable for i, k in enumerate(match.outputs))
    with_slice_mean = any(k in MIXES for k in match.outputs)
    if with_slice_mean and sum_grads:
        raise ValueError("the slice mean of the log-probs is not read where a gradient flows through all-reduces")
    chunk = config.chunk_size or 0

    def node(target, *args, like=None, **kwargs):
        return _torch_api.fake_node(graph, fake_mode, target, args, kwargs, like)

    with graph.inserting_before(like):
        rows = logits.meta["val"].shape[:-1]
        if match.target is None:  # entropy only: targets that every rank agrees on, all ignored
            target = node(aten.zeros.default, list(rows), dtype=torch.long, device=logits.meta["val"].device)
            ignore_index = 0
        else:
            target = match.target
            if row_order != sorted(row_order):  # the logits' rows in the op's order
                target = node(aten.permute.default, target, [row_order.index(d) for d in range(len(row_order))],
                              like=like)
            target = node(aten.reshape.default, target, list(rows))
            ignore_index = None
        op = node(torch.ops.graphpass.vocab_parallel_logprob_entropy.default, logits, target, None,
                  match.group_name, float(temperature), with_entropy, entropy_grad, ignore_index, chunk,
                  "inductor" if config.inner == "inductor" else "eager", rounded, config.chunk_budget_bytes,
                  *((True,) if with_slice_mean else ()), like=like)
        results = {"logprob": node(operator.getitem, op, 0), "entropy": node(operator.getitem, op, 1)}
        if with_slice_mean:
            results["slice-mean"] = node(operator.getitem, op, _SLICE_MEAN_ITEM)
        if sum_grads:
            results = _summing_grads(node, results, with_entropy, match.group_name)
        if row_order != sorted(row_order):  # the op's rows, put in the logits' order
            used = {kind.lstrip("-") for kind in match.outputs} | ({"logprob", "slice-mean"} if with_slice_mean else set())
            results = {k: node(aten.permute.default, node(aten.reshape.default, v, list(rows), like=like),
                               list(row_order), like=like)
                       for k, v in results.items() if k in used}
    outputs = []
    for user, index in replaced:
        with graph.inserting_before(user):
            if match.outputs[index] in MIXES:
                new = _mixed(node, results, match.mixes[index], user.meta["val"], index in non_differentiable)
            else:
                new = as_the_output_was(node, results, match.outputs[index], user.meta["val"],
                                        index in non_differentiable)
        new.meta.update({k: v for k, v in user.meta.items() if k != "val"})
        user.replace_all_uses_with(new)
        graph.erase_node(user)
    for i, kind in enumerate(match.outputs):
        if kind != EMPTY:
            outputs.append(OutputRecord(kind, i not in non_differentiable and (entropy_grad or "logprob" in kind),
                                        _temperature_text(temperature, rounded, logits.meta["val"].dtype)))
    wide = logits.meta["val"]
    rows_hint = _torch_api.size_hint(wide.numel()) // max(1, _torch_api.size_hint(wide.shape[-1]))
    return SiteRecord(
        kind=site_kind(o.kind for o in outputs), source=source_of(op), shape=tuple(wide.shape), dtype=wide.dtype,
        chunk_size=config.chunk_size, outputs=outputs, tp_size=match.group_size, group=match.group_name,
        collectives=_all_gathers(match.group_size, [collective_bytes(rows_hint, wide.dtype, with_entropy, masked=False)])
        + ([CollectiveRecord("all_reduce in backward", match.group_size,
                             rows_hint * (2 if with_entropy else 1) * results["logprob"].meta["val"].dtype.itemsize)]
           if sum_grads and match.group_size > 1 else [])), op


def _all_gathers(group_size: int, sizes: list[int]) -> list[CollectiveRecord]:
    """The op's all-gathers of row statistics, one of each of `sizes` bytes: none over a group of
    one, where the op issues none."""
    return [CollectiveRecord("all_gather", group_size, size) for size in sizes] if group_size > 1 else []


def _summing_grads(node, results: dict, with_entropy: bool, group_name: str) -> dict:
    """`results` behind one `sum_grads_over_group`: one all-reduce in backward for both outputs."""
    summed = torch.ops.graphpass.sum_grads_over_group.default
    if not with_entropy:
        return {"logprob": node(summed, results["logprob"], group_name), "entropy": results["entropy"]}
    both = node(summed, node(aten.stack.default, [results["logprob"], results["entropy"]]), group_name)
    return {"logprob": node(aten.select.int, both, 0, 0), "entropy": node(aten.select.int, both, 0, 1)}


def _read_through(logits: torch.fx.Node, temperature: float, target: torch.fx.Node | None = None):
    """(logits, temperature, rounded, row order) that the op reads for `logits`: through copies,
    upcasts and a temperature division (`_absorb_scaling`) and permutations of their row dims
    (`[s, b, v]` logits transposed to `[b, s, v]`): the given logits' row dim
    `i` is the op's row dim `row_order[i]` (permutations only where the `target` ids, if any, have
    those row dims, to be permuted alike). Read from the graph alone, the same on every rank: a
    Function replaced on one rank and its forward inlined on another give the op the same rows."""
    rows = logits.meta["val"].ndim - 1
    order = list(range(rows))
    logits, temperature, rounded = _absorb_scaling(logits, temperature)
    permutable = target is None or target.meta["val"].ndim == rows
    while permutable and (peeled := _row_permutation(logits)) is not None:
        logits, permutation = peeled
        order = [permutation[o] for o in order]
        logits, temperature, rounded = _absorb_scaling(logits, temperature, rounded)
    return logits, temperature, rounded, order


def _row_permutation(node: torch.fx.Node):
    """(x, p) for `node` = `x` with its row dims permuted (dim `i` is `x`'s dim `p[i]`, the last
    kept), else None. (A view: the op reads `x` whoever else reads `node`.)"""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    ndim = node.meta["val"].ndim
    if node.target is aten.transpose.int:
        d0, d1 = (d % ndim for d in node.args[1:3])
        if ndim - 1 in (d0, d1):
            return None
        p = list(range(ndim - 1))
        p[d0], p[d1] = d1, d0
    elif node.target is aten.permute.default and list(node.args[1])[-1] % ndim == ndim - 1:
        p = [d % ndim for d in node.args[1][:-1]]
    else:
        return None
    return node.args[0], p


def _absorb_scaling(logits: torch.fx.Node, temperature: float, rounded: bool = False):
    """(logits, temperature, rounded) with an exact copy, upcast or temperature division moved into
    the op (`rounded`: the op divides in the logits' dtype, its `rounded_division`).

    `x.clone()` holds the values of `x` and the op writes into neither (megatron-core's Function
    overwrites its input, so callers hand it a clone): it reads `x`. `x.float()` of bf16/fp16 `x`
    is exact and the op upcasts per chunk: it reads `x`. `x / t` of compute-dtype `x` by a constant
    is what the op computes per chunk: it reads `x` and divides. `x / t` of bf16/fp16 `x` in that
    dtype rounds the quotient: the op computes it per chunk with the same aten division, then
    upcasts (`rounded`), where it divides by nothing else (one division, one rounding; a second
    division before or after it is two, which the op does not compute). Only when that node has no
    other reader but metadata checks (erased with it; else it exists anyway)."""
    while True:
        checks = [u for u in logits.users if u.op == "call_function" and u.target in METADATA_CHECKS]
        if len(logits.users) - len(checks) > 1:  # (none: made for the op, as an output layer's logits)
            break
        val, source = logits.meta["val"], logits.args[0] if logits.args else None
        division = logits.target in (aten.div.Tensor, aten.div.Scalar) and not logits.kwargs and \
            isinstance(logits.args[1], float) and logits.args[1] > 0 and source.meta["val"].dtype == val.dtype
        if logits.target is aten.clone.default and set(logits.kwargs) <= {"memory_format"}:
            new = source, temperature, rounded
        elif logits.target is aten._to_copy.default and set(logits.kwargs) <= {"dtype", "device", "layout"} \
                and logits.kwargs.get("dtype") == torch.float32 and source.meta["val"].dtype in (torch.bfloat16, torch.float16) \
                and source.meta["val"].device == val.device and not rounded:
            new = source, temperature, rounded
        elif division and val.dtype in (torch.float32, torch.float64) and not rounded:
            new = source, temperature * logits.args[1], rounded
        elif division and val.dtype in (torch.bfloat16, torch.float16) and temperature == 1.0 and not rounded:
            new = source, logits.args[1], True
        else:
            break
        for check in checks:
            logits.graph.erase_node(check)
        logits, temperature, rounded = new
    return logits, temperature, rounded
