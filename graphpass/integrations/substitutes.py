"""Your own hand-fused kernel as graphpass can fuse it: its plain math, traced in its place.

graphpass replaces a hand-written `autograd.Function` by the math it computes only where it can
read that math from the traced graph and check the backward against it (a Function over logits:
`passes.replace_hand_written_functions`). A kernel that multiplies the hidden states by the
output layer in vocabulary blocks inside chunks of rows, or scales its logits per token
(prime-rl's `_SequenceChunkedLogProbEntropyFn`), or whose forward breaks the graph, stays as it is.
For such a kernel, state its plain math once and graphpass fuses that:

    @graphpass.integrations.substitute_in_graph(ChunkedLogProbEntropy)
    def chunked_logprob_entropy(hidden, weight, labels, inv_t, chunk_size):
        z = (hidden @ weight.T).float() * inv_t[:, None]
        logp = z.log_softmax(-1)
        return logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    graphpass.integrations.check_substitute(ChunkedLogProbEntropy, chunked_logprob_entropy,
                                            hidden, weight, labels, inv_t, 8, rtol=1e-5)

`torch.compile` then traces the stand-in wherever traced code calls `ChunkedLogProbEntropy.apply`,
with autograd differentiating it; eager calls run the Function itself. The stand-in is yours to
get right, as with `torch.compiler.substitute_in_graph`: `check_substitute` runs both on small
inputs you give, in float64, and raises where the values or any input's gradient differ (here
within 1e-5: the stand-in's `.float()` rounds float64 to float32).
"""

from __future__ import annotations

import torch

from graphpass import _torch_api

__all__ = ["substitute_in_graph", "check_substitute"]


def substitute_in_graph(function_cls: type):
    """Decorator: `torch.compile` traces the decorated function in place of `function_cls.apply`
    (an `autograd.Function`), for every backend; eager calls and other uses of the class are
    unchanged. Returns the function as it is. Process-wide; one stand-in per class."""
    if not (isinstance(function_cls, type) and issubclass(function_cls, torch.autograd.Function)):
        raise TypeError(f"substitute_in_graph takes an autograd.Function class, not {function_cls!r}")

    def register(stand_in):
        if not callable(stand_in):
            raise TypeError(f"substitute_in_graph({function_cls.__name__}) decorates a function, not {stand_in!r}")
        try:
            _torch_api.substitute_in_graph_apply(function_cls, stand_in)
        except ValueError:
            raise ValueError(f"{function_cls.__name__} already has a stand-in (or another Dynamo rule); "
                             "register one per class, once per process") from None
        return stand_in

    return register


def check_substitute(function_cls: type, stand_in, *args, rtol: float = 1e-9, outputs=None, seed: int = 0) -> None:
    """Raise AssertionError (one line) unless `stand_in(*args)` gives `function_cls.apply(*args)`'s
    values and, for random output gradients, the same gradient of every floating input.

    Floating tensors are copied to float64 (each keeps its own `requires_grad`, and every floating
    input is differentiated), so the check compares the math, not the rounding; pass small
    inputs that take every path of the kernel (several chunks of each loop). `rtol`: the
    largest difference allowed, relative to each value's largest magnitude; a kernel that casts
    to float32 inside (`.float()`) needs about 1e-5. `outputs`: the positions of the tensor
    outputs whose gradients are weighted (default: every floating one); leave out one whose
    gradient the Function does not implement (the others' gradients must still agree)."""
    inputs = [_leaf(a) for a in args]
    differentiable = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
    want = _tensors(function_cls.apply(*inputs))
    got = _tensors(stand_in(*inputs))
    name = f"{getattr(stand_in, '__name__', 'the stand-in')} for {function_cls.__name__}"
    if len(got) != len(want):
        raise AssertionError(f"{name}: {len(got)} tensor outputs, the Function returns {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            raise AssertionError(f"{name}: output {i} has shape {tuple(g.shape)}, the Function's {tuple(w.shape)}")
        _compare(f"{name}: output {i}", g, w, rtol)
    if not differentiable:
        return
    generator = torch.Generator().manual_seed(seed)
    weighted = range(len(want)) if outputs is None else outputs
    weights = [torch.randn(w.shape, generator=generator, dtype=torch.float64)
               if i in weighted and w.is_floating_point() else None for i, w in enumerate(want)]
    want_grads = _gradients(want, weights, differentiable)
    got_grads = _gradients(got, weights, differentiable)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        position = next(k for k, a in enumerate(inputs) if a is differentiable[i])
        _compare(f"{name}: the gradient of input {position}", g, w, rtol)


def _leaf(a):
    """A float64 leaf copy of a floating tensor (requires_grad as the original's), else `a`."""
    if not isinstance(a, torch.Tensor):
        return a
    copy = a.detach().clone()
    if copy.is_floating_point():
        copy = copy.to(torch.float64).requires_grad_(a.requires_grad)
    return copy


def _tensors(out) -> list:
    """The tensor outputs of a call, in order (None and non-tensors left out, as autograd does)."""
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in out if isinstance(o, torch.Tensor)]


def _gradients(outputs, weights, inputs) -> list:
    """d sum(weights * outputs) / d inputs, zeros where an input does not reach the outputs."""
    total = sum((o.to(torch.float64) * w).sum() for o, w in zip(outputs, weights)
                if w is not None and o.requires_grad)
    if not isinstance(total, torch.Tensor):
        return [torch.zeros_like(a) for a in inputs]
    grads = torch.autograd.grad(total, inputs, allow_unused=True)
    return [torch.zeros_like(a) if g is None else g for a, g in zip(inputs, grads)]


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    got, want = got.detach().to(torch.float64), want.detach().to(torch.float64)
    finite = torch.isfinite(want)
    same = (got == want) | (got.isnan() & want.isnan())
    if not torch.equal(torch.isfinite(got), finite) or not same[~finite].all():
        raise AssertionError(f"{what}: its non-finite values differ")
    if not finite.any():
        return
    scale = want[finite].abs().max().clamp_min(1e-300)
    error = float((got - want)[finite].abs().max() / scale)
    if error > rtol:
        raise AssertionError(f"{what} differs by {error:.3g} of its largest magnitude (allowed {rtol:.3g})")
