"""Differential tests of the CP rewrite on programs nobody wrote by hand.

A program unshards one or two local per-token values (a log-prob, a log-sum-exp), runs a random
chain of row-wise ops with the rollout's replicated per-token tensors, reduces with random
reductions over tokens (sum, mean, per-sequence index_add / scatter_add, a loop over `split` by
sequence, a slice of the rows, or `[B, S]` views of equal-length sequences), sometimes reads the
per-sequence sums back per token for a second level (as GSPO and OPSM do), and sometimes ends in
an op that needs every row. Compiled with graphpass it must equal eager, value and gradient, and
be rewritten exactly when no such op is present. Hypothesis draws programs on one process (a
group of one, with the zigzag layout's padding rows); a seeded sample of them runs on 2 ranks
against one device in float64.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphpass
from bench.workloads import cp_losses
from bench.harness.ranks import run_ranks
from graphpass import cp

pytestmark = pytest.mark.heavy  # a minute or more: xdist starts it early (tests/conftest.py)

ROW_OPS = ("exp_ratio", "times_adv", "clamp", "where_mask", "square", "neg", "plus_second", "pair_sum", "over_len",
           "detach_mix")
REDUCTIONS = ("sum", "mean", "index_add", "scatter_add", "masked_mean", "sum_dtype", "split_means", "slice_sum")
BREAKERS = (None, "cumsum", "flip", "shift", "returned")
#: A second level of reductions over per-sequence sums read back per token; "with grad" keeps the
#: unshard (each rank would get only its rows' share of the gradient through the sums).
SECOND_LEVELS = (None, "detached", "with grad")


def rewritten(program) -> bool:
    """Whether graphpass must rewrite the program (else keep its unshard)."""
    return program[3] is None and program[2] != "with grad"


def _row_op(op, v, second, d):
    if op == "exp_ratio":
        return torch.exp((v - d["old_logp"]).clamp(-5, 5))
    if op == "times_adv":
        return v * d["adv"]
    if op == "clamp":
        return v.clamp(-2.0, 1.5)
    if op == "where_mask":
        return torch.where(d["mask"] > 0, v, 0.5 * v)
    if op == "square":
        return v * v
    if op == "neg":
        return -v
    if op == "plus_second":
        return v + 0.3 * second
    if op == "pair_sum":  # [T] -> [T, 2] -> [T]: views and a reduction over another dim
        return (v.unsqueeze(-1).expand(-1, 2) * torch.tensor([0.25, -1.5], dtype=v.dtype)).sum(-1)
    if op == "over_len":
        return v / (1 + d["seq_ids"].to(v.dtype))
    return v - v.detach() + 0.5 * v.detach()  # "detach_mix"


def _reduce(kind, v, d):
    if kind == "sum":
        return v.sum()
    if kind == "mean":
        return v.mean()
    if kind == "index_add":
        return d["seq_zeros"].index_add(0, d["seq_ids"], v * d["mask"])
    if kind == "scatter_add":
        return d["seq_zeros"].scatter_add(0, d["seq_ids"], v)
    if kind == "masked_mean":
        return (v * d["mask"]).sum() / d["mask"].sum().clamp_min(1)
    if kind == "split_means":  # slime's per-sample mean: a loop over split by sequence lengths
        return sum((x * m).sum() / m.sum().clamp_min(1) for x, m in zip(v.split(d["lens"]), d["mask"].split(d["lens"])))
    if kind == "slice_sum":
        return (v[2:-1] * d["mask"][1:-2]).sum()
    return v.sum(dtype=torch.float64)  # "sum_dtype"


def build(program, lens):
    """The loss function of a program: (row ops, reductions, second level?, breaker)."""
    ops, reductions, second_level, breaker = program

    def loss(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
        d = dict(old_logp=old_logp, adv=adv, mask=mask, seq_ids=seq_ids, seq_zeros=seq_zeros, lens=lens)
        local_lp = cp_losses.token_logprobs(local_logits, layout.shifted_targets(tokens))
        v = layout.unshard(local_lp)
        second = layout.unshard(local_logits.logsumexp(-1))
        for op in ops:
            v = _row_op(op, v, second, d)
        total = sum(_reduce(kind, v, d).sum() for kind in reductions)
        if second_level:  # per-sequence values read back per token (as GSPO, OPSM do), reduced again
            per_seq = seq_zeros.index_add(0, seq_ids, v * mask).tanh()
            if second_level == "detached":
                per_seq = per_seq.detach()
            total = total + (v * per_seq[seq_ids]).mean()
        if breaker == "cumsum":
            total = total + v.cumsum(0)[-1]
        elif breaker == "flip":
            total = total + (v.flip(0) * mask).sum()
        elif breaker == "shift":
            total = total + (v[1:] * v[:-1]).sum()
        elif breaker == "returned":
            return total, v
        return total

    return loss


programs = st.tuples(st.lists(st.sampled_from(ROW_OPS), min_size=1, max_size=5),
                     st.lists(st.sampled_from(REDUCTIONS), min_size=1, max_size=3),
                     st.sampled_from(SECOND_LEVELS), st.sampled_from(BREAKERS))

ARGS = ("tokens", "old_logp", "adv", "mask", "seq_ids", "seq_zeros")


def _check_one_process(program, lens, seed):
    data = cp_losses.rollout(lens, 6, seed=seed)
    layout = cp.Layout.zigzag(None, lens)
    fn = build(program, lens)
    results = []
    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")
    for f in (torch.compile(fn, backend=backend), fn):
        local = layout.shard(data["logits"]).requires_grad_()
        value = f(layout, local, *(data[k] for k in ARGS))
        loss = value[0] if isinstance(value, tuple) else value
        loss.backward()
        results.append((loss.detach(), local.grad))
    (value, grad), (ref, ref_grad) = results
    torch.testing.assert_close(value, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)
    [record] = backend.records
    assert record.fallback_reason is None, record.fallback_reason
    [cp_record] = record.cp
    assert cp_record.rewritten == rewritten(program), (program, cp_record)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(program=programs, lens=st.lists(st.integers(1, 9), min_size=1, max_size=5), seed=st.integers(0, 100))
def test_random_programs_equal_eager_on_one_process(program, lens, seed):
    _check_one_process(program, lens, seed)


# ---- the same on two ranks, against one device ----------------------------------------------------------
def _sample(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        out.append(([rng.choice(ROW_OPS) for _ in range(rng.randint(1, 5))],
                    [rng.choice(REDUCTIONS) for _ in range(rng.randint(1, 3))],
                    rng.choice((None, None, "detached", "detached", "with grad")),
                    None if rng.random() < 0.7 else rng.choice(BREAKERS[1:])))
    return out


PROGRAMS = _sample(12)
LENS = [7, 2, 11, 4]


class _OneDevice:
    """The program on one device: the whole logits, no layout."""

    def __init__(self, lens=LENS):
        self.lens = lens

    def shifted_targets(self, tokens):
        return cp_losses.shifted_targets(tokens, self.lens)

    def unshard(self, y):
        return y


PER_SEQUENCE = [(["exp_ratio", "times_seq_adv", "clip", "times_mask"], ["per_sequence_mean", "token_mean"]),
                (["minus_col", "times_mask"], ["per_position_mean", "per_sequence_sum", "all_sum"])]


def _on_ranks(rank, world, programs):
    import torch.distributed as dist

    out = _per_sequence_on_ranks()
    data = cp_losses.rollout(LENS, 6, seed=5)
    for kind in ("zigzag", "allgather"):
        layout = getattr(cp.Layout, kind)(dist.group.WORLD, LENS)
        for program in programs:
            fn = build(program, LENS)
            full = data["logits"].clone().requires_grad_()
            ref = fn(_OneDevice(), full, *(data[k] for k in ARGS))
            ref = ref[0] if isinstance(ref, tuple) else ref
            ref.backward()
            torch._dynamo.reset()
            backend = graphpass.Backend(inner="aot_eager")
            local = layout.shard(data["logits"]).requires_grad_()
            value = torch.compile(fn, backend=backend)(layout, local, *(data[k] for k in ARGS))
            value = value[0] if isinstance(value, tuple) else value
            value.backward()
            out.append(dict(program=program, kind=kind, loss=(value - ref).abs().item(),
                            grad=(local.grad - layout.shard(full.grad)).abs().max().item(),
                            rewritten=[c.rewritten for r in backend.records for c in r.cp], expected=rewritten(program)))
    return out


# ---- the per-sequence form: [B, S] views of equal-length sequences (TRL's and verl's losses) --------
SEQ_OPS = ("times_seq_adv", "minus_col", "times_mask", "exp_ratio", "clip")
SEQ_REDUCTIONS = ("per_sequence_mean", "per_sequence_sum", "per_position_mean", "all_sum", "token_mean")


def build_per_sequence(program, B, S):
    ops, reductions = program

    def loss(layout, local_logits, tokens, old_logp, adv, mask, seq_ids, seq_zeros):
        v = layout.unshard(cp_losses.token_logprobs(local_logits, layout.shifted_targets(tokens))).view(B, S)
        old, m, seq_adv = old_logp.view(B, S), mask.view(B, S), adv.view(B, S)[:, :1]  # [B, 1]
        position = torch.linspace(-1, 1, S, dtype=v.dtype)  # [S]
        for op in ops:
            if op == "times_seq_adv":
                v = v * seq_adv
            elif op == "minus_col":
                v = v - position
            elif op == "times_mask":
                v = v * m
            elif op == "exp_ratio":
                v = torch.exp((v - old).clamp(-5, 5))
            else:
                v = torch.min(v, v.clamp(-0.5, 0.5) * 1.5)
        total = 0
        for kind in reductions:
            if kind == "per_sequence_mean":
                total = total + ((v * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
            elif kind == "per_sequence_sum":
                total = total + v.sum(dim=1, keepdim=True).square().sum()
            elif kind == "per_position_mean":
                total = total + (v.mean(0) * position).sum()
            elif kind == "all_sum":
                total = total + v.sum(dim=(0, 1))
            else:
                total = total + (v * m).sum() / m.sum().clamp(min=1)
        return total

    return loss


per_sequence_programs = st.tuples(st.lists(st.sampled_from(SEQ_OPS), min_size=1, max_size=4),
                                  st.lists(st.sampled_from(SEQ_REDUCTIONS), min_size=1, max_size=3))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(program=per_sequence_programs, B=st.integers(1, 4), S=st.integers(2, 7), seed=st.integers(0, 100))
def test_random_per_sequence_programs_equal_eager_on_one_process(program, B, S, seed):
    lens = [S] * B
    data = cp_losses.rollout(lens, 6, seed=seed)
    layout = cp.Layout.zigzag(None, lens)
    fn = build_per_sequence(program, B, S)
    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")
    results = []
    for f in (torch.compile(fn, backend=backend), fn):
        local = layout.shard(data["logits"]).requires_grad_()
        loss = f(layout, local, *(data[k] for k in ARGS))
        loss.backward()
        results.append((loss.detach(), local.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-10, atol=1e-10)
    [record] = backend.records
    assert record.fallback_reason is None and record.cp[0].rewritten, record.cp


def _per_sequence_on_ranks(B=3, S=7):
    import torch.distributed as dist

    lens = [S] * B
    data = cp_losses.rollout(lens, 6, seed=6)
    out = []
    for kind in ("zigzag", "contiguous"):
        layout = getattr(cp.Layout, kind)(dist.group.WORLD, lens)
        for program in PER_SEQUENCE:
            fn = build_per_sequence(program, B, S)
            full = data["logits"].clone().requires_grad_()
            ref = fn(_OneDevice(lens), full, *(data[k] for k in ARGS))
            ref.backward()
            torch._dynamo.reset()
            backend = graphpass.Backend(inner="aot_eager")
            local = layout.shard(data["logits"]).requires_grad_()
            value = torch.compile(fn, backend=backend)(layout, local, *(data[k] for k in ARGS))
            value.backward()
            out.append(dict(program=program, kind=kind, loss=(value - ref).abs().item(),
                            grad=(local.grad - layout.shard(full.grad)).abs().max().item(),
                            rewritten=[c.rewritten for r in backend.records for c in r.cp], expected=True))
    return out


def test_random_programs_on_two_ranks_match_one_device():
    per_rank = run_ranks(_on_ranks, 2, args=(PROGRAMS,), timeout_s=400)
    for rank, results in enumerate(per_rank):
        for r in results:
            assert r["loss"] <= 1e-10 * 10 and r["grad"] <= 1e-10, (rank, r)
            assert r["rewritten"] == [r["expected"]], (rank, r)
