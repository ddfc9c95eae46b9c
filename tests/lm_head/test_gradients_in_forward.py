"""An lm_head site whose loss is one sum of per-token terms computes its gradients in forward.

The op takes in the per-token loss math up to the sum (`graphpass.analysis.summed_loss`), computes
hidden's, the weight's (and any other input's) gradients while each chunk's logits are at hand,
and its backward scales them by the sum's gradient. Parity with eager of the loss and of every
input's gradient: scaled losses, a second backward through a retained graph, a gradient from
elsewhere added, sum and mean, cross-entropy, masks, bias, bf16, an input of the loss math that
requires grad. Where the gradient is not one sum's, the backward recomputes the logits, and the
site says why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphpass
from tests.lm_head.test_lm_head import _batch as lm_head_batch

pytestmark = pytest.mark.heavy  # a minute or more: xdist starts it early (tests/conftest.py)

T, H, V = 29, 8, 37
CLIP = 0.2


def _batch(rows=T, dtype=torch.float32, seed=0, bias=False):
    return lm_head_batch(rows, dtype=dtype, seed=seed, bias=bias, hidden_size=H, vocab=V)


def _logprob_entropy(logits, tokens, temperature=0.7):
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def ppo(hidden, weight, tokens, old_logp, adv, mask, ent_coef=0.0):
    logp, entropy = _logprob_entropy(F.linear(hidden, weight), tokens)
    ratio = torch.exp(logp - old_logp)
    pg = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    count = mask.sum().clamp(min=1)
    return (pg * mask).sum() / count - ent_coef * (entropy * mask).sum() / count


def _clone(tensors):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _run(fn, tensors, backend, seeds=(None,), retain=False):
    """Loss and every input's gradient after `backward(seed)` for each seed, compiled and eager."""
    results = []
    for compiled, inputs in ((True, tensors), (False, _clone(tensors))):
        loss = (torch.compile(fn, backend=backend) if compiled else fn)(*inputs)
        for i, seed in enumerate(seeds):
            loss.backward(None if seed is None else torch.tensor(seed, dtype=loss.dtype),
                          retain_graph=retain and i + 1 < len(seeds))
        results.append((loss.detach(), [t.grad for t in inputs if t.requires_grad]))
    return results


def _check(fn, tensors, backend=None, atol=1e-5, rtol=1e-5, **kwargs):
    backend = backend or graphpass.Backend(chunk_size=4, inner="aot_eager")
    (loss, grads), (ref, ref_grads) = _run(fn, tensors, backend, **kwargs)
    torch.testing.assert_close(loss.float(), ref.float(), atol=atol, rtol=rtol)
    assert len(grads) == len(ref_grads)
    for mine, theirs in zip(grads, ref_grads):
        assert mine is not None and mine.dtype == theirs.dtype
        torch.testing.assert_close(mine.float(), theirs.float(), atol=atol, rtol=rtol)
    (record,) = backend.records
    assert record.fallback_reason is None
    (site,) = record.sites
    return site, record


def _op_targets(record):
    return {n.target for n in record.graph_module.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("chunk_size", [1, 5, None])
def test_ppo_gradients_come_from_the_forward(chunk_size):
    backend = graphpass.Backend(chunk_size=chunk_size, inner="aot_eager")
    site, record = _check(ppo, _batch(), backend)
    assert site.lm_head and site.gradients_in_forward and site.recompute_reason is None
    # What the region computes: the log-prob (into the loss) and the entropy (gradient-free).
    assert [(o.kind, o.keeps_grad, o.temperature) for o in site.outputs] == [
        ("logprob", True, "/ 0.7"), ("entropy", False, "/ 0.7")]
    assert torch.ops.graphpass.rowwise_chunked_with_gradients.default in _op_targets(record)
    assert torch.ops.graphpass.rowwise_chunked.default not in _op_targets(record)


def test_entropy_gradient_in_the_same_sum():
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        logp, entropy = _logprob_entropy(F.linear(hidden, weight), tokens)
        return ((logp * adv - 0.01 * entropy) * mask).sum() / mask.sum()

    site, _ = _check(fn, _batch())
    assert site.gradients_in_forward


@pytest.mark.parametrize("seed", [None, 3.0])
def test_an_entropy_bonus_summed_apart(seed):
    """Two masked means, `pg_sum / n - c * ent_sum / n`: the loss is affine in the two sums, with
    coefficients `1 / n` and `-c / n` known before the op runs, so one backward kernel takes both."""
    site, _ = _check(lambda *t: ppo(*t, ent_coef=0.01), _batch(), seeds=(seed,))
    assert site.gradients_in_forward and site.recompute_reason is None


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("seed", [3.0, -0.5, 0.0])
def test_the_backward_scales_by_the_loss_gradient(seed, inner):
    site, _ = _check(ppo, _batch(), graphpass.Backend(chunk_size=4, inner=inner), seeds=(seed,))
    assert site.gradients_in_forward


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_second_backward_through_a_retained_graph_is_right_or_refused(inner):
    """The gradients were handed out (and may be a .grad) after the first backward: a second one
    either gets fresh ones (aot_eager's functional copy) or a clear error, never rescales them."""
    tensors = _batch()
    ref_tensors = _clone(tensors)
    loss = torch.compile(ppo, backend=graphpass.Backend(chunk_size=4, inner=inner))(*tensors)
    ref = ppo(*ref_tensors)
    for seed in (2.0, 0.25):
        ref.backward(torch.tensor(seed), retain_graph=True)
    try:
        loss.backward(torch.tensor(2.0), retain_graph=True)
        loss.backward(torch.tensor(0.25))
    except RuntimeError as e:
        # Ours, or inductor's own refusal to retain a graph whose backward reuses saved buffers.
        assert "gradients_in_forward=False" in str(e) or "retain_graph=False" in str(e)
        assert inner == "inductor"
        return
    for mine, theirs in zip(tensors[:2], ref_tensors[:2]):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)


def test_scaled_loss_and_a_gradient_from_elsewhere():
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        return 2.5 * ppo(hidden, weight, tokens, old_logp, adv, mask) / 7 + (hidden ** 2).mean() + weight.sum()

    site, _ = _check(fn, _batch())
    assert site.gradients_in_forward


def test_a_mean_and_a_bias():
    def fn(hidden, weight, tokens, old_logp, adv, mask, bias):
        logp, _ = _logprob_entropy(F.linear(hidden, weight, bias), tokens, 1.0)
        return -(logp * adv).mean()

    site, _ = _check(fn, _batch(bias=True))
    assert site.gradients_in_forward


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy(reduction):
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        targets = torch.where(mask > 0, tokens, -100)
        return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction=reduction)

    site, _ = _check(fn, _batch())
    assert site.gradients_in_forward


def test_an_input_of_the_loss_math_that_requires_grad():
    tensors = _batch()
    tensors[4].requires_grad_()  # the advantages: its gradient is computed in forward too
    site, _ = _check(ppo, tensors)
    assert site.gradients_in_forward


def test_bf16():
    site, _ = _check(ppo, _batch(dtype=torch.bfloat16), atol=2e-2, rtol=2e-2)
    assert site.gradients_in_forward


def _recomputed(fn, tensors=None, **backend_options):
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager", **backend_options)
    site, _ = _check(fn, tensors or _batch(), backend)
    assert site.lm_head and not site.gradients_in_forward
    return site.recompute_reason


def test_two_sums_recompute():
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        logp, entropy = _logprob_entropy(F.linear(hidden, weight), tokens)
        return -(logp * adv).sum() / (0.1 + (entropy * mask).sum())  # a quotient of two sums

    assert "2 sums" in _recomputed(fn)


def test_per_sequence_sums_recompute():
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        logp, _ = _logprob_entropy(F.linear(hidden, weight), tokens)
        per_seq = logp[:28].view(4, 7).sum(-1)
        return -(torch.exp(per_seq / 7) * adv[:4]).mean()  # GSPO-like: a nonlinear function of a sum

    assert _recomputed(fn) is not None


@pytest.mark.parametrize("seed", [None, 2.0])
@pytest.mark.parametrize("spelling", ["scaled", "alpha", "cast", "constant", "coefficient_from_the_op"])
def test_losses_affine_in_their_sums(spelling, seed):
    """The coefficients of the sums in the loss, whatever the spelling, are what autograd sends
    them; a coefficient computed from the op's own outputs keeps its sum as the carrier's place."""
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        logp, entropy = _logprob_entropy(F.linear(hidden, weight), tokens)
        n = mask.sum().clamp(min=1)
        pg, ent = (logp * adv * mask).sum(), (entropy * mask).sum()
        if spelling == "scaled":
            return -0.5 * (pg / n) + 0.01 * ent / n
        if spelling == "alpha":
            return torch.sub(pg / n, ent, alpha=0.25) / 4
        if spelling == "cast":
            return (pg.double() / n - ent.double() / n).float()
        if spelling == "constant":
            return 3.0 - pg / n + 1.0
        return pg / ent.detach()  # the sum's coefficient depends on the op: one sum, scaled in backward

    site, _ = _check(fn, _batch(), seeds=(seed,))
    assert site.gradients_in_forward


def test_sums_added_into_one_loss():
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        logp, _ = _logprob_entropy(F.linear(hidden, weight), tokens)
        return -(logp * adv).sum() + 0 * logp.mean() + logp.square().sum()

    site, _ = _check(fn, _batch())
    assert site.gradients_in_forward


@pytest.mark.parametrize("head", [True, False])
def test_a_returned_log_prob_recomputes(head):
    """A per-token value the graph returns may get a gradient from outside the loss (here
    `loss + logp.sum()`): the op keeps it differentiable and recomputes."""
    def fn(hidden, weight, tokens, adv):
        logits = F.linear(hidden, weight) if head else hidden
        logp, _ = _logprob_entropy(logits, tokens)
        return -(logp * adv).sum(), logp

    hidden, weight, tokens, _, adv, _ = _batch()
    if not head:
        hidden = torch.randn(T, V, generator=torch.Generator().manual_seed(3)).requires_grad_()
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    results = []
    for f, inputs in ((torch.compile(fn, backend=backend), [hidden, weight, tokens, adv]),
                      (fn, _clone([hidden, weight, tokens, adv]))):
        loss, logp = f(*inputs)
        (loss + logp.sum()).backward()
        results.append([t.grad for t in inputs if t.requires_grad])
    for mine, theirs in zip(*results):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    (site,) = backend.records[0].sites
    assert not site.gradients_in_forward
    assert ("is returned" if head else "reads the logits") in site.recompute_reason


def test_option_off_recomputes():
    assert _recomputed(ppo, gradients_in_forward=False) == "gradients_in_forward=False"


def test_no_gradient_no_fusion():
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    tensors = [t.detach() for t in _batch()]
    out = torch.compile(ppo, backend=backend)(*tensors)
    torch.testing.assert_close(out, ppo(*tensors))
    (site,) = backend.records[0].sites
    assert site.lm_head and not site.gradients_in_forward


def test_inductor_parity():
    site, _ = _check(ppo, _batch(), graphpass.Backend(chunk_size=8))
    assert site.gradients_in_forward


def test_a_per_token_vocabulary_mask_is_read_beside_the_head():
    def fn(hidden, weight, tokens, old_logp, adv, mask, vocab_mask):
        logits = F.linear(hidden, weight).float().masked_fill(vocab_mask, float("-inf"))
        logp, _ = _logprob_entropy(logits, tokens)
        return -(logp * adv * mask).sum()

    tensors = _batch()
    vocab_mask = torch.rand(T, V, generator=torch.Generator().manual_seed(1)) < 0.3
    vocab_mask.scatter_(-1, tensors[2][:, None], False)  # never the sampled token
    site, _ = _check(fn, [*tensors, vocab_mask])
    assert site.lm_head and site.gradients_in_forward


@pytest.mark.parametrize("spelling", ["weighted", "difference"])
def test_two_heads_in_one_sum(spelling):
    """Two lm_head sites whose per-token terms meet in one sum: one site takes the sum in, the
    other's output is its input (and gets its gradient through it)."""
    def fn(hidden, weight, tokens, old_logp, adv, mask, hidden2, weight2):
        logp, _ = _logprob_entropy(F.linear(hidden, weight), tokens)
        logp2, _ = _logprob_entropy(F.linear(hidden2, weight2), tokens, 1.0)
        if spelling == "weighted":
            return (logp * adv + logp2 * mask).sum()
        return (logp - logp2).square().sum()

    tensors = _batch()
    second = _batch(seed=5)[:2]
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    (loss, grads), (ref, ref_grads) = _run(fn, [*tensors, *second], backend)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    assert len(grads) == len(ref_grads) == 4
    for mine, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    (record,) = backend.records
    assert record.fallback_reason is None and len(record.sites) == 2
    assert all(s.lm_head for s in record.sites)
    assert sorted(s.gradients_in_forward for s in record.sites) == [False, True]


def test_loss_math_reading_an_earlier_sites_output():
    """The site computing its gradients in forward reads the log-probs of an earlier site (over
    given logits) in its loss math: the op reads that site's op output."""
    def fn(logits, hidden, weight, tokens, adv):
        ref_logp, _ = _logprob_entropy(logits, tokens, 1.0)
        logp, _ = _logprob_entropy(F.linear(hidden, weight), tokens)
        return ((logp - ref_logp).square() * adv).sum()

    hidden, weight, tokens, _, adv, _ = _batch()
    logits = torch.randn(T, V, generator=torch.Generator().manual_seed(7)).requires_grad_()
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    (loss, grads), (ref, ref_grads) = _run(fn, [logits, hidden, weight, tokens, adv], backend)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    (record,) = backend.records
    assert record.fallback_reason is None
    assert [(s.lm_head, s.gradients_in_forward) for s in record.sites] == [(False, False), (True, True)]
