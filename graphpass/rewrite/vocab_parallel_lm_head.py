"""The vocab-parallel op given this rank's lm_head: where its logits are `hidden @ W_shard.T (+ b)`
read by nothing else, the op that computes them chunk by chunk (`fuse_lm_head`); where its loss
allows, the one that also computes its inputs' gradients in forward (`take_loss_math`).
`replace_vocab_parallel_functions_pass` drives it."""

from __future__ import annotations

import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis.grad_flow import grad_modes, requires_grad
from graphpass.analysis.lm_head import (METADATA_CHECKS, ROW_RESHAPES, match_head_behind, not_computed_here,
                                        other_readers)
from graphpass.analysis.regions import source_of
from graphpass.analysis.vocab_parallel import match_token_loss
from graphpass.ops.vocab_parallel import collective_bytes
from graphpass.ops.vocab_parallel_gradients import block_rows, register_loss
from graphpass.records import Rejection, SiteRecord
from graphpass.rewrite.loss_gradients import add_gradient_carrier, loss_coefficients
from graphpass.rewrite.vocab_parallel_op import all_gathers, computes_slice_mean, divides_rounded

aten = torch.ops.aten

__all__ = ["fuse_lm_head", "take_loss_math"]


_HEAD_OP = torch.ops.graphpass.vocab_parallel_lm_head_logprob_entropy.default
_WITH_GRADIENTS = torch.ops.graphpass.vocab_parallel_lm_head_with_gradients.default


def fuse_lm_head(graph: torch.fx.Graph, op: torch.fx.Node, site: SiteRecord, modes, record) -> torch.fx.Node | None:
    """`op` reading `hidden, W (, b)` instead of its logits where they are `hidden @ W.T (+ b)`
    (`graphpass.analysis.lm_head.match_matmul`) that nothing else reads, in the op's grad mode: the
    new op's node; else None, `op` as it is, with the reason on the site (and among the candidates
    where the logits are a matmul)."""
    logits = op.args[0]
    head, why = match_head_behind(logits) if isinstance(logits, torch.fx.Node) else (None, None)
    if head is not None and divides_rounded(op):
        dtype = str(logits.meta["val"].dtype).removeprefix("torch.")
        head, why = None, (f"the op divides its logits by the temperature in {dtype} (as the code does, between "
                           "the matmul and the loss); the lm_head ops divide in fp32")
    if head is not None and computes_slice_mean(op):
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
        if any(n.op == "call_function" and n.target in ROW_RESHAPES for n in head.nodes):
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


def take_loss_math(gm, example_inputs, op: torch.fx.Node, site: SiteRecord, config, taken: set) -> None:
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
    site.collectives = all_gathers(site.tp_size, [collective_bytes(min(block, rows - i * block), val.dtype,
                                                                   with_entropy, False) for i in range(blocks)])
