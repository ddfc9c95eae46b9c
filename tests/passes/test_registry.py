"""The pass registry: order, one signature, disable-by-name, errors that name the pass."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

import graphpass
import graphpass.passes as passes
from graphpass import pipeline
from graphpass.capture import capture_function
from graphpass.records import GraphRecord


def test_registry_is_numbered_in_order():
    entries = passes.registry()
    assert [p.name for p in entries] == list(passes.PASS_NAMES)
    assert [p.number for p in entries] == list(range(1, len(entries) + 1))
    assert passes.PASS_NAMES == ("sink_row_slices_pass", "replace_hand_written_functions_pass",
                                 "replace_vocab_parallel_functions_pass", "index_rows_as_gather_pass", "fold_row_loops_pass",
                                 "expose_row_reductions_pass", "read_sliced_rows_whole_pass", "tag_grad_flow_pass", "chunk_rowwise_regions_pass",
                                 "localize_cp_reductions_pass")


@pytest.mark.parametrize("entry", passes.registry(), ids=lambda p: p.name)
def test_every_pass_has_the_one_signature(entry):
    assert entry.fn.__name__ == entry.name and entry.fn.__module__.endswith(entry.name.removesuffix("_pass"))
    signature = inspect.signature(entry.fn)
    assert list(signature.parameters)[:2] == ["gm", "example_inputs"]
    signature.bind("gm", [], config=None, record=None)  # config and record by keyword
    with pytest.raises(TypeError):
        signature.bind("gm", [], None, None)  # never by position


def test_unknown_pass_name_fails_at_config_construction_with_the_known_names():
    with pytest.raises(ValueError) as info:
        graphpass.Config(disable_passes=("drop_unused_grad_pass",))
    message = str(info.value)
    assert "\n" not in message and "'drop_unused_grad_pass'" in message
    assert all(name in message for name in passes.PASS_NAMES)
    assert graphpass.Config(disable_passes=["tag_grad_flow_pass"]).disable_passes == ("tag_grad_flow_pass",)


def test_names_are_known_without_importing_torch():
    # Config checks names against the registry; importing it must not import the passes (cycles).
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('p', sys.argv[1]); "
            "module = sys.modules['p'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "assert module.PASS_NAMES and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code, passes.__file__], check=True)


def test_a_failing_pass_is_named(monkeypatch):
    def broken(gm, example_inputs, *, config, record):
        raise RuntimeError("boom")

    entries = passes.registry()
    monkeypatch.setattr(pipeline, "registry", lambda: (entries[0], passes.Pass(2, "broken_pass", broken)))
    captured = []

    def backend(gm, example_inputs):
        try:
            pipeline.rewrite_graph(gm, example_inputs, graphpass.Config(), GraphRecord(index=0))
        except pipeline.PassFailed as e:
            captured.append(str(e))
        return gm.forward

    torch.compile(lambda x: (x.sin(),), backend=backend)(torch.randn(3))
    assert captured == ["pass 2 broken_pass failed: RuntimeError: boom"]


def test_function_body_sub_pipeline_runs_registered_passes_and_honours_disable_passes():
    """`fold_function_body` runs `FUNCTION_BODY_PASSES`, each a step of a registered pass, and skips
    the steps whose pass `disable_passes` names: here `x[arange(T), t]` becomes a gather or stays."""
    assert all(name in passes.PASS_NAMES for name, _ in passes.FUNCTION_BODY_PASSES)

    def picked(logits, target):
        return torch.log_softmax(logits, -1)[torch.arange(logits.shape[0]), target]

    def indexes(config) -> bool:
        c = capture_function(picked, torch.randn(6, 5), torch.randint(0, 5, (6,)))
        passes.fold_function_body(c.gm, c.fakes, config=config)
        return bool(c.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.index.Tensor))

    assert not indexes(graphpass.Config())
    assert indexes(graphpass.Config(disable_passes=("index_rows_as_gather_pass",)))
