"""Shapes that vary between calls: from the second shape on Dynamo makes the sizes symbolic
(TRL's completion lengths), and the graph with symbolic row counts is rewritten too.

A view that keeps the row's width (`view(mask.shape)` of per-token values) names the symbolic
size; it is no input of the per-chunk program. Checked: values and every input gradient against
eager in float64, a site in every graph, the symbolic one included.
"""

from __future__ import annotations

import pytest
import torch

import graphpass


def _masked_ppo_from_hidden(hidden, weight, ids, mask):
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()) / 0.7
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, ids.reshape(-1, 1)).squeeze(-1).view(mask.shape)
    entropy = -(logp_all.exp() * logp_all).sum(-1).view(mask.shape)
    return -((logp + 0.01 * entropy) * mask).sum() / mask.sum()


def _masked_mean_from_logits(logits, ids, mask):
    logp = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return -(logp.view(mask.shape) * mask).sum() / mask.sum()


def _inputs(fn, S, g):
    mask = (torch.rand(2, S, generator=g) > 0.2).double()
    ids = torch.randint(0, 96, (2, S), generator=g)
    if fn is _masked_ppo_from_hidden:
        return [torch.randn(2, S, 16, generator=g, dtype=torch.float64),
                torch.randn(96, 16, generator=g, dtype=torch.float64), ids, mask], (0, 1)
    return [torch.randn(2 * S, 96, generator=g, dtype=torch.float64), ids.reshape(-1), mask], (0,)


@pytest.mark.parametrize("fn", [_masked_ppo_from_hidden, _masked_mean_from_logits])
def test_lengths_that_vary_keep_their_rewrite(fn):
    torch.compiler.reset()
    backend = graphpass.Backend(inner="aot_eager")
    compiled = torch.compile(fn, backend=backend)
    g = torch.Generator().manual_seed(0)
    for S in (12, 20, 16):
        inputs, grads = _inputs(fn, S, g)
        ours = [t.clone().requires_grad_() if i in grads else t for i, t in enumerate(inputs)]
        ref = [t.clone().requires_grad_() if i in grads else t for i, t in enumerate(inputs)]
        value = compiled(*ours)
        value.backward()
        expected = fn(*ref)
        expected.backward()
        torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
        for i in grads:
            torch.testing.assert_close(ours[i].grad, ref[i].grad, rtol=1e-10, atol=1e-12)
    assert len(backend.records) == 2  # the static shape, then one graph with symbolic sizes
    symbolic = backend.records[1].graph_module
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for n in symbolic.graph.find_nodes(op="placeholder"))
    for record in backend.records:
        assert len(record.sites) == 1, record.rejected
        assert record.sites[0].lm_head == (fn is _masked_ppo_from_hidden)


# ---- a symbolic vocabulary (issue 47, item 1) ---------------------------------------------------
# Frameworks compile their log-prob and entropy helpers with `dynamic=True`, which makes the
# vocabulary's size symbolic too. Each is restated from its source (verl does not install beside
# the test extra; prime-rl does not install here).


def verl_entropy_from_logits(logits):
    """verl/utils/torch_functional.py: entropy_from_logits, which verl's FSDP actor compiles with
    `torch.compile(verl_F.entropy_from_logits, dynamic=True)` (verl/workers/actor/dp_actor.py)."""
    pd = torch.nn.functional.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)
    return entropy


def prime_rl_selective_log_softmax(logits, index):
    """prime-rl src/prime_rl/trainer/rl/loss.py: selective_log_softmax, `@torch.compile(dynamic=True)`."""
    logprobs = logits.log_softmax(dim=-1)
    return torch.gather(logprobs, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


def prime_rl_compute_entropy(shifted_logits):
    """prime-rl src/prime_rl/trainer/rl/loss.py: compute_entropy, `@torch.compile(dynamic=True)`."""
    with torch.no_grad():
        pd = torch.nn.functional.softmax(shifted_logits, dim=-1)
        entropy = torch.logsumexp(shifted_logits, dim=-1) - torch.sum(pd * shifted_logits, dim=-1)
    return entropy


def smoothed_cross_entropy(logits, index):
    """Label smoothing reads 1/V: with a symbolic V, a runtime float of the op."""
    return torch.nn.functional.cross_entropy(logits, index, label_smoothing=0.1, reduction="none")


KINDS = {verl_entropy_from_logits: {"entropy"}, prime_rl_selective_log_softmax: {"logprob"},
         prime_rl_compute_entropy: {"entropy"}, smoothed_cross_entropy: {"rowwise"}}


def _with_targets(fn):
    return fn.__code__.co_argcount == 2


def _three_runs(fn, compiled, logits, ids):
    """(float64, eager fp32, compiled fp32) runs: (output, gradient of the logits or None)."""
    runs = []
    for f, dtype in ((fn, torch.float64), (fn, torch.float32), (compiled, torch.float32)):
        x = logits.to(dtype).clone().requires_grad_()
        out = f(x, ids) if _with_targets(fn) else f(x)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
        if out.requires_grad:
            (out * weights).sum().backward()
        runs.append((out.detach(), x.grad))
    return runs


# Under inductor by default: verl's recipe and the row-wise site (each a cold compile of symbolic
# kernels); prime-rl's two with --runslow.
INDUCTOR_BY_DEFAULT = (verl_entropy_from_logits, smoothed_cross_entropy)


@pytest.mark.parametrize("inner, fn", [
    pytest.param(inner, fn, marks=() if inner == "aot_eager" or fn in INDUCTOR_BY_DEFAULT else pytest.mark.slow)
    for inner in ("aot_eager", "inductor") for fn in KINDS])
def test_a_symbolic_vocabulary_is_rewritten(fn, inner):
    """Compiled as the frameworks compile them (`dynamic=True`): one graph with symbolic rows and
    vocabulary, one site in it, and every vocabulary and row count after that as accurate as eager
    (`bench.fuzz`'s rule: value and gradient against float64). verl's case is the first recipe of
    docs/frameworks/verl.md."""
    from bench.fuzz import run as fuzz

    torch.compiler.reset()
    backend = graphpass.Backend(inner=inner)
    compiled = torch.compile(fn, dynamic=True, backend=backend)
    g = torch.Generator().manual_seed(0)
    for rows, vocab in ((6, 40), (9, 37), (3, 101), (6, 40)):
        logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2
        ids = torch.randint(0, vocab, (rows,), generator=g)
        (ref, ref_grad), (eager, eager_grad), (ours, our_grad) = _three_runs(fn, compiled, logits, ids)
        assert (why := fuzz.compare("value", ours, eager, ref, fuzz.RTOL[torch.float32], min_scale=1.0)) is None, why
        assert (our_grad is None) == (eager_grad is None)
        if eager_grad is not None:
            assert (why := fuzz.compare("grad", our_grad, eager_grad, ref_grad, fuzz.RTOL[torch.float32])) is None, why
    assert len(backend.records) == 1, "recompiled for a new vocabulary size"
    (record,) = backend.records
    assert len(record.sites) == 1, record.rejected
    (site,) = record.sites
    assert all(isinstance(size, torch.SymInt) for size in site.shape), site.shape
    kinds = {o.kind for o in site.outputs}
    assert kinds == KINDS[fn], kinds


def test_a_vocabulary_marked_dynamic_alone():
    """`mark_dynamic` on the vocabulary's dim only: the rows stay static, the site is rewritten,
    and a second vocabulary size runs the same graph."""
    torch.compiler.reset()
    backend = graphpass.Backend(inner="aot_eager")
    compiled = torch.compile(prime_rl_selective_log_softmax, backend=backend)
    g = torch.Generator().manual_seed(1)
    for vocab in (48, 64):
        logits = torch.randn(5, vocab, generator=g, dtype=torch.float64)
        ids = torch.randint(0, vocab, (5,), generator=g)
        ours, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        torch._dynamo.mark_dynamic(ours, 1)
        compiled(ours, ids).sum().backward()
        prime_rl_selective_log_softmax(ref, ids).sum().backward()
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-12, atol=1e-12)
    assert len(backend.records) == 1 and len(backend.records[0].sites) == 1, backend.records[0].rejected
    rows, vocab = backend.records[0].sites[0].shape
    assert rows == 5 and isinstance(vocab, torch.SymInt)
