"""`index_rows_as_gather_pass`: `x[arange(T), t]` (and its broadcast N-d form) becomes a gather the
regions read, values and every gradient as eager's in float64; other indexing stays as written."""

from __future__ import annotations

import pytest
import torch

import graphpass
from graphpass.passes.index_rows_as_gather import index_rows_as_gather_pass
from tests.helpers import run_passes

aten = torch.ops.aten
T, V = 24, 37


def _rewritten(fn, *args):
    return run_passes(fn, *args, passes=[index_rows_as_gather_pass]).gm


def _indexes(gm) -> bool:
    return bool(gm.graph.find_nodes(op="call_function", target=aten.index.Tensor))


def picked_2d(logits, target, adv):
    lp = torch.log_softmax(logits, -1)[torch.arange(logits.shape[0]), target]
    return -(adv * lp).mean(), lp.detach()


def megatron_inline(logits, target, adv):
    # megatron-core's cross-entropy math written out: shift by the max, pick, log of the sum.
    shifted = logits - torch.max(logits, dim=-1)[0].unsqueeze(-1)
    predicted = shifted[torch.arange(shifted.shape[0]), target]
    lp = predicted - torch.log(shifted.exp().sum(-1))
    return -(adv * lp).mean(), lp.detach()


def picked_3d(logits, target, adv):
    x = logits.view(4, -1, V)
    b, s = torch.arange(4)[:, None], torch.arange(x.shape[1])
    lp = torch.log_softmax(x / 0.7, -1)[b, s, target.view(4, -1)]
    return -(adv.view(4, -1) * lp).mean(), lp.detach()


def _inputs(negative=False):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(T, V, generator=g, dtype=torch.float64) * 3).requires_grad_()
    target = torch.randint(0, V, (T,), generator=g)
    if negative:  # indexing counts these from the end
        target[::3] -= V
    return logits, target, torch.randn(T, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("fn", [picked_2d, megatron_inline, picked_3d], ids=lambda f: f.__name__)
@pytest.mark.parametrize("negative", [False, True], ids=["targets", "negative-targets"])
def test_picked_rows_become_one_site_with_eager_values_and_gradients(fn, negative):
    logits, target, adv = _inputs(negative)
    assert not _indexes(_rewritten(fn, logits, target, adv))
    loss, lp = fn(logits, target, adv)
    (grad,) = torch.autograd.grad(loss, logits)
    backend = graphpass.Backend(inner="eager", strict=True)
    c_loss, c_lp = torch.compile(fn, backend=backend)(logits, target, adv)
    (c_grad,) = torch.autograd.grad(c_loss, logits)
    torch.testing.assert_close(c_lp, lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c_loss, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c_grad, grad, rtol=1e-12, atol=1e-12)
    assert [s.kind for r in backend.records for s in r.sites] == ["logprob"]


def shifted_rows(logits, target, adv):  # row i picks from row i + 1: not one entry per row
    lp = torch.log_softmax(logits, -1)[1:][torch.arange(logits.shape[0] - 1), target[:-1]]
    return lp.sum(), lp.detach()


def reversed_rows(logits, target, adv):
    lp = torch.log_softmax(logits, -1)[torch.arange(logits.shape[0]).flip(0), target]
    return lp.sum(), lp.detach()


def rows_from_one(logits, target, adv):
    lp = torch.log_softmax(logits, -1)[torch.arange(1, logits.shape[0]), target[1:]]
    return lp.sum(), lp.detach()


def columns_then_rows(logits, target, adv):  # x[t, arange]: picks rows by token id
    lp = torch.log_softmax(logits, -1).t()[target[:V % T + 1], torch.arange(V % T + 1)]
    return lp.sum(), lp.detach()


def mask_index(logits, target, adv):
    lp = torch.log_softmax(logits, -1)[target > 3]
    return lp.sum(), lp.detach()


@pytest.mark.parametrize("fn", [reversed_rows, rows_from_one, columns_then_rows, mask_index], ids=lambda f: f.__name__)
def test_other_indexing_stays_as_written(fn):
    logits, target, adv = _inputs()
    assert _indexes(_rewritten(fn, logits, target, adv))
    loss, lp = fn(logits, target, adv)
    (grad,) = torch.autograd.grad(loss, logits)
    backend = graphpass.Backend(inner="eager")
    c_loss, c_lp = torch.compile(fn, backend=backend)(logits, target, adv)
    (c_grad,) = torch.autograd.grad(c_loss, logits)
    torch.testing.assert_close(c_lp, lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c_grad, grad, rtol=1e-12, atol=1e-12)
    reasons = [c.reason for r in backend.records for c in r.rejected]
    # (A boolean mask's data-dependent size breaks the graph there: no index node to speak of.)
    assert fn is mask_index or any("other than one per row, as x[arange(T), t]" in reason for reason in reasons), reasons


def test_a_row_slice_then_aranged_rows_is_still_one_entry_per_row():
    # x[1:][arange(T - 1), t]: entry i is x[i + 1, t[i]], which the gather of the slice computes.
    logits, target, adv = _inputs()
    assert not _indexes(_rewritten(shifted_rows, logits, target, adv))
    loss, lp = shifted_rows(logits, target, adv)
    c_loss, c_lp = torch.compile(shifted_rows, backend=graphpass.Backend(inner="eager"))(logits, target, adv)
    torch.testing.assert_close(c_lp, lp, rtol=1e-12, atol=1e-12)


def test_a_target_outside_the_vocabulary_still_raises():
    logits, target, adv = _inputs()
    target[5] = V
    with pytest.raises(Exception):
        picked_2d(logits, target, adv)
    with pytest.raises(Exception):
        torch.compile(picked_2d, backend=graphpass.Backend(inner="eager"))(logits, target, adv)
