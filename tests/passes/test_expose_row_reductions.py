"""Unit tests of `expose_row_reductions_pass` on tiny captured graphs: each reduction that hides a
region becomes a sum over the vocabulary, then over rows, and the region behind it one chunked op
(the chunk pass runs after it, as in the pipeline). Values and gradients equal the original's;
what it must not split stays as written."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphpass.ops.chunked_op  # noqa: F401  (registers torch.ops.graphpass)
from graphpass.capture import capture_function
from graphpass.config import Config
from graphpass.passes.chunk_rowwise_regions import chunk_rowwise_regions_pass
from graphpass.passes.expose_row_reductions import expose_row_reductions_pass
from graphpass.records import GraphRecord
from tests.helpers import run_passes

aten = torch.ops.aten
T, V = 7, 11


def rewritten(fn, *args):
    """The captured graph of `fn` after this pass and the chunk pass."""
    torch.compiler.reset()  # every float a constant: a recompile would make it a graph input
    return run_passes(fn, *args, passes=[expose_row_reductions_pass, chunk_rowwise_regions_pass],
                      config=Config(chunk_size=3, inner="eager")).gm


def chunked_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.graphpass.rowwise_chunked.default]


def inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(T, V, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(T, V, generator=g, dtype=torch.float64), torch.randint(0, V, (T,), generator=g))


def _same(gm, fn, *args):
    (value,) = gm(*args)
    (ref,) = fn(*args)
    torch.testing.assert_close(value, ref)
    torch.testing.assert_close(torch.autograd.grad(value, args[0])[0], torch.autograd.grad(ref, args[0])[0])


def test_reduced_cross_entropy_becomes_per_token_plus_its_reduction():
    logits, _, tokens = inputs()
    tokens = tokens.clone()
    tokens[2] = -100  # ignored: out of the mean's count, as in torch
    for kwargs in ({}, {"reduction": "sum"}, {"ignore_index": 3}, {"label_smoothing": 0.1},
                   {"label_smoothing": 0.2, "reduction": "sum"}):
        t = tokens if "ignore_index" not in kwargs else tokens.clamp(min=0)

        def fn(logits, t):
            return (F.cross_entropy(logits / 0.7, t, **kwargs),)

        gm = rewritten(fn, logits, t)
        assert len(chunked_nodes(gm)) == 1, (kwargs, gm.code)
        _same(gm, fn, logits, t)

    def plain(logits, t):
        return (F.cross_entropy(logits, t),)

    ignored = torch.full_like(tokens, -100)  # nothing to average: nan, as in torch
    gm = rewritten(plain, logits, ignored)
    assert len(chunked_nodes(gm)) == 1
    assert torch.isnan(gm(logits, ignored)[0]) and torch.isnan(plain(logits, ignored)[0])

    def class_weights(logits, t, w):  # a weighted mean: not split, stays as written
        return (F.cross_entropy(logits, t, weight=w),)

    w = torch.rand(V, dtype=torch.float64) + 0.5
    gm = rewritten(class_weights, logits, tokens.clamp(min=0), w)
    assert chunked_nodes(gm) == [] and "cross_entropy_loss" in gm.code
    torch.testing.assert_close(gm(logits, tokens.clamp(min=0), w)[0], class_weights(logits, tokens.clamp(min=0), w)[0])


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "mean", "batchmean", "none"])
def test_kl_div_becomes_its_terms_and_a_row_sum(reduction, log_target):
    def fn(s, t):  # `s` read first: the captured graph's inputs are in the order of first use
        logp = torch.log_softmax(s, -1)
        target = torch.log_softmax(t, -1) if log_target else torch.softmax(t, -1)
        out = F.kl_div(logp, target, reduction=reduction, log_target=log_target)
        return (out.sum(-1).mean() if reduction == "none" else out,)

    s, t, _ = inputs()
    gm = rewritten(fn, s, t)
    assert len(chunked_nodes(gm)) == 1 and "kl_div" not in gm.code
    _same(gm, fn, s, t)


def test_a_full_sum_of_softmax_values_sums_rows_first():
    def fn(s, t):
        logp, p = torch.log_softmax(s, -1), torch.softmax(t, -1)
        return ((p * (p.log() - logp)).sum() + (p * logp).mean(),)

    s, t, _ = inputs()
    gm = rewritten(fn, s, t)
    assert len(chunked_nodes(gm)) == 1
    _same(gm, fn, s, t)


def test_a_stacked_logsumexp_becomes_logaddexp():
    def fn(s, t):
        logp = torch.log_softmax(s, -1)
        mix = torch.logsumexp(torch.stack([logp - 0.5, torch.log_softmax(t, -1) - 1.0]), 0)
        return (mix.exp().sum(-1).mean(),)

    s, t, _ = inputs()
    gm = rewritten(fn, s, t)
    assert len(chunked_nodes(gm)) == 1 and "logaddexp" not in gm.code  # inside the op's program
    _same(gm, fn, s, t)


def test_must_not_split():
    """Reductions over some dims only, of plain values, or a broadcasting kl_div stay as written."""
    def fn(s, t):
        return ((s * t).sum() + s.sum(0).mean() + F.kl_div(s, t[:1], reduction="sum"),)

    s, t, _ = inputs()
    c = capture_function(fn, s, t)
    before = c.gm.code
    gm = expose_row_reductions_pass(c.gm, c.fakes, config=Config(), record=GraphRecord(index=0))
    gm.recompile()
    assert gm.code == before
