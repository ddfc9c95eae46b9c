"""The pass runner: capture the ATen graph, apply the passes in order, record what happened."""

from __future__ import annotations

import dataclasses
import logging

import torch

from graphpass.analysis.catalogue import non_float_normaliser
from graphpass.analysis.regions import source_of
from graphpass.capture import capture
from graphpass.config import Config
from graphpass.fx_utils import copy_graph_module
from graphpass.records import GraphRecord
from graphpass.passes import registry

log = logging.getLogger("graphpass")


class PassFailed(RuntimeError):
    """A pass raised; the message names the pass."""


class EagerRaises(RuntimeError):
    """The graph would raise in eager (e.g. a softmax of integer logits), where a compiler may
    return a value: the backend runs it eagerly, so that torch raises its own error."""


@dataclasses.dataclass
class RewriteResult:
    before: torch.fx.GraphModule
    after: torch.fx.GraphModule
    fake_inputs: list
    record: GraphRecord


def rewrite_graph(gm: torch.fx.GraphModule, example_inputs, config: Config, record: GraphRecord,
                  on_stage=None) -> RewriteResult:
    """Capture `gm` as pre-dispatch ATen ops and run every enabled pass over it.

    `on_stage(stage, pass_name, gm)` is called with the graph after capture and after each pass
    (for dumps).
    """
    captured = capture(gm, example_inputs)
    before, fakes = captured.gm, captured.fakes
    refused = non_float_normaliser(before.graph)
    if refused is not None:
        val = refused.args[0].meta["val"]
        raise EagerRaises(f"{refused.target.__name__} of {str(val.dtype).removeprefix('torch.')} values "
                          f"at {source_of(refused)}: eager raises, so the graph runs eagerly")
    if on_stage:
        on_stage("captured", "capture", before)
    after = copy_graph_module(before)  # `before` stays intact for reports and the memory model
    passes = registry()
    for p in passes:
        if p.name in config.disable_passes:
            log.info("graphpass: graph %d: pass %d/%d %s disabled", record.index, p.number, len(passes), p.name)
            continue
        log.debug("graphpass: graph %d: pass %d/%d %s", record.index, p.number, len(passes), p.name)
        try:
            after = p.fn(after, fakes, config=config, record=record)
            after.graph.lint()
            after.recompile()
        except Exception as e:
            raise PassFailed(f"pass {p.number} {p.name} failed: {type(e).__name__}: {e}") from e
        record.passes_run.append(p.name)
        if on_stage:
            on_stage("after", p.name, after)
    after.graph.eliminate_dead_code()
    after = captured.restore(after)
    record.graph_module, record.example_inputs = after, fakes
    if captured.hops:
        # Reports and the memory model read `before` as the user's program: its higher-order
        # ops (a user autograd.Function, with its own backward) back in place of their stubs.
        before = captured.restore(copy_graph_module(before), for_analysis=True)
    return RewriteResult(before, after, fakes, record)
