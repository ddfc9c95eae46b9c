"""Vocab-parallel ops over the same logits merged into one where that is exact: one collective, and
one gradient of the logits instead of one per op (`merge_same_logits` for the replaced Functions,
`merge_inlined` for the op of inlined code). `replace_vocab_parallel_functions_pass` drives it."""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis.grad_flow import grad_modes
from graphpass.fx_utils import RESHAPES
from graphpass.ops.vocab_parallel import collective_bytes
from graphpass.records import Rejection, SiteRecord, site_kind
from graphpass.rewrite.vocab_parallel_op import (OP, SLICE_MEAN_ITEM, absorb_scaling, all_gathers, computes_slice_mean,
                                                 divides_rounded, temperature_text)

aten = torch.ops.aten

__all__ = ["merge_inlined", "merge_same_logits"]


_OTHER_LOGITS = "reads other logits"  # not a reason: ops over different logits have nothing to share


def merge_same_logits(graph: torch.fx.Graph, built: list, record) -> list:
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
    the logits in one op too (the pass's op for inlined code), with the same one collective."""
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
            and a.target is b.target and a.target in RESHAPES and not a.kwargs and not b.kwargs
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
    if divides_rounded(a) != divides_rounded(b):
        return "one divides the logits by the temperature in their dtype, the other in fp32"
    if ka is not None or kb is not None:
        return "a keep mask"
    if (ca, kera) != (cb, kerb):
        return "different chunking"
    if any(u.target is not operator.getitem or u.args[1] not in (0, 1, SLICE_MEAN_ITEM) for u in (*a.users, *b.users)):
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
    if target.op == "call_function" and target.target in (*RESHAPES, aten.zeros.default):
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
        if target.op == "call_function" and target.target in (*RESHAPES, aten.zeros.default) and \
                not _before(graph, target, place):
            target = _torch_api.fake_node(graph, fake_mode, target.target, target.args, target.kwargs, target)
        with_entropy = with_a or with_b
        entropy_grad = (with_a and grad_a) or (with_b and grad_b)
        with_slice_mean = computes_slice_mean(a) or computes_slice_mean(b)
        op = _torch_api.fake_node(graph, fake_mode, OP, (logits, target, keep_mask, group, temperature, with_entropy,
                                                         entropy_grad, ignore_index, chunk, kernels, divides_rounded(a),
                                                         *(next(o for o in (a, b) if computes_slice_mean(o)).args[11:13]
                                                           if with_slice_mean else a.args[11:12])),
                                  {}, place)
        indices = (0, 1, SLICE_MEAN_ITEM) if with_slice_mean else (0, 1)
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
        collectives=all_gathers(site_a.tp_size, [collective_bytes(rows_hint, wide.dtype, with_entropy, masked=False)]))
    return site, op


def _before(graph, node, place) -> bool:
    for n in graph.nodes:
        if n is node:
            return True
        if n is place:
            return False
    return False


def merge_inlined(graph: torch.fx.Graph, built: list, inlined: tuple, record) -> list:
    """`built` ((site, op, may) per replaced Function) with `inlined` ((site, op, whether it is a
    Function's inlined forward): the op the pass built for inlined vocab-parallel code) merged into the Function op over the same logits where exact, else appended.

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
    """The merged `op` reading through what only it now reads (`absorb_scaling`); the site updated."""
    logits, temperature, rounded = absorb_scaling(op.args[0], op.args[4], divides_rounded(op))
    if logits is op.args[0]:
        return
    op.args = (logits, *op.args[1:4], float(temperature), *op.args[5:10], rounded, *op.args[11:])
    wide = logits.meta["val"]
    site.shape, site.dtype = tuple(wide.shape), wide.dtype
    for output in site.outputs:
        output.temperature = temperature_text(temperature, rounded, wide.dtype)
