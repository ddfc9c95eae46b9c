"""Vocab-parallel Functions that multiply by the output layer themselves, on 1 and 2 gloo ranks.

`_HiddenToLogprobs` is shaped like NeMo-RL's `ChunkedDistributedHiddenStatesToLogprobs`: it takes
this rank's hidden states `[s/tp, b, h]` (sequence parallel: it all-gathers their rows into a list,
and its backward reduce-scatters their gradient from a list, which Dynamo traces through
graphpass's stand-in for `dist.reduce_scatter`) or all of them (`replicated`: its backward
all-reduces their gradient), and loops over chunks of sequence positions: `hidden @ W_shard.T`,
transposed to `[b, s, v/tp]`, a log-softmax with its max and sum all-reduced, the target's entry
(zero where another rank owns it), all-reduced. Compiled with graphpass it becomes the product
and one vocab-parallel lm_head op (`site.lm_head`), checked against eager and against one device
in float64: values, the hidden states' and the weight's gradients, and the collectives each
rank issued (the same on every rank). Twins that get one thing wrong (a rank-local max; a
backward that does not reduce-scatter the gradient of the rows it gathered) stay as they are,
with the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphpass
from graphpass import _torch_api
from graphpass.ops.groups import ALL_GATHER
from bench.harness.ranks import collectives
from tests import spawned
from tests.helpers import mixed_error

pytestmark = pytest.mark.heavy  # a minute or more: xdist starts it early (tests/conftest.py)

LOCAL_ROWS, BATCH, HIDDEN, VOCAB, CHUNK = 5, 2, 16, 48, 4  # a last chunk shorter than the others
TEMPLATE = torch.linspace(0.5, 1.5, 64, dtype=torch.float64)  # per-position loss weights


def _log_softmax(logits, group, flaw):
    row_max = logits.amax(-1, keepdim=True)
    if flaw != "rank-local max":
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max
    sum_exp = shifted.exp().sum(-1, keepdim=True)
    dist.all_reduce(sum_exp, group=group)
    return shifted - sum_exp.log()


def _all_rows(hidden, group, layout):
    size = dist.get_world_size(group)
    if layout != "sequence parallel" or size == 1:
        return hidden
    parts = [torch.zeros_like(hidden) for _ in range(size)]
    dist.all_gather(parts, hidden, group=group)
    return torch.cat(parts, 0)


class _HiddenToLogprobs(torch.autograd.Function):
    """Log-probs `[b, s]` of `target` under `(hidden @ weight.T)` (this rank's vocabulary columns
    `first:end`), chunk by chunk over the sequence; `layout` and `flaw` as the module says."""

    @staticmethod
    def forward(ctx, hidden, target, weight, first, end, group, layout, flaw):
        elsewhere = (target < first) | (target >= end)
        local = target - first
        local[elsewhere] = 0
        rows = _all_rows(hidden, group, layout)
        pieces = []
        for start in range(0, rows.shape[0], CHUNK):
            stop = min(rows.shape[0], start + CHUNK)
            logits = torch.matmul(rows[start:stop], weight.T).float().transpose(0, 1).contiguous()
            logp = _log_softmax(logits, group, flaw).gather(-1, local[:, start:stop, None]).squeeze(-1)
            logp[elsewhere[:, start:stop]] = 0.0
            pieces.append(logp)
        out = torch.cat(pieces, 1)
        dist.all_reduce(out, group=group)
        ctx.save_for_backward(hidden, elsewhere, local, weight)
        ctx.group, ctx.layout, ctx.flaw = group, layout, flaw
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, elsewhere, local, weight = ctx.saved_tensors
        rows = _all_rows(hidden, ctx.group, ctx.layout)
        d_rows, d_weight = [], torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, rows.shape[0], CHUNK):
            stop = min(rows.shape[0], start + CHUNK)
            logits = torch.matmul(rows[start:stop], weight.T).float().transpose(0, 1).contiguous()
            softmax = _log_softmax(logits, ctx.group, "none").exp()
            chosen = (~elsewhere[:, start:stop, None]) * torch.nn.functional.one_hot(local[:, start:stop],
                                                                                  weight.shape[0])
            d_logits = (chosen.float() - softmax) * grad[:, start:stop, None]
            d_rows.append(torch.matmul(d_logits, weight.float()))
            d_weight += torch.einsum("bsh,bsv->vh", rows[start:stop].transpose(0, 1).float(), d_logits)
        d_rows = torch.cat(d_rows, 1).transpose(0, 1).contiguous()
        size = dist.get_world_size(ctx.group)
        if ctx.layout == "replicated":
            dist.all_reduce(d_rows, group=ctx.group)
        elif size > 1 and ctx.flaw == "unreduced hidden gradient":
            d_rows = d_rows.chunk(size)[dist.get_rank(ctx.group)].contiguous()
        elif size > 1:
            mine = torch.empty_like(d_rows[:hidden.shape[0]])
            dist.reduce_scatter(mine, list(d_rows.chunk(size)), group=ctx.group)
            d_rows = mine
        return d_rows, None, d_weight, None, None, None, None, None


def _loss(hidden, target, weight, first, end, group, layout, flaw):
    logp = _HiddenToLogprobs.apply(hidden, target, weight, first, end, group, layout, flaw)
    return -(logp * TEMPLATE[:logp.shape[1]].to(logp.dtype)).sum()


def _case(rank, world, layout, flaw, dtype):
    g = torch.Generator().manual_seed(0)
    seq, width = LOCAL_ROWS * world, VOCAB // world
    full_hidden = torch.randn(seq, BATCH, HIDDEN, generator=g, dtype=torch.float64)
    full_weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.3
    target = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    mine = slice(rank * LOCAL_ROWS, (rank + 1) * LOCAL_ROWS) if layout == "sequence parallel" else slice(None)
    cols = slice(rank * width, (rank + 1) * width)
    args = (target, rank * width, (rank + 1) * width, dist.group.WORLD, layout, flaw)

    def leaves():
        return (full_hidden[mine].to(dtype).requires_grad_(), full_weight[cols].to(dtype).requires_grad_())

    eager_h, eager_w = leaves()
    eager = _loss(eager_h, args[0], eager_w, *args[1:])
    eager.backward()
    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")
    h, w = leaves()
    with collectives() as forward_log:
        value = torch.compile(_loss, backend=backend)(h, args[0], w, *args[1:])
    with collectives() as backward_log:
        value.backward()

    ref_h, ref_w = full_hidden.clone().requires_grad_(), full_weight.clone().requires_grad_()
    logp = (ref_h @ ref_w.T).transpose(0, 1).log_softmax(-1).gather(-1, target[..., None])[..., 0]
    ref = -(logp * TEMPLATE[:seq]).sum()
    ref.backward()
    record = backend.records[0]
    return dict(
        value_vs_eager=mixed_error(value, eager), value_vs_ref=mixed_error(value, ref), eager_vs_ref=mixed_error(eager, ref),
        grads_vs_eager=max(mixed_error(h.grad, eager_h.grad), mixed_error(w.grad, eager_w.grad)),
        grads_vs_ref=max(mixed_error(h.grad, ref_h.grad[mine]), mixed_error(w.grad, ref_w.grad[cols])),
        eager_grads_vs_ref=max(mixed_error(eager_h.grad, ref_h.grad[mine]), mixed_error(eager_w.grad, ref_w.grad[cols])),
        sites=[(s.kind, s.tp_size, s.lm_head) for s in record.sites],
        rejected=[r.reason for r in record.rejected], fallback=record.fallback_reason, warnings=record.warnings,
        forward_log=forward_log, backward_log=backward_log)


CASES = [
    ("sequence parallel", "none", torch.float32),
    ("sequence parallel", "none", torch.bfloat16),
    ("replicated", "none", torch.float32),
    ("sequence parallel", "rank-local max", torch.float32),
    ("sequence parallel", "unreduced hidden gradient", torch.float32),
]
KEPT_BECAUSE = {"rank-local max": "its math on those logits is not read",
                "unreduced hidden gradient": "does not reduce-scatter the gradient of the hidden states it gathered"}


def _spawned(world):
    """Per rank, every case's results on `world` ranks."""
    return [results["cases"] for results in _SPAWNS[world]()]


@pytest.mark.parametrize("world", [1, 2])
def test_lm_head_function_becomes_the_product_and_one_fused_op(world):
    """docs/frameworks/nemo-rl.md's recipe: NeMo-RL's loss code over its hidden-states Function, compiled."""
    per_rank = _spawned(world)
    for index, (layout, flaw, dtype) in enumerate(CASES):
        if flaw != "none":
            continue
        for rank, results in enumerate(per_rank):
            r = results[index]
            where = (layout, str(dtype), rank, r)
            assert r["fallback"] is None and not r["rejected"], where
            assert r["sites"] == [("logprob", world, True)], where
            if dtype == torch.float32:
                assert r["value_vs_ref"] <= 1e-5 and r["grads_vs_ref"] <= 1e-5, where
                assert r["value_vs_eager"] <= 1e-5 and r["grads_vs_eager"] <= 1e-5, where
            else:  # bf16: graphpass rounds where eager's fp32 math does not; both near float64
                assert r["value_vs_ref"] <= 2 * r["eager_vs_ref"] + 1e-2, where
                assert r["grads_vs_ref"] <= 2 * r["eager_grads_vs_ref"] + 2e-2, where
    for index in range(len(CASES)):  # every rank issues the same collectives
        assert all(results[index]["forward_log"] == per_rank[0][index]["forward_log"] for results in per_rank)
        assert all(results[index]["backward_log"] == per_rank[0][index]["backward_log"] for results in per_rank)


@pytest.mark.parametrize("flaw", ["rank-local max", "unreduced hidden gradient"])
def test_a_function_that_differs_stays_as_it_is(flaw):
    per_rank = _spawned(2)
    index = next(i for i, case in enumerate(CASES) if case[1] == flaw)
    for rank, results in enumerate(per_rank):
        r = results[index]
        assert r["sites"] == [] and r["fallback"] is None, (flaw, rank, r)
        assert any(KEPT_BECAUSE[flaw] in reason for reason in r["rejected"]), (flaw, rank, r["rejected"])
        assert r["value_vs_eager"] == 0.0, (flaw, rank, r)
        # torch 2.11's Dynamo loses the gradient of a Function that all-reduces its output in place:
        # there graphpass gives what torch's compile gives, and warns.
        assert r["grads_vs_eager"] == 0.0 or (_torch_api.dynamo_loses_gradients_of_written_function_outputs()
            and any("Dynamo loses gradients" in w for w in r["warnings"])), (flaw, rank, r)


def _differing_ranks(rank, world):
    """On rank 0 the inputs require grad; on rank 1 nothing does, so Dynamo inlines the Function's
    forward there. (Neither calls backward: a sequence-parallel backward reduce-scatters, on every
    rank or on none, as the Function's own does.)"""
    g = torch.Generator().manual_seed(1)
    seq, width = LOCAL_ROWS * world, VOCAB // world
    full_hidden = torch.randn(seq, BATCH, HIDDEN, generator=g)
    full_weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.3
    target = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    hidden = full_hidden[rank * LOCAL_ROWS:(rank + 1) * LOCAL_ROWS].clone().requires_grad_(rank == 0)
    weight = full_weight[rank * width:(rank + 1) * width].clone().requires_grad_(rank == 0)
    backend = graphpass.Backend(inner="aot_eager")
    args = (rank * width, (rank + 1) * width, dist.group.WORLD, "sequence parallel", "none")
    with collectives() as log:
        value = torch.compile(_loss, backend=backend)(hidden, target, weight, *args)
    logp = (full_hidden.double() @ full_weight.double().T).transpose(0, 1).log_softmax(-1)
    ref = -(logp.gather(-1, target[..., None])[..., 0] * TEMPLATE[:seq]).sum()
    return log, mixed_error(value, ref), [(s.kind, s.lm_head) for r in backend.records for s in r.sites]


def test_ranks_differing_in_grad_mode_issue_the_same_collectives():
    per_rank = [results["differing"] for results in _SPAWNS[2]()]
    logs = [log for log, _, _ in per_rank]
    assert all(log == logs[0] for log in logs) and [c[0] for c in logs[0]] == [ALL_GATHER], logs
    for _, err, sites in per_rank:
        assert err < 1e-5 and sites == [("logprob", True)], (err, sites)


# ---- one spawn per group size --------------------------------------------------------------------
def _on_ranks(rank, world):
    """Every test's work on `world` ranks: the cases, and at 2 ranks ranks that differ."""
    out = dict(cases=[_case(rank, world, *case) for case in CASES])
    if world == 2:
        out["differing"] = spawned.part(_differing_ranks, rank, world)
    return out


_SPAWNS = {world: spawned.once(_on_ranks, world, 300) for world in (1, 2)}
