"""The `torch.compile` backend: rewrite row-local regions, hand the rest to the inner compiler."""

from __future__ import annotations

import logging

import torch

from graphpass import _torch_api
from graphpass.config import Config
from graphpass.lint import lint, lint_functions
from graphpass.pipeline import EagerRaises, rewrite_graph
from graphpass.records import GraphRecord
from graphpass.report import human_bytes, print_graph_report, reporting_enabled

log = logging.getLogger("graphpass")


class Backend:
    """A configured graphpass backend: `torch.compile(fn, backend=graphpass.Backend(chunk_size=512))`.

    It remembers what it compiled: `backend.records` holds one `GraphRecord` per graph.
    """

    def __init__(self, config: Config | None = None, **options):
        if config is not None and options:
            raise TypeError("graphpass.Backend: pass either a Config or keyword options, not both")
        self.config = config or Config.from_options(**options)
        self.records: list[GraphRecord] = []

    def __repr__(self):
        return f"graphpass.Backend({self.config})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        record = GraphRecord(index=len(self.records))
        self.records.append(record)
        record.warnings = lint(gm)
        try:
            return self._compile(gm, example_inputs, record)
        finally:
            replaced = {f for s in record.sites if record.rewritten and s.replaced_function
                        for f in s.replaced_function.split(", ")}
            record.warnings += lint_functions(gm, replaced)

    def _compile(self, gm, example_inputs, record):
        """The rewritten graph compiled by the inner compiler, or the graph as written, `record` filled."""
        try:
            result = rewrite_graph(gm, example_inputs, self.config, record)
        except EagerRaises as e:
            # Run as eager does, op by op, so that torch raises its own error at the call; an inner
            # compiler might compute a value (inductor does, for a softmax of integers).
            record.fallback_reason = str(e)
            return gm.forward
        except Exception as e:
            return self._fall_back(gm, example_inputs, record, f"rewrite failed: {_describe(e)}", e)
        estimate = None
        if record.rewritten and self.config.never_worse and _single_device(record):
            estimate = _estimate(result)
            if estimate is not None and _materially_worse(estimate.before.peak_bytes, estimate.after.peak_bytes):
                record.runs_unchanged(f"the rewrite would peak at {human_bytes(estimate.after.peak_bytes)}, above "
                                      f"the graph as written ({human_bytes(estimate.before.peak_bytes)}; memory model)")
                log.info("graphpass: graph %d runs unchanged: %s", record.index, record.fallback_reason)
        if reporting_enabled(self.config):
            if estimate is None:
                print_graph_report(result)  # the memory model runs there
            else:
                print_graph_report(record, estimate)
        if not record.rewritten:
            return _torch_api.inner_compile(self.config.inner, gm, example_inputs)
        try:
            return _torch_api.inner_compile(self.config.inner, result.after, example_inputs)
        except Exception as e:
            return self._fall_back(gm, example_inputs, record,
                                   f"inner compiler {self.config.inner} failed on the rewritten graph: "
                                   f"{_describe(e)}", e)

    def _fall_back(self, gm, example_inputs, record, reason, error):
        """Never wrong: run the original graph, with the reason logged and recorded."""
        if self.config.strict or isinstance(error, _torch_api.dynamo_control_flow_errors()):
            raise error
        record.runs_unchanged(reason)
        log.warning("graphpass: graph %d runs unchanged: %s", record.index, record.fallback_reason,
                    exc_info=log.isEnabledFor(logging.DEBUG))
        return _torch_api.inner_compile(self.config.inner, gm, example_inputs)


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
        log.info("graphpass: graph %d: no memory estimate (%s): the rewrite stays", result.record.index, _describe(e))
        return None


def _describe(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def graphpass_backend(gm, example_inputs):
    """`backend="graphpass"`: a Backend with default options (entry point for torch.compile)."""
    return _default_backend()(gm, example_inputs)


_DEFAULT: Backend | None = None


def _default_backend() -> Backend:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Backend()
    return _DEFAULT
