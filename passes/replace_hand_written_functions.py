"""Replace a one-device log-prob/entropy `autograd.Function` by its plain math, its backward checked.

Hand-written Functions without collectives (a TP Function run with no group, a chunked
log-prob kernel written for one GPU) reach the graph as one `autograd_function_apply` (a stub
after capture) that graphpass cannot chunk. When its forward computes exactly log-probs and/or
entropies of its logits (`graphpass.analysis.vocab_parallel.match_single_device`) *and* its
backward is their gradient (`graphpass.analysis.backward_check`, a float64 probe on a few rows),
the Function becomes `log_softmax(logits.float() / t).gather(...)` and `-(p * logp).sum(-1)`:
the chunk pass then rewrites it like any other such math, the lm_head fused where its matmul is
in the graph. Its bodies are read as written, then with their chunk loops over rows folded
(`graphpass.passes.read_folded`).

A Function that multiplies by the output layer itself (`z = hidden @ W.T (+ b)` inside, whole,
chunk by chunk or a vocabulary block at a time) is read at its logits (`output_layer_function.cut_at_logits`): when its
backward is the chain rule around `z` (`dhidden = dz @ W`, `dW = dz.T @ hidden`, `db = dz.sum(0)`)
and `dz` checks out as above, it becomes `hidden @ W.T (+ b)` and the plain math of `z`, which the
chunk pass fuses; an input it returns no gradient for is read detached.

Where Dynamo passes the Function symbolic sizes (the second length it compiles, or `dynamic=True`),
its forward is read as it is, and its backward checked at the sizes' example values, and again
with a symbolic vocabulary twice as wide: the probe runs on numbers.

A Function whose backward is not that gradient, or cannot be checked, stays as it is with the
reason recorded; where an output layer inside it is not read, the reason names the stand-in a
user can register for it (`graphpass.integrations.substitute_in_graph`).
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from graphpass import _torch_api
from graphpass.analysis import catalogue
from graphpass.analysis.backward_check import check_backward, joint_module
from graphpass.analysis.output_layer_function import (cut_at_logits, emit_product, fold_weight_blocks,
                                                       issues_collectives, output_layer_inside, read_transposes,
                                                       transposed_inputs)
from graphpass.analysis.regions import source_of
from graphpass.analysis.vocab_parallel import match_single_device
from graphpass.capture import CantCapture, capture, hop_of
from graphpass.fx_utils import target_name, transitive_inputs, value_or_constant
from graphpass.records import REPLACED_FUNCTION, Rejection
from graphpass.rewrite.replaced_function import as_the_output_was

from . import fold_function_body, read_folded

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
            found = _match(hop, stub, config)
        except Exception as e:  # noqa: BLE001 - a Function this pass cannot read stays as it is
            log.debug("graphpass: reading the Function at %s failed", source_of(stub), exc_info=True)
            found = f"graphpass could not read it ({type(e).__name__})"
        if found is None:
            continue
        if isinstance(found, str):
            record.rejected.append(Rejection(source_of(stub), f"autograd.Function kept: {found}"))
            continue
        match, logits, target, non_differentiable, *head = found
        # (A Function with the output layer inside is checked at static sizes only: its logits are made here.)
        if not head and not _sizes_readable(stub, logits):
            record.rejected.append(Rejection(source_of(stub), "autograd.Function kept: an output's symbolic size "
                                                              "is none of its logits' sizes"))
            continue
        if head:  # the Function multiplied by the output layer itself: its product comes first
            logits = _emit_logits(gm.graph, stub, *head[0])
        _replace(gm.graph, stub, hop, match, logits, target, non_differentiable)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _match(hop, stub, config):
    """(match, outer logits, outer target) for a Function to replace; why it stays (one line);
    or None when it is none of this pass's business (collectives, or no log-prob or entropy)."""
    forward, backward = hop.bodies[0], hop.bodies[1]
    operands = hop.operands(stub)  # the forward's inputs: tensors, and sizes where shapes are dynamic
    returned = forward.graph.output_node().args[0]  # Dynamo's forward: ((outputs), (saved))
    n_outputs, n_saved = len(returned[0]), len(returned[1])
    vals = [value_or_constant(o) for o in operands]
    try:
        captured = capture(forward, vals)
    except CantCapture:
        return None
    if hop.unread is not None:
        return hop.unread if any(catalogue.normalises(n) for n in captured.gm.graph.nodes) else None

    def outputs():
        return list(captured.gm.graph.output_node().args[0])[len(captured.mutated_inputs):][:n_outputs]

    match = read_folded(captured.gm, vals, lambda gm: match_single_device(gm, outputs()),
                        lambda m: m is not None and not isinstance(m, str), config=config)
    if match is None or isinstance(match, str):
        product = output_layer_inside(captured.gm)
        if product is None:
            return _unread_log_softmax(captured.gm, match)
        if issues_collectives(captured.gm):
            return None  # a vocab-parallel lm_head Function: replace_vocab_parallel_functions reads it
        if hop.mutates_inputs or captured.mutated_inputs:
            return _OUTPUT_LAYER_KEPT.format(source_of(product), "it writes into its inputs")
        return _match_output_layer(hop, product, operands, vals, [o.meta["val"] for o in outputs()], n_saved, config)
    what = " and ".join(k for k in ("log-prob", "entropy") if any(k.replace("-", "") in o for o in match.outputs))
    kept = f"its forward computes the {what} of its logits, but "
    if hop.mutates_inputs or captured.mutated_inputs:
        return kept + "it writes into its inputs; hand it a clone, or write the math without the Function"
    placeholders = list(captured.gm.graph.find_nodes(op="placeholder"))
    positions = placeholders.index(match.logits), None if match.target is None else placeholders.index(match.target)
    non_differentiable = set(hop.kwargs.get("non_differentiable_idx", ()))
    if not _torch_api.any_symbolic(vals):
        why = _backward_unchecked(hop, vals, [o.meta["val"] for o in outputs()], n_saved, positions, match,
                                  non_differentiable, config)
    else:
        why = _backward_unchecked_at_two_sizes(hop, vals, n_outputs, n_saved, positions, match, non_differentiable,
                                               config)
    if why is not None:
        return kept + why
    target = None if positions[1] is None else operands[positions[1]]
    return match, operands[positions[0]], target, non_differentiable


def _sizes_readable(stub, source) -> bool:
    """Whether each symbolic size of `stub`'s outputs is one of `source`'s, where the replacement
    reads it (`as_the_output_was`)."""
    have = tuple(source.meta["val"].shape)
    return all(isinstance(s, int) or any(_torch_api.same_size(s, h) for h in have)
               for user in stub.users if isinstance(user.meta.get("val"), torch.Tensor)
               for s in user.meta["val"].shape)


def _backward_unchecked(hop, vals, output_vals, n_saved, positions, match, non_differentiable, config) -> str | None:
    """Why the backward of the Function behind `hop`, on inputs `vals`, is not shown to be the
    gradient of `match` (the end of a sentence about it), or None when the probe shows it is.
    `positions`: of its logits and its target (or None) among its inputs."""
    forward, backward = hop.bodies[0], hop.bodies[1]
    grads = [torch.empty_like(v) for v in output_vals]
    try:
        joint = capture(joint_module(forward, backward, len(vals), len(output_vals), n_saved), vals + grads)
    except CantCapture as e:
        return f"its backward cannot be captured ({e})"
    except Exception as e:  # noqa: BLE001 - a backward that does not trace cannot be checked
        return f"its backward does not trace on fake values ({type(e).__name__})"
    if joint.mutated_inputs:
        return "its backward writes into its inputs (its saved logits), which the plain math would not"

    def check(gm):
        try:
            return check_backward(gm, vals, *positions, match.outputs, match.temperature, non_differentiable)
        except Exception as e:  # noqa: BLE001 - what the check cannot read keeps the Function
            return f"the check failed on its code ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"

    why = read_folded(joint.gm, vals + grads, check, lambda why: why is None, config=config)
    if why is None:
        return None
    return f"its hand-written backward is unchecked: {why}; write the math without the Function " \
           "(torch.log_softmax(logits, -1).gather(...)) to have it chunked"


def _backward_unchecked_at_two_sizes(hop, vals, n_outputs, n_saved, positions, match, non_differentiable,
                                     config) -> str | None:
    """`_backward_unchecked` where the Function's sizes are symbolic: the probe runs on numbers, so
    its bodies are captured again and checked at the example sizes, and, where the vocabulary's size
    is symbolic, again with the vocabulary twice as wide (the replacement serves every size the graph is compiled for; a backward that
    reads the vocabulary's size as a number, or slices it at a constant, would agree at one size
    by chance, hardly at two; doubling keeps what Dynamo may have guarded, a divisor of it or a
    lower bound)."""
    width = vals[positions[0]].shape[-1]
    vocab = _torch_api.size_symbol(width)
    if vocab is None and not isinstance(width, int):
        return "its hand-written backward is unchecked: its vocabulary's size is not one symbolic size"
    try:
        sizes = [_torch_api.fakes_at_sizes(vals)]
        if vocab is not None:
            sizes.append(_torch_api.fakes_at_sizes(vals, {vocab: 2 * _torch_api.size_at(width)}))
    except Exception as e:  # noqa: BLE001 - sizes without example values cannot be probed
        return f"its hand-written backward is unchecked: its sizes have no example values ({type(e).__name__})"
    for at in sizes:
        try:
            forward = capture(hop.bodies[0], at)
        except Exception as e:  # noqa: BLE001 - code that does not trace at these sizes is not checked there
            return f"its forward does not trace at its example sizes ({type(e).__name__})"
        output_vals = [o.meta["val"] for o in
                       list(forward.gm.graph.output_node().args[0])[len(forward.mutated_inputs):][:n_outputs]]
        why = _backward_unchecked(hop, at, output_vals, n_saved, positions, match, non_differentiable, config)
        if why is not None:
            return why
    return None


_OUTPUT_LAYER_KEPT = ("its forward computes logits from its inputs itself (the output layer's product at {}), "
                      "but {}; register the Function's plain math with graphpass.integrations.substitute_in_graph "
                      "to have the lm_head fused")


def _match_output_layer(hop, product, operands, vals, output_vals, n_saved, config):
    """(match, logits, target, non-differentiable, head) for a Function that multiplies by the
    output layer itself, read at its logits (`output_layer_function.cut_at_logits`) and its
    backward checked there; else why it is kept."""
    forward, backward = hop.bodies[0], hop.bodies[1]
    where = source_of(product)
    grads = [torch.empty_like(v) for v in output_vals]
    try:
        joint = capture(joint_module(forward, backward, len(operands), len(output_vals), n_saved), vals + grads)
    except Exception as e:  # noqa: BLE001 - a backward that does not trace cannot be checked
        return _OUTPUT_LAYER_KEPT.format(where, f"its backward does not trace on fake values ({type(e).__name__})")
    if joint.mutated_inputs:
        return _OUTPUT_LAYER_KEPT.format(where, "its backward writes into its inputs")
    read_transposes(joint.gm, transposed_inputs(operands))
    why = fold_weight_blocks(joint.gm, len(vals), len(output_vals))
    if why is not None:
        return _OUTPUT_LAYER_KEPT.format(where, why)
    fold_function_body(joint.gm, vals + grads, config=config)
    cut = cut_at_logits(joint.gm, vals, len(output_vals))
    if isinstance(cut, str):
        return _OUTPUT_LAYER_KEPT.format(where, cut)
    lj = cut.logits_joint
    match = match_single_device(lj, list(lj.graph.output_node().args[0])[:len(output_vals)])
    if match is None or isinstance(match, str):
        return _OUTPUT_LAYER_KEPT.format(where, match or "its outputs are not log-probs or entropies of them")
    placeholders = list(lj.graph.find_nodes(op="placeholder"))
    target_position = None if match.target is None else placeholders.index(match.target)
    non_differentiable = set(hop.kwargs.get("non_differentiable_idx", ()))
    try:
        why = check_backward(lj, cut.example_inputs, 0, target_position, match.outputs, match.temperature,
                             non_differentiable)
    except Exception as e:  # noqa: BLE001 - what the check cannot read keeps the Function
        why = f"the check failed on its code ({type(e).__name__})"
    if why is not None:
        return _OUTPUT_LAYER_KEPT.format(where, f"its hand-written backward is unchecked at its logits: {why}")
    target = None if target_position is None else operands[cut.other_positions[target_position - 1]]
    return match, None, target, non_differentiable, (cut, operands)


def _emit_logits(graph, stub, cut, operands):
    """The Function's logits in the caller's graph, before `stub`: its product of the caller's
    hidden states and weight (and bias), as the Function wrote it (`hidden @ W.T + b`), which the
    lm_head fusion then takes in."""
    head, env = cut.head, {}
    for node, position in ((head.hidden, cut.hidden_position), (head.weight, cut.weight_position),
                           (head.bias, cut.bias_position)):
        if node is not None:
            env[node] = operands[position]
            if position in cut.detached:  # the Function returns no gradient for it
                with graph.inserting_before(stub):
                    env[node] = _torch_api.fake_node(graph, _torch_api.detect_fake_mode([env[node].meta["val"]]),
                                                     aten.detach.default, (env[node],), like=stub)
    return emit_product(graph, head.logits, env, stub)


#: What only a log-prob's math computes (a plain softmax is also attention's).
_LOG_NORMALISERS = (catalogue.NORMALISERS - catalogue.SOFTMAX) | {aten._log_softmax.default, aten.log_softmax.int}


def _unread_log_softmax(gm: torch.fx.GraphModule, why: str | None) -> str | None:
    """Why a Function whose forward takes a log-softmax or log-sum-exp is kept though its outputs
    were not read as log-probs or entropies (`why`, from the match), or None for any other Function."""
    if why is None:
        return None
    for node in gm.graph.nodes:
        if node.op == "call_function" and (node.target in _LOG_NORMALISERS or _logs_a_sum_of_exps(node)):
            return (f"its forward takes a {target_name(node)} (at {source_of(node)}), but {why}; graphpass "
                    "replaces a Function whose outputs are exactly log-probs or entropies of its logits")
    return None


def _logs_a_sum_of_exps(node) -> bool:
    """`log(...)` of a value computed from `exp(...).sum(...)`: a log-sum-exp written out by hand
    (block by block, an online one)."""
    return node.target is aten.log.default and any(
        n.target is aten.sum.dim_IntList and getattr(n.args[0], "target", None) is aten.exp.default
        for n in transitive_inputs([node]))


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
            # A symbolic size is read from the logits (a graph argument must be a node or a number;
            # the region the chunk pass finds reads them, not what it computes).
            rows = [n if isinstance(n, int) else node(aten.sym_size.int, logits, d)
                    for d, n in enumerate(logits.meta["val"].shape[:-1])]
            ids = node(aten.reshape.default, ids, [*rows, 1])
            values["logprob"] = node(aten.squeeze.dim, node(aten.gather.default, logp, -1, ids), -1)
        if any(k.endswith("entropy") for k in match.outputs):
            p_logp = node(aten.mul.Tensor, node(aten.exp.default, logp), logp)
            values["entropy"] = node(aten.neg.default, node(aten.sum.dim_IntList, p_logp, [-1]))
    for user in users:
        index = user.args[1]
        with graph.inserting_before(user):
            new = as_the_output_was(node, values, match.outputs[index], user.meta["val"], index in non_differentiable,
                                    sizes_of=logits)
        user.replace_all_uses_with(new)
        graph.erase_node(user)
    graph.erase_node(stub)
