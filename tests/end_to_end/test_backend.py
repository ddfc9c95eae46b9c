"""The backend as a user meets it: entry point, fallback, strict mode, errors, recompiles, layouts."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import graphpass
from graphpass.passes import chunk_rowwise_regions

V = 37


def logprob_entropy(logits, tokens, temperature=0.7, ent_coef=0.0):
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return -logp.mean() - ent_coef * entropy.mean(), entropy


def _inputs(*rows, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*rows, V, generator=g).to(dtype).requires_grad_()
    tokens = torch.randint(0, V, rows, generator=g)
    return logits, tokens


def _check_parity(fn, backend, *rows, dtype=torch.float32, atol=1e-5, **kwargs):
    """Values and logits gradients of the compiled fn equal eager's."""
    logits, tokens = _inputs(*rows, dtype=dtype)
    ref_logits = logits.detach().clone().requires_grad_()
    out = torch.compile(fn, backend=backend)(logits, tokens, **kwargs)
    ref = fn(ref_logits, tokens, **kwargs)
    out[0].backward()
    ref[0].backward()
    for a, b in zip(out, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), atol=atol, rtol=atol)
    assert logits.grad.dtype == dtype
    return backend.records


def test_string_backend_works_without_importing_graphpass():
    script = textwrap.dedent("""
        import sys, torch
        assert "graphpass" not in sys.modules
        fn = lambda x, t: torch.log_softmax(x / 0.7, -1).gather(-1, t[:, None]).sum()
        x = torch.randn(9, 21, requires_grad=True); t = torch.randint(0, 21, (9,))
        y = torch.compile(fn, backend="graphpass")(x, t); y.backward()
        xe = x.detach().clone().requires_grad_(); fn(xe, t).backward()
        torch.testing.assert_close(y, fn(xe, t)); torch.testing.assert_close(x.grad, xe.grad)
        from graphpass.backend import _default_backend
        print(len(_default_backend().records[0].sites))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1"


def test_site_record_describes_the_rewrite():
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    records = _check_parity(logprob_entropy, backend, 13)
    (site,) = records[0].sites
    assert [o.kind for o in site.outputs] == ["logprob", "entropy"]
    assert site.shape == (13, V) and site.dtype == torch.float32 and site.chunk_size == 4
    assert site.source.startswith("test_backend.py:")
    assert site.outputs[0].temperature == "/ 0.7"
    # The entropy is a graph output, so its gradient may be wanted: kept (skipped at run time
    # when the incoming gradient is zero); ent_coef=0.0 is a constant, but the output escapes.
    assert site.outputs[0].keeps_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_parity_bsv_layout(dtype):
    backend = graphpass.Backend(chunk_size=3)
    _check_parity(logprob_entropy, backend, 2, 5, dtype=dtype, atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert len(backend.records[0].sites) == 1


def test_t_equals_one_and_chunk_larger_than_t():
    backend = graphpass.Backend(chunk_size=64, inner="aot_eager")
    _check_parity(logprob_entropy, backend, 1)
    assert len(backend.records[0].sites) == 1


def test_entropy_gradient_dropped_for_constant_zero_coefficient():
    def loss(logits, tokens, ent_coef=0.0):
        lp = torch.log_softmax(logits, -1)
        logp = lp.gather(-1, tokens[:, None]).squeeze(-1)
        entropy = -(lp.exp() * lp).sum(-1)
        return (-logp.mean() - ent_coef * entropy.mean(),)

    for coef, kept in [(0.0, False), (0.01, True)]:
        torch.compiler.reset()
        backend = graphpass.Backend(chunk_size=5, inner="aot_eager")
        _check_parity(loss, backend, 11, ent_coef=coef)
        kinds = {o.kind: o.keeps_grad for o in backend.records[0].sites[0].outputs}
        assert kinds == {"logprob": True, "entropy": kept}


def test_entropy_in_no_grad_block_is_forward_only():
    def loss(logits, tokens):
        lp = torch.log_softmax(logits, -1)
        with torch.no_grad():
            entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        return -lp.gather(-1, tokens[:, None]).mean(), entropy

    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    _check_parity(loss, backend, 10)
    outputs = [o for s in backend.records[0].sites for o in s.outputs]
    assert sorted((o.kind, o.keeps_grad) for o in outputs) == [("entropy", False), ("logprob", True)]


def test_non_contiguous_logits_slice():
    def loss(logits, tokens):
        shifted = logits[:, :-1, :]
        lp = torch.log_softmax(shifted, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        return (-lp.mean(),)

    backend = graphpass.Backend(chunk_size=2, inner="aot_eager")
    _check_parity(loss, backend, 3, 7)
    assert len(backend.records[0].sites) == 1


def test_wide_value_needed_outside_is_left_alone_and_correct():
    def loss(logits, tokens):
        probs = torch.softmax(logits, -1)
        lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])
        return (-lp.mean() + probs.pow(2).sum(0).mean(),)  # a sum over rows: probs leave the region

    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    _check_parity(loss, backend, 9)
    assert [o.kind for s in backend.records[0].sites for o in s.outputs] == ["logprob"]


def online_logprob_entropy(logits, tokens, block=10):
    """Log-prob and entropy by an online log-sum-exp over vocabulary blocks (a hand-fused
    kernel's loop, written inline): the running max, sum and sum of x * exp(x) carry from block
    to block; each block's target logit is kept where the token falls in it."""
    rows = logits.shape[:-1]
    m = torch.full(rows, float("-inf"), dtype=logits.dtype)
    s, t, target = (torch.zeros(rows, dtype=logits.dtype) for _ in range(3))
    for v0 in range(0, logits.shape[-1], block):
        x = logits[..., v0:v0 + block] / 0.7
        m_new = torch.maximum(m, x.amax(-1))
        rescale = torch.exp(m - m_new)
        e = torch.exp(x - m_new.unsqueeze(-1))
        s, t, m = s * rescale + e.sum(-1), t * rescale + (e * x).sum(-1), m_new
        inside = (tokens >= v0) & (tokens < v0 + x.shape[-1])
        local = (tokens - v0).clamp(0, x.shape[-1] - 1)
        target = torch.where(inside, x.gather(-1, local.unsqueeze(-1)).squeeze(-1), target)
    lse = m + torch.log(s)
    logp, entropy = target - lse, lse - t / s
    return -logp.mean() - 0.01 * entropy.mean(), entropy.detach()


@pytest.mark.parametrize("rows, block", [((9,), 10), ((2, 5), 10), ((9,), 12)])  # 12: the last block one wide
def test_online_logsumexp_over_vocabulary_blocks_is_chunked_exactly(rows, block):
    # Each block's statistics depend on the previous block's: the loop is one row-local region
    # (it used to be rejected, each block "reading its own outputs"), run as written, by rows.
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    _check_parity(functools.partial(online_logprob_entropy, block=block), backend, *rows, dtype=torch.float64,
                  atol=1e-12)
    (site,) = [site for record in backend.records for site in record.sites]
    # Its outputs are what the loop computes, the log-prob and the entropy, not each block's share.
    assert [(o.kind, o.temperature) for o in site.outputs] == [("logprob", "/ 0.7"), ("entropy", "/ 0.7")]
    assert not [r for rec in backend.records for r in rec.rejected if "own outputs" in r.reason]


def test_online_logsumexp_of_the_output_layer_fuses_the_lm_head():
    def loss(hidden, weight, tokens):
        return online_logprob_entropy(F.linear(hidden, weight), tokens, block=8)

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, 6, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (11,), generator=g)
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    out = torch.compile(loss, backend=backend)(hidden, weight, tokens)
    grads = torch.autograd.grad(out[0], (hidden, weight))
    ref = loss(hidden, weight, tokens)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, torch.autograd.grad(ref[0], (hidden, weight))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    (site,) = backend.records[0].sites
    assert site.lm_head and site.kind == "logprob+entropy"


def manual_logprob_entropy(logits, tokens, shift="detached", keepdim=False, pick="select", entropy=True):
    """A stable log-softmax written out by hand (slime's and Megatron's inline math): shift by the
    row max, then `x_t - log(sum(exp(x)))`, the entropy `log(s) - sum(p * x)`; with or without
    keepdim, the picked logit squeezed by `[..., 0]` or `squeeze(-1)`."""
    x = logits / 0.7
    if shift is not None:
        m = x.amax(-1, keepdim=True)
        x = x - (m.detach() if shift == "detached" else m)
    picked = x.gather(-1, tokens.unsqueeze(-1))
    s = x.exp().sum(-1, keepdim=keepdim)
    log_s = s.log() if not keepdim else (s.log()[..., 0] if pick == "select" else s.log().squeeze(-1))
    picked = picked[..., 0] if pick == "select" else picked.squeeze(-1)
    logp = picked - log_s
    loss = -logp.mean()
    if not entropy:
        return loss, logp.detach()
    p = x.exp() / (s if keepdim else s.unsqueeze(-1))
    ent = log_s - (p * x).sum(-1)
    return loss - 0.01 * ent.mean(), ent.detach()


@pytest.mark.parametrize("rows", [(9,), (2, 5)])
@pytest.mark.parametrize("shift, keepdim, pick, entropy", [
    ("detached", False, "select", True), ("detached", True, "select", False), (None, False, "select", False),
    ("kept", False, "squeeze", True), ("kept", True, "squeeze", True), (None, True, "select", True)])
def test_a_log_softmax_written_out_is_one_site(rows, shift, keepdim, pick, entropy):
    # `x.gather(...)[..., 0] - s.log()` on [rows] values: the subtraction finishes the log-prob
    # inside the region (a select of a one-wide dim is a squeeze); it used to stay outside, the
    # region's outputs the picked logit and log(s), labelled rowwise.
    fn = functools.partial(manual_logprob_entropy, shift=shift, keepdim=keepdim, pick=pick, entropy=entropy)
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    _check_parity(fn, backend, *rows, dtype=torch.float64, atol=1e-12)
    (site,) = [site for record in backend.records for site in record.sites]
    assert site.kind == ("logprob+entropy" if entropy else "logprob")
    assert all(o.temperature == "/ 0.7" for o in site.outputs)


def test_nothing_to_rewrite_runs_unchanged():
    def loss(logits, tokens):
        return ((logits * 2).sum(-1).mean(),)

    backend = graphpass.Backend(inner="aot_eager")
    _check_parity(loss, backend, 6)
    assert backend.records[0].sites == [] and backend.records[0].fallback_reason is None


def test_failing_pass_falls_back_and_strict_raises(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(chunk_rowwise_regions, "find_regions", broken)
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    _check_parity(logprob_entropy, backend, 7)
    record = backend.records[0]
    assert record.sites == []
    assert "chunk_rowwise_regions_pass" in record.fallback_reason and "boom" in record.fallback_reason

    torch.compiler.reset()
    strict = graphpass.Backend(chunk_size=4, inner="aot_eager", strict=True)
    logits, tokens = _inputs(7)
    with pytest.raises(Exception, match="boom"):
        torch.compile(logprob_entropy, backend=strict)(logits, tokens)


def test_a_rewrite_the_memory_model_says_peaks_higher_runs_as_written(monkeypatch):
    """Never worse: where the model predicts the rewritten graph to peak above the graph as
    written, the graph runs as written, and the record says why; `never_worse=False` keeps it."""
    from graphpass import memory

    real = memory.estimate_rewrite

    def worse(result):
        estimate = real(result)
        estimate.after.peak_bytes = 2 * estimate.before.peak_bytes + (2 << 20)
        return estimate

    monkeypatch.setattr(memory, "estimate_rewrite", worse)
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    _check_parity(logprob_entropy, backend, 7)
    record = backend.records[0]
    assert record.sites == [] and "above the graph as written" in record.fallback_reason

    torch.compiler.reset()
    keep = graphpass.Backend(chunk_size=4, inner="aot_eager", never_worse=False)
    _check_parity(logprob_entropy, keep, 7)
    assert keep.records[0].sites and keep.records[0].fallback_reason is None


def test_out_of_range_token_id_raises_clear_error():
    logits, tokens = _inputs(6)
    tokens[3] = V + 5
    compiled = torch.compile(logprob_entropy, backend=graphpass.Backend(chunk_size=4, inner="aot_eager"))
    with pytest.raises(IndexError, match=r"token id 42 is outside the vocabulary \[0, 37\)"):
        compiled(logits, tokens)


def test_cross_entropy_ignore_index_is_not_an_error():
    def loss(logits, tokens):
        return (-(-F.cross_entropy(logits, tokens, reduction="none")).mean(),)

    logits, tokens = _inputs(8)
    tokens[2] = -100
    ref_logits = logits.detach().clone().requires_grad_()
    backend = graphpass.Backend(chunk_size=3, inner="aot_eager")
    out = torch.compile(loss, backend=backend)(logits, tokens)[0]
    ref = loss(ref_logits, tokens)[0]
    out.backward()
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    assert len(backend.records[0].sites) == 1


def test_ten_sequence_lengths_cost_at_most_two_compilations():
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    compiled = torch.compile(logprob_entropy, backend=backend)
    for rows in range(5, 15):
        logits, tokens = _inputs(rows, seed=rows)
        ref_logits = logits.detach().clone().requires_grad_()
        out = compiled(logits, tokens)[0]
        ref = logprob_entropy(ref_logits, tokens)[0]
        out.backward()
        ref.backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(logits.grad, ref_logits.grad)
    assert len(backend.records) <= 2
    assert all(len(r.sites) == 1 for r in backend.records)


def test_runtime_temperature_is_applied_exactly_without_a_recompile_per_value():
    backend = graphpass.Backend(chunk_size=4, inner="aot_eager")
    compiled = torch.compile(logprob_entropy, backend=backend)
    for temperature in (0.7, 0.5, 1.3, 0.9):
        logits, tokens = _inputs(9)
        ref_logits = logits.detach().clone().requires_grad_()
        out = compiled(logits, tokens, temperature=temperature)
        ref = logprob_entropy(ref_logits, tokens, temperature=temperature)
        out[0].backward()
        ref[0].backward()
        torch.testing.assert_close(out[1], ref[1])
        torch.testing.assert_close(logits.grad, ref_logits.grad)
    # As with any backend: the first value is baked in, the second makes it a graph input.
    assert len(backend.records) == 2
    assert all(len(r.sites) == 1 for r in backend.records)


@pytest.mark.parametrize("options, message", [
    ({"inner": "tvm"}, "inner must be one of inductor, aot_eager, eager"),
    ({"chunk_size": 0}, "chunk_size must be a positive int"),
    ({"chunk_size": True}, "chunk_size must be a positive int"),
    ({"chunk_budget_bytes": False}, "chunk_budget_bytes must be a positive int"),
    ({"disable_passes": "tag_grad_flow_pass"}, "must be a tuple of pass names"),
])
def test_config_rejects_bad_options(options, message):
    with pytest.raises(ValueError, match=message) as info:
        graphpass.Backend(**options)
    assert "\n" not in str(info.value)


def test_an_unknown_option_names_the_valid_ones():
    with pytest.raises(TypeError) as info:
        graphpass.Backend(chunk_sise=512)
    message = str(info.value)
    assert "unknown option 'chunk_sise'" in message and "chunk_size" in message and "\n" not in message


def test_disabling_the_rewrite_pass_runs_the_graph_unchanged():
    backend = graphpass.Backend(inner="aot_eager", disable_passes=("chunk_rowwise_regions_pass",))
    _check_parity(logprob_entropy, backend, 5)
    assert backend.records[0].sites == []
    assert backend.records[0].passes_run == ["sink_row_slices_pass", "replace_hand_written_functions_pass",
                                             "replace_vocab_parallel_functions_pass", "index_rows_as_gather_pass",
                                             "fold_row_loops_pass", "expose_row_reductions_pass", "read_sliced_rows_whole_pass",
                                             "tag_grad_flow_pass", "localize_cp_reductions_pass"]


@pytest.mark.parametrize("inner", ["inductor", "eager"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize("loss", [
    lambda x, t: -torch.log_softmax(x, -1).gather(-1, t[:, None]).sum(),
    lambda x, t: torch.nn.functional.cross_entropy(x, t),
    lambda x, t: -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(),
], ids=["log_softmax", "cross_entropy", "entropy"])
def test_non_float_logits_raise_as_eager_does(loss, dtype, inner):
    """Inductor computes a softmax of integers; eager refuses it, and so does graphpass."""
    logits = torch.randint(0, 2 if dtype == torch.bool else 5, (16, 32)).to(dtype)
    targets = torch.randint(0, 32, (16,))
    with pytest.raises(Exception) as eager:
        loss(logits, targets)
    backend = graphpass.Backend(inner=inner)
    with pytest.raises(Exception) as compiled:
        torch.compile(loss, backend=backend)(logits, targets)
    assert backend.records or dtype == torch.bool  # Dynamo itself refuses bool logits, before any backend
    if backend.records:
        assert type(compiled.value) is type(eager.value) and str(compiled.value) == str(eager.value)
        assert "eager raises" in backend.records[0].fallback_reason
