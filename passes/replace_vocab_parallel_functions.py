"""Replace a vocab-parallel log-prob/entropy `autograd.Function` by the vocab-parallel chunked op.

Megatron's `vocab_parallel_cross_entropy`, slime's `_VocabParallelLogProbEntropy` and their kind
reach the graph as one `autograd_function_apply` (a stub after capture) whose forward all-reduces
row statistics over the tensor-parallel group and whose backward is written by hand. When the
forward computes exactly log-probs and/or entropies of its vocabulary slice
(`graphpass.analysis.vocab_parallel`), the Function, forward and backward together, becomes one
`graphpass::vocab_parallel_logprob_entropy` call: one collective per call instead of one per
statistic, O(rows) saved instead of the softmax. The group is the one the forward names.

Also moved into the op, where exact: an fp32 upcast of bf16/fp16 logits (the op upcasts one chunk
at a time) and a division of the compute-dtype logits by a constant temperature. Anything else
stays as it was; a Function with collectives that does not match is recorded with the reason.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis.regions import source_of
from graphpass.analysis.grad_flow import requires_grad
from graphpass.analysis.vocab_parallel import (EMPTY, NO_LOGPROB, NOT_PARALLEL, VocabParallelMatch, match_forward,
                                                match_graph, values_without_gradient)
from graphpass.capture import CantCapture, capture, hop_of
from graphpass.ops.vocab_parallel import collective_bytes
from graphpass.records import Candidate, CollectiveRecord, OutputRecord, SiteRecord

aten = torch.ops.aten

__all__ = ["replace_vocab_parallel_functions_pass"]


def replace_vocab_parallel_functions_pass(gm: torch.fx.GraphModule, example_inputs, *, config,
                                          record) -> torch.fx.GraphModule:
    """Each vocab-parallel log-prob/entropy Function -> one `vocab_parallel_logprob_entropy` call;
    so too the same math inlined in the graph, where no gradient flows through it."""
    for stub in list(gm.graph.find_nodes(op="call_function", target=torch.ops.graphpass.opaque.default)):
        hop = hop_of(stub)
        if hop.target is not _torch_api.autograd_function_apply():
            continue
        match = _match_function(hop, stub)
        if isinstance(match, str):
            if match != NOT_PARALLEL:
                record.rejected.append(Candidate(source_of(stub), f"vocab-parallel Function kept: {match}"))
            continue
        _add_site(record, _replace_function(gm.graph, stub, hop, match, config))
    _replace_inlined(gm, example_inputs, config, record)
    gm.graph.eliminate_dead_code()
    return gm


def _add_site(record, site: SiteRecord) -> None:
    record.sites.append(site)
    record.collectives.extend(site.collectives)


def _match_function(hop, stub) -> VocabParallelMatch | str:
    forward = hop.bodies[0]
    tensors = stub.args[1]
    n_outputs = len(forward.graph.output_node().args[0][0])  # Dynamo's forward: ((outputs), (saved))
    try:
        captured = capture(forward, [t.meta["val"] for t in tensors])
    except CantCapture as e:
        return f"its forward cannot be captured: {e}"
    outputs = list(captured.gm.graph.output_node().args[0])[len(captured.mutated_inputs):][:n_outputs]
    match = match_forward(captured.gm, outputs, _rank_and_size)
    if isinstance(match, str):
        return match
    # The forward's inputs are the stub's tensors, in order.
    placeholders = list(captured.gm.graph.find_nodes(op="placeholder"))
    return dataclasses.replace(
        match, logits=tensors[placeholders.index(match.logits)],
        target=None if match.target is None else tensors[placeholders.index(match.target)])


def _replace_inlined(gm, example_inputs, config, record) -> None:
    """The vocab-parallel math of a Function Dynamo inlined (it does so when no input requires
    grad), or written with functional all-reduces, where no gradient flows through it: the same
    one collective as where the Function is replaced, whatever the grad mode of each rank.

    Where a gradient flows, a functional all-reduce's backward sums it over the ranks: the op's
    outputs then do too (`sum_grads_over_group`). Code with a detached statistic (its gradient is
    not that of its values) stays as it is; so does code whose all-reduced values anything else
    reads (its collectives would still run beside the op's)."""
    match = match_graph(gm, _rank_and_size)
    if isinstance(match, str):
        # Collectives that compute no log-prob or entropy are none of this pass's business.
        if match not in (NOT_PARALLEL, NO_LOGPROB):
            collective = next(gm.graph.find_nodes(op="call_function", target=_ALL_REDUCE))
            record.rejected.append(Candidate(source_of(collective), f"vocab-parallel code kept: {match}"))
        return
    source = source_of(match.nodes[0])
    requires = requires_grad(gm, example_inputs)
    with_gradient = any(requires[n] for n in match.nodes)
    if with_gradient and values_without_gradient(gm, match, requires, _rank_and_size):
        record.rejected.append(Candidate(source, "vocab-parallel code kept: part of its statistics is detached, "
                                                 "so its gradient is not that of its values"))
        return
    dead = _dead_after_replacing(gm.graph, match.nodes)
    collectives = [n for n in gm.graph.nodes if n.target in _COLLECTIVE_OPS]
    if any(n not in dead for n in collectives):
        record.rejected.append(Candidate(source, "vocab-parallel code kept: its all-reduced values are read "
                                                 "by other code"))
        return
    no_gradient = {i for i, n in enumerate(match.nodes) if not requires[n]}
    # Where a gradient flows, the code's all-reduces sum it over the ranks in backward: so does the op's stand-in.
    _add_site(record, _replace_outputs(gm.graph, match, list(match.nodes), no_gradient, config,
                                       like=match.nodes[0], sum_grads=with_gradient))
    # Erased here, not left to dead-code elimination, which keeps collectives (they look impure).
    for node in reversed(list(gm.graph.nodes)):
        if node in dead and not node.users:
            gm.graph.erase_node(node)


_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_COLLECTIVE_OPS = {_ALL_REDUCE, torch.ops._c10d_functional.wait_tensor.default}


def _dead_after_replacing(graph, outputs) -> set:
    """The nodes nothing reads once every use of `outputs` reads a replacement instead."""
    dead = set(outputs)
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.users and all(u in dead for u in node.users):
            dead.add(node)
    return dead


def _rank_and_size(group_name: str) -> tuple[int, int]:
    group = _torch_api.resolve_process_group(group_name)
    return group.rank(), group.size()


def _replace_function(graph: torch.fx.Graph, stub, hop, match: VocabParallelMatch, config) -> SiteRecord:
    users = list(stub.users)
    if any(user.target is not operator.getitem for user in users):
        raise CantCapture("a vocab-parallel Function's result is used whole, not item by item")
    site = _replace_outputs(graph, match, [(u, u.args[1]) for u in users],
                            set(hop.kwargs.get("non_differentiable_idx", ())), config, like=stub)
    graph.erase_node(stub)
    return site


def _replace_outputs(graph: torch.fx.Graph, match: VocabParallelMatch, replaced, non_differentiable: set, config,
                     like, sum_grads: bool = False) -> SiteRecord:
    """One op call before `like`; each of `replaced` (a node, or (node, index into match.outputs))
    reads it instead. `non_differentiable`: the output indices that carry no gradient. `sum_grads`:
    the outputs' gradients are summed over the group in backward (one all-reduce)."""
    replaced = [r if isinstance(r, tuple) else (r, i) for i, r in enumerate(replaced)]
    logits, temperature = _absorb_scaling(match.logits, match.temperature)
    fake_mode = _torch_api.detect_fake_mode([logits.meta["val"]])
    with_entropy = any(k.endswith("entropy") for k in match.outputs)
    entropy_grad = with_entropy and not any(
        k.endswith("entropy") and i in non_differentiable for i, k in enumerate(match.outputs))
    chunk = config.chunk_size or 0

    def node(target, *args, like=None, **kwargs):
        return _torch_api.fake_node(graph, fake_mode, target, args, kwargs, like)

    with graph.inserting_before(like):
        rows = logits.meta["val"].shape[:-1]
        if match.target is None:  # entropy only: targets that every rank agrees on, all ignored
            target = node(aten.zeros.default, list(rows), dtype=torch.long, device=logits.meta["val"].device)
            ignore_index = 0
        else:
            target = node(aten.reshape.default, match.target, list(rows))
            ignore_index = None
        op = node(torch.ops.graphpass.vocab_parallel_logprob_entropy.default, logits, target, None,
                  match.group_name, float(temperature), with_entropy, entropy_grad, ignore_index, chunk,
                  "inductor" if config.inner == "inductor" else "eager", like=like)
        results = {"logprob": node(operator.getitem, op, 0), "entropy": node(operator.getitem, op, 1)}
        if sum_grads:
            results = _summing_grads(node, results, with_entropy, match.group_name)
    outputs = []
    for user, index in replaced:
        kind, want = match.outputs[index], user.meta["val"]
        with graph.inserting_before(user):
            if kind == EMPTY:
                new = node(aten.empty.memory_format, list(want.shape), dtype=want.dtype, device=want.device)
            else:
                new = results[kind.lstrip("-")]
                if kind.startswith("-"):
                    new = node(aten.neg.default, new)
                new = node(aten.reshape.default, new, list(want.shape))
                if new.meta["val"].dtype != want.dtype:
                    new = node(aten._to_copy.default, new, dtype=want.dtype)
                if index in non_differentiable:
                    new = node(aten.detach.default, new)
        new.meta.update({k: v for k, v in user.meta.items() if k != "val"})
        user.replace_all_uses_with(new)
        graph.erase_node(user)
    for i, kind in enumerate(match.outputs):
        if kind != EMPTY:
            outputs.append(OutputRecord(kind, i not in non_differentiable and (entropy_grad or "logprob" in kind),
                                        None if temperature == 1.0 else f"/ {temperature:.3g}"))
    wide = logits.meta["val"]
    rows_hint = _torch_api.size_hint(wide.numel()) // max(1, _torch_api.size_hint(wide.shape[-1]))
    return SiteRecord(
        kind="+".join(o.kind for o in outputs), source=source_of(op), shape=tuple(wide.shape), dtype=wide.dtype,
        chunk_size=config.chunk_size, outputs=outputs, tp_size=match.group_size, group=match.group_name,
        collectives=[CollectiveRecord("all_gather", match.group_size,
                                      collective_bytes(rows_hint, wide.dtype, with_entropy, masked=False))]
        + ([CollectiveRecord("all_reduce in backward", match.group_size,
                             rows_hint * (2 if with_entropy else 1) * results["logprob"].meta["val"].dtype.itemsize)]
           if sum_grads else []))


def _summing_grads(node, results: dict, with_entropy: bool, group_name: str) -> dict:
    """`results` behind one `sum_grads_over_group`: one all-reduce in backward for both outputs."""
    summed = torch.ops.graphpass.sum_grads_over_group.default
    if not with_entropy:
        return {"logprob": node(summed, results["logprob"], group_name), "entropy": results["entropy"]}
    both = node(summed, node(aten.stack.default, [results["logprob"], results["entropy"]]), group_name)
    return {"logprob": node(aten.select.int, both, 0, 0), "entropy": node(aten.select.int, both, 0, 1)}


def _absorb_scaling(logits: torch.fx.Node, temperature: float):
    """(logits, temperature) with an exact upcast or temperature division moved into the op.

    `x.float()` of bf16/fp16 `x` is exact and the op upcasts per chunk: it reads `x`. `x / t` of
    compute-dtype `x` by a constant is what the op computes per chunk: it reads `x` and divides.
    Only when that node has no other reader (else it exists anyway)."""
    while len(logits.users) == 1:
        val, source = logits.meta["val"], logits.args[0] if logits.args else None
        if logits.target is aten._to_copy.default and set(logits.kwargs) <= {"dtype", "device", "layout"} \
                and logits.kwargs.get("dtype") == torch.float32 and source.meta["val"].dtype in (torch.bfloat16, torch.float16) \
                and source.meta["val"].device == val.device:
            logits = source
        elif logits.target in (aten.div.Tensor, aten.div.Scalar) and not logits.kwargs and \
                isinstance(logits.args[1], float) and logits.args[1] > 0 and \
                val.dtype in (torch.float32, torch.float64) and source.meta["val"].dtype == val.dtype:
            logits, temperature = source, temperature * logits.args[1]
        else:
            break
    return logits, temperature
