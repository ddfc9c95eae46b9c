"""Shared pytest setup: `bench` and `examples` importable from the checkout (graphpass itself must be
installed, `pip install -e .`: `graphpass.passes` exists only installed), fresh Dynamo state per test,
the `slow` and `heavy` markers."""

from __future__ import annotations

import os
import sys

# Triton kernels the tests make run in Triton's interpreter, on CPU tensors (tests/ops/test_kernels.py):
# read when Triton is imported, which importing graphpass does, so before anything imports it.
# Nothing else in the tests runs Triton (inductor compiles C++ on the CPU).
os.environ.setdefault("TRITON_INTERPRET", "1")
# The lm_head's CPU schedule follows this machine's measured GEMM rates (graphpass.ops.gemm_rates):
# fixed here, about an AMD EPYC's with AVX512-BF16 (bf16 products 4-8 x faster than from fp32
# copies), so every test machine takes the same schedules and nothing is measured or cached on disk.
# Tests of the other schedules set their own.
os.environ.setdefault("GRAPHPASS_GEMM_RATES", "native=1.5e11,upcast=2.5e10")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (full parity grid, inductor)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running (full dtype/layout grid, inductor); needs --runslow")
    config.addinivalue_line("markers", "heavy: a module that takes a minute or more; it runs before the others")


def pytest_collection_modifyitems(config, items):
    # xdist (--dist loadscope) hands whole modules to workers in this order, the next to whichever
    # finishes first: long modules first and short ones last, so that no worker is left running a
    # long module alone at the end. A stable sort: modules stay whole and in order otherwise.
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
    if config.getoption("--runslow") or os.environ.get("GRAPHPASS_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or GRAPHPASS_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Every test compiles from scratch: no cached graphs or recompile limits leak between tests."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.fixture
def graphpass_log():
    """The messages graphpass logs (INFO and above) during the test, as a list of strings; works
    where pytest's own log capture is off (`.ci/run` passes `-p no:logging`)."""
    import logging

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger, handler = logging.getLogger("graphpass"), Collect(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield messages
    logger.removeHandler(handler)
    logger.setLevel(level)
