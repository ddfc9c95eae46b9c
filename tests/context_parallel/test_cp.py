"""Context parallelism on 2 and 4 gloo ranks: layouts, the four RL losses, eager and compiled.

Every rank holds its rows of the same float64 logits (`graphpass.cp.Layout`); the loss is
`bench.workloads.cp_losses.cp_loss`, written once for one device. Checked per case, on every rank: the loss
and this rank's logits gradient against a single-device float64 run (<= 1e-10), eager and compiled
with graphpass; the CP record (rewritten, the reductions, one all-reduce per dependency level);
the collectives each rank issued (the same on every rank, none in backward; compiled: all-reduces
of the sums only; eager: one all-gather of the local rows). Sequence lengths are uneven and some
are shorter than 2 x cp; one sequence has no response token; a variant gives rank 0 none at all.

One spawn per group size runs every test's work (`_on_ranks`): each spawn costs seconds.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import graphpass
from graphpass.ops.groups import ALL_GATHER
from bench.workloads import cp_losses
from bench.harness.ranks import collectives
from graphpass import cp
from tests import spawned

pytestmark = pytest.mark.heavy  # a minute or more: xdist starts it early (tests/conftest.py)

LENS = {2: [9, 3, 14, 2, 7], 4: [9, 3, 14, 2, 7, 5]}
VOCAB = 11
TOL = 1e-10
ARGS = ("tokens", "old_logp", "adv", "mask", "seq_ids", "seq_zeros")
LEVELS = {"ppo_token_mean": 1, "grpo_sample_mean": 1, "gspo": 1, "opsm": 2}

CASES = {
    2: [(name, kind, "plain") for name in cp_losses.LOSSES for kind in cp.KINDS]
    + [(name, "zigzag", "rank 0 has no response token") for name in cp_losses.LOSSES]
    + [("opsm", "allgather", "inductor")],  # graphpass's default inner compiler (the others: aot_eager)
    4: [(name, "zigzag", "plain") for name in cp_losses.LOSSES]
    + [("ppo_token_mean", "contiguous", "plain"), ("gspo", "allgather", "plain"),
       ("opsm", "zigzag", "rank 0 has no response token")],
}


def _err(a, b) -> float:
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def _inputs(world, kind, variant):
    lens = LENS[world]
    layout = getattr(cp.Layout, kind)(dist.group.WORLD, lens)
    data = cp_losses.rollout(lens, VOCAB, masked_sequences=(1,))
    if variant == "rank 0 has no response token":
        rows = layout.all_rows[0]
        data["mask"][rows[rows >= 0]] = 0
    return layout, data


def _reference(name, data, lens):
    logits = data["logits"].clone().requires_grad_()
    loss = cp_losses.single_device_loss(cp_losses.loss_by_name(name), logits, *(data[k] for k in ARGS), lens)
    loss.backward()
    return loss.detach(), logits.grad


def _case(rank, world, name, kind, variant):
    layout, data = _inputs(world, kind, variant)
    ref, ref_grad = _reference(name, data, LENS[world])
    ref_local = layout.shard(ref_grad)
    fn = functools.partial(cp_losses.cp_loss, cp_losses.loss_by_name(name))
    out = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        backend = graphpass.Backend(inner="inductor" if variant == "inductor" else "aot_eager")
        f = fn if mode == "eager" else torch.compile(fn, backend=backend)
        local = layout.shard(data["logits"]).requires_grad_()
        with collectives() as forward_log:
            loss = f(layout, local, *(data[k] for k in ARGS))
        with collectives() as backward_log:
            loss.backward()
        out[mode] = dict(
            loss=_err(loss, ref), grad=_err(local.grad, ref_local), forward=forward_log, backward=backward_log,
            cp=[(c.rewritten, c.reason, c.reductions, [(x.op, x.group_size, x.bytes) for x in c.collectives])
                for r in backend.records for c in r.cp],
            fallback=[r.fallback_reason for r in backend.records])
    return out


def _spawned(world):
    """Per rank, every case's results for `world` ranks."""
    return [results["cases"] for results in _SPAWNS[world]()]


def _case_id(case):
    return "-".join(case)


@pytest.mark.parametrize("world", [2, 4])
def test_losses_match_one_device_in_float64_eager_and_compiled(world):
    per_rank = _spawned(world)
    for index, case in enumerate(CASES[world]):
        for rank, results in enumerate(per_rank):
            for mode, r in results[index].items():
                where = (_case_id(case), rank, mode, r["loss"], r["grad"])
                assert r["loss"] <= TOL and r["grad"] <= TOL, where


@pytest.mark.parametrize("world", [2, 4])
def test_compiled_losses_reduce_locally_and_all_reduce_only_the_sums(world):
    per_rank = _spawned(world)
    for index, case in enumerate(CASES[world]):
        name = case[0]
        for rank, results in enumerate(per_rank):
            r = results[index]["compiled"]
            where = (_case_id(case), rank, r["cp"], r["fallback"])
            assert r["fallback"] == [None] and len(r["cp"]) == 1, where
            rewritten, reason, reductions, colls = r["cp"][0]
            assert rewritten and reason is None and reductions, where
            assert [c[:2] for c in colls] == [("all_reduce", world)] * LEVELS[name], where
            assert [e[0] for e in r["forward"]] == ["all_reduce"] * LEVELS[name], where
            # The bytes recorded are the bytes sent: num_sequences or 1 float64 values per level.
            assert sum(c[2] for c in colls) == sum(e[1][0][0][0] for e in r["forward"]) * 8, where
            eager = results[index]["eager"]
            assert [e[0] for e in eager["forward"]] == [ALL_GATHER], where


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_issues_the_same_collectives_and_none_in_backward(world):
    per_rank = _spawned(world)
    for index, case in enumerate(CASES[world]):
        for mode in ("eager", "compiled"):
            logs = [(results[index][mode]["forward"], results[index][mode]["backward"]) for results in per_rank]
            assert all(log == logs[0] for log in logs), (_case_id(case), mode, logs)
            assert logs[0][1] == [], (_case_id(case), mode, logs[0][1])


# ---- ranks that differ in grad mode -------------------------------------------------------------------
def _differing_ranks(rank, world, name):
    """Rank 0 trains; rank 1 runs under no_grad on logits that do not require grad; rank 2 under
    no_grad on logits that do; rank 3 requires grad but never calls backward. Rank 1 has no
    response token."""
    layout, data = _inputs(world, "zigzag", "plain")
    rows = layout.all_rows[1]
    data["mask"][rows[rows >= 0]] = 0
    ref, _ = _reference(name, data, LENS[world])
    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")
    compiled = torch.compile(functools.partial(cp_losses.cp_loss, cp_losses.loss_by_name(name)), backend=backend)
    local = layout.shard(data["logits"]).requires_grad_(rank != 1)
    with collectives() as log:
        with torch.set_grad_enabled(rank not in (1, 2)):
            loss = compiled(layout, local, *(data[k] for k in ARGS))
        if rank == 0:
            loss.backward()
    return log, _err(loss, ref), [c.rewritten for r in backend.records for c in r.cp]


DIFFERING = ["grpo_sample_mean", "opsm"]


@pytest.mark.parametrize("name", DIFFERING)
def test_ranks_differing_in_grad_mode_issue_the_same_collectives(name):
    per_rank = [results["differing"][name] for results in _SPAWNS[4]()]
    logs = [log for log, _, _ in per_rank]
    assert all(log == logs[0] for log in logs) and len(logs[0]) == LEVELS[name], logs
    for log, err, rewritten in per_rank:
        assert err <= TOL and rewritten == [True], (err, rewritten)


# ---- TP x CP ------------------------------------------------------------------------------------------
def _tp_cp(rank, world):
    """TP=2 x CP=2 from megatron-core's parallel_state (or new groups without it): this rank holds
    its sequence rows of its vocabulary slice; log-probs from the vocab-parallel op, then unshard."""
    from graphpass.ops import vocab_parallel_logprob_entropy

    tp_group, cp_group, megatron = _groups()
    lens = LENS[2]
    width = 8
    data = cp_losses.rollout(lens, 2 * width, masked_sequences=(1,))
    layout = (cp.Layout.from_megatron("zigzag", lens) if megatron else
              cp.Layout.zigzag(cp_group, lens, tp_group=tp_group))
    tp_rank = dist.get_rank(tp_group)
    ref, ref_grad = _reference("gspo", data, lens)

    def loss_fn(local_logits, *args):
        logp, _ = vocab_parallel_logprob_entropy(local_logits, layout.shifted_targets(args[0]).clamp_min(0), tp_group)
        return cp_losses.gspo(layout.unshard(logp), *args[1:])

    def megatron_loss_fn(local_logits, *args):  # megatron-core's own Function, recognised (fp32 inside)
        from bench.workloads.tp_losses import megatron_logprob

        logp = megatron_logprob(local_logits, layout.shifted_targets(args[0]).clamp_min(0))
        return cp_losses.gspo(layout.unshard(logp.double()), *args[1:])

    out = {}
    for mode in ("eager", "compiled") + (("compiled megatron",) if megatron else ()):
        torch._dynamo.reset()
        backend = graphpass.Backend(inner="aot_eager")
        f = loss_fn if mode == "eager" else torch.compile(megatron_loss_fn if "megatron" in mode else loss_fn,
                                                          backend=backend)
        local = layout.shard(data["logits"])[:, tp_rank * width:(tp_rank + 1) * width].clone().requires_grad_()
        with collectives() as log:
            loss = f(local, *(data[k] for k in ARGS))
            loss.backward()
        expected = layout.shard(ref_grad)[:, tp_rank * width:(tp_rank + 1) * width]
        out[mode] = dict(loss=_err(loss, ref), grad=_err(local.grad, expected), log=log,
                         cp=[c.rewritten for r in backend.records for c in r.cp],
                         tp=[s.tp_size for r in backend.records for s in r.sites])
    try:
        cp.Layout.zigzag(dist.group.WORLD, lens, tp_group=tp_group)
    except ValueError as e:
        out["overlap error"] = str(e)
    if megatron:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    return out


def _groups():
    try:
        from megatron.core import parallel_state
    except ImportError:
        tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        rank = dist.get_rank()
        return tp[rank // 2], cps[rank % 2], False
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group(), True


def test_cp_composes_with_the_vocab_parallel_op_at_tp2_cp2():
    per_rank = [results["tp x cp"] for results in _SPAWNS[4]()]
    for rank, out in enumerate(per_rank):
        for mode in ("eager", "compiled", "compiled megatron"):
            if mode not in out:
                continue
            r = out[mode]
            tol = 1e-6 if "megatron" in mode else TOL  # megatron-core computes in fp32
            assert r["loss"] <= tol and r["grad"] <= tol, (rank, mode, r)
        assert out["compiled"]["cp"] == [True], out["compiled"]
        if "compiled megatron" in out:  # the Function became the vocab-parallel op, the loss reduced locally
            r = out["compiled megatron"]
            assert r["cp"] == [True] and r["tp"] == [2], r
            assert [e[0] for e in r["log"]] == [ALL_GATHER, "all_reduce"], r["log"]
        assert [e[0] for e in out["compiled"]["log"]] == [ALL_GATHER, "all_reduce"], out["compiled"]["log"]
        assert "share ranks" in out["overlap error"] and "\n" not in out["overlap error"]
    logs = [out["compiled"]["log"] for out in per_rank]
    assert all(log == logs[0] for log in logs), logs


# ---- layouts ----------------------------------------------------------------------------------------
def _megatron_zigzag(rank, world):
    """A single sequence: our zigzag rows are megatron-core's `get_batch_on_this_cp_rank`'s."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    x = torch.arange(24.0)[None, :, None].expand(1, 24, 3).contiguous()
    theirs = get_batch_on_this_cp_rank({"x": x.clone()}, cp_group=dist.group.WORLD)["x"][0]
    return torch.equal(cp.Layout.zigzag(dist.group.WORLD, [24]).shard(x[0]), theirs)


def test_zigzag_rows_are_megatron_cores():
    pytest.importorskip("megatron.core")
    assert [results["megatron zigzag"] for results in _SPAWNS[2]()] == [True, True]


def test_ranks_given_different_sequence_lengths_all_raise_one_line():
    per_rank = [results["mismatched"] for results in _SPAWNS[2]()]
    for message in per_rank:
        assert message.startswith("graphpass.cp: ranks [") and "same seq_lens" in message and "\n" not in message


def _mismatched(rank, world):
    try:
        cp.Layout.zigzag(dist.group.WORLD, [8, 4 + rank])
    except ValueError as e:
        return str(e)
    return "no error"


# ---- one spawn per group size --------------------------------------------------------------------
def _on_ranks(rank, world):
    """Every test's work on `world` ranks: the cases; at 4 ranks, ranks that differ and TP x CP; at
    2, the layouts' checks."""
    out = dict(cases=[spawned.part(_case, rank, world, *case) for case in CASES[world]])
    if world == 4:
        out["differing"] = {name: spawned.part(_differing_ranks, rank, world, name) for name in DIFFERING}
        out["tp x cp"] = spawned.part(_tp_cp, rank, world)
    if world == 2:
        out["mismatched"] = spawned.part(_mismatched, rank, world)
        if spawned.installed("megatron.core"):
            out["megatron zigzag"] = spawned.part(_megatron_zigzag, rank, world)
    return out


_SPAWNS = {world: spawned.once(_on_ranks, world, timeout_s) for world, timeout_s in ((2, 480), (4, 600))}
