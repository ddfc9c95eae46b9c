"""The measured GEMM rates the lm_head's CPU schedule is chosen by (`graphpass.ops.gemm_rates`):
fixed by the environment, else measured once per process and dtype and cached on disk per machine."""

from __future__ import annotations

import json

import pytest
import torch

from graphpass.ops import gemm_rates
from graphpass.ops.gemm_rates import GemmRates


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """No fixed rates, an empty disk cache under `tmp_path`, a fresh process's memory; returns the
    list of dtypes `measure` was called for (it returns rates of 1 and 2 flop/s)."""
    monkeypatch.delenv(gemm_rates.ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(gemm_rates, "_MEASURED", {})
    calls = []
    monkeypatch.setattr(gemm_rates, "measure", lambda dtype: calls.append(dtype) or GemmRates(1.0, 2.0))
    return calls


def test_the_environment_fixes_the_rates(monkeypatch, measuring):
    monkeypatch.setenv(gemm_rates.ENVIRONMENT_VARIABLE, "native=2e11, upcast=8e10")
    assert gemm_rates.measured(torch.bfloat16) == GemmRates(native=2e11, upcast=8e10)
    assert not measuring and not gemm_rates.cache_path().exists()
    monkeypatch.setenv(gemm_rates.ENVIRONMENT_VARIABLE, "native=fast")
    with pytest.raises(ValueError, match="native=FLOPS,upcast=FLOPS"):
        gemm_rates.measured(torch.bfloat16)


def test_measured_once_per_process_and_dtype_then_read_from_disk(monkeypatch, measuring):
    assert gemm_rates.measured(torch.bfloat16) == GemmRates(1.0, 2.0)
    gemm_rates.measured(torch.bfloat16)
    gemm_rates.measured(torch.float16)
    assert measuring == [torch.bfloat16, torch.float16]
    cache = json.loads(gemm_rates.cache_path().read_text())
    assert cache == {f"{gemm_rates.machine_key()}|bfloat16": {"native": 1.0, "upcast": 2.0},
                     f"{gemm_rates.machine_key()}|float16": {"native": 1.0, "upcast": 2.0}}
    monkeypatch.setattr(gemm_rates, "_MEASURED", {})  # another process on this machine: the file's
    assert gemm_rates.measured(torch.bfloat16) == GemmRates(1.0, 2.0)
    assert measuring == [torch.bfloat16, torch.float16]


def test_another_machine_or_a_damaged_cache_measures_again(monkeypatch, measuring):
    path = gemm_rates.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"another CPU|bfloat16": {"native": 5.0, "upcast": 5.0},
                                f"{gemm_rates.machine_key()}|float16": {"native": "?"}}))
    assert gemm_rates.measured(torch.bfloat16) == GemmRates(1.0, 2.0)
    assert gemm_rates.measured(torch.float16) == GemmRates(1.0, 2.0)
    assert "another CPU|bfloat16" in json.loads(path.read_text())  # kept beside this machine's
    path.write_text("not json")
    monkeypatch.setattr(gemm_rates, "_MEASURED", {})
    assert gemm_rates.measured(torch.bfloat16) == GemmRates(1.0, 2.0)
    assert len(measuring) == 3


def test_machine_key_names_the_processor_torch_and_threads():
    key = gemm_rates.machine_key()
    assert f"torch {torch.__version__}" in key and f"threads {torch.get_num_threads()}" in key


def test_a_measurement_gives_positive_rates():
    rates = gemm_rates.measure(torch.bfloat16)
    assert rates.native > 0 and rates.upcast > 0
