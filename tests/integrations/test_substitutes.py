"""A user's own hand-fused lm_head kernel (`graphpass.integrations.substitute_in_graph`).

The kernel is prime-rl's `_SequenceChunkedLogProbEntropyFn` as the corpus restates it (prime-rl
does not install here): token chunks of `hidden @ weight.T`, vocabulary blocks combined by an
online log-sum-exp, a per-token inverse temperature, a hand-written backward. graphpass cannot
read an lm_head inside a Function, so unregistered it stays as it is, with that reason; with its
plain math registered, the lm_head is fused and the values and gradients are the Function's.
Each test registers for a class of its own: a stand-in is registered once per class and process.
"""

from __future__ import annotations

import pytest
import torch

import graphpass
from graphpass.integrations import check_substitute, substitute_in_graph
from tests.corpus import prime_rl
from tests.helpers import relative_error

N, H, V, CHUNK = prime_rl.N, prime_rl.HID, prime_rl.V2, prime_rl.TOKEN_CHUNK


def _own_class():
    """The corpus's Function under a class of its own."""
    return type("ChunkedLogProbEntropy", (prime_rl.ChunkedLogProbEntropy,), {})


def plain_math(hidden, weight, labels, inv_t, chunk_size):
    z = (hidden @ weight.T).to(torch.promote_types(hidden.dtype, torch.float32)) * inv_t[:, None]
    logp = z.log_softmax(-1)
    return logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def without_temperature(hidden, weight, labels, inv_t, chunk_size):
    return plain_math(hidden, weight, labels, torch.ones_like(inv_t), chunk_size)


def detached_entropy(hidden, weight, labels, inv_t, chunk_size):
    logprobs, entropy = plain_math(hidden, weight, labels, inv_t, chunk_size)
    return logprobs, entropy.detach() + 0 * logprobs  # the same values; no entropy gradient


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    inv_t = 1 / torch.where(torch.arange(N) < 10, 0.7, 1.0).to(dtype)
    return hidden, weight, labels, inv_t


def _loss(function):
    def loss(hidden, weight, labels, inv_t):
        logprobs, entropy = function.apply(hidden, weight, labels, inv_t, CHUNK)
        return (logprobs * torch.linspace(-1, 1, N)).sum() - 0.01 * entropy.mean()
    return loss


def _step(fn, inputs):
    hidden, weight, labels, inv_t = (t.detach().clone().requires_grad_(t.requires_grad) for t in inputs)
    value = fn(hidden, weight, labels, inv_t)
    value.backward()
    return value.detach(), hidden.grad, weight.grad


def test_unregistered_function_is_kept_with_the_reason():
    backend = graphpass.Backend(inner="aot_eager")
    torch.compile(_loss(prime_rl.ChunkedLogProbEntropy), backend=backend)(*_inputs())
    reasons = [r.reason for record in backend.records for r in record.rejected]
    assert not [s for record in backend.records for s in record.sites]
    assert any("output layer" in r and "substitute_in_graph" in r for r in reasons), reasons


def test_registered_stand_in_fuses_the_lm_head():
    """The second recipe of docs/frameworks/own-kernels.md: register the plain math, check it, compile."""
    function = _own_class()
    assert substitute_in_graph(function)(plain_math) is plain_math
    inputs = _inputs()
    check_substitute(function, plain_math, *inputs, CHUNK)  # float64: the math, not the rounding
    backend = graphpass.Backend(inner="aot_eager")
    got = _step(torch.compile(_loss(function), backend=backend), inputs)
    [site] = [s for record in backend.records for s in record.sites]
    assert site.lm_head, site
    for g, e in zip(got, _step(_loss(function), inputs)):  # eager: the Function itself
        assert relative_error(g, e) <= 1e-5


def test_eager_calls_run_the_function():
    function = _own_class()
    substitute_in_graph(function)(plain_math)
    logprobs, _ = function.apply(*_inputs(), CHUNK)
    assert type(logprobs.grad_fn).__name__ == "ChunkedLogProbEntropyBackward"


@pytest.mark.parametrize("twin, where", [(without_temperature, "output 0"),
                                         (detached_entropy, "the gradient of input 0")])
def test_check_names_what_differs(twin, where):
    with pytest.raises(AssertionError, match=where) as raised:
        check_substitute(prime_rl.ChunkedLogProbEntropy, twin, *_inputs(), CHUNK)
    assert "\n" not in str(raised.value)


def test_check_weights_only_the_outputs_asked_for():
    # The entropy's gradient left out, a stand-in without it agrees: prime-rl's own backward
    # refuses an entropy gradient, so its stand-in need not model one.
    check_substitute(prime_rl.ChunkedLogProbEntropy, detached_entropy, *_inputs(), CHUNK, outputs=(0,))


def test_bad_registrations_are_one_line_errors():
    with pytest.raises(TypeError, match="autograd.Function class"):
        substitute_in_graph(plain_math)
    function = _own_class()
    substitute_in_graph(function)(plain_math)
    with pytest.raises(ValueError, match="already has a stand-in"):
        substitute_in_graph(function)(plain_math)
