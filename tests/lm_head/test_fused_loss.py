"""`graphpass.fuse_loss`: a log-prob helper and the loss its caller computes, compiled as one graph.

Compiled alone, the helper's lm_head site recomputes its logits in backward; fused with a loss
that is one sum of per-token terms, the site computes every gradient in forward. Values and every
input's gradient against eager, in both cases; a loss that is not such a sum stays exact and the
warning says why.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import graphpass
from tests.lm_head.test_gradients_in_forward import CLIP, _batch, _logprob_entropy


def logprob_helper(hidden, weight, tokens, temperature=0.7):
    return _logprob_entropy(F.linear(hidden, weight), tokens, temperature)


def ppo_from_logprobs(logp, entropy, old_logp, adv, mask, ent_coef=0.01):
    ratio = torch.exp(logp - old_logp)
    pg = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    count = mask.sum().clamp(min=1)
    return (pg * mask).sum() / count - ent_coef * (entropy * mask).sum() / count


def gspo_from_logprobs(logp, entropy, old_logp, adv, mask):
    """A sequence-level ratio: a scalar function of one sum of per-token terms."""
    ratio = torch.exp(((logp - old_logp) * mask).sum() / mask.sum())
    return -torch.min(ratio * adv.mean(), ratio.clamp(1 - CLIP, 1 + CLIP) * adv.mean())


def max_penalty_from_logprobs(logp, entropy, old_logp, adv, mask):
    """A penalty on the least likely token: its gradient is not one sum's."""
    return -(logp * adv * mask).sum() / mask.sum() + 0.1 * (-logp).amax()


def _leaves(batch):
    hidden, weight, tokens, old_logp, adv, mask = batch
    return [hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_(), tokens,
            old_logp, adv, mask]


def _compare(loss_fn, helper=logprob_helper, **fuse_options):
    batch = _batch()
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    step = graphpass.fuse_loss(helper, loss_fn, backend=backend, **fuse_options)
    results = []
    for fn in (step, lambda args, *rest: loss_fn(*helper(*args), *rest)):
        hidden, weight, tokens, old_logp, adv, mask = _leaves(batch)
        value = fn((hidden, weight, tokens), old_logp, adv, mask)
        value.backward()
        results.append((value.detach(), hidden.grad, weight.grad))
    for ours, ref in zip(*results):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert step.backend is backend
    return [s for r in backend.records for s in r.sites]


def test_a_summed_loss_takes_gradients_in_forward(graphpass_log):
    sites = _compare(ppo_from_logprobs)
    assert [(s.lm_head, s.gradients_in_forward) for s in sites] == [(True, True)]
    assert not [m for m in graphpass_log if "fuse_loss" in m]


def test_the_helper_alone_recomputes():
    """The baseline fuse_loss removes: the same helper compiled alone recomputes in backward."""
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    hidden, weight, tokens, *_ = _leaves(_batch())
    logp, entropy = torch.compile(logprob_helper, backend=backend)(hidden, weight, tokens)
    (logp.sum() + entropy.sum()).backward()
    sites = [s for r in backend.records for s in r.sites]
    assert [(s.lm_head, s.gradients_in_forward) for s in sites] == [(True, False)]
    assert sites[0].recompute_reason


def test_helper_keyword_arguments_bind_with_partial():
    sites = _compare(ppo_from_logprobs, helper=functools.partial(logprob_helper, temperature=1.3))
    assert [s.gradients_in_forward for s in sites] == [True]


def test_a_function_of_one_sum_takes_gradients_in_forward():
    sites = _compare(gspo_from_logprobs)
    assert [(s.lm_head, s.gradients_in_forward) for s in sites] == [(True, True)]


def test_a_loss_that_is_not_a_sum_stays_exact_and_says_why(graphpass_log):
    sites = _compare(max_penalty_from_logprobs)
    assert [(s.lm_head, s.gradients_in_forward) for s in sites] == [(True, False)]
    warnings = [m for m in graphpass_log if m.startswith("graphpass.fuse_loss")]
    assert len(warnings) == 1 and sites[0].recompute_reason in warnings[0]


def test_helper_arguments_must_be_a_tuple():
    step = graphpass.fuse_loss(logprob_helper, ppo_from_logprobs)
    hidden, weight, tokens, old_logp, adv, mask = _leaves(_batch())
    with pytest.raises(TypeError, match=r"as a tuple"):
        step(hidden, weight, tokens)
