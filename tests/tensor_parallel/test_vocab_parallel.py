"""`graphpass.ops.vocab_parallel_logprob_entropy` on 2 and 4 gloo ranks against one device.

Each spawn of ranks costs seconds, so one spawn per group size runs every check and the tests
below read its results (`_on_ranks`): value and gradient parity over dtypes, temperatures, entropy
modes, keep masks and ignored rows; the collectives each rank issued, call by call; the cases
that hung slime (requires_grad or grad mode differing across ranks, a rank whose slice is all
masked) and bad input; at 2 ranks also the op compiled with aot_eager, and megatron-core's
`vocab_parallel_cross_entropy` beside it where that is installed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from bench.harness.ranks import collectives
from graphpass import _torch_api
from graphpass.ops import vocab_parallel_logprob_entropy
from graphpass.ops.groups import ALL_GATHER
from tests.helpers import covering_grid, mixed_error
from tests import spawned

IGNORE = -100
T = 37
# Odd slices: V/tp = 33 at tp=2, 17 at tp=4.
SLICE = {2: 33, 4: 17}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-6}


# ---- the single-device reference ---------------------------------------------------------------
def reference(full, target, *, temperature=1.0, keep=None, ignore_index=IGNORE, dtype=torch.float64):
    """(logprob, entropy) of `full` `[T, V]` computed on one device in `dtype`, by autograd-able torch ops.

    The log-prob is over the kept logits plus the target's own (slime's support); the entropy over
    all logits. Ignored rows give 0; their target column stands in for one so that a fully
    masked ignored row stays finite (and its zero has a zero gradient, not NaN).
    """
    x = full.to(dtype) / temperature
    ignored = target == ignore_index
    safe = torch.where(ignored, 0, target)
    logp = x.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    if keep is not None:
        support = keep.expand(x.shape).clone()
        support.scatter_(1, safe[:, None], True)
        logp = x.masked_fill(~support, float("-inf")).log_softmax(-1)
    logprob = logp.gather(1, safe[:, None])[:, 0] * ~ignored
    return logprob, entropy


def _shard(full, rank, width):
    return full[..., rank * width:(rank + 1) * width]


def _case_data(world, width, seed):
    """Full logits `[T, V]`, targets with two ignored rows, and 2-D and 1-D keep masks that leave the
    last rank's slice all masked (the 1-D one for every row, the 2-D one for some)."""
    g = torch.Generator().manual_seed(seed)
    vocab = world * width
    full = torch.randn(T, vocab, generator=g, dtype=torch.float64) * 2
    target = torch.randint(0, vocab, (T,), generator=g)
    target[3] = IGNORE
    target[10] = IGNORE
    keep2 = torch.rand(T, vocab, generator=g) < 0.5
    keep2[1] = False  # only the target remains: logprob 0
    keep2[3] = False  # ignored and nothing kept: the log-prob distribution is empty
    keep2[4:9, (world - 1) * width:] = False  # all masked on the last rank's slice
    keep1 = torch.rand(vocab, generator=g) < 0.6
    keep1[(world - 1) * width:] = False
    return full, target, keep2, keep1


# ---- what each rank runs ------------------------------------------------------------------------
def _parity(rank, world, width):
    """Every combination of dtype, keep mask, entropy mode and temperature (on 2 ranks; on more,
    only temperature 0.7 and entropy modes none and grad): errors against the float64 reference,
    and the collectives of each forward and backward."""
    full, target, keep2, keep1 = _case_data(world, width, seed=0)
    g = torch.Generator().manual_seed(1)
    g_lp = torch.randn(T, generator=g, dtype=torch.float64)
    g_ent = torch.randn(T, generator=g, dtype=torch.float64)
    rows = []
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for keep_kind in (None, "2d", "1d"):
            for entropy_mode in ("none", "grad", "no-grad"):
                for temperature in (1.0, 0.7):
                    if dtype == torch.bfloat16 and (entropy_mode != "grad" or keep_kind == "1d"):
                        continue
                    if world > 2 and (temperature == 1.0 or entropy_mode == "no-grad"):
                        continue  # each combination ran on 2 ranks; keep the 4-process spawn short
                    keep = {None: None, "2d": keep2, "1d": keep1}[keep_kind]
                    chunk = 5 if temperature == 1.0 or keep_kind == "1d" else None
                    rows.append(_parity_case(rank, width, full.to(dtype), target, keep, entropy_mode, temperature,
                                             chunk, g_lp, g_ent, dtype, keep_kind))
    return rows


def _parity_case(rank, width, full, target, keep, entropy_mode, temperature, chunk, g_lp, g_ent, dtype, keep_kind):
    with_entropy = entropy_mode != "none"
    entropy_grad = entropy_mode == "grad"
    logits = _shard(full, rank, width).clone().requires_grad_()
    with collectives() as forward_log:
        logprob, entropy = vocab_parallel_logprob_entropy(
            logits, target, None, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
            keep_mask=None if keep is None else _shard(keep, rank, width), chunk_size=chunk)
    loss = (logprob * g_lp.to(logprob.dtype)).sum()
    if entropy_grad:
        loss = loss + (entropy * g_ent.to(entropy.dtype)).sum()
    with collectives() as backward_log:
        loss.backward()

    ref_full = full.double().clone().requires_grad_()
    ref_lp, ref_ent = reference(ref_full, target, temperature=temperature, keep=keep)
    ref_loss = (ref_lp * g_lp).sum() + ((ref_ent * g_ent).sum() if entropy_grad else 0)
    ref_loss.backward()
    row = dict(dtype=dtype, keep=keep_kind, entropy=entropy_mode, temperature=temperature, chunk=chunk,
               out_dtype=logprob.dtype, grad_dtype=logits.grad.dtype,
               entropy_is_none=entropy is None, entropy_requires_grad=bool(entropy is not None and entropy.requires_grad),
               lp=mixed_error(logprob, ref_lp), ent=mixed_error(entropy, ref_ent) if with_entropy else 0.0,
               grad=mixed_error(logits.grad, _shard(ref_full.grad, rank, width)),
               finite=bool(torch.isfinite(logits.grad.double()).all() and torch.isfinite(logprob).all()),
               forward_log=forward_log, backward_log=backward_log)
    if dtype == torch.bfloat16:
        # The error of the same math done eagerly in bf16 on one device: the bound for ours.
        eager_full = full.clone().requires_grad_()
        eager_lp, eager_ent = reference(eager_full, target, temperature=temperature, keep=keep, dtype=torch.bfloat16)
        ((eager_lp.double() * g_lp).sum() + (eager_ent.double() * g_ent).sum()).backward()
        row.update(eager_lp=mixed_error(eager_lp, ref_lp), eager_ent=mixed_error(eager_ent, ref_ent),
                   eager_grad=mixed_error(_shard(eager_full.grad, rank, width), _shard(ref_full.grad, rank, width)))
    return row


def _call(logits, target, group=None, **kwargs):
    """(logprob, entropy, collectives issued) of one forward, or (message, None, log) if it raised ValueError."""
    with collectives() as log:
        try:
            logprob, entropy = vocab_parallel_logprob_entropy(logits, target, group, **kwargs)
        except ValueError as error:
            return str(error), None, log
    return logprob, entropy, log


def _hang_cases(rank, world, width):
    """The cases where ranks could disagree on their collectives: {name: (logs, values ok)}."""
    full, target, keep2, _ = _case_data(world, width, seed=2)
    vocab = world * width
    out = {}

    def check(name, logits, target_, keep=None, group=None, backward=False, **kwargs):
        lp, ent, log = _call(logits, target_, group, with_entropy=True,
                             keep_mask=None if keep is None else _shard(keep, rank, width), **kwargs)
        ok = None
        if ent is not None:
            ref_lp, ref_ent = reference(full[:target_.shape[0]], target_, keep=keep)
            ok = mixed_error(lp, ref_lp) < 1e-10 and mixed_error(ent, ref_ent) < 1e-10
            if backward and logits.requires_grad:
                with collectives() as backward_log:
                    (lp.sum() + ent.sum()).backward()
                log = log + backward_log
        out[name] = (log, ok if ent is not None else lp)

    shard = _shard(full, rank, width)
    # requires_grad on one rank only, and a backward there alone.
    check("requires_grad on rank 0 only", shard.clone().requires_grad_(rank == 0), target, backward=True)
    # One rank under no_grad.
    with torch.set_grad_enabled(rank != world - 1):
        check("no_grad on the last rank", shard.clone().requires_grad_(), target, backward=rank != world - 1)
    # The last rank's slice entirely masked (targets there are still kept).
    keep = keep2.clone()
    keep[:, (world - 1) * width:] = False
    check("all masked on the last rank", shard.clone().requires_grad_(), target, keep, backward=True)
    # Every target ignored; every target on rank 0's slice.
    check("all targets ignored", shard.clone().requires_grad_(), torch.full_like(target, IGNORE), keep2, backward=True)
    check("all targets on rank 0", shard.clone().requires_grad_(), target.remainder(width), backward=True)
    # No rows at all.
    check("no rows", shard[:0].clone().requires_grad_(), target[:0], backward=True)
    # Few and many rows, small chunks: the number of collectives does not grow with the rows.
    big = torch.randn(200, vocab, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    big_target = torch.randint(0, vocab, (200,), generator=torch.Generator().manual_seed(4))
    for rows in (5, 200):
        lp, _, log = _call(_shard(big[:rows], rank, width), big_target[:rows], chunk_size=3)
        ref_lp, _ = reference(big[:rows], big_target[:rows])
        out[f"T={rows}, chunk 3"] = (log, mixed_error(lp, ref_lp) < 1e-10)
    # Bad token ids: every rank raises after the one collective, with the same message.
    bad = target.clone()
    bad[5] = vocab
    out["token id = V"] = _call(shard, bad)[::-2]
    differing = target.clone()
    differing[6] = (target[6] + 1 + rank) % vocab
    out["targets differ across ranks"] = _call(shard, differing)[::-2]
    # A group of one rank: no collective at all.
    single, _ = dist.new_subgroups(group_size=1)
    local_target = torch.where(target == IGNORE, IGNORE, target.remainder(width))
    lp, ent, log = _call(shard.clone(), local_target, single, with_entropy=True)
    ref_lp, ref_ent = reference(shard, local_target)
    out["group of one"] = (log, mixed_error(lp, ref_lp) < 1e-10 and mixed_error(ent, ref_ent) < 1e-10)
    return out


def _spawned(world):
    """Per rank, the results of `_on_ranks` on `world` ranks, spawned once per group size."""
    return _SPAWNS[world]()


def _label(row):
    return (f"{str(row['dtype']).replace('torch.', '')} keep={row['keep']} entropy={row['entropy']} "
            f"T={row['temperature']} chunk={row['chunk']}")


# ---- tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_values_and_gradients_match_one_device(world):
    per_rank = _spawned(world)
    failures = []
    for rank, result in enumerate(per_rank):
        for row in result["parity"]:
            dtype = row["dtype"]
            if not row["finite"]:
                failures.append(f"rank {rank} {_label(row)}: non-finite logprob or gradient")
            if row["out_dtype"] != (torch.float64 if dtype == torch.float64 else torch.float32):
                failures.append(f"rank {rank} {_label(row)}: outputs are {row['out_dtype']}")
            if row["grad_dtype"] != dtype:
                failures.append(f"rank {rank} {_label(row)}: gradient is {row['grad_dtype']}, not {dtype}")
            if row["entropy_is_none"] != (row["entropy"] == "none"):
                failures.append(f"rank {rank} {_label(row)}: entropy None is {row['entropy_is_none']}")
            if row["entropy_requires_grad"] != (row["entropy"] == "grad"):
                failures.append(f"rank {rank} {_label(row)}: entropy.requires_grad is {row['entropy_requires_grad']}")
            for key in ("lp", "ent", "grad"):
                if dtype == torch.bfloat16:
                    # Ours reads the bf16 logits exactly, computes in fp32 and rounds only the gradient
                    # to bf16, once (at most 2^-8 relative); eager bf16 rounds every intermediate
                    # (about 1e-2 here). Ours must be no worse than eager, and fp32-exact in value.
                    bound = max(row["eager_grad"], 2.0**-8) if key == "grad" else min(row["eager_" + key], 1e-6)
                else:
                    bound = TOLERANCE[dtype]
                if not row[key] <= bound:
                    failures.append(f"rank {rank} {_label(row)}: {key} error {row[key]:.3g} > {bound:.3g}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_one_collective_per_forward_none_in_backward_same_on_every_rank(world):
    per_rank = _spawned(world)
    for rank, result in enumerate(per_rank):
        for row in result["parity"]:
            assert len(row["forward_log"]) == 1, (rank, _label(row), row["forward_log"])
            name, shapes, _, size = row["forward_log"][0]
            assert name == ALL_GATHER and size == world, row["forward_log"]
            assert shapes[0][0][0] == world * T, shapes
            assert row["backward_log"] == [], (rank, _label(row), row["backward_log"])
    logs = [[(row["forward_log"], row["backward_log"]) for row in result["parity"]] for result in per_rank]
    assert all(log == logs[0] for log in logs)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_differ_issue_the_same_collectives(world):
    per_rank = _spawned(world)
    hang = [result["hang"] for result in per_rank]
    for name in hang[0]:
        logs = [h[name][0] for h in hang]
        assert all(log == logs[0] for log in logs), (name, logs)
        expected = 0 if name == "group of one" else 1
        assert len(logs[0]) == expected, (name, logs[0])
    for name in ("requires_grad on rank 0 only", "no_grad on the last rank", "all masked on the last rank",
                 "all targets ignored", "all targets on rank 0", "no rows", "T=5, chunk 3", "T=200, chunk 3",
                 "group of one"):
        assert all(h[name][1] is True for h in hang), (name, [h[name][1] for h in hang])
    assert hang[0]["T=5, chunk 3"][0][0][0] == hang[0]["T=200, chunk 3"][0][0][0]


@pytest.mark.parametrize("world", [2])
def test_bad_token_ids_raise_on_every_rank(world):
    hang = [result["hang"] for result in _spawned(world)]
    for name, needle in (("token id = V", f"token id {world * SLICE[world]} at row 5 is outside the vocabulary"),
                         ("targets differ across ranks", "were given different targets (row 6")):
        messages = [h[name][1] for h in hang]
        assert all(isinstance(m, str) and needle in m for m in messages), (name, messages)
        if name == "token id = V":
            assert len(set(messages)) == 1, messages


# ---- compiled ------------------------------------------------------------------------------------
def _compiled(rank, world, width):
    full, target, keep2, _ = _case_data(world, width, seed=5)
    adv = torch.randn(T, generator=torch.Generator().manual_seed(6))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return _torch_api.inner_compile("aot_eager", gm, example_inputs)

    def loss_fn(logits, target_, keep, group):
        logprob, entropy = vocab_parallel_logprob_entropy(logits, target_, group, temperature=0.7, with_entropy=True,
                                                          keep_mask=keep)
        return (logprob * adv).sum() - 0.01 * entropy.sum()

    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True)
    out = {}
    for name, keep, group in (("default group", None, None), ("explicit group, keep mask", keep2, dist.group.WORLD)):
        local_keep = None if keep is None else _shard(keep, rank, width)
        logits = _shard(full, rank, width).float().clone().requires_grad_()
        eager = loss_fn(logits, target, local_keep, group)
        eager.backward()
        eager_grad, logits.grad = logits.grad, None
        with collectives() as log:
            value = compiled(logits, target, local_keep, group)
            value.backward()
        out[name] = ((value - eager).abs().item(), (logits.grad - eager_grad).abs().max().item(), log)
    return out, graphs


def test_compiled_with_aot_eager_fullgraph_matches_eager():
    per_rank = [results["compiled"] for results in _spawned(2)]
    for rank, (out, graphs) in enumerate(per_rank):
        assert graphs and all("graphpass.vocab_parallel_logprob_entropy" in code for code in graphs), graphs
        for name, (value_err, grad_err, log) in out.items():
            assert value_err == 0.0 and grad_err == 0.0, (rank, name, value_err, grad_err)
            assert len(log) == 1 and log == per_rank[0][0][name][2], (rank, name, log)


# ---- megatron-core ---------------------------------------------------------------------------------
def _megatron(rank, world, width):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        full, target, _, _ = _case_data(world, width, seed=7)
        target = target.remainder(world * width)  # Megatron has no ignore_index
        weight = torch.randn(T, generator=torch.Generator().manual_seed(8))
        ours = _shard(full, rank, width).float().clone().requires_grad_()
        with collectives() as ours_log:
            logprob, _ = vocab_parallel_logprob_entropy(ours, target, group)
        (logprob * weight).sum().backward()
        theirs = _shard(full, rank, width).float().clone().requires_grad_()
        with collectives() as theirs_log:
            # It writes into its input: hand it a copy.
            loss = tensor_parallel.vocab_parallel_cross_entropy(theirs.clone(), target)
        (-loss * weight).sum().backward()
        return mixed_error(logprob, -loss), mixed_error(ours.grad, theirs.grad), ours_log, theirs_log
    finally:
        parallel_state.destroy_model_parallel()


def test_matches_megatron_core_vocab_parallel_cross_entropy():
    pytest.importorskip("megatron.core")
    per_rank = [results["megatron"] for results in _spawned(2)]
    for rank, (lp_err, grad_err, ours_log, theirs_log) in enumerate(per_rank):
        assert lp_err < 1e-6 and grad_err < 1e-6, (rank, lp_err, grad_err)
        assert len(ours_log) == 1 and len(theirs_log) >= 3, (ours_log, theirs_log)


# ---- one spawn per group size --------------------------------------------------------------------
def _on_ranks(rank, world):
    """Every test's work on `world` ranks: parity and the cases that hung slime; at 2 ranks also the
    op compiled, and megatron-core's loss beside it (where it is installed)."""
    width = SLICE[world]
    out = {"parity": _parity(rank, world, width), "hang": _hang_cases(rank, world, width)}
    if world == 2:
        out["compiled"] = spawned.part(_compiled, rank, world, width)
        if spawned.installed("megatron.core"):
            out["megatron"] = _megatron(rank, world, 32)
    return out


_SPAWNS = {world: spawned.once(_on_ranks, world, timeout_s=240) for world in (2, 4)}


# ---- one process ------------------------------------------------------------------------------------
def test_single_process_without_torch_distributed():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    full, target, keep2, _ = _case_data(1, 24, seed=9)
    logits = full.clone().requires_grad_()
    lp, ent = vocab_parallel_logprob_entropy(logits, target, temperature=1.3, with_entropy=True, keep_mask=keep2,
                                             chunk_size=4)
    (lp.sum() + ent.sum()).backward()
    ref_full = full.clone().requires_grad_()
    ref_lp, ref_ent = reference(ref_full, target, temperature=1.3, keep=keep2)
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert mixed_error(lp, ref_lp) < 1e-10 and mixed_error(ent, ref_ent) < 1e-10
    assert mixed_error(logits.grad, ref_full.grad) < 1e-10


def test_ignore_index_is_any_id_and_no_rows_is_empty():
    full = torch.randn(9, 12, dtype=torch.float64)
    target = torch.tensor([5, 1, 5, 11, 0, 5, 3, 2, 7])
    logits = full.clone().requires_grad_()
    lp, ent = vocab_parallel_logprob_entropy(logits, target, ignore_index=5, with_entropy=True)
    lp.sum().backward()
    ref_full = full.clone().requires_grad_()
    ref_lp, ref_ent = reference(ref_full, target, ignore_index=5)
    ref_lp.sum().backward()
    assert lp[target == 5].eq(0).all() and logits.grad[target == 5].eq(0).all()
    assert mixed_error(lp, ref_lp) < 1e-10 and mixed_error(ent, ref_ent) < 1e-10 and mixed_error(logits.grad, ref_full.grad) < 1e-10
    empty = torch.randn(0, 12, requires_grad=True)
    lp, ent = vocab_parallel_logprob_entropy(empty, target[:0], with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == ent.shape == (0,) and empty.grad.shape == (0, 12)


def test_leading_dims_and_strided_logits():
    full = torch.randn(2, 7, 13, dtype=torch.float64)
    logits = full[:, :-1]  # [2, 6, 13], not viewable as [12, 13]
    target = torch.randint(0, 13, (2, 6))
    lp, ent = vocab_parallel_logprob_entropy(logits, target, with_entropy=True, chunk_size=4)
    ref_lp, ref_ent = reference(logits.reshape(12, 13), target.reshape(12))
    assert lp.shape == (2, 6) and mixed_error(lp.reshape(12), ref_lp) < 1e-10 and mixed_error(ent.reshape(12), ref_ent) < 1e-10


@pytest.mark.parametrize("dtype, kernels, keep, strided", covering_grid(
    [torch.bfloat16, torch.float16], ["eager", "inductor"], [False, True], [False, True]))
def test_rounded_division_is_eagers_division_in_the_logits_dtype(dtype, kernels, keep, strided):
    """`rounded_division`: the op on `x` divided by t in x's dtype, chunk by chunk, is bit for bit
    the op at temperature 1 on eager's `x / t` (values, entropy, and the gradient through eager's
    autograd of that division), under eager and inductor kernels, with and without a keep mask, on
    strided logits; the fp32 division (the default) is not (it does not round the quotient)."""
    op = torch.ops.graphpass.vocab_parallel_logprob_entropy.default
    g = torch.Generator().manual_seed(3)
    base = (torch.randn(2, 70 if strided else 65, 300, generator=g) * 3).to(dtype)
    x0 = base[:, ::2] if strided else base  # [2, 35 or 65, 300]
    target = torch.randint(0, 300, x0.shape[:-1], generator=g)
    keep_mask = (torch.rand(x0.shape, generator=g) < 0.8) if keep else None
    g_lp, g_ent = torch.randn(x0.shape[:-1], generator=g), torch.randn(x0.shape[:-1], generator=g)

    def run(temperature, rounded, divide_first):
        x = x0.detach().clone().requires_grad_()
        logits = x / 0.7 if divide_first else x
        lp, ent, *_ = op(logits, target, keep_mask, "", temperature, True, True, None, 16, kernels, rounded)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return lp, ent, x.grad

    ours, eager, fp32 = run(0.7, True, False), run(1.0, False, True), run(0.7, False, False)
    assert ours[2].dtype == dtype and all(torch.equal(a, b) for a, b in zip(ours, eager))
    assert not all(torch.equal(a, b) for a, b in zip(fp32, eager))


@pytest.mark.parametrize("call, message", [
    (lambda: vocab_parallel_logprob_entropy(torch.randn(5), torch.zeros(5, dtype=torch.long)), "at least 2-D"),
    (lambda: vocab_parallel_logprob_entropy(torch.randn(5, 4), torch.zeros(4, dtype=torch.long)),
     "target shape (4,) must equal logits.shape[:-1] = (5,)"),
    (lambda: vocab_parallel_logprob_entropy(torch.randn(5, 4), torch.zeros(5)), "integer tensor of token ids"),
    (lambda: vocab_parallel_logprob_entropy(torch.randn(5, 4), torch.zeros(5, dtype=torch.long),
                                            keep_mask=torch.ones(5, 3, dtype=torch.bool)), "keep_mask shape (5, 3)"),
    (lambda: vocab_parallel_logprob_entropy(torch.randn(5, 4), torch.zeros(5, dtype=torch.long),
                                            keep_mask=torch.ones(5, 4)), "keep_mask must be a bool tensor"),
    (lambda: vocab_parallel_logprob_entropy(torch.randn(5, 4), torch.zeros(5, dtype=torch.long), temperature=0.0),
     "temperature must be a positive"),
    (lambda: vocab_parallel_logprob_entropy(torch.randn(5, 0), torch.zeros(5, dtype=torch.long)), "slice is empty"),
    (lambda: vocab_parallel_logprob_entropy(torch.randn(5, 4), torch.tensor([0, 1, 2, 4, 0])),
     "token id 4 at row 3 is outside the vocabulary [0, 4)"),
])
def test_bad_input_is_a_clear_value_error(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_bf16_is_never_copied_whole():
    """The forward and backward hold chunk-sized fp32 temporaries, not an fp32 copy of the shard."""
    logits = torch.randn(64, 512, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 512, (64,))
    seen = []

    class Watch(_torch_api.torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    seen.append(t.numel())
            return out

    with Watch():
        lp, ent = vocab_parallel_logprob_entropy(logits, target, with_entropy=True, chunk_size=8)
        (lp.sum() + ent.sum()).backward()
    assert max(seen) <= 8 * 512, max(seen)
    assert math.isfinite(lp.sum().item())
