"""Shared pytest setup: import graphpass from the checkout, fresh Dynamo state for every test."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Every test compiles from scratch: no cached graphs or recompile limits leak between tests."""
    torch.compiler.reset()
    yield
    torch.compiler.reset()
