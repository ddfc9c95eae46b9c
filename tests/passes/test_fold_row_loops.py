"""Unit tests of `fold_row_loops_pass`: unrolled row loops become one op over all rows, values
unchanged; loops whose iterations mix rows, leave gaps or differ stay as they are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphpass
from graphpass.passes.fold_row_loops import fold_row_loops_pass
from graphpass.passes.sink_row_slices import sink_row_slices_pass
from tests.helpers import run_passes

aten = torch.ops.aten


def folded(fn, *args):
    """`fn`'s captured graph after slice sinking and the fold, checked against eager."""
    after = run_passes(fn, *args, passes=[sink_row_slices_pass, fold_row_loops_pass])
    gm = after.gm
    # Dynamo orders (and drops unused) graph inputs its own way: match them by shape and dtype.
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    inputs = []
    for fake in after.fakes:
        inputs.append(next(t for t in tensors if t.shape == fake.shape and t.dtype == fake.dtype
                           and not any(t is u for u in inputs)))
    for got, want in zip(gm(*inputs), fn(*args)):
        torch.testing.assert_close(got, want)
    return gm


def count(gm, *targets) -> int:
    return sum(len(gm.graph.find_nodes(op="call_function", target=t)) for t in targets)


def test_stack_of_per_row_logsumexp_is_one_logsumexp():  # verl logprobs_from_logits_v2, TRL fp32
    def fn(logits, labels):
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return (torch.gather(logits, -1, labels[:, None]).squeeze(-1) - lse,)

    gm = folded(fn, torch.randn(6, 11), torch.randint(0, 11, (6,)))
    assert count(gm, aten.logsumexp.default) == 1 and count(gm, aten.stack.default, aten.select.int) == 0


def test_zip_loop_over_rows_and_labels_folds():  # TRL bf16 selective_log_softmax
    def fn(logits, labels):
        rows = [F.log_softmax(lg, -1).gather(-1, lb.unsqueeze(-1)).squeeze(-1) for lg, lb in zip(logits, labels)]
        return (torch.stack(rows),)

    gm = folded(fn, torch.randn(3, 4, 9), torch.randint(0, 9, (3, 4)))
    assert count(gm, aten.log_softmax.int) == 1


def test_split_chunks_with_a_temperature_fold_into_one_scaled_region():  # TRL entropy_from_logits
    def fn(logits):
        parts = [-(F.log_softmax(c, -1).exp() * F.log_softmax(c, -1)).sum(-1) for c in (logits / 0.7).split(3)]
        return (torch.cat(parts),)

    gm = folded(fn, torch.randn(8, 11))
    assert count(gm, aten.div.Tensor) == 1 and count(gm, aten.cat.default, aten.slice.Tensor) == 0


def test_buffer_filled_along_the_sequence_dim_folds():  # SkyRL chunked_entropy_from_logits
    def fn(logits, mask):
        out = torch.zeros(logits.shape[:2])
        for s in range(0, logits.shape[1], 2):
            lp = F.log_softmax(logits[:, s:s + 2], -1)
            out[:, s:s + 2] = -(lp.exp() * lp).sum(-1) * mask[:, s:s + 2]
        return (out,)

    gm = folded(fn, torch.randn(2, 5, 11), torch.rand(2, 5))
    assert count(gm, aten.log_softmax.int) == 1 and count(gm, aten.slice_scatter.default) == 0


def test_loops_over_an_lm_heads_rows_fold_with_the_product():  # SkyRL bf16: both loops read the logits
    """Every reader picks rows of `hidden @ W.T / t`, so `sink_row_slices` moved the picks onto the
    hidden states and each iteration multiplies its own rows: the fold takes the product in, over
    a per-batch-row loop and a buffer filled along the sequence dim, and the two loops' folded
    products and softmaxes are one."""
    def fn(hidden, weight, labels):
        logits = hidden @ weight.T / 0.7
        rows = [F.log_softmax(lg, -1).gather(-1, lb.unsqueeze(-1)).squeeze(-1) for lg, lb in zip(logits, labels)]
        out = torch.zeros(logits.shape[:2])
        for s in range(0, logits.shape[1], 2):
            lp = F.log_softmax(logits[:, s:s + 2], -1)
            out[:, s:s + 2] = -(lp.exp() * lp).sum(-1)
        return torch.stack(rows), out

    gm = folded(fn, torch.randn(2, 5, 4), torch.randn(11, 4), torch.randint(0, 11, (2, 5)))
    assert count(gm, aten.log_softmax.int) == 1 and count(gm, aten.matmul.default) == 1
    assert count(gm, aten.slice_scatter.default, aten.stack.default, aten.select.int) == 0


def test_a_buffer_loop_after_an_in_place_temperature_folds():  # OpenRLHF log_probs_from_logits, fp32
    """After `logits.div_(t)` functionalization re-derives `logits.reshape(-1, V)` for each
    iteration: copies of one view are one `x`, so the buffer's loop folds, and the gather and
    the log-sum-exp read the same logits."""
    def fn(hidden, weight, labels):
        logits = hidden @ weight.T
        logits.div_(0.7)
        picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
        flat = logits.reshape(-1, logits.shape[-1])
        lse = torch.zeros(flat.shape[0])
        for s in range(0, flat.shape[0], 4):
            lse[s:s + 4] = torch.logsumexp(flat[s:s + 4], dim=-1)
        return (picked - lse.view(labels.shape),)

    gm = folded(fn, torch.randn(2, 6, 4), torch.randn(11, 4), torch.randint(0, 11, (2, 6)))
    assert count(gm, aten.logsumexp.default) == 1 and count(gm, aten.matmul.default) == 1
    assert count(gm, aten.slice_scatter.default, aten.cat.default, aten.slice.Tensor) == 0


def test_a_per_row_loop_over_packed_logits_folds_with_the_product():  # verl rmpad, bf16
    """`for row, label in zip(hidden @ W.T, labels)` over packed `[T, V]` logits: each iteration
    multiplies one hidden row, a vector, by the weight; the fold makes it one product."""
    def fn(hidden, weight, labels):
        logits = hidden @ weight.T
        logits.div_(0.7)
        return (torch.stack([F.log_softmax(row, -1).gather(-1, lb.unsqueeze(-1)).squeeze(-1)
                             for row, lb in zip(logits, labels)]),)

    gm = folded(fn, torch.randn(5, 4), torch.randn(11, 4), torch.randint(0, 11, (5,)))
    assert count(gm, aten.log_softmax.int) == 1 and count(gm, aten.matmul.default) == 1
    assert count(gm, aten.stack.default, aten.select.int) == 0


def test_a_product_with_a_weight_that_varies_by_iteration_stays():
    def fn(hidden, weights):
        return (torch.stack([F.log_softmax(h @ w.T, -1) for h, w in zip(hidden, weights)]),)

    gm = folded(fn, torch.randn(3, 5, 4), torch.randn(3, 11, 4))
    assert count(gm, aten.log_softmax.int) == 3


def test_two_buffers_filled_by_one_loop_share_the_folded_softmax():
    def fn(logits, labels):
        logp, ent = torch.empty(logits.shape[0]), torch.empty(logits.shape[0])
        for s in range(0, logits.shape[0], 2):
            lp = F.log_softmax(logits[s:s + 2], -1)
            logp[s:s + 2] = lp.gather(-1, labels[s:s + 2, None]).squeeze(-1)
            ent[s:s + 2] = -(lp.exp() * lp).sum(-1)
        return logp, ent

    gm = folded(fn, torch.randn(6, 7), torch.randint(0, 7, (6,)))
    assert count(gm, aten.log_softmax.int) == 1


def test_cat_of_per_sequence_results_is_a_flattened_stack():
    def fn(logits, labels):
        parts = [F.log_softmax(logits[b], -1).gather(-1, labels[b, :, None]).squeeze(-1) for b in range(3)]
        return (torch.cat(parts).view_as(labels),)

    gm = folded(fn, torch.randn(3, 4, 9), torch.randint(0, 9, (3, 4)))
    assert count(gm, aten.log_softmax.int) == 1 and count(gm, aten.flatten.using_ints) == 1


def test_stack_along_the_sequence_dim_folds():
    def fn(logits):
        return (torch.stack([torch.logsumexp(logits[:, i], -1) for i in range(logits.shape[1])], 1),)

    gm = folded(fn, torch.randn(2, 5, 11))
    assert count(gm, aten.logsumexp.default) == 1


def test_loop_invariant_operand_broadcast_along_the_rows_folds():
    def fn(logits, bias):
        return (torch.cat([F.log_softmax(c + bias, -1) for c in logits.split(2)]),)

    gm = folded(fn, torch.randn(6, 5), torch.randn(5))
    assert count(gm, aten.log_softmax.int) == 1


@pytest.mark.parametrize("case", ["mixes_rows", "gap", "overlap", "differ", "invariant_varies_along_rows",
                                  "reduces_the_loop_dim"])
def test_loops_that_are_not_row_local_stay(case):
    def fn(logits, other):
        if case == "mixes_rows":  # cumsum over the chunk's rows
            return (torch.cat([c.cumsum(0) for c in logits.split(2)]),)
        if case == "gap":  # rows 4..5 keep the buffer's zeros
            out = torch.zeros(6, 5)
            out[0:2], out[2:4] = logits[0:2].exp(), logits[2:4].exp()
            return (out,)
        if case == "overlap":
            out = torch.zeros(6, 5)
            out[0:4], out[2:6] = logits[0:4].exp(), logits[2:6].exp() * 2
            return (out,)
        if case == "differ":  # the second chunk runs another op
            return (torch.cat([logits[0:3].exp(), logits[3:6].sin()]),)
        if case == "invariant_varies_along_rows":  # each chunk meets the same two rows of `other`
            return (torch.cat([c + other[0:2] for c in logits.split(2)]),)
        return (torch.stack([row.sum() for row in logits]),)  # sum over everything: fine per row,
        # but the batched op would need dims the piece never named

    gm = folded(fn, torch.randn(6, 5), torch.randn(6, 5))
    assert count(gm, aten.cat.default, aten.stack.default, aten.slice_scatter.default) >= 1


def test_loop_under_no_grad_read_with_grad_stays():
    def fn(logits):
        with torch.no_grad():
            parts = [c.exp() for c in logits.split(2)]
        return (torch.cat(parts) * logits,)

    gm = folded(fn, torch.randn(6, 5, requires_grad=True))
    assert count(gm, aten.cat.default) == 1


def test_backend_gradients_match_eager_through_a_folded_loop():
    def fn(logits, labels):
        logp = torch.zeros(logits.shape[0])
        for s in range(0, logits.shape[0], 4):
            logp[s:s + 4] = torch.gather(F.log_softmax(logits[s:s + 4] / 0.9, -1), -1, labels[s:s + 4, None]).squeeze(-1)
        return -logp.mean()

    logits, labels = torch.randn(10, 13, requires_grad=True), torch.randint(0, 13, (10,))
    backend = graphpass.Backend(chunk_size=3)
    compiled = torch.compile(fn, backend=backend)
    got = compiled(logits, labels)
    (g_got,) = torch.autograd.grad(got, logits)
    want = fn(logits, labels)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)
    (site,) = backend.records[0].sites
    assert [o.temperature for o in site.outputs] == ["/ 0.9"]  # the division is inside the one region
