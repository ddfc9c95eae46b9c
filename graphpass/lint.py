"""Where torch.compile itself changes the user's math: warnings about Dynamo's graph, once per
source line, recorded in `GraphRecord.warnings`.

- **A grad-carrying in-place `dist.all_reduce`.** Eager's in-place all-reduce is invisible to
  autograd: the gradient of its input is the local one. Dynamo remaps it to the functional
  all-reduce, which has a backward that all-reduces (sums) the gradient over the group, so the
  compiled gradients come out up to the group size times eager's.
- **An autograd.Function that writes into a tensor it returns, on torch 2.11.** There Dynamo loses
  the gradient through it (`_torch_api.dynamo_loses_gradients_of_written_function_outputs`), with
  any backend; graphpass replaces such a Function only where it reads it.
"""

from __future__ import annotations

import logging
import operator
import warnings

import torch

from graphpass import _torch_api
from graphpass.analysis.regions import stack_frames
from graphpass.capture import written_inputs

log = logging.getLogger("graphpass")

# Frames of Dynamo's remapping of `dist.all_reduce` to the functional op (torch 2.13).
INPLACE_ALL_REDUCE_FRAMES = ("all_reduce_inplace", "_remapped_allreduce")

_warned: set[str] = set()


def lint(gm: torch.fx.GraphModule) -> list[str]:
    """The warnings for Dynamo's graph `gm` (each also issued once per process and source line)."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and _is_differentiable_inplace_all_reduce(node):
            where = user_frame(node.meta.get("stack_trace") or "")
            found.append(
                f"graphpass: `{where[1] or 'dist.all_reduce'}` ({where[0]}) carries a gradient: torch.compile traces "
                "an in-place dist.all_reduce as a differentiable all-reduce whose backward sums the gradient over "
                "the group, so compiled gradients differ from eager's (up to the group size times); all-reduce a "
                "detached tensor, or put it in an autograd.Function whose backward says what you mean")
    return _issue(found)


def lint_functions(gm: torch.fx.GraphModule, replaced: set[str]) -> list[str]:
    """The warnings for the autograd.Functions of Dynamo's graph `gm` that still run (graphpass
    replaced those called at the source lines `replaced`)."""
    found = []
    if _torch_api.dynamo_loses_gradients_of_written_function_outputs():
        for node in gm.graph.find_nodes(op="call_function", target=_torch_api.autograd_function_apply()):
            where = user_frame(node.meta.get("stack_trace") or "")[0]
            if where not in replaced and _writes_into_what_it_returns(gm, node):
                found.append(
                    f"graphpass: the autograd.Function at {where} writes in place into a tensor it returns or into "
                    f"its input: torch {torch.__version__}'s Dynamo loses gradients through it, with any backend; "
                    "clone before writing, or use torch 2.13 or newer")
    return _issue(found)


def _issue(found: list[str]) -> list[str]:
    """`found`, each message also warned once per process."""
    for message in found:
        if message not in _warned:
            _warned.add(message)
            warnings.warn(message, stacklevel=2)
            log.warning("%s", message)
    return found


def _writes_into_what_it_returns(gm, node) -> bool:
    """Whether the Function op `node`'s forward writes into its inputs or into an output the graph reads."""
    forward = getattr(gm, node.args[0].target)
    returned = forward.graph.output_node().args[0][0]
    read = [returned[u.args[1]] for u in node.users if u.target is operator.getitem and isinstance(u.args[1], int)]
    written = written_inputs(forward, [*forward.graph.find_nodes(op="placeholder"), *read])
    return written is None or bool(written)


def _is_differentiable_inplace_all_reduce(node) -> bool:
    collectives = _torch_api.functional_collectives
    if getattr(node.target, "overloadpacket", node.target) not in (collectives.all_reduce, collectives.all_reduce_):
        return False
    trace = node.meta.get("stack_trace") or ""
    if not any(frame in trace for frame in INPLACE_ALL_REDUCE_FRAMES):
        return False  # written as a functional collective: its backward is the user's choice
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.requires_grad


def user_frame(stack_trace: str) -> tuple[str, str]:
    """("file.py:LINE", source text) of the innermost frame outside torch, or ("?", "")."""
    frames = [f for f in stack_frames(stack_trace) if "/torch/" not in f.path]
    return (frames[-1].where, frames[-1].code) if frames else ("?", "")


def function_warnings(gm: torch.fx.GraphModule, record) -> list[str]:
    """`lint_functions` for Dynamo's graph `gm` as `record` says it runs: the Functions replaced by
    the sites of a rewrite that runs do not run."""
    replaced = {f for s in record.sites if record.rewritten and s.replaced_function
                for f in s.replaced_function.split(", ")}
    return lint_functions(gm, replaced)
