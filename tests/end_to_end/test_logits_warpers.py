"""Log-probs after transformers' logits warpers (issue 47, item 5): rollout-matched training applies
the sampler's MinP, or TopK then TopP, before the log-softmax. The keep-mask comes from the row's
own values through an op that is not row-local (`sort`, `topk`): the region ends at the mask and
the log-probs after it are rewritten; the warper's own math runs as written.

Values and the logits' gradient against eager and float64 (`bench.fuzz`'s rule); a twin without
the cut shows what it changes.
"""

from __future__ import annotations

import pytest
import torch

import graphpass
from bench.fuzz import run as fuzz
from graphpass.analysis import regions

logits_process = pytest.importorskip("transformers.generation.logits_process")


def min_p(logits):
    return logits_process.MinPLogitsWarper(min_p=0.1)(None, logits)


def top_k_then_top_p(logits):
    return logits_process.TopPLogitsWarper(top_p=0.9)(None, logits_process.TopKLogitsWarper(top_k=10)(None, logits))


def top_p(logits):
    return logits_process.TopPLogitsWarper(top_p=0.9)(None, logits)


def _logprobs_after(warp):
    def logprobs(logits, ids):
        warped = warp(logits / 0.7)
        return torch.log_softmax(warped, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return logprobs


def _run(fn, logits, ids, dtype):
    x = logits.to(dtype).clone().requires_grad_()
    out = fn(x, ids)
    (out * torch.linspace(-1, 1, out.numel(), dtype=dtype)).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("warp", [min_p, top_k_then_top_p, top_p])
@pytest.mark.parametrize("cut", [True, False], ids=["cut_at_the_mask", "no_cut"])
def test_logprobs_after_a_warper_are_rewritten(monkeypatch, warp, cut):
    if not cut:
        monkeypatch.setattr(regions, "_after_its_own_outputs", lambda grower, order: None)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 64, generator=g, dtype=torch.float64) * 3
    ids = logits.argmax(-1)  # kept by every warper: a finite log-prob
    fn = _logprobs_after(warp)
    backend = graphpass.Backend(inner="aot_eager")
    ours = _run(torch.compile(fn, backend=backend), logits, ids, torch.float32)
    eager, ref = _run(fn, logits, ids, torch.float32), _run(fn, logits, ids, torch.float64)
    for name, got, want, exact in zip(("log-prob", "grad"), ours, eager, ref):
        assert (why := fuzz.compare(name, got, want, exact, fuzz.RTOL[torch.float32], min_scale=1.0)) is None, why
    kinds = [s.kind for r in backend.records for s in r.sites]
    rejected = [c.reason for r in backend.records for c in r.rejected]
    if cut:
        assert kinds == ["logprob"], rejected
    else:
        assert kinds == [] and any(regions._OWN_OUTPUTS in why for why in rejected), rejected
