"""An lm_head block's products on the CPU (`graphpass.ops.head_matmul`, `devices.fastest`).

Which form of a product the CPU's BLAS runs fastest depends on the processor, so an fp32 block's
logits (one GEMM, or the weight as the left operand tile by tile) and its `dhidden` are each timed
once per shape and the faster form kept. The choice is checked with a fake clock; every form
against a float64 product, bias, an `[H, V]` weight and a ragged last tile included.
"""

from __future__ import annotations

import pytest
import torch

from graphpass.ops import devices, head_matmul
from graphpass.ops.head_matmul import HeadSpec

ROWS, H, V = 6, 512, 2100  # H >= 512: the fp32 block takes the timed choice; tiles of 2048 and 52


@pytest.fixture(autouse=True)
def _no_choices(monkeypatch):
    monkeypatch.setattr(devices, "_FASTEST", {})


def _clock(monkeypatch, durations):
    """A clock under which the k-th timed way takes durations[k % len(durations)] seconds."""
    state = {"now": 0.0, "calls": 0}

    def clock():
        calls, state["calls"] = state["calls"], state["calls"] + 1
        if calls % 2:  # the reading after a way ran
            state["now"] += durations[(calls // 2) % len(durations)]
        return state["now"]

    monkeypatch.setattr(devices, "_clock", clock)


@pytest.mark.parametrize("slow", [0, 1])
def test_fastest_runs_each_way_twice_then_only_the_faster(monkeypatch, slow):
    _clock(monkeypatch, [2.0, 1.0] if slow == 0 else [1.0, 2.0])
    runs = []
    ways = tuple((lambda i=i: runs.append(i) or torch.tensor(float(i))) for i in range(2))
    first = devices.fastest("k", ways)
    assert runs == [0, 1, 0, 1, 1 - slow] and float(first) == 1 - slow  # the result is the chosen way's
    runs.clear()
    assert float(devices.fastest("k", ways)) == 1 - slow and runs == [1 - slow]
    runs.clear()
    devices.fastest("another shape", ways)
    assert len(runs) == 5  # timed again


def test_fastest_least_time_counts(monkeypatch):
    """One slow run (another process took the cores) does not decide: the least of two counts."""
    _clock(monkeypatch, [1.0, 1.5, 9.0, 1.5])  # way 0: 1.0 then 9.0; way 1: 1.5 twice
    runs = []
    ways = tuple((lambda i=i: runs.append(i) or torch.tensor(float(i))) for i in range(2))
    assert float(devices.fastest("k", ways)) == 0.0


@pytest.mark.parametrize("form", [0, 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_logits_forms_match_float64(monkeypatch, form, bias, transposed):
    _clock(monkeypatch, [1.0, 2.0] if form == 0 else [2.0, 1.0])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, H, generator=g)
    weight = torch.randn(*((H, V) if transposed else (V, H)), generator=g)
    b = torch.randn(V, generator=g)
    tensors = [hidden, weight] + ([b] if bias else [])
    head = HeadSpec(position=0, weight=1, bias=2 if bias else None, weight_transposed=transposed, hidden_size=H)
    expected = hidden.double() @ (weight.double() if transposed else weight.double().t())
    if bias:
        expected += b.double()
    out = torch.full((ROWS, V), float("nan"))
    for _ in range(2):  # timed, then the chosen form alone
        got = head_matmul.logits(head, tensors, hidden, out=out)
        assert got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    assert list(devices._FASTEST.values()) == [form]
