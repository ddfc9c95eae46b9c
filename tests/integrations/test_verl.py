"""verl's fused lm_head (`FusedLinearForPPOFunction`) compiled with graphpass (`graphpass.integrations.verl`).

The stand-in against verl's own Function, as verl 0.9.1 ships it: compiled, one lm_head site, its
log-probs, entropy and the hidden states' and weight's gradients against eager verl, for 2-D and
3-D hidden states, a temperature, one output's gradient alone.

verl's top-level package imports Ray and its trainer's dependencies; the module that holds the
Function needs torch alone. Where verl is installed without them (`pip install --no-deps verl`),
that one module is loaded with verl's parent packages as bare namespaces; where verl is not
installed at all, the tests skip (the `test` extra does not install it: Ray alone is larger than
the rest of the test environment).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch

import graphpass
from graphpass.integrations import verl as verl_integration
from tests.helpers import relative_error

T, H, V = 24, 8, 40


def _verl_module():
    """verl's `utils.experimental.torch_functional`, imported as verl ships it, or None."""
    try:
        return importlib.import_module(verl_integration.MODULE)
    except ImportError:
        pass
    spec = importlib.util.find_spec("verl") if "verl" not in sys.modules else None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    for name, path in (("verl", root), ("verl.utils", f"{root}/utils"),
                       ("verl.utils.experimental", f"{root}/utils/experimental")):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package  # a bare namespace: its __init__ (Ray, the trainer) does not run
    return importlib.import_module(verl_integration.MODULE)


torch_functional = _verl_module()
pytestmark = pytest.mark.skipif(torch_functional is None, reason="verl is not installed")


def _call(hidden, weight, labels, temperature):
    return torch_functional.FusedLinearForPPO(chunk_size=8)(hidden, weight, labels, temperature)


def _run(fn, shape, temperature, which, seed=0):
    """fn's (log-probs, entropy) and the gradients of hidden and weight for random output gradients."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, shape, generator=g)
    log_probs, entropy = fn(hidden, weight, labels, temperature)
    weights = torch.randn(2, *shape, generator=g)
    loss = sum((o * w).sum() for o, w, used in zip((log_probs, entropy), weights, which) if used)
    loss.backward()
    return (log_probs, entropy), (hidden.grad, weight.grad)


@pytest.mark.parametrize("shape", [(T,), (3, T // 3)], ids=["2-D", "3-D"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("which", [(True, True), (True, False)], ids=["both", "log-probs"])
def test_stand_in_matches_verl_function(shape, temperature, which):
    """docs/frameworks/verl.md's fused-kernels recipe: the stand-in for verl's Function, compiled."""
    assert verl_integration.register_for(torch_functional)
    expected, expected_grads = _run(_call, shape, temperature, which)
    backend = graphpass.Backend(inner="aot_eager")
    got, grads = _run(torch.compile(_call, backend=backend, fullgraph=True), shape, temperature, which)
    [site] = [s for r in backend.records for s in r.sites]
    assert site.lm_head, site
    for e, o in zip(expected, got):
        assert o.shape == e.shape and o.dtype == e.dtype and relative_error(o, e) <= 1e-5
    for e, o in zip(expected_grads, grads):
        assert relative_error(o, e) <= 1e-5


def test_eager_calls_run_verls_function():
    assert verl_integration.register_for(torch_functional)
    hidden = torch.randn(T, H, requires_grad=True)
    log_probs, _ = _call(hidden, torch.randn(V, H), torch.randint(0, V, (T,)), 1.0)
    assert type(log_probs.grad_fn).__name__ == "FusedLinearForPPOFunctionBackward"
