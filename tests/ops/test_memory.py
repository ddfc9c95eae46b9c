"""The memory model: eager-exact liveness on small graphs, the chunked op, and agreement with measurement."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from graphpass import _torch_api, memory
from graphpass.capture import capture
from graphpass.records import GraphRecord, OutputRecord, SiteRecord

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, ROOT)
from examples.ppo_loss import ppo_loss  # noqa: E402

T, V = 64, 128


@pytest.fixture(autouse=True)
def _reset():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def capture_before(fn, *args, **kwargs):
    """Dynamo's graph as pre-dispatch ATen ops, and its fake inputs (what the core hands us)."""
    captured = []

    def backend(gm, example_inputs):
        c = capture(gm, example_inputs)
        captured.append((c.gm, c.fakes))
        return gm.forward

    torch.compile(fn, backend=backend)(*args, **kwargs)
    assert len(captured) == 1
    return captured[0]


def fake_ppo_inputs(dtype=torch.float32, t=T, v=V):
    with _torch_api.new_fake_mode():
        return (torch.empty(t, v, dtype=dtype, requires_grad=True), torch.empty(t, dtype=torch.int64),
                torch.empty(t), torch.empty(t), torch.empty(t))


def wide(dtype=torch.float32, t=T, v=V):
    return t * v * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_ppo_keeps_five_fp32_copies(dtype):
    gm, fakes = capture_before(ppo_loss, *fake_ppo_inputs(dtype))
    est = memory.estimate_peak(gm, fakes)
    fp32_copy = wide(torch.float32)
    # log_softmax and exp saved, three [T, V] gradients at the peak (measured: 5.0 x fp32 floor).
    assert 5 * fp32_copy <= est.peak_bytes < 5 * fp32_copy + 64 * T
    assert est.floor_bytes == wide(dtype)
    assert est.baseline_bytes >= wide(dtype)
    assert est.peak_phase == "backward"
    assert sum(lt.nbytes for lt in est.live_at_peak) <= est.peak_bytes
    assert est.saved_bytes >= 2 * fp32_copy  # log_softmax and exp outputs


def test_inputs_are_baseline_and_views_are_free():
    def f(x):
        y = x.view(T * V).view(T, V)[:, :]  # views of the input allocate nothing
        return (y * 2.0).sum()

    with _torch_api.new_fake_mode():
        x = torch.empty(T, V, requires_grad=True)
    gm, fakes = capture_before(f, x)
    est = memory.estimate_peak(gm, fakes)
    # forward: one [T, V] product (not saved: mul by a scalar); backward: the gradient.
    assert wide() <= est.peak_bytes < wide() + 64
    assert est.floor_bytes == wide()
    assert est.saved_bytes < 64


def test_forward_only_graph_counts_transients_only():
    def f(x):
        return torch.log_softmax(x, -1).exp().sum(-1)

    with _torch_api.new_fake_mode():
        x = torch.empty(T, V)
    gm, fakes = capture_before(f, x)
    est = memory.estimate_peak(gm, fakes)
    assert est.floor_bytes == 0
    assert 2 * wide() <= est.peak_bytes < 2 * wide() + 64 * T


# ---- the chunked op, through a local stand-in with the core's contract ------------------------------
@torch.library.custom_op("graphpass_standin::chunked", mutates_args=())
def standin_chunked(key: str, tensors: list[torch.Tensor], scalars: list[float],
                    out_sizes: list[int]) -> list[torch.Tensor]:
    logits, tokens = tensors
    lp = (logits.float() / scalars[0]).log_softmax(-1)
    return [lp.gather(-1, tokens[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)]


@standin_chunked.register_fake
def _(key, tensors, scalars, out_sizes):
    rows = tensors[0].shape[0]
    return [tensors[0].new_empty(rows, dtype=torch.float32), tensors[0].new_empty(rows, dtype=torch.float32)]


CHUNK = 16
WORKSPACE = 3 * CHUNK * V * 4  # three fp32 [chunk, V] temporaries, as an op-by-op inner compiler



def after_ppo(logits, tokens, old_logp, advantages, mask):
    outs = torch.ops.graphpass_standin.chunked.default("k0", [logits, tokens], [0.7], [T, T])
    logp, entropy = outs[0], outs[1]
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 0.8, 1.2)) - 0.0 * entropy
    return ((pg * mask).sum() / mask.sum().clamp(min=1.0),)


@pytest.fixture
def standin(monkeypatch):
    """The stand-in op plays the chunked op; all the model knows of it is in the SiteRecords."""
    monkeypatch.setattr(memory, "_chunked_op", lambda: torch.ops.graphpass_standin.chunked.default)


def site_record(dtype=torch.float32, keeps=(True, False), workspace=WORKSPACE, shape=(T, V), key="k0"):
    return SiteRecord(kind="logprob+entropy", source="ppo_loss.py:25", shape=shape, dtype=dtype, chunk_size=CHUNK,
                      outputs=[OutputRecord("logprob", keeps[0], "/ 0.7"), OutputRecord("entropy", keeps[1], "/ 0.7")],
                      program_key=key, chunk_rows=CHUNK, workspace_bytes=workspace)


def rewrite_result(dtype=torch.float32, n_sites=1, **site):
    before, fakes = capture_before(ppo_loss, *fake_ppo_inputs(dtype))
    after = torch.fx.symbolic_trace(after_ppo)
    record = GraphRecord(index=0, sites=[site_record(dtype, **site)] * n_sites)
    return types.SimpleNamespace(before=before, after=after, fake_inputs=fakes, record=record)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_op_peak_is_floor_plus_one_chunk(standin, dtype):
    est = memory.estimate_rewrite(rewrite_result(dtype))
    workspace = WORKSPACE
    assert est.after.floor_bytes == wide(dtype)
    assert wide(dtype) + workspace <= est.after.peak_bytes < wide(dtype) + workspace + 64 * T
    assert est.after.workspace_bytes == workspace
    assert est.bytes_saved == est.before.peak_bytes - est.after.peak_bytes > 0
    assert 0 < est.fraction_saved < 1


def test_forward_only_outputs_get_no_backward(standin):
    est = memory.estimate_rewrite(rewrite_result(keeps=(False, False)))
    # Nothing differentiable reaches the logits: no gradient buffer, only the forward's chunk.
    assert est.after.floor_bytes == 0
    assert est.after.peak_bytes < WORKSPACE + 64 * T


def test_unrecorded_workspace_counts_nothing(standin):
    est = memory.estimate_rewrite(rewrite_result(workspace=None))
    assert est.after.workspace_bytes == 0
    assert wide() <= est.after.peak_bytes < wide() + 64 * T


def test_one_program_at_two_shapes_takes_each_sites_workspace():
    sites = memory._Sites([site_record(shape=(T, V), workspace=1), site_record(shape=(2 * T, V), workspace=2)])
    with _torch_api.new_fake_mode():
        logits, tokens = torch.empty(2 * T, V), torch.empty(2 * T, dtype=torch.int64)
    assert sites.workspace_bytes("k0", [logits, tokens]) == 2
    assert sites.workspace_bytes("k1", [logits, tokens]) == 0
    assert sites.keeps_grad("k0") == [True, False] and sites.keeps_grad("k1") is None


@pytest.mark.parametrize("module", ["memory", "report", "inspection", "cli"])
def test_readers_of_records_never_import_the_op_registry(module):
    with open(os.path.join(ROOT, "graphpass", f"{module}.py")) as f:
        tree = ast.parse(f.read())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert not [name for name in imported if "chunked_op" in name]


def test_no_sites_means_no_change():
    before, fakes = capture_before(ppo_loss, *fake_ppo_inputs())
    result = types.SimpleNamespace(before=before, after=before, fake_inputs=fakes, record=GraphRecord(index=0))
    est = memory.estimate_rewrite(result)
    assert est.bytes_saved == 0


# ---- agreement with measurement ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_estimate_within_15_percent_of_measured_eager(dtype):
    """The benchmark's check at a smaller size: each measurement in a fresh process."""
    script = os.path.join(ROOT, "bench", "memory_model_check.py")
    out = subprocess.run([sys.executable, script, "--impl", "eager", "--dtype", dtype, "--T", "1024",
                          "--V", "16384", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    (row,) = json.loads(out.stdout)
    assert abs(row["error"]) <= 0.15, row
