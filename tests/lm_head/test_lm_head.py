"""The lm_head inside the region: `hidden @ W.T` computed chunk by chunk by the op, the logits never stored.

Parity with eager of the loss and of every input's gradient (hidden, weight, bias, and the rest),
across spellings of the matmul (`F.linear`, `@ W.t()`, `mm`, `addmm`, a `[H, V]` weight), a bias,
a cast, temperature, masks, a `[B, S, H]` batch, tied embeddings, bf16, odd shapes and chunk
sizes; the site says `lm_head`; and where the logits have another reader the matmul stays
outside (today's region), with the reason recorded.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphpass
from graphpass.ops import lm_head as lm_head_op

pytestmark = pytest.mark.heavy  # a minute or more: xdist starts it early (tests/conftest.py)

T, H, V = 13, 8, 37


def ppo_from_hidden(hidden, weight, tokens, old_logp, adv, mask, temperature=0.7, ent_coef=0.01):
    logits = F.linear(hidden, weight)
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    return ((pg - ent_coef * entropy) * mask).sum() / mask.sum()


def _batch(*rows, dtype=torch.float32, hidden_size=H, vocab=V, seed=0, bias=False, weight_shape=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*rows, hidden_size, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(*(weight_shape or (vocab, hidden_size)), generator=g) / hidden_size ** 0.5)
    weight = weight.to(dtype).requires_grad_()
    tokens = torch.randint(0, vocab, rows, generator=g)
    old_logp = -torch.rand(rows, generator=g) * 3
    adv = torch.randn(rows, generator=g)
    mask = (torch.rand(rows, generator=g) < 0.8).float()
    tensors = [hidden, weight, tokens, old_logp, adv, mask]
    if bias:
        tensors.append((torch.randn(vocab, generator=g) * 0.1).to(dtype).requires_grad_())
    return tensors


def _clone(tensors):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _parity(fn, tensors, backend, atol=1e-5, rtol=1e-5, **kwargs):
    """Compiled and eager values and gradients of every input that requires grad are equal."""
    ref_tensors = _clone(tensors)
    out = torch.compile(fn, backend=backend)(*tensors, **kwargs)
    ref = fn(*ref_tensors, **kwargs)
    out.backward()
    ref.backward()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    for mine, theirs in zip(tensors, ref_tensors):
        if theirs.requires_grad:
            assert mine.grad is not None and mine.grad.dtype == theirs.grad.dtype
            torch.testing.assert_close(mine.grad.float(), theirs.grad.float(), atol=atol, rtol=rtol)
    return backend.records


def _site(records):
    (record,) = records
    assert record.fallback_reason is None
    (site,) = record.sites
    return site, record


@pytest.mark.parametrize("chunk_size", [1, 4, 5, None])
def test_ppo_from_hidden_fuses_the_matmul(chunk_size):
    backend = graphpass.Backend(chunk_size=chunk_size, inner="aot_eager")
    records = _parity(ppo_from_hidden, _batch(T), backend)
    site, record = _site(records)
    assert site.lm_head and site.shape == (T, V) and site.hidden_shape == (T, H)
    # The loss is a masked sum of per-token terms: the op takes it in (tests/lm_head/test_gradients_in_forward.py).
    assert site.kind == "logprob+entropy" and site.gradients_in_forward
    assert sorted((o.kind, o.keeps_grad) for o in site.outputs) == [("entropy", True), ("logprob", True)]
    code = record.graph_module.code
    assert "linear" not in code and "mm" not in code and "log_softmax" not in code
    # The op reads the hidden states and the weight, never a [T, V] tensor.
    (op,) = [n for n in record.graph_module.graph.nodes
             if n.target is torch.ops.graphpass.rowwise_chunked_with_gradients.default]
    shapes = [tuple(a.meta["val"].shape) for a in op.args[1]]
    assert (T, H) in shapes and (V, H) in shapes and not any(s[-1:] == (V,) and len(s) == 2 and s[0] == T
                                                             for s in shapes)


def logprob_mm(hidden, weight, tokens, old_logp, adv, mask):
    logits = torch.mm(hidden, weight.t())
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return -(logp * mask).sum()


def logprob_matmul_t(hidden, weight, tokens, old_logp, adv, mask):
    logits = hidden @ weight.T
    logp = torch.log_softmax(logits.float() / 1.3, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return -(logp * mask).sum() / mask.sum()


def logprob_weight_hv(hidden, weight_hv, tokens, old_logp, adv, mask):
    logits = hidden @ weight_hv  # a [H, V] weight, not transposed
    return F.cross_entropy(logits, tokens, reduction="none").mul(mask).mean()


def logprob_bias(hidden, weight, tokens, old_logp, adv, mask, bias):
    logits = F.linear(hidden, weight, bias)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    entropy = torch.distributions.Categorical(logits=logits.float()).entropy()
    return -(logp * mask).sum() + 0.1 * (entropy * adv).sum()


def logprob_addmm(hidden, weight, tokens, old_logp, adv, mask, bias):
    logits = torch.addmm(bias, hidden, weight.t())
    return -(torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1) * adv).sum()


def logprob_bias_added(hidden, weight, tokens, old_logp, adv, mask, bias):
    logits = hidden @ weight.t() + bias
    return -(torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1) * adv).sum()


@pytest.mark.parametrize("fn,bias,weight_shape", [
    (logprob_mm, False, None), (logprob_matmul_t, False, None), (logprob_weight_hv, False, (H, V)),
    (logprob_bias, True, None), (logprob_addmm, True, None), (logprob_bias_added, True, None),
])
def test_spellings_of_the_head(fn, bias, weight_shape):
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    site, _ = _site(_parity(fn, _batch(T, bias=bias, weight_shape=weight_shape), backend))
    assert site.lm_head


@pytest.mark.parametrize("rows", [(3, 5), (1, 7), (4, 1)])
def test_batched_hidden(rows):
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    site, _ = _site(_parity(ppo_from_hidden, _batch(*rows), backend))
    assert site.lm_head and site.hidden_shape == (*rows, H)


def test_temperature_and_vocab_mask_and_entropy_without_grad():
    vocab_mask = torch.zeros(V, dtype=torch.bool)
    vocab_mask[-5:] = True  # padded vocabulary entries

    def fn(hidden, weight, tokens, old_logp, adv, mask, temperature):
        logits = F.linear(hidden, weight).float().masked_fill(vocab_mask, float("-inf")) / temperature
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all.clamp(min=-1e4)).sum(-1)
        return (-(logp * mask).sum() / mask.sum()) + 0 * entropy.mean()

    tensors = _batch(T, vocab=V)
    tensors[2] = tensors[2] % (V - 5)
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    for temperature in (0.7, 1.1):
        torch.compiler.reset()
        backend.records.clear()
        site, _ = _site(_parity(fn, _clone(tensors), backend, temperature=temperature))
        assert site.lm_head
        assert [o.keeps_grad for o in site.outputs] == [True, False], site.outputs


def test_tied_embedding_gets_both_gradients():
    def model(ids, weight, tokens, old_logp, adv, mask):
        hidden = torch.tanh(F.embedding(ids, weight))  # the input embedding is the output layer
        return ppo_from_hidden(hidden, weight, tokens, old_logp, adv, mask)

    hidden, weight, tokens, old_logp, adv, mask = _batch(T)
    ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(3))
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    site, _ = _site(_parity(model, [ids, weight, tokens, old_logp, adv, mask], backend))
    assert site.lm_head


def test_frozen_weight_and_frozen_hidden():
    for frozen in (0, 1):
        tensors = _batch(T)
        tensors[frozen].requires_grad_(False)
        backend = graphpass.Backend(chunk_size=5, inner="aot_eager")
        site, _ = _site(_parity(ppo_from_hidden, tensors, backend))
        assert site.lm_head and tensors[frozen].grad is None
        torch.compiler.reset()


@pytest.mark.parametrize("bias", [False, True])
def test_bf16(bias):
    tensors = _batch(T, dtype=torch.bfloat16, bias=bias, hidden_size=16)
    fn = logprob_bias if bias else ppo_from_hidden
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    ref64 = _clone([t.double() if t.is_floating_point() else t for t in tensors])
    records = _parity(fn, tensors, backend, atol=3e-2, rtol=3e-2)
    site, _ = _site(records)
    assert site.lm_head and site.dtype == torch.bfloat16
    # Closer to float64 than eager bf16 is, or as close: the weight's gradient sums in fp32.
    fn(*ref64).backward()
    eager = _clone(tensors)
    fn(*eager).backward()
    for i in (0, 1):
        ours = (tensors[i].grad.double() - ref64[i].grad).abs().max()
        theirs = (eager[i].grad.double() - ref64[i].grad).abs().max()
        assert ours <= theirs * 1.5 + 1e-3, (i, float(ours), float(theirs))


def test_inductor_parity_and_float64():
    tensors = _batch(64, hidden_size=32, vocab=300)
    backend = graphpass.Backend(chunk_size=24)
    records = _parity(ppo_from_hidden, tensors, backend, atol=1e-5, rtol=1e-4)
    site, _ = _site(records)
    assert site.lm_head


def test_default_chunking_matches():
    tensors = _batch(200, hidden_size=16, vocab=129)
    backend = graphpass.Backend(inner="aot_eager", chunk_budget_bytes=40_000)
    site, _ = _site(_parity(ppo_from_hidden, tensors, backend))
    assert site.lm_head and 4 < site.chunk_rows < 200


# ---- must not match: the logits have another reader -------------------------------------------------
def test_logits_returned_keep_todays_region():
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        logits = F.linear(hidden, weight)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
        return -(logp * mask).sum(), logits

    tensors = _batch(T)
    ref_tensors = _clone(tensors)
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    loss, logits = torch.compile(fn, backend=backend)(*tensors)
    ref_loss, ref_logits = fn(*ref_tensors)
    (loss + logits.sum()).backward()
    (ref_loss + ref_logits.sum()).backward()
    torch.testing.assert_close(logits, ref_logits)
    for a, b in zip(tensors[:2], ref_tensors[:2]):
        torch.testing.assert_close(a.grad, b.grad)
    site, record = _site(backend.records)
    assert not site.lm_head  # today's region over the logits, the matmul outside
    assert any("lm_head not fused" in c.reason and "output of the graph" in c.reason for c in record.rejected)


def test_logits_read_elsewhere_keep_todays_region():
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        logits = F.linear(hidden, weight)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
        z_loss = logits.pow(2).mean()  # another reader of the [T, V] logits
        return -(logp * mask).sum() + 1e-2 * z_loss

    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    site, record = _site(_parity(fn, _batch(T), backend))
    assert not site.lm_head
    assert any("lm_head not fused" in c.reason and "read outside the region" in c.reason for c in record.rejected)


def test_matmul_of_batched_weights_is_not_a_head():
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        logits = torch.bmm(hidden[None], weight.t()[None])[0]
        return -(torch.log_softmax(logits, -1).gather(-1, tokens[:, None]) * mask[:, None]).sum()

    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    site, _ = _site(_parity(fn, _batch(T), backend))
    assert not site.lm_head


def test_program_hooks_keep_the_base_loop():
    """One row loop: the lm_head program overrides hooks, never the row loops (its backward adds a
    schedule over vocabulary tiles, tests/lm_head/test_lm_head_tiles.py, and hands row blocks to the base's)."""
    for name in ("forward", "forward_with_gradients", "_chunks"):
        assert name not in vars(lm_head_op.LinearHeadProgram), name


# ---- cross-entropy (reduction 'mean', the default) from hidden states ---------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_mean_from_hidden(dtype):
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        return F.cross_entropy(F.linear(hidden, weight).float(), tokens)

    tensors = _batch(T, dtype=dtype)
    tensors[2][3] = -100  # an ignored position
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    site, _ = _site(_parity(fn, tensors, backend, atol=tol, rtol=tol))
    assert site.lm_head and site.kind == "-logprob"


def test_memory_model_counts_the_head_gradients():
    """The estimate after the rewrite: the floor is hidden.grad + W.grad, and no [T, V] value."""
    from graphpass.memory import estimate_rewrite
    from graphpass.pipeline import rewrite_graph
    from graphpass.config import Config
    from graphpass.records import GraphRecord

    from torch._subclasses.fake_tensor import FakeTensorMode

    rows, hidden_size, vocab = 512, 64, 4096
    with FakeTensorMode():
        tensors = _batch(rows, hidden_size=hidden_size, vocab=vocab)
    record = GraphRecord(0)
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        return (ppo_from_hidden(hidden, weight, tokens, old_logp, adv, mask),)

    result = rewrite_graph(torch.fx.symbolic_trace(fn), tensors, Config(chunk_budget_bytes=4096), record)
    (site,) = record.sites
    assert site.lm_head
    est = estimate_rewrite(result)
    floor = (rows + vocab) * hidden_size * 4
    assert est.after.floor_bytes == floor == est.before.floor_bytes
    assert est.after.peak_bytes < 1.3 * floor < est.before.peak_bytes


def test_dynamic_token_count_reuses_the_graph():
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    fn = torch.compile(ppo_from_hidden, backend=backend)  # a new T recompiles once, T symbolic
    for rows in (9, 14, 21):
        tensors = _batch(rows)
        ref_tensors = _clone(tensors)
        fn(*tensors).backward()
        ppo_from_hidden(*ref_tensors).backward()
        for mine, theirs in zip(tensors[:2], ref_tensors[:2]):
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)
    assert len(backend.records) == 2 and all(r.sites[0].lm_head for r in backend.records)
    assert not isinstance(backend.records[1].sites[0].shape[0], int)  # the rows are symbolic


def test_shifted_logits_of_a_batch_reach_the_head():
    """`lm_head(hidden)[:, :-1]` (the logits of the next tokens): the slice moves onto the hidden
    states, and the op absorbs the matmul."""
    def fn(hidden, weight, tokens, old_logp, adv, mask):
        logits = F.linear(hidden, weight)[:, :-1]
        logp = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()

    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    site, record = _site(_parity(fn, _batch(3, 6), backend))
    assert site.lm_head and site.hidden_shape == (3, 5, H)
    assert "linear" not in record.graph_module.code


# ---- the analysis on tiny captured graphs -----------------------------------------------------------
def _heads(fn, *args):
    from graphpass.analysis.grad_flow import grad_modes
    from graphpass.analysis.lm_head import match_lm_head
    from graphpass.analysis.regions import find_regions
    from graphpass.capture import capture_function

    gm = capture_function(fn, *args).gm
    (region,), _ = find_regions(gm)
    modes = grad_modes(gm.graph)
    found = [match_lm_head(region, n, modes) for n in region.inputs if n.op == "call_function"]
    return gm, [f for f in found if f != (None, None)]


def test_analysis_finds_hidden_weight_and_bias():
    hidden, weight, tokens, *_, bias = _batch(T, bias=True)

    def fn(hidden, weight, bias, tokens):
        return (torch.log_softmax(F.linear(hidden, weight, bias).float(), -1).gather(-1, tokens[:, None]).sum(),)

    gm, [(head, why)] = _heads(fn, hidden, weight, bias, tokens)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert why is None and head.hidden in placeholders and head.weight in placeholders and head.bias in placeholders
    assert not head.weight_transposed and head.hidden_size == H
    assert head.nodes[0] is head.logits and head.logits.target is torch.ops.aten.linear.default


def test_analysis_says_why_not():
    hidden, weight, tokens, *_ = _batch(T)

    def two_readers(hidden, weight, tokens):
        logits = hidden @ weight.t()
        return (torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).sum(), logits.amax())

    _, [(head, why)] = _heads(two_readers, hidden, weight, tokens)
    assert head is None and "also" in why


@pytest.mark.parametrize("bias", [False, True])
def test_float64_sums_in_float64(bias):
    """The weight's and bias's gradients are summed over chunks in fp32 at least: float64 stays float64."""
    tensors = [t.double() if t.is_floating_point() else t for t in _batch(T, bias=bias)]
    tensors = [t.detach().requires_grad_(t.is_floating_point() and i in (0, 1, 6)) for i, t in enumerate(tensors)]
    def fn(hidden, weight, tokens, old_logp, adv, mask, *bias):  # no .float(): float64 throughout
        logp_all = torch.log_softmax(F.linear(hidden, weight, *bias) / 0.7, -1)
        logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return -(logp * adv).sum() + 0.1 * (entropy * mask).sum()

    backend = graphpass.Backend(chunk_size=3, inner="aot_eager")
    site, _ = _site(_parity(fn, tensors, backend, atol=1e-12, rtol=1e-12))
    assert site.lm_head and site.dtype == torch.float64


# ---- one log-softmax read two ways (issue 47, item 4) ----------------------------------------------


def _preference_nll_on_a_slice(h, W, y):
    """Liger's preference `chunk_forward` shape: an NLL over the chosen half `lp[:B]` of the batch
    and a gather over all rows, from one log-softmax."""
    lp = torch.log_softmax(h @ W.T, -1)
    nll = torch.nn.functional.nll_loss(lp[:2].flatten(0, 1), y[:2].flatten())
    logps = lp.gather(-1, y.unsqueeze(-1)).squeeze(-1).sum(-1)
    return nll - torch.nn.functional.logsigmoid(logps[:2] - logps[2:]).mean()


def _preference_nll_of_the_gathered_rows(h, W, y):
    """The same loss with the NLL read from the gather over all rows, sliced after."""
    lp = torch.log_softmax(h @ W.T, -1)
    picked = lp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    logps = picked.sum(-1)
    return -picked[:2].mean() - torch.nn.functional.logsigmoid(logps[:2] - logps[2:]).mean()


def test_a_row_slice_of_a_log_softmax_read_whole_is_one_site_with_the_lm_head():
    """The NLL over the chosen half reads all rows (`read_sliced_rows_whole`), so the `[2B, S, V]`
    log-softmax is one region with the matmul in it, as where the NLL is written on the gathered
    rows; without that pass the site says why the matmul stays out and what to change."""
    g = torch.Generator().manual_seed(0)
    h, W = torch.randn(4, 5, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (4, 5), generator=g)
    results = {}
    for fn, kind, disabled in ((_preference_nll_on_a_slice, "-logprob+logprob", ()),
                               (_preference_nll_of_the_gathered_rows, "logprob", ()),
                               (_preference_nll_on_a_slice, "rowwise", ("read_sliced_rows_whole_pass",))):
        backend = graphpass.Backend(inner="aot_eager", disable_passes=disabled)
        ours = [h.clone().requires_grad_(), W.clone().requires_grad_()]
        torch.compile(fn, backend=backend)(*ours, y).backward()
        torch.compiler.reset()
        results[fn, disabled] = [t.grad for t in ours]
        (site,) = [s for r in backend.records for s in r.sites]
        assert site.kind == kind
        if disabled:
            assert not site.lm_head
            assert site.lm_head_reason.startswith("it reads rows sliced (slice.Tensor at test_lm_head.py"), site.lm_head_reason
            assert "slice those to take the matmul in" in site.lm_head_reason
        else:
            assert site.lm_head, site.lm_head_reason
    expected = [h.clone().requires_grad_(), W.clone().requires_grad_()]
    _preference_nll_on_a_slice(*expected, y).backward()
    for grads in results.values():
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want.grad, rtol=1e-10, atol=1e-12)
