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

import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis.regions import source_of
from graphpass.analysis.vocab_parallel import EMPTY, VocabParallelMatch, match_forward
from graphpass.capture import CantCapture, capture, hop_of
from graphpass.ops.vocab_parallel import collective_bytes
from graphpass.records import Candidate, CollectiveRecord, OutputRecord, SiteRecord

aten = torch.ops.aten

__all__ = ["replace_vocab_parallel_functions_pass"]


def replace_vocab_parallel_functions_pass(gm: torch.fx.GraphModule, example_inputs, *, config,
                                          record) -> torch.fx.GraphModule:
    """Each vocab-parallel log-prob/entropy Function -> one `vocab_parallel_logprob_entropy` call."""
    for stub in list(gm.graph.find_nodes(op="call_function", target=torch.ops.graphpass.opaque.default)):
        hop = hop_of(stub)
        if hop.target is not _torch_api.autograd_function_apply():
            continue
        match = _match(hop, stub)
        if isinstance(match, str):
            if match != _NOT_PARALLEL:
                record.rejected.append(Candidate(source_of(stub), f"vocab-parallel Function kept: {match}"))
            continue
        site = _replace(gm.graph, stub, hop, match, config)
        record.sites.append(site)
        record.collectives.extend(site.collectives)
    gm.graph.eliminate_dead_code()
    return gm


_NOT_PARALLEL = "no all-reduce: not vocab-parallel"


def _match(hop, stub) -> VocabParallelMatch | str:
    forward = hop.bodies[0]
    tensors = stub.args[1]
    n_outputs = len(forward.graph.output_node().args[0][0])  # Dynamo's forward: ((outputs), (saved))
    try:
        captured = capture(forward, [t.meta["val"] for t in tensors])
    except CantCapture as e:
        return f"its forward cannot be captured: {e}"
    outputs = list(captured.gm.graph.output_node().args[0])[len(captured.mutated_inputs):][:n_outputs]
    return match_forward(captured.gm, outputs, _rank_and_size)


def _rank_and_size(group_name: str) -> tuple[int, int]:
    group = _torch_api.resolve_process_group(group_name)
    return group.rank(), group.size()


def _replace(graph: torch.fx.Graph, stub, hop, match: VocabParallelMatch, config) -> SiteRecord:
    tensors = stub.args[1]
    logits, temperature = _absorb_scaling(tensors[match.logits], match.temperature)
    fake_mode = _torch_api.detect_fake_mode([logits.meta["val"]])
    non_differentiable = set(hop.kwargs.get("non_differentiable_idx", ()))
    with_entropy = any(k.endswith("entropy") for k in match.outputs)
    entropy_grad = with_entropy and not any(
        k.endswith("entropy") and i in non_differentiable for i, k in enumerate(match.outputs))
    chunk = config.chunk_size or 0

    def node(target, *args, like=None, **kwargs):
        new = graph.call_function(target, args, kwargs)
        if like is not None:
            new.meta.update({k: v for k, v in like.meta.items() if k != "val"})
        vals = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with fake_mode:
            new.meta["val"] = target(*vals[0], **vals[1])
        return new

    with graph.inserting_before(stub):
        rows = logits.meta["val"].shape[:-1]
        if match.target is None:  # entropy only: targets that every rank agrees on, all ignored
            target = node(aten.zeros.default, list(rows), dtype=torch.long, device=logits.meta["val"].device)
            ignore_index = 0
        else:
            target = node(aten.reshape.default, tensors[match.target], list(rows))
            ignore_index = None
        op = node(torch.ops.graphpass.vocab_parallel_logprob_entropy.default, logits, target, None,
                  match.group_name, float(temperature), with_entropy, entropy_grad, ignore_index, chunk, like=stub)
        results = {"logprob": node(operator.getitem, op, 0), "entropy": node(operator.getitem, op, 1)}
    outputs = []
    for user in list(stub.users):
        if user.target is not operator.getitem:
            raise CantCapture("a vocab-parallel Function's result is used whole, not item by item")
        kind, want = match.outputs[user.args[1]], user.meta["val"]
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
                if user.args[1] in non_differentiable:
                    new = node(aten.detach.default, new)
        new.meta.update({k: v for k, v in user.meta.items() if k != "val"})
        user.replace_all_uses_with(new)
        graph.erase_node(user)
    graph.erase_node(stub)
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
                                      collective_bytes(rows_hint, wide.dtype, with_entropy, masked=False))])


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
