"""The `torch.compile` backend: rewrite row-local regions, hand the rest to the inner compiler."""

from __future__ import annotations

import logging

import torch

from graphpass import _torch_api
from graphpass.config import Config
from graphpass.lint import lint
from graphpass.pipeline import EagerRaises, rewrite_graph
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
        record.warnings = lint(gm)
        try:
            result = rewrite_graph(gm, example_inputs, self.config, record)
        except EagerRaises as e:
            # Run as eager does, op by op, so that torch raises its own error at the call; an inner
            # compiler might compute a value (inductor does, for a softmax of integers).
            record.fallback_reason = str(e)
            return gm.forward
        except Exception as e:
            return self._fall_back(gm, example_inputs, record, f"rewrite failed: {_describe(e)}", e)
        if reporting_enabled(self.config):
            print_graph_report(result)
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
