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
through permutations of their rows (`graphpass.rewrite.vocab_parallel_op`): every rank gets the same op, in the same
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
A Function called with symbolic sizes (the second length Dynamo compiles, or `dynamic=True`) runs
as written, the reason recorded: the op is built for static sizes.

This module drives it: what a Function's body computes is read by `graphpass.analysis.vocab_parallel`
(its output layer by `graphpass.analysis.output_layer_function`), the op's nodes are built by
`graphpass.rewrite.vocab_parallel_op`, merged by `graphpass.rewrite.vocab_parallel_merge` and given
the lm_head by `graphpass.rewrite.vocab_parallel_lm_head`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis.backward_check import joint_module
from graphpass.analysis.grad_flow import grad_modes, requires_grad
from graphpass.analysis.output_layer_function import (VocabParallelOutputLayerFunction, cut_forward_at_logits,
                                                      hidden_gradient_collective, output_layer_inside, read_transposes,
                                                      transposed_inputs)
from graphpass.analysis.regions import source_of
from graphpass.analysis.vocab_parallel import (MIXES, NO_LOGPROB, NOT_PARALLEL, VocabParallelMatch, match_forward,
                                               match_graph, values_without_gradient)
from graphpass.capture import CantCapture, capture, hop_of, later_reader, written_inputs
from graphpass.fx_utils import copy_graph_module, value_or_constant
from graphpass.lint import INPLACE_ALL_REDUCE_FRAMES  # how lint knows them
from graphpass.records import Rejection, SiteRecord
from graphpass.rewrite.vocab_parallel_lm_head import fuse_lm_head, take_loss_math
from graphpass.rewrite.vocab_parallel_merge import merge_inlined, merge_same_logits
from graphpass.rewrite.vocab_parallel_op import (emit_output_layer, group_rank_and_size, note_kept_division,
                                                 replace_function, replace_outputs)

from . import fold_function_body, read_folded

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
        if not isinstance(match, (VocabParallelMatch, VocabParallelOutputLayerFunction)):
            if match is not None:
                record.rejected.append(Rejection(source_of(stub), match))
            continue
        lost = _lost_write(gm.graph, stub, hop) if hop.mutates_inputs else None
        if lost is not None:
            record.rejected.append(Rejection(source_of(stub), f"vocab-parallel Function kept: {lost}"))
            continue
        if isinstance(match, VocabParallelOutputLayerFunction):  # its product first, then the op reads it
            match = emit_output_layer(gm.graph, stub, match)
        built.append(replace_function(gm.graph, stub, hop, match, config))
    built = merge_same_logits(gm.graph, built, record)
    built = [(*b, True) for b in built]  # (site, op node, whether its gradients may be computed in forward)
    inlined = _replace_inlined(gm, example_inputs, config, record)
    if inlined is not None:
        built = merge_inlined(gm.graph, built, inlined, record)
    # The replaced code's readers of the logits (an upcast, a division moved into the op) are gone
    # before the fusion asks what else reads them.
    gm.graph.eliminate_dead_code()
    for site, op, _ in built:
        note_kept_division(op, site, record)
    modes = grad_modes(gm.graph)
    heads = [(site, fuse_lm_head(gm.graph, op, site, modes, record), may) for site, op, may in built]
    taken = set()  # the loss math an earlier site took in
    for site, head, may in heads:
        if head is not None and not may:
            # Functional all-reduces, or a gradient through them: a sum over the ranks in backward,
            # which the op computing its gradients in forward does not do.
            site.recompute_reason = "its code's all-reduces are functional collectives or carry a gradient"
        elif head is not None:
            take_loss_math(gm, example_inputs, head, site, config, taken)
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
    reader = later_reader(graph, stub, hop.operands(stub), written_inputs(hop.bodies[0]))
    if reader is None:
        return None
    return f"its forward writes into {reader} after it (replacing it would lose the write); hand it a clone"


def _add_site(record, site: SiteRecord) -> None:
    record.sites.append(site)
    record.collectives.extend(site.collectives)


def _match_function(hop, stub, config) -> VocabParallelMatch | VocabParallelOutputLayerFunction | str | None:
    """The match of the Function behind `stub`, else why it is kept (one line), or None for a
    Function with no collective that computes no log-prob or entropy: none of this pass's business."""
    forward = hop.bodies[0]
    operands = hop.operands(stub)  # the forward's inputs: tensors, and sizes where shapes are dynamic
    vals = [value_or_constant(o) for o in operands]
    n_outputs = len(forward.graph.output_node().args[0][0])  # Dynamo's forward: ((outputs), (saved))
    try:
        captured = capture(forward, vals)
    except CantCapture as e:
        return f"vocab-parallel Function kept: its forward cannot be captured: {e}"

    def read(gm):
        outputs = list(gm.graph.output_node().args[0])[len(captured.mutated_inputs):][:n_outputs]
        return match_forward(gm, outputs, group_rank_and_size)

    match = read_folded(captured.gm, vals, read,
                        lambda m: not isinstance(m, str) or m == NOT_PARALLEL, config=config)
    if match == NOT_PARALLEL:
        return None  # one device: replace_hand_written_functions' business
    if hop.unread is not None:
        return f"vocab-parallel Function kept: {hop.unread}"
    if _torch_api.any_symbolic(vals):
        # The op and its lm_head fusion are built from concrete row and vocabulary sizes.
        return "vocab-parallel Function kept: its sizes are symbolic (dynamic shapes), and graphpass builds " \
               "the vocab-parallel op for static sizes only"
    if isinstance(match, str):
        product = output_layer_inside(captured.gm)
        if product is not None:
            return _match_output_layer(hop, stub, captured, product, n_outputs, config)
        return f"vocab-parallel Function kept: {match}"
    # The forward's inputs are the stub's operands, in order.
    placeholders = list(captured.gm.graph.find_nodes(op="placeholder"))
    return dataclasses.replace(
        match, logits=operands[placeholders.index(match.logits)],
        target=None if match.target is None else operands[placeholders.index(match.target)])


_OUTPUT_LAYER_KEPT = "vocab-parallel Function kept: it multiplies by the output layer itself (at {}), but {}"


def _match_output_layer(hop, stub, captured, product, n_outputs, config) -> VocabParallelOutputLayerFunction | str:
    """The Function behind `stub`, whose forward computes its logits itself (`product`), read at
    those logits (`output_layer_function.cut_forward_at_logits`), else why it is kept.

    Its forward from the logits on must be vocab-parallel log-probs/entropies, as a logits
    Function's must; its backward is trusted as a logits Function's is, once it returns gradients
    for the hidden states and the weight alone and communicates the hidden states' gradient as
    the forward implies (reduce-scattered where their rows were all-gathered)."""
    forward, backward = hop.bodies[0], hop.bodies[1]
    operands = hop.operands(stub)
    vals = [value_or_constant(o) for o in operands]
    where = source_of(product)
    if hop.mutates_inputs or captured.mutated_inputs:
        return _OUTPUT_LAYER_KEPT.format(where, "it writes into its inputs")
    read = capture(forward, vals).gm
    read_transposes(read, transposed_inputs(operands))
    fold_function_body(read, vals, config=config)
    cut = cut_forward_at_logits(read, n_outputs)
    if isinstance(cut, str):
        return _OUTPUT_LAYER_KEPT.format(where, cut)
    logits_forward = cut.logits_forward
    match = match_forward(logits_forward, list(logits_forward.graph.output_node().args[0]), group_rank_and_size)
    if isinstance(match, str):
        return _OUTPUT_LAYER_KEPT.format(where, f"its math on those logits is not read: {match}")
    if cut.gathered_over not in (None, match.group_name):
        return _OUTPUT_LAYER_KEPT.format(where, "it gathers the hidden states over another group than it reduces over")
    outputs = list(captured.gm.graph.output_node().args[0])[:n_outputs]
    grads = [torch.empty_like(o.meta["val"]) for o in outputs]
    n_saved = len(forward.graph.output_node().args[0][1])
    try:
        joint = capture(joint_module(forward, backward, len(operands), n_outputs, n_saved), vals + grads)
    except Exception as e:  # noqa: BLE001 - a backward that does not trace cannot be read
        return _OUTPUT_LAYER_KEPT.format(where, f"its backward does not trace on fake values ({type(e).__name__})")
    kind, why = hidden_gradient_collective(joint.gm, n_outputs, cut, match.group_name)
    if why is not None:
        return _OUTPUT_LAYER_KEPT.format(where, why)
    placeholders = list(logits_forward.graph.find_nodes(op="placeholder"))
    target = None if match.target is None else operands[cut.other_positions[placeholders.index(match.target) - 1]]
    return VocabParallelOutputLayerFunction(dataclasses.replace(match, logits=None, target=target), cut, kind)


def _replace_inlined(gm, example_inputs, config, record) -> tuple | None:
    """The vocab-parallel math of a Function Dynamo inlined (it does so when no input requires
    grad), or written with functional all-reduces, where no gradient flows through it: the same
    one collective as where the Function is replaced, whatever the grad mode of each rank.
    Returns (site, op node, whether it is a Function's inlined forward), or None.

    Where a gradient flows, a functional all-reduce's backward sums it over the ranks: the op's
    outputs then do too (`sum_grads_over_group`). Code with a detached statistic (its gradient is
    not that of its values) stays as it is; so does code whose all-reduced values anything else
    reads (its collectives would still run beside the op's)."""
    match = match_graph(gm, group_rank_and_size)
    if isinstance(match, str) and match != NOT_PARALLEL and _fold_where_it_reads(gm, example_inputs, config):
        match = match_graph(gm, group_rank_and_size)
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
    if with_gradient and values_without_gradient(gm, match, requires, group_rank_and_size):
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
    built = replace_outputs(gm.graph, match, list(match.nodes), no_gradient, config, like=match.nodes[0],
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
    if isinstance(match_graph(folded, group_rank_and_size), str):
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
