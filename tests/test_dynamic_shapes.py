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
