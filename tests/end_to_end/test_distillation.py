"""Distillation and the last idioms: two models' logits in one region, kl_div, JSD, label smoothing,
padded vocabularies.

Each loss is compiled with graphpass and compared with eager (values and every input gradient) in
float64; the student's and the teacher's logits are the region's two wide inputs, the teacher's
read under no_grad (it gets no gradient, as in eager, even when its logits require one). A few
run under inductor in fp32. Must-not-match cases stay as written, with the reason recorded.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import graphpass

T, V, PAD = 24, 40, 6  # the padded vocabulary: V + PAD columns, V of them real


def forward_kl(s, t, mask, temperature=2.0):
    sl = torch.log_softmax(s / temperature, -1)
    with torch.no_grad():
        tl = torch.log_softmax(t / temperature, -1)
    return ((tl.exp() * (tl - sl)).sum(-1) * mask).sum() / mask.sum() * temperature ** 2


def reverse_kl(s, t, mask, temperature=1.5):
    with torch.no_grad():
        tl = torch.log_softmax(t / temperature, -1)
    sl = torch.log_softmax(s / temperature, -1)
    return ((sl.exp() * (sl - tl)).sum(-1) * mask).sum() / mask.sum()


def symmetric_kl(s, t, mask):
    sl, tl = torch.log_softmax(s, -1), torch.log_softmax(t, -1).detach()
    return (((tl.exp() - sl.exp()) * (tl - sl)).sum(-1) * mask).mean()


def jsd(s, t, mask, beta=0.3):
    """TRL GKD's generalised JSD: the mixture as a logsumexp over the stacked pair."""
    sl, tl = F.log_softmax(s, -1), F.log_softmax(t, -1)
    mix = torch.logsumexp(torch.stack([sl + torch.log(torch.tensor(1 - beta, dtype=s.dtype)),
                                       tl + torch.log(torch.tensor(beta, dtype=s.dtype))]), dim=0)
    kl_teacher = F.kl_div(mix, tl, reduction="none", log_target=True)
    kl_student = F.kl_div(mix, sl, reduction="none", log_target=True)
    return (beta * kl_teacher + (1 - beta) * kl_student).sum() / mask.sum()


def per_sequence_kl(s, t, mask):
    """Per-sequence sums (4 sequences of T / 4 tokens), then their mean."""
    sl, tl = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    kl = (tl.exp() * (tl - sl)).sum(-1) * mask
    return kl.view(4, -1).sum(-1).mean()


def top_k_distillation(s, t, mask, k=5):
    """The teacher's top-k tokens only: the student's log-probs there, weighted by the teacher's."""
    with torch.no_grad():
        top_logp, top_ids = torch.log_softmax(t, -1).topk(k, -1)
    picked = torch.log_softmax(s, -1).gather(-1, top_ids)
    return -((top_logp.exp() * picked).sum(-1) * mask).mean()


def kl_div_reduction(reduction, log_target):
    def loss(s, t, mask):
        target = torch.log_softmax(t, -1) if log_target else torch.softmax(t, -1)
        out = F.kl_div(torch.log_softmax(s, -1), target, reduction=reduction, log_target=log_target)
        return out.sum(-1).mean() if reduction == "none" else out
    loss.__name__ = f"kl_div_{reduction}_{'log' if log_target else 'prob'}"
    return loss


def hinton(s, t, mask, temperature=2.0):
    return F.kl_div(F.log_softmax(s / temperature, -1), F.softmax(t / temperature, -1),
                    reduction="batchmean") * temperature ** 2


def label_smoothing(reduction):
    def loss(s, t, mask):
        labels = t.argmax(-1)
        labels[::7] = -100
        out = F.cross_entropy(s, labels, label_smoothing=0.1, reduction=reduction)
        return out.mean() if reduction == "none" else out
    loss.__name__ = f"label_smoothing_{reduction}"
    return loss


def padded_vocabulary(s, t, mask):
    """Megatron pads the vocabulary (to a multiple of 128 x tp): the real columns sliced off."""
    labels = t[:, :V - PAD].argmax(-1)
    return -torch.log_softmax(s[:, :V - PAD], -1).gather(-1, labels[:, None]).squeeze(-1).mean()


REWRITTEN = [forward_kl, reverse_kl, symmetric_kl, jsd, per_sequence_kl, top_k_distillation, hinton,
             padded_vocabulary, *[kl_div_reduction(r, lt) for r in ("none", "sum", "mean", "batchmean")
                                  for lt in (False, True)],
             *[label_smoothing(r) for r in ("none", "mean", "sum")]]


def _inputs(dtype=torch.float64, teacher_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(T, V, generator=g, dtype=dtype).requires_grad_()
    teacher = (torch.randn(T, V, generator=g, dtype=dtype) * 2).requires_grad_(teacher_grad)
    mask = (torch.rand(T, generator=g) > 0.25).to(dtype)
    return [student, teacher, mask]


def _parity(loss, tensors, inner="eager", atol=1e-10, **options):
    """Compile `loss` with graphpass (`options` for its Backend), compare the value and every input's
    gradient with eager; the graph's record."""
    refs = [x.detach().clone().requires_grad_(x.requires_grad) for x in tensors]
    backend = graphpass.Backend(inner=inner, strict=True, **options)
    out = torch.compile(loss, backend=backend)(*tensors)
    ref = loss(*refs)
    out.backward()
    ref.backward()
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    for mine, theirs in zip(tensors, refs):
        if theirs.grad is None:
            assert mine.grad is None, "a gradient eager does not give"
        else:
            torch.testing.assert_close(mine.grad, theirs.grad, atol=atol, rtol=atol)
    return backend.records[0]


@pytest.mark.parametrize("loss", REWRITTEN, ids=lambda f: f.__name__)
def test_rewritten_in_float64(loss):
    record = _parity(loss, _inputs())
    assert record.sites, record.rejected
    assert sum(site.wide_inputs for site in record.sites) >= 1


@pytest.mark.parametrize("loss", [forward_kl, reverse_kl, top_k_distillation], ids=lambda f: f.__name__)
def test_a_teacher_whose_logits_require_grad_gets_none_under_no_grad(loss):
    record = _parity(loss, _inputs(teacher_grad=True))
    assert record.sites


def test_both_models_in_one_region():
    """The teacher's log_softmax joins the student's region: both logits are its wide inputs,
    no `[T, V]` value of the teacher is stored between them."""
    record = _parity(forward_kl, _inputs())
    (site,) = record.sites
    assert site.wide_inputs == 2 and not record.rejected


# By default the JSD (both models' log-softmaxes and their mixture); the other two with --runslow.
@pytest.mark.parametrize("loss", [pytest.param(forward_kl, marks=pytest.mark.slow), jsd,
                                  pytest.param(hinton, marks=pytest.mark.slow)], ids=lambda f: f.__name__)
def test_under_inductor_in_fp32(loss):
    record = _parity(loss, _inputs(torch.float32), inner="inductor", atol=2e-5)
    assert record.sites


def test_padded_vocabulary_with_the_lm_head():
    def head_loss(hidden, weight, labels):
        logits = F.linear(hidden, weight)[:, :V - PAD]
        return F.cross_entropy(logits, labels)

    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(T, 8, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(V, 8, generator=g, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, V - PAD, (T,), generator=g)
    record = _parity(head_loss, [hidden, weight, labels])
    assert record.sites and record.sites[0].lm_head


def test_the_vocabulary_on_dim_1_says_what_to_change():
    def loss(s, t, mask):
        logits = s.view(4, -1, V).transpose(1, 2)  # [B, V, S]
        return -torch.log_softmax(logits, 1).amax(1).mean()

    record = _parity(loss, _inputs())
    assert not record.sites
    assert any("put the vocabulary last" in c.reason for c in record.rejected), record.rejected


def test_the_vocabulary_on_dim_1_of_cross_entropy_is_rewritten():
    def loss(s, t, mask):
        return F.cross_entropy(s.view(4, -1, V).transpose(1, 2), t.argmax(-1).view(4, -1), label_smoothing=0.1)

    assert _parity(loss, _inputs()).sites


def test_must_not_match_a_full_sum_of_plain_values():
    """A full sum of values no softmax made stays as it is (no region, nothing to chunk)."""
    def loss(s, t, mask):
        return (s * t).sum() + torch.log_softmax(s, -1).gather(-1, t.argmax(-1, keepdim=True)).mean()

    record = _parity(loss, _inputs())
    assert len(record.sites) == 1
    sums = record.graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.sum.default)
    assert any(n.args[0].target is torch.ops.aten.mul.Tensor for n in sums)  # still one full sum


def test_must_not_match_returned_teacher_log_probs():
    """The teacher's `[T, V]` log-probs are returned: they stay outside, the KL's region reads them."""
    def loss(s, t, mask):
        with torch.no_grad():
            tl = torch.log_softmax(t, -1)
        kl = (tl.exp() * (tl - torch.log_softmax(s, -1))).sum(-1).mean()
        return kl, tl

    tensors = _inputs()
    refs = [x.detach().clone().requires_grad_(x.requires_grad) for x in tensors]
    backend = graphpass.Backend(inner="eager", strict=True)
    out, tl = torch.compile(loss, backend=backend)(*tensors)
    ref, ref_tl = loss(*refs)
    out.backward()
    ref.backward()
    torch.testing.assert_close(tl, ref_tl)
    torch.testing.assert_close(tensors[0].grad, refs[0].grad, atol=1e-10, rtol=1e-10)


# ---- the student's lm_head beside the teacher's logits ---------------------------------------------
def _student_head(loss):
    """`loss` over the student's `hidden @ W.T` (the teacher's logits given, without a gradient)."""
    def head_loss(hidden, weight, t, mask):
        return loss(F.linear(hidden, weight), t, mask)
    head_loss.__name__ = f"{loss.__name__}_student_head"
    return head_loss


def _head_inputs(dtype=torch.float64, teacher_grad=False):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, 8, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, 8, generator=g, dtype=dtype) * 0.5).requires_grad_()
    teacher = (torch.randn(T, V, generator=g, dtype=dtype) * 2).requires_grad_(teacher_grad)
    mask = (torch.rand(T, generator=g) > 0.25).to(dtype)
    return [hidden, weight, teacher, mask]


@pytest.mark.parametrize("gradients_in_forward", [True, False], ids=["fwd", "recomputed"])
@pytest.mark.parametrize("loss", [forward_kl, reverse_kl, jsd, top_k_distillation], ids=lambda f: f.__name__)
def test_the_students_lm_head_fuses_beside_the_teachers_logits(loss, gradients_in_forward):
    """The teacher's `[T, V]` logits (no gradient) are read chunk by chunk beside the student's
    head: its logits and their gradient never exist; the teacher gets no gradient, as in eager."""
    tensors = _head_inputs(teacher_grad=loss is forward_kl)
    refs = [x.detach().clone().requires_grad_(x.requires_grad) for x in tensors]
    backend = graphpass.Backend(inner="eager", strict=True, gradients_in_forward=gradients_in_forward,
                                chunk_size=7)
    out = torch.compile(_student_head(loss), backend=backend)(*tensors)
    ref = _student_head(loss)(*refs)
    out.backward()
    ref.backward()
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for mine, theirs in zip(tensors, refs):
        assert (mine.grad is None) == (theirs.grad is None)
        if theirs.grad is not None:
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-10, rtol=1e-10)
    heads = [s for r in backend.records for s in r.sites if s.lm_head]
    assert heads and heads[0].wide_inputs >= 2, [r.rejected for r in backend.records]  # (top-k: its ids too)


def test_must_not_match_a_head_beside_logits_that_need_a_gradient():
    """Both the student's head and another `[T, V]` input with a gradient: the other would need its
    own `[rows, V]` gradient beside the head's blocks; the matmul stays outside, the reason says so."""
    def loss(hidden, weight, other, mask):
        s = F.linear(hidden, weight)
        return (torch.log_softmax(s, -1) * torch.log_softmax(other, -1)).sum(-1).mean()

    tensors = _head_inputs()
    tensors[2].requires_grad_()
    refs = [x.detach().clone().requires_grad_(x.requires_grad) for x in tensors]
    backend = graphpass.Backend(inner="eager", strict=True)
    out = torch.compile(loss, backend=backend)(*tensors)
    ref = loss(*refs)
    out.backward()
    ref.backward()
    for mine, theirs in zip([out, *[t.grad for t in tensors[:3]]], [ref, *[r.grad for r in refs[:3]]]):
        torch.testing.assert_close(mine, theirs, atol=1e-10, rtol=1e-10)
    record = backend.records[0]
    assert record.sites and not any(s.lm_head for s in record.sites)
    assert any("needs a gradient besides the lm_head's logits" in r.reason for r in record.rejected), record.rejected


# ---- both lm_heads: the teacher's computed chunk by chunk too, without a gradient ------------------
def _both_heads(loss, *, teacher_bias=False, teacher_transposed=False):
    """`loss` over the student's `hidden @ W.T` and the teacher's, its matmul under no_grad."""
    def heads_loss(hidden, weight, teacher_hidden, teacher_weight, mask):
        with torch.no_grad():
            if teacher_transposed:  # an [H, V] weight: hidden @ W
                t = teacher_hidden @ teacher_weight
            else:
                t = F.linear(teacher_hidden, teacher_weight, teacher_weight[:, 0] if teacher_bias else None)
        return loss(F.linear(hidden, weight), t, mask)
    heads_loss.__name__ = f"{loss.__name__}_both_heads"
    return heads_loss


def _both_head_inputs(dtype=torch.float64, teacher_grad=False, rows=T, vocab=V, hidden_size=8, transposed=False):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(rows, hidden_size, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g, dtype=dtype) * 0.5).requires_grad_()
    teacher_hidden = torch.randn(rows, hidden_size, generator=g, dtype=dtype).requires_grad_(teacher_grad)
    teacher_weight = (torch.randn(vocab, hidden_size, generator=g, dtype=dtype) * 0.7).requires_grad_(teacher_grad)
    if transposed:
        teacher_weight = teacher_weight.detach().t().contiguous().requires_grad_(teacher_grad)
    mask = (torch.rand(rows, generator=g) > 0.25).to(dtype)
    return [hidden, weight, teacher_hidden, teacher_weight, mask]


@pytest.mark.parametrize("gradients_in_forward", [True, False], ids=["fwd", "recomputed"])
@pytest.mark.parametrize("loss", [forward_kl, reverse_kl, symmetric_kl, jsd, per_sequence_kl, hinton],
                         ids=lambda f: f.__name__)
def test_both_lm_heads_fuse(loss, gradients_in_forward):
    """Both matmuls in the graph: the op computes each block's student and teacher logits from their
    hidden states; neither `[T, V]` exists. The teacher's operands (requiring grad, under no_grad)
    get no gradient, as in eager. Recomputed at T <= V, the backward takes vocabulary tiles."""
    record = _parity(_both_heads(loss), _both_head_inputs(teacher_grad=loss is forward_kl),
                     gradients_in_forward=gradients_in_forward, chunk_size=7)
    assert [(s.lm_head, s.frozen_lm_heads) for s in record.sites] == [(True, 1)], record.rejected
    assert not any("lm_head" in r.reason for r in record.rejected), record.rejected


@pytest.mark.parametrize("variant", [dict(teacher_bias=True), dict(teacher_transposed=True)], ids=["bias", "transposed"])
def test_the_teachers_head_with_a_bias_or_an_hv_weight(variant):
    tensors = _both_head_inputs(transposed=variant.get("teacher_transposed", False))
    record = _parity(_both_heads(forward_kl, **variant), tensors, chunk_size=5)
    assert [(s.lm_head, s.frozen_lm_heads) for s in record.sites] == [(True, 1)], record.rejected


def test_a_teachers_head_beside_given_student_logits():
    """The student's logits come from outside (a graph input); the teacher's matmul is in the
    graph: the op reads the one and computes the other."""
    def loss(student, teacher_hidden, teacher_weight, mask):
        with torch.no_grad():
            t = F.linear(teacher_hidden, teacher_weight)
        return forward_kl(student, t, mask)

    hidden, weight, teacher_hidden, teacher_weight, mask = _both_head_inputs()
    student = F.linear(hidden, weight).detach().requires_grad_()
    record = _parity(loss, [student, teacher_hidden, teacher_weight, mask], chunk_size=7)
    assert [(s.lm_head, s.frozen_lm_heads) for s in record.sites] == [(False, 1)], record.rejected


def test_a_teachers_hidden_states_keep_their_gradient_from_elsewhere():
    """The teacher's hidden states need a gradient from another term of the loss: the op gives
    them none (none reaches its logits), autograd the other term's."""
    def loss(hidden, weight, teacher_hidden, teacher_weight, mask):
        with torch.no_grad():
            t = F.linear(teacher_hidden, teacher_weight)
        return forward_kl(F.linear(hidden, weight), t, mask) + (teacher_hidden ** 2).mean()

    tensors = _both_head_inputs()
    tensors[2].requires_grad_()
    record = _parity(loss, tensors, chunk_size=7)
    assert [(s.lm_head, s.frozen_lm_heads) for s in record.sites] == [(True, 1)], record.rejected


@pytest.mark.parametrize("loss", [forward_kl, jsd], ids=lambda f: f.__name__)
def test_bf16_both_heads_as_close_to_float64_as_eager(loss, graphpass_log):
    """bf16, gradients in forward: the weight's gradient over vocabulary tiles after row blocks
    (the two passes of `ops.lm_head`), the teacher's tile logits recomputed in the second. The
    log-softmax's backward sums the teacher's terms along each row: the first pass writes those
    sums, which the tiles read, so no fp32 accumulator of the weight's gradient exists."""
    tensors = _both_head_inputs(torch.bfloat16, rows=64, vocab=256, hidden_size=32)
    fn = _both_heads(loss)
    exact = [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]
    fn(*exact).backward()
    backend = graphpass.Backend(inner="eager", strict=True)
    errors = {}
    for name, f in (("graphpass", torch.compile(fn, backend=backend)), ("eager", fn)):
        mine = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
        f(*mine).backward()
        errors[name] = max(float((m.grad.double() - r.grad).abs().max() / r.grad.abs().max())
                           for m, r in zip(mine[:2], exact[:2]))
    assert errors["graphpass"] <= 2 * errors["eager"], errors
    sites = [s for r in backend.records for s in r.sites]
    assert [(s.lm_head, s.frozen_lm_heads, s.gradients_in_forward) for s in sites] == [(True, 1, True)]
    assert not [m for m in graphpass_log if "accumulates over row blocks" in m], graphpass_log


def test_per_token_jsd_returned_from_inductor_matches_eager():
    """The loss outside the compiled function (`jsd_per_token = compiled(...)`, then weighted):
    the backward recomputes, and its kernel both sums along the row and overwrites the row's
    logits, which inductor's CPU code generator cannot compile as one (pytorch/pytorch#196570):
    it runs as two kernels, the sums first; the gradients as eager's."""
    def per_token(hidden, weight, teacher_hidden, teacher_weight):
        with torch.no_grad():
            t = F.linear(teacher_hidden, teacher_weight)
        s = F.linear(hidden, weight)
        sl, tl = F.log_softmax(s, -1), F.log_softmax(t, -1)
        mix = torch.logsumexp(torch.stack([sl + math.log(0.5), tl + math.log(0.5)]), dim=0)
        return 0.5 * (tl.exp() * (tl - mix)).sum(-1) + 0.5 * (sl.exp() * (sl - mix)).sum(-1)

    tensors = _both_head_inputs(torch.float32, rows=32, vocab=128, hidden_size=16)[:4]
    weights = torch.rand(32, generator=torch.Generator().manual_seed(2))
    backend = graphpass.Backend(strict=True)
    results = []
    for f in (torch.compile(per_token, backend=backend), per_token):
        mine = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
        value = f(*mine)
        (value * weights).sum().backward()
        results.append([value, mine[0].grad, mine[1].grad])
    for mine, theirs in zip(*results):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    sites = [s for r in backend.records for s in r.sites]
    assert [(s.lm_head, s.frozen_lm_heads, s.gradients_in_forward) for s in sites] == [(True, 1, False)]
