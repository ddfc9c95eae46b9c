"""The vocab-parallel op (`graphpass::vocab_parallel_logprob_entropy`) built in place of the code it
replaces: a vocab-parallel `autograd.Function` or its math inlined, each output rebuilt from the op's
results as the code computed it; the op reads its logits through exact copies, upcasts, a
temperature's division and permutations of their rows (`absorb_scaling`). Also the product of an
`autograd.Function` that multiplies by the output layer itself (`emit_output_layer`), which the op
then reads. `replace_vocab_parallel_functions_pass` drives it."""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis.lm_head import METADATA_CHECKS
from graphpass.analysis.output_layer_function import VocabParallelOutputLayerFunction, emit_product
from graphpass.analysis.regions import source_of
from graphpass.analysis.vocab_parallel import EMPTY, MIXES, VocabParallelMatch
from graphpass.capture import CantCapture, hop_of
from graphpass.ops.groups import rank_and_size
from graphpass.ops.vocab_parallel import collective_bytes
from graphpass.records import CollectiveRecord, OutputRecord, Rejection, SiteRecord, site_kind
from graphpass.rewrite.replaced_function import as_the_output_was

aten = torch.ops.aten

__all__ = ["OP", "SLICE_MEAN_ITEM", "absorb_scaling", "all_gathers", "computes_slice_mean", "divides_rounded",
           "emit_output_layer", "group_rank_and_size", "note_kept_division", "replace_function", "replace_outputs",
           "temperature_text"]


#: The op this module builds.
OP = torch.ops.graphpass.vocab_parallel_logprob_entropy.default

#: The op's output that is the mean log-prob over this rank's vocabulary slice (`with_slice_mean`).
SLICE_MEAN_ITEM = 4


def computes_slice_mean(op: torch.fx.Node) -> bool:
    """Whether the op computes the slice mean of the log-probs (its argument 12, `with_slice_mean`)."""
    return len(op.args) > 12 and bool(op.args[12])


def divides_rounded(op: torch.fx.Node) -> bool:
    """Whether the op divides its logits by the temperature in their own dtype (`rounded_division`)."""
    return len(op.args) > 10 and bool(op.args[10])


def temperature_text(temperature: float, rounded: bool, dtype: torch.dtype) -> str | None:
    """How an output record names the op's temperature ("/ 0.7", "/ 0.7 in bfloat16"), None for 1."""
    if temperature == 1.0:
        return None
    return f"/ {temperature:.3g}" + (f" in {str(dtype).removeprefix('torch.')}" if rounded else "")


def group_rank_and_size(group_name: str) -> tuple[int, int]:
    """(rank, size) in the process group `group_name` names, as the vocab-parallel analyses ask for them."""
    return rank_and_size(group_name)[1:]  # "": a forward run without a process group


def replace_function(graph: torch.fx.Graph, stub, hop, match: VocabParallelMatch, config):
    """(site, op node) of the op that replaces the Function's `stub`."""
    users = list(stub.users)
    if any(user.target is not operator.getitem for user in users):
        raise CantCapture("a vocab-parallel Function's result is used whole, not item by item")
    built = replace_outputs(graph, match, [(u, u.args[1]) for u in users],
                            set(hop.kwargs.get("non_differentiable_idx", ())), config, like=stub)
    graph.erase_node(stub)
    return built


def replace_outputs(graph: torch.fx.Graph, match: VocabParallelMatch, replaced, non_differentiable: set, config,
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
            results["slice-mean"] = node(operator.getitem, op, SLICE_MEAN_ITEM)
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
                                        temperature_text(temperature, rounded, logits.meta["val"].dtype)))
    wide = logits.meta["val"]
    rows_hint = _torch_api.size_hint(wide.numel()) // max(1, _torch_api.size_hint(wide.shape[-1]))
    return SiteRecord(
        kind=site_kind(o.kind for o in outputs), source=source_of(op), shape=tuple(wide.shape), dtype=wide.dtype,
        chunk_size=config.chunk_size, outputs=outputs, tp_size=match.group_size, group=match.group_name,
        collectives=all_gathers(match.group_size, [collective_bytes(rows_hint, wide.dtype, with_entropy, masked=False)])
        + ([CollectiveRecord("all_reduce in backward", match.group_size,
                             rows_hint * (2 if with_entropy else 1) * results["logprob"].meta["val"].dtype.itemsize)]
           if sum_grads and match.group_size > 1 else [])), op


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


def all_gathers(group_size: int, sizes: list[int]) -> list[CollectiveRecord]:
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
    upcasts and a temperature division (`absorb_scaling`) and permutations of their row dims
    (`[s, b, v]` logits transposed to `[b, s, v]`): the given logits' row dim
    `i` is the op's row dim `row_order[i]` (permutations only where the `target` ids, if any, have
    those row dims, to be permuted alike). Read from the graph alone, the same on every rank: a
    Function replaced on one rank and its forward inlined on another give the op the same rows."""
    rows = logits.meta["val"].ndim - 1
    order = list(range(rows))
    logits, temperature, rounded = absorb_scaling(logits, temperature)
    permutable = target is None or target.meta["val"].ndim == rows
    while permutable and (peeled := _row_permutation(logits)) is not None:
        logits, permutation = peeled
        order = [permutation[o] for o in order]
        logits, temperature, rounded = absorb_scaling(logits, temperature, rounded)
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


def absorb_scaling(logits: torch.fx.Node, temperature: float, rounded: bool = False):
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


def note_kept_division(op: torch.fx.Node, site: SiteRecord, record) -> None:
    """Among the candidates: the op reads a temperature's division of bf16/fp16 logits that
    `absorb_scaling` left outside it, so the quotient and its gradient exist whole."""
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


def emit_output_layer(graph: torch.fx.Graph, stub, read: VocabParallelOutputLayerFunction) -> VocabParallelMatch:
    """The Function's logits in the caller's graph, before `stub`: this rank's product of the
    hidden states (their rows all-gathered first where the Function gathers them: their gradient
    then reduce-scattered, as its backward does) and the weight shard, cast and its rows permuted
    as the Function does; the match reading them. The op reads through the cast and the
    permutation (`_read_through`) and the lm_head fusion takes the product in."""
    operands, cut = hop_of(stub).operands(stub), read.cut
    hidden, weight = operands[cut.hidden_position], operands[cut.weight_position]
    group = read.match.group_name
    fake_mode = _torch_api.detect_fake_mode([hidden.meta["val"]])

    def node(target, *args):
        return _torch_api.fake_node(graph, fake_mode, target, args, {}, like=stub)

    with graph.inserting_before(stub):
        if cut.gathered_over is not None:
            gathered = node(_torch_api.functional_collectives.all_gather_into_tensor.default, hidden,
                            group_rank_and_size(group)[1], group)
            hidden = node(_torch_api.functional_collectives.wait_tensor.default, gathered)
        elif read.hidden_gradient == "all_reduce":
            hidden = node(torch.ops.graphpass.sum_grads_over_group.default, hidden, group)
    logits = emit_product(graph, cut.logits, {cut.head.hidden: hidden, cut.head.weight: weight}, stub)
    return dataclasses.replace(read.match, logits=logits)
