"""The pass runner: capture the ATen graph, apply the passes in order, record what happened; and
the one decision, rewrite or not, that the backend acts on and `explain` / `graphpass inspect`
report (`decide`)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from graphpass import _torch_api
from graphpass.analysis.catalogue import non_float_normaliser
from graphpass.analysis.regions import source_of
from graphpass.capture import capture
from graphpass.config import Config
from graphpass.fx_utils import copy_graph_module
from graphpass.lint import lint
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


@dataclasses.dataclass
class Decision:
    """Rewrite or not, for one graph: what the backend runs and what `explain` reports."""

    result: RewriteResult | None
    """The rewrite (its `after` runs when `record.rewritten`); None where it raised."""
    estimate: object | None = None
    """The memory model's peaks before and after, where the `never_worse` veto consulted it."""
    eager: bool = False
    """Run the graph op by op, so that torch raises its own error at the call (`EagerRaises`)."""
    error: Exception | None = None
    """Why the rewrite failed: the graph runs unchanged."""


def decide(gm: torch.fx.GraphModule, example_inputs, config: Config, record: GraphRecord,
           on_stage=None) -> Decision:
    """Lint Dynamo's graph `gm`, rewrite it, and veto a rewrite that fails, or that the memory model
    says peaks above the graph as written (`Config.never_worse`, single-device graphs): `record`
    says what runs. With `config.strict` a failed rewrite raises instead."""
    record.warnings = lint(gm)
    try:
        result = rewrite_graph(gm, example_inputs, config, record, on_stage)
    except EagerRaises as e:
        record.fallback_reason = str(e)
        return Decision(None, eager=True)
    except Exception as e:
        if config.strict or isinstance(e, _torch_api.dynamo_control_flow_errors()):
            raise
        record.runs_unchanged(f"rewrite failed: {describe(e)}")
        return Decision(None, error=e)
    estimate = None
    if record.rewritten and config.never_worse and _single_device(record):
        estimate = _estimate(result)
        if estimate is not None and _materially_worse(estimate.before.peak_bytes, estimate.after.peak_bytes):
            from graphpass.report import human_bytes

            record.runs_unchanged(f"the rewrite would peak at {human_bytes(estimate.after.peak_bytes)}, above "
                                  f"the graph as written ({human_bytes(estimate.before.peak_bytes)}; memory model)")
            log.info("graphpass: graph %d runs unchanged: %s", record.index, record.fallback_reason)
    return Decision(result, estimate)


# The model is an estimate: a rewrite is vetoed where it predicts a peak above the graph's by more
# than its own error (an eighth) and by bytes that matter (at a few hundred KiB, the sizes of tests
# and toy shapes, a chunk budget spans every row and both peaks are noise).
_WORSE_RATIO, _WORSE_BYTES = 1.125, 1 << 20


def _materially_worse(before: int, after: int) -> bool:
    return after > before * _WORSE_RATIO and after - before > _WORSE_BYTES


def _single_device(record: GraphRecord) -> bool:
    """No site of the graph communicates (tensor- or context-parallel)."""
    return not record.cp and not record.collectives and all(site.tp_size == 1 for site in record.sites)


def _estimate(result):
    """The memory model's before/after peaks, or None where it cannot tell (then the rewrite stays)."""
    from graphpass import memory

    try:
        return memory.estimate_rewrite(result)
    except Exception as e:  # noqa: BLE001 - the model is an advisor: no estimate, no veto
        log.info("graphpass: graph %d: no memory estimate (%s): the rewrite stays", result.record.index, describe(e))
        return None


def describe(error: Exception) -> str:
    """`Type: message`, one line's worth, for a reason."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
