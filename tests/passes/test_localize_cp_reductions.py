"""localize_cp_reductions_pass on one process: a CP layout over a group of one.

A group of one still has padding rows (the zigzag layout pads each sequence to a multiple of 2),
so the local reductions must leave them out exactly as across ranks; the multi-process parity is
in tests/context_parallel/test_cp.py. Every case compares the value and every input's gradient with eager.
"""

from __future__ import annotations

import pytest
import torch

import graphpass
from bench.workloads import cp_losses
from graphpass import cp

LENS = [5, 2, 8, 3]  # odd lengths: padding rows in the zigzag layout


def _inputs(seed=0, requires=("local_logits",), lens=LENS):
    data = cp_losses.rollout(lens, 7, seed=seed)
    layout = cp.Layout.zigzag(None, lens)
    data["local_logits"] = layout.shard(data.pop("logits"))
    for name in requires:
        data[name] = data[name].clone().requires_grad_()
    return layout, data


ARGS = ("local_logits", "tokens", "old_logp", "adv", "mask", "seq_ids", "seq_zeros")


def _run(fn, layout, data):
    """fn(layout, *ARGS) compiled with graphpass and eager: (record, compiled, eager, grads each)."""
    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")
    results = []
    for f in (torch.compile(fn, backend=backend), fn):
        inputs = {k: (v.detach().clone().requires_grad_() if v.requires_grad else v) for k, v in data.items()}
        value = f(layout, *(inputs[k] for k in ARGS))
        loss = value[0] if isinstance(value, tuple) else value
        leaves = [k for k in ARGS if inputs[k].requires_grad]
        grads = torch.autograd.grad(loss, [inputs[k] for k in leaves])
        results.append((value, dict(zip(leaves, grads))))
    assert len(backend.records) == 1 and backend.records[0].fallback_reason is None
    return backend.records[0], results[0], results[1]


def _assert_same(compiled, eager):
    (value, grads), (ref, ref_grads) = compiled, eager
    for a, b in zip(torch.utils._pytree.tree_leaves(value), torch.utils._pytree.tree_leaves(ref)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-12, atol=1e-12, msg=k)


EXPECTED = {"ppo_token_mean": (["sum"], 1), "grpo_sample_mean": (["index_add"], 1),
            "gspo": (["index_add"], 1), "opsm": (["index_add", "sum"], 2)}


@pytest.mark.parametrize("name", cp_losses.LOSSES)
def test_rl_losses_reduce_locally_and_sum_once_per_dependency_level(name):
    layout, data = _inputs()
    loss = cp_losses.loss_by_name(name)
    record, compiled, eager = _run(lambda lay, *a: cp_losses.cp_loss(loss, lay, *a), layout, data)
    [cp_record] = record.cp
    assert cp_record.rewritten and cp_record.reason is None, cp_record
    reductions, levels = EXPECTED[name]
    assert cp_record.reductions == reductions
    assert [c.op for c in cp_record.collectives] == ["all_reduce"] * levels
    assert record.collectives == cp_record.collectives
    assert cp_record.source.startswith("cp_losses.py:")  # the user's line, not graphpass/cp.py's
    targets = [n.target for n in record.graph_module.graph.nodes]
    assert torch.ops.graphpass.cp_unshard.default not in targets
    assert targets.count(torch.ops.graphpass.cp_sum_over_ranks.default) == levels
    _assert_same(compiled, eager)


def _logp(layout, local_logits, tokens):
    return layout.unshard(cp_losses.token_logprobs(local_logits, layout.shifted_targets(tokens)))


def _mean_and_views(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    logp = _logp(layout, local_logits, tokens)
    both = layout.unshard(torch.stack([cp_losses.token_logprobs(local_logits, layout.shifted_targets(tokens)),
                                       local_logits.logsumexp(-1)], dim=1))  # [T, 2]
    scaled = (both * mask[:, None]).reshape(-1, 2).unsqueeze(-1).squeeze(-1)
    per_column = scaled.mean(0)  # a mean over the rows of a [T, 2] value
    token_sum = (logp[:, None] * old_logp.unsqueeze(1)).sum(-1)  # a reduction over another dim stays row-wise
    scatter = seq_zeros.scatter_add(0, seq_ids, token_sum * mask)
    scatter = scatter + seq_zeros.scatter_reduce(0, seq_ids, logp, "sum") + seq_zeros.index_put((seq_ids,), logp * 2,
                                                                                             accumulate=True)
    # Unmasked: padding rows (a zero logit row's log-prob is -log V, not 0) must be left out.
    unmasked = logp.exp().sum() + seq_zeros.index_add(0, seq_ids, logp).square().sum()
    return per_column.sum() + (logp * mask).mean() + scatter.sum() + (adv * logp).sum(dtype=torch.float64) + unmasked


def test_means_views_column_reductions_and_sums_by_index_reduce_locally():
    layout, data = _inputs(seed=1)
    record, compiled, eager = _run(_mean_and_views, layout, data)
    [cp_record] = record.cp
    assert cp_record.rewritten, cp_record
    assert sorted(cp_record.reductions) == ["index_add", "index_put", "mean", "mean", "scatter_add", "scatter_reduce",
                                            "sum", "sum"]
    assert len(cp_record.collectives) == 1
    _assert_same(compiled, eager)


def _sample_means_by_split(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    """slime's sum_of_sample_mean, written for one device: a loop over `split` by sequence lengths."""
    logp = _logp(layout, local_logits, tokens)
    pg = torch.exp(logp - old_logp) * -adv
    pieces = zip(pg.split(LENS), mask.split(LENS))
    per_sample = sum((x * m).sum() / m.sum().clamp_min(1) for x, m in pieces)
    # A slice and a narrow of the rows, with replicated operands sliced alike.
    return per_sample + (logp[3:-2] * mask[3:-2]).mean() + logp.narrow(0, 4, 6).exp().sum() + (logp[1:] * mask[:-1]).sum()


def test_split_loops_and_slices_of_the_rows_reduce_locally():
    layout, data = _inputs(seed=4)
    record, compiled, eager = _run(_sample_means_by_split, layout, data)
    [cp_record] = record.cp
    assert cp_record.rewritten, cp_record
    assert cp_record.reductions.count("sum") == len(LENS) + 2 and "mean" in cp_record.reductions
    assert len(cp_record.collectives) == 1
    _assert_same(compiled, eager)


B, S = 4, 5  # equal-length sequences for the per-sequence [B, S] form


def _trl_grpo(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    """TRL's GRPO loss on [B, S] views (per-token loss, per-sequence mean, mean over sequences)."""
    logp = _logp(layout, local_logits, tokens).view(B, S)
    old, m, advantages = old_logp.view(B, S), mask.view(B, S), adv.view(B, S)[:, 0]
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
    per_token_loss = -torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
    per_token_loss = per_token_loss + 0.04 * (torch.exp(old - logp) - (old - logp) - 1)
    loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    by_position = (logp * m).mean(0) * torch.arange(S, dtype=logp.dtype)  # [S]: over the sequences
    return loss + by_position.sum() + logp.exp().sum(dim=(0, 1)) + logp.reshape(-1)[2:9].sum()


def test_per_sequence_views_of_equal_length_sequences_reduce_locally():
    layout, data = _inputs(seed=6, lens=[S] * B)
    record, compiled, eager = _run(_trl_grpo, layout, data)
    [cp_record] = record.cp
    assert cp_record.rewritten and cp_record.reductions == ["sum", "mean", "sum", "sum"], cp_record
    assert len(cp_record.collectives) == 1
    _assert_same(compiled, eager)


def _per_sequence_cumsum(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    return (_logp(layout, local_logits, tokens).view(B, S).cumsum(-1) * mask.view(B, S)).sum()


def test_a_per_sequence_view_read_across_tokens_keeps_the_unshard():
    layout, data = _inputs(seed=7, lens=[S] * B)
    record, compiled, eager = _run(_per_sequence_cumsum, layout, data)
    assert not record.cp[0].rewritten and "per-sequence view" in record.cp[0].reason, record.cp
    _assert_same(compiled, eager)


# ---- what must keep the exact unshard ------------------------------------------------------------------
def _returns_logp(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    logp = _logp(layout, local_logits, tokens)
    return ((logp - old_logp) * mask).sum(), logp.detach()


def _cumsum(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    logp = _logp(layout, local_logits, tokens)
    return (logp.cumsum(0) * mask).sum()


def _rows_against_shifted_rows(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    logp = _logp(layout, local_logits, tokens)
    return (logp[1:] * logp[:-1]).sum()  # row g against row g - 1: rows of two ranks


def _max_of_sequence_sums(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    logp = _logp(layout, local_logits, tokens)
    return seq_zeros.index_add(0, seq_ids, logp * mask).max() + (logp * mask).sum()


def _replicated_requires_grad(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    logp = _logp(layout, local_logits, tokens)
    return ((logp - old_logp) ** 2 * mask).sum()


def _learnable_coefficient(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    logp = _logp(layout, local_logits, tokens)
    return (logp * mask * old_logp.new_ones(()).mul(seq_zeros.sum() + 0.5)).sum()


def _sequence_values_with_grad(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    logp = _logp(layout, local_logits, tokens)
    per_seq = seq_zeros.index_add(0, seq_ids, logp * mask)
    return (logp * per_seq[seq_ids]).sum()  # d loss / d per_seq sums over every rank's rows


def _scatter_max(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    logp = _logp(layout, local_logits, tokens)
    return seq_zeros.scatter_reduce(0, seq_ids, logp, "amax").sum()


def _broadcast_against_rows(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
    logp = _logp(layout, local_logits, tokens)
    return (logp[None, :] * mask[:, None]).sum()  # [T, T]: every row against every row


KEPT = [
    (_returns_logp, (), "returned"),
    (_cumsum, (), "cumsum"),
    (_rows_against_shifted_rows, (), "combines rows of different ranges"),
    (_replicated_requires_grad, ("old_logp",), "may carry a gradient"),
    (_learnable_coefficient, ("seq_zeros",), "may carry a gradient"),
    (_sequence_values_with_grad, (), "index.Tensor"),
    (_broadcast_against_rows, (), "unsqueeze"),
    (_scatter_max, (), "another reduction than a sum"),
]


@pytest.mark.parametrize("fn, requires, why", KEPT, ids=[k[0].__name__.strip("_") for k in KEPT])
def test_anything_else_keeps_the_exact_unshard_with_the_reason(fn, requires, why):
    layout, data = _inputs(seed=2, requires=("local_logits", *requires))
    record, compiled, eager = _run(fn, layout, data)
    [cp_record] = record.cp
    assert not cp_record.rewritten and why in cp_record.reason, cp_record
    assert "\n" not in cp_record.reason
    assert [c.op for c in cp_record.collectives] == ["all_gather"]
    assert torch.ops.graphpass.cp_unshard.default in [n.target for n in record.graph_module.graph.nodes]
    _assert_same(compiled, eager)


def test_math_on_the_summed_values_is_replicated_math():
    layout, data = _inputs(seed=3)
    record, compiled, eager = _run(_max_of_sequence_sums, layout, data)
    # The index_add is a per-sequence sum; its max is math on the [N] sums every rank holds.
    [cp_record] = record.cp
    assert cp_record.rewritten, cp_record
    _assert_same(compiled, eager)


def test_a_new_batch_with_other_sequence_lengths_reuses_the_compiled_graph():
    backend = graphpass.Backend(inner="aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(lambda lay, *a: cp_losses.cp_loss(cp_losses.gspo, lay, *a), backend=backend)
    for step, lens in enumerate([[5, 2, 8, 3], [7, 4], [3, 3, 9, 2, 6], [11, 1, 5]]):
        data = cp_losses.rollout(lens, 7, seed=step)
        layout = cp.Layout.zigzag(None, lens)
        local = layout.shard(data.pop("logits")).requires_grad_()
        eager_local = local.detach().clone().requires_grad_()
        value = compiled(layout, local, *(data[k] for k in ARGS[1:]))
        ref = cp_losses.cp_loss(cp_losses.gspo, layout, eager_local, *(data[k] for k in ARGS[1:]))
        value.backward(), ref.backward()
        torch.testing.assert_close(value, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(local.grad, eager_local.grad, rtol=1e-12, atol=1e-12)
    # The first call compiles with static sizes, the second dynamic; later batches reuse it.
    assert len(backend.records) == 2 and all(r.cp and r.cp[0].rewritten for r in backend.records)


def test_the_report_says_how_the_unshards_communicate():
    from graphpass.report import build_graph_report, render_table

    layout, data = _inputs()
    record, _, _ = _run(lambda lay, *a: cp_losses.cp_loss(cp_losses.opsm, lay, *a), layout, data)
    text = render_table(build_graph_report(record, None))
    start = text.index("context parallel")  # one note, wrapped to the report's width
    assert " ".join(text[start:].split()) == (
        f"context parallel ({record.cp[0].source}): reduced on local rows (index_add, sum), per call: "
        "all_reduce 32 B over 1 ranks, all_reduce 8 B over 1 ranks"), text
    kept, _, _ = _run(_cumsum, *_inputs())
    assert "unshard kept (an unsharded value reaches cumsum" in " ".join(render_table(build_graph_report(kept, None)).split())


def test_cp_composes_with_the_lm_head_fusion():
    """hidden @ W.T on the local rows: the lm_head site and the local reductions, both gradients exact."""
    layout, data = _inputs(seed=5)
    hidden = torch.randn(layout.local_row_count, 8, dtype=torch.float64)
    weight = torch.randn(7, 8, dtype=torch.float64)

    def head_and_loss(hidden, weight, *args):
        logits = torch.nn.functional.linear(hidden, weight)
        return cp_losses.cp_loss(cp_losses.gspo, layout, logits, *args)

    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")
    results = []
    for f in (torch.compile(head_and_loss, backend=backend), head_and_loss):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        value = f(h, w, *(data[k] for k in ARGS[1:]))
        results.append((value, dict(zip("hw", torch.autograd.grad(value, [h, w])))))
    [record] = backend.records
    assert [s.lm_head for s in record.sites] == [True] and record.cp[0].rewritten, record
    _assert_same(*results)
