"""The `torch.compile` backend: rewrite row-local regions, hand the rest to the inner compiler."""

from __future__ import annotations

import logging

import torch

from graphpass import _torch_api
from graphpass.config import Config
from graphpass.lint import function_warnings
from graphpass.pipeline import decide, describe
from graphpass.records import GraphRecord
from graphpass.report import print_graph_report, reporting_enabled

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
        try:
            return self._compile(gm, example_inputs, record)
        finally:
            record.warnings += function_warnings(gm, record)

    def _compile(self, gm, example_inputs, record):
        """The rewritten graph compiled by the inner compiler, or the graph as written, `record` filled."""
        decision = decide(gm, example_inputs, self.config, record)
        if decision.eager:
            # Run as eager does, op by op, so that torch raises its own error at the call; an inner
            # compiler might compute a value (inductor does, for a softmax of integers).
            return gm.forward
        if decision.error is not None:
            log.warning("graphpass: graph %d runs unchanged: %s", record.index, record.fallback_reason,
                        exc_info=log.isEnabledFor(logging.DEBUG))
            return _torch_api.inner_compile(self.config.inner, gm, example_inputs)
        if reporting_enabled(self.config):
            if decision.estimate is None:
                print_graph_report(decision.result)  # the memory model runs there
            else:
                print_graph_report(record, decision.estimate)
        if not record.rewritten:
            return _torch_api.inner_compile(self.config.inner, gm, example_inputs)
        try:
            return _torch_api.inner_compile(self.config.inner, decision.result.after, example_inputs)
        except Exception as e:
            return self._fall_back(gm, example_inputs, record,
                                   f"inner compiler {self.config.inner} failed on the rewritten graph: "
                                   f"{describe(e)}", e)

    def _fall_back(self, gm, example_inputs, record, reason, error):
        """Never wrong: run the original graph, with the reason logged and recorded."""
        if self.config.strict or isinstance(error, _torch_api.dynamo_control_flow_errors()):
            raise error
        record.runs_unchanged(reason)
        log.warning("graphpass: graph %d runs unchanged: %s", record.index, record.fallback_reason,
                    exc_info=log.isEnabledFor(logging.DEBUG))
        return _torch_api.inner_compile(self.config.inner, gm, example_inputs)


def graphpass_backend(gm, example_inputs):
    """`backend="graphpass"`: a Backend with default options (entry point for torch.compile)."""
    return _default_backend()(gm, example_inputs)


_DEFAULT: Backend | None = None


def _default_backend() -> Backend:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Backend()
    return _DEFAULT
