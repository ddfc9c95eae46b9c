"""Replace a one-device log-prob/entropy `autograd.Function` by its plain math, its backward checked.

Hand-written Functions without collectives (a TP Function run with no group, a chunked
log-prob kernel written for one GPU) reach the graph as one `autograd_function_apply` (a stub
after capture) that graphpass cannot chunk. When its forward computes exactly log-probs and/or
entropies of its logits (`graphpass.analysis.vocab_parallel.match_single_device`) *and* its
backward is their gradient (`graphpass.analysis.backward_check`, a float64 probe on a few rows),
the Function becomes `log_softmax(logits.float() / t).gather(...)` and `-(p * logp).sum(-1)`:
the chunk pass then rewrites it like any other such math, the lm_head fused where its matmul is
in the graph. A Function whose backward is not that gradient, or cannot be checked, stays as it
is with the reason recorded; so does one that multiplies by the output layer itself (an lm_head
inside the Function, which this pass cannot read), the reason naming the stand-in a user can
register for it (`graphpass.integrations.substitute_in_graph`).
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis import catalogue
from graphpass.analysis.backward_check import check_backward, joint_module
from graphpass.analysis.lm_head import METADATA_CHECKS
from graphpass.analysis.regions import source_of
from graphpass.analysis.vocab_parallel import match_single_device
from graphpass.capture import CantCapture, capture, hop_of
from graphpass.fx_utils import is_floating, target_name, transitive_users
from graphpass.records import REPLACED_FUNCTION, Rejection

from .fold_row_loops import fold_row_loops_pass
from .replace_vocab_parallel_functions import as_the_output_was
from .sink_row_slices import sink_row_slices_pass

aten = torch.ops.aten
log = logging.getLogger("graphpass")

__all__ = ["replace_hand_written_functions_pass"]


def replace_hand_written_functions_pass(gm: torch.fx.GraphModule, example_inputs, *, config,
                                        record) -> torch.fx.GraphModule:
    """Each one-device log-prob/entropy Function whose backward checks out -> its plain math."""
    changed = False
    for stub in list(gm.graph.find_nodes(op="call_function", target=torch.ops.graphpass.opaque.default)):
        hop = hop_of(stub)
        if hop.target is not _torch_api.autograd_function_apply():
            continue
        try:
            found = _match(hop, stub)
        except Exception as e:  # noqa: BLE001 - a Function this pass cannot read stays as it is
            log.debug("graphpass: reading the Function at %s failed", source_of(stub), exc_info=True)
            found = f"graphpass could not read it ({type(e).__name__})"
        if found is None:
            continue
        if isinstance(found, str):
            record.rejected.append(Rejection(source_of(stub), f"autograd.Function kept: {found}"))
            continue
        _replace(gm.graph, stub, hop, *found)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _match(hop, stub):
    """(match, outer logits, outer target) for a Function to replace; why it stays (one line);
    or None when it is none of this pass's business (collectives, or no log-prob or entropy)."""
    forward, backward = hop.bodies[0], hop.bodies[1]
    tensors = stub.args[1]
    returned = forward.graph.output_node().args[0]  # Dynamo's forward: ((outputs), (saved))
    n_outputs, n_saved = len(returned[0]), len(returned[1])
    vals = [t.meta["val"] for t in tensors]
    try:
        captured = capture(forward, vals)
    except CantCapture:
        return None
    _fold_chunk_loops(captured.gm, vals)
    if (why := _torch_api.function_bodies_unread()) is not None:
        return why if any(catalogue.normalises(n) for n in captured.gm.graph.nodes) else None
    outputs = list(captured.gm.graph.output_node().args[0])[len(captured.mutated_inputs):][:n_outputs]
    match = match_single_device(captured.gm, outputs)
    if match is None or isinstance(match, str):
        return _output_layer_inside(captured.gm) or _unread_log_softmax(captured.gm, match)
    what = " and ".join(k for k in ("log-prob", "entropy") if any(k.replace("-", "") in o for o in match.outputs))
    kept = f"its forward computes the {what} of its logits, but "
    if hop.mutates_inputs or captured.mutated_inputs:
        return kept + "it writes into its inputs; hand it a clone, or write the math without the Function"
    placeholders = list(captured.gm.graph.find_nodes(op="placeholder"))
    logits_position = placeholders.index(match.logits)
    target_position = None if match.target is None else placeholders.index(match.target)
    grads = [torch.empty_like(o.meta["val"]) for o in outputs]
    try:
        joint = capture(joint_module(forward, backward, len(tensors), n_outputs, n_saved), vals + grads)
    except CantCapture as e:
        return kept + f"its backward cannot be captured ({e})"
    except Exception as e:  # noqa: BLE001 - a backward that does not trace cannot be checked
        return kept + f"its backward does not trace on fake values ({type(e).__name__})"
    _fold_chunk_loops(joint.gm, vals + grads)
    if joint.mutated_inputs:
        return kept + "its backward writes into its inputs (its saved logits), which the plain math would not"
    non_differentiable = set(hop.kwargs.get("non_differentiable_idx", ()))
    try:
        why = check_backward(joint.gm, vals, logits_position, target_position, match.outputs, match.temperature,
                             non_differentiable)
    except Exception as e:  # noqa: BLE001 - what the check cannot read keeps the Function
        why = f"the check failed on its code ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if why is not None:
        return kept + f"its hand-written backward is unchecked: {why}; write the math without the Function " \
                      "(torch.log_softmax(logits, -1).gather(...)) to have it chunked"
    target = None if target_position is None else tensors[target_position]
    return match, tensors[logits_position], target, non_differentiable


def _fold_chunk_loops(gm: torch.fx.GraphModule, example_inputs) -> None:
    """A Function's bodies as one computation over all rows: the chunk loops a hand-written kernel
    runs over its rows (`cat` of per-chunk results, a buffer filled chunk by chunk), which Dynamo
    unrolled, folded as the inline passes fold them. The bodies are read, never run as they are,
    so their metadata checks (which would keep each chunk's slice alive) go first."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in METADATA_CHECKS:
            gm.graph.erase_node(node)
    for fold in (sink_row_slices_pass, fold_row_loops_pass):
        fold(gm, example_inputs, config=None, record=None)
    gm.graph.eliminate_dead_code()
    gm.recompile()


#: The products an output layer's logits come from, as captured: where each reads its two operands.
_PRODUCTS = {aten.matmul.default: slice(0, 2), aten.linear.default: slice(0, 2), aten.mm.default: slice(0, 2),
             aten.bmm.default: slice(0, 2), aten.addmm.default: slice(1, 3)}


def _output_layer_inside(gm: torch.fx.GraphModule) -> str | None:
    """Why a Function whose forward normalises a product of two of its float inputs (logits
    `hidden @ W.T` it computes itself) is kept, or None for any other Function."""
    inputs = [p for p in gm.graph.find_nodes(op="placeholder") if is_floating(p)]
    from_inputs = set(inputs) | transitive_users(inputs)  # nodes computed from a float input
    for product in gm.graph.nodes:
        operands = product.args[_PRODUCTS[product.target]] if product.target in _PRODUCTS else ()
        if len(operands) < 2 or not all(a in from_inputs for a in operands):
            continue
        if any(catalogue.normalises(n) for n in transitive_users([product])):
            return (f"its forward computes logits from its inputs itself (the output layer's product at "
                    f"{source_of(product)}), which graphpass cannot read inside a Function; register the "
                    "Function's plain math with graphpass.integrations.substitute_in_graph to have the lm_head fused")
    return None


#: What only a log-prob's math computes (a plain softmax is also attention's).
_LOG_NORMALISERS = (catalogue.NORMALISERS - catalogue.SOFTMAX) | {aten._log_softmax.default, aten.log_softmax.int}


def _unread_log_softmax(gm: torch.fx.GraphModule, why: str | None) -> str | None:
    """Why a Function whose forward takes a log-softmax or log-sum-exp is kept though its outputs
    were not read as log-probs or entropies (`why`, from the match), or None for any other Function."""
    if why is None:
        return None
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _LOG_NORMALISERS:
            return (f"its forward takes a {target_name(node)} (at {source_of(node)}), but {why}; graphpass "
                    "replaces a Function whose outputs are exactly log-probs or entropies of its logits")
    return None


def _replace(graph: torch.fx.Graph, stub, hop, match, logits, target, non_differentiable) -> None:
    """The plain math of `match` on `logits` before `stub`; each of the stub's items reads it."""
    users = list(stub.users)
    if any(u.target is not operator.getitem for u in users):
        return  # used whole: left as it is (Dynamo hands items)
    fake_mode = _torch_api.detect_fake_mode([logits.meta["val"]])

    def node(target_op, *args, **kwargs):
        new = _torch_api.fake_node(graph, fake_mode, target_op, args, kwargs, like=stub)
        new.meta[REPLACED_FUNCTION] = source_of(stub)
        return new

    with graph.inserting_before(stub):
        x = logits
        if x.meta["val"].dtype in (torch.bfloat16, torch.float16):
            x = node(aten._to_copy.default, x, dtype=torch.float32)
        if match.temperature != 1.0:
            x = node(aten.div.Tensor, x, float(match.temperature))
        logp = node(aten._log_softmax.default, x, -1, False)
        values = {}
        if target is not None:
            ids = target if target.meta["val"].dtype == torch.long else node(aten._to_copy.default, target,
                                                                               dtype=torch.long)
            ids = node(aten.reshape.default, ids, [*logp.meta["val"].shape[:-1], 1])
            values["logprob"] = node(aten.squeeze.dim, node(aten.gather.default, logp, -1, ids), -1)
        if any(k.endswith("entropy") for k in match.outputs):
            p_logp = node(aten.mul.Tensor, node(aten.exp.default, logp), logp)
            values["entropy"] = node(aten.neg.default, node(aten.sum.dim_IntList, p_logp, [-1]))
    for user in users:
        index = user.args[1]
        with graph.inserting_before(user):
            new = as_the_output_was(node, values, match.outputs[index], user.meta["val"], index in non_differentiable)
        user.replace_all_uses_with(new)
        graph.erase_node(user)
    graph.erase_node(stub)
