"""Unit tests of `chunk_rowwise_regions_pass` on tiny captured graphs: one chunked op per region."""

from __future__ import annotations

import torch

import graphpass.ops.chunked_op  # noqa: F401  (registers torch.ops.graphpass)
from graphpass.config import Config
from graphpass.passes.chunk_rowwise_regions import chunk_rowwise_regions_pass
from tests.helpers import run_passes

aten = torch.ops.aten
T, V = 7, 11


def rewritten(fn, *args):
    """(graph after the pass, its placeholders, the record) for `fn`'s captured ATen graph; the
    graph's code before the pass is kept as `gm.code_before`."""
    after = run_passes(fn, *args, passes=[chunk_rowwise_regions_pass], config=Config(chunk_size=3, inner="eager"))
    after.gm.code_before = after.code_before
    return after.gm, [n for n in after.gm.graph.nodes if n.op == "placeholder"], after.record


def chunked_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.graphpass.rowwise_chunked.default]


def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(T, V, generator=g, requires_grad=True), torch.randint(0, V, (T,), generator=g)


def logprob_entropy(logits, tokens):
    logp_all = torch.log_softmax(logits.float() / 0.7, -1)
    logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return ((logp * 2.0 + entropy).sum(),)


def test_region_becomes_one_chunked_op_with_the_same_result():
    logits, tokens = inputs()
    gm, placeholders, record = rewritten(logprob_entropy, logits, tokens)
    (op,) = chunked_nodes(gm)
    key, tensors, _sizes = op.args
    # It reads the logits themselves and the token ids (as indexed, `tokens[:, None]`), nothing else.
    assert len(tensors) == 2 and tensors[0] is placeholders[0]
    assert tensors[1] is placeholders[1] or tensors[1].all_input_nodes == [placeholders[1]]
    assert "log_softmax" in gm.code_before and "log_softmax" not in gm.code and "gather" not in gm.code
    (site,) = record.sites
    assert site.program_key == key and site.shape == (T, V) and site.chunk_size == 3
    assert sorted(o.kind for o in site.outputs) == ["entropy", "logprob"]

    (loss,) = gm(logits, tokens)
    (ref,) = logprob_entropy(logits, tokens)
    torch.testing.assert_close(loss, ref)
    (grad,) = torch.autograd.grad(loss, logits)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(grad, ref_grad)


def test_softmax_across_rows_is_not_rewritten():
    def over_rows(logits, tokens):
        logp_all = torch.log_softmax(logits, 0)  # normalised over the rows: not row-local
        return (logp_all.gather(-1, tokens[:, None]).sum(),)

    logits, tokens = inputs()
    gm, _, record = rewritten(over_rows, logits, tokens)
    assert chunked_nodes(gm) == [] and record.sites == []
    assert gm.code == gm.code_before


