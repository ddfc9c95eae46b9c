"""Logits in any layout and stride: Megatron's `[s, b, v]`, transposed, column-major, strided slices.

Every op returns its gradients contiguous, and its fake kernel says so: a fake that promised the
input's strides while the real kernel returned a row-major buffer made inductor's stride check
fail in `loss.backward()` (a crash in training, with nothing to fall back to). Values and every
input gradient are compared with eager, under each inner compiler.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphpass
from graphpass.ops import vocab_parallel_lm_head_logprob_entropy, vocab_parallel_logprob_entropy

S, B, V, H = 12, 3, 40, 8

# Each makes a `[rows..., V]` leaf-backed view; the leaf is what receives the gradient.
LAYOUTS = {
    "[s, b, v]": lambda g: _leaf(torch.randn(S, B, V, generator=g)),
    "[s, b, v] -> [b, s, v]": lambda g: _view(torch.randn(S, B, V, generator=g), lambda x: x.transpose(0, 1)),
    "[b, s, v] contiguous": lambda g: _view(torch.randn(S, B, V, generator=g),
                                            lambda x: x.transpose(0, 1).contiguous()),
    "column-major [T, V]": lambda g: _view(torch.randn(V, S * B, generator=g), lambda x: x.t()),
    "strided row slice": lambda g: _view(torch.randn(S, 2 * B, V, generator=g), lambda x: x.transpose(0, 1)[::2]),
}


def _leaf(x):
    leaf = x.requires_grad_()
    return leaf, lambda t: t


def _view(base, view):
    return base.requires_grad_(), view


def ppo(logits, tokens, adv):
    logp_all = torch.log_softmax(logits.float() / 0.7, -1)
    logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return (-(adv * logp) - 0.01 * entropy).mean()


def _check(loss, make, inner, atol=1e-5):
    g = torch.Generator().manual_seed(0)
    leaf, view = make(g)
    rows = view(leaf).shape[:-1]
    tokens = torch.randint(0, V, rows, generator=g)
    adv = torch.randn(rows, generator=g)
    ref_leaf = leaf.detach().clone().requires_grad_()
    backend = graphpass.Backend(inner=inner)
    out = torch.compile(lambda x, t, a: loss(view(x), t, a), backend=backend)(leaf, tokens, adv)
    out.backward()
    ref = loss(view(ref_leaf), tokens, adv)
    ref.backward()
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, atol=atol, rtol=atol)
    return backend.records[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_under_inductor(layout):
    record = _check(ppo, LAYOUTS[layout], "inductor")
    assert record.sites and record.fallback_reason is None


@pytest.mark.parametrize("inner", ["aot_eager", "eager"])
@pytest.mark.parametrize("layout", ["[s, b, v] -> [b, s, v]", "column-major [T, V]"])
def test_other_inner_compilers(layout, inner):
    assert _check(ppo, LAYOUTS[layout], inner).sites


def test_lm_head_over_transposed_hidden_states():
    """Megatron's `[s, b, h]` hidden states read as `[b, s, h]`: the head's gradient comes back whole."""
    def head_loss(hidden_sbh, weight, tokens, adv):
        return ppo(F.linear(hidden_sbh.transpose(0, 1), weight), tokens, adv)

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(S, B, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).requires_grad_()
    tokens, adv = torch.randint(0, V, (B, S), generator=g), torch.randn(B, S, generator=g)
    ref_hidden, ref_weight = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    backend = graphpass.Backend()
    torch.compile(head_loss, backend=backend)(hidden, weight, tokens, adv).backward()
    head_loss(ref_hidden, ref_weight, tokens, adv).backward()
    assert backend.records[0].sites[0].lm_head
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad, ref_weight.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head", [False, True], ids=["logits", "lm_head"])
def test_vocab_parallel_ops_under_inductor(head):
    """The ops called directly in a function inductor compiles: fake and real strides agree."""
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, V, (B, S), generator=g)
    if head:
        hidden = torch.randn(S, B, H, generator=g).requires_grad_()
        weight = torch.randn(H, V, generator=g).requires_grad_()  # a transposed [V, H] shard

        def fn(h, w):
            lp, ent = vocab_parallel_lm_head_logprob_entropy(h.transpose(0, 1), w.t(), tokens, with_entropy=True)
            return lp.sum() + ent.sum()
        inputs = [hidden, weight]
    else:
        logits = torch.randn(S, B, V, generator=g).requires_grad_()

        def fn(x):
            lp, ent = vocab_parallel_logprob_entropy(x.transpose(0, 1), tokens, with_entropy=True)
            return lp.sum() + ent.sum()
        inputs = [logits]
    refs = [t.detach().clone().requires_grad_() for t in inputs]
    torch.compile(fn, backend="inductor")(*inputs).backward()
    fn(*refs).backward()
    for mine, theirs in zip(inputs, refs):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)
