"""Several vocab-parallel Functions over the same logits become one op (issue 20, item 2).

megatron-core's `vocab_parallel_cross_entropy` on a clone of the logits, as verl's Megatron actor
calls it, with an entropy Function on the same logits beside it (`bench.workloads.tp_losses.VerlStyleEntropy`,
or the slime-style Function whose log-prob nothing reads), at TP=2 on gloo ranks: graphpass
replaces each Function by a `vocab_parallel_logprob_entropy` op, absorbs the clone, and merges the
ops into one (one collective, one gradient of the logits), then absorbs the temperature's division
that only the merged op reads. Checked per case: the loss and every input gradient against eager
and against one device in float64 (megatron-core returns an fp32 log-prob whatever its input:
there float64 parity is with eager megatron-core), the sites (one after
the merge), the reason where ops over the same logits stay apart (different temperatures,
different targets both read, different groups), and the gloo collectives each rank issued
(profiler events, forward and backward), the same on every rank, also when ranks differ in
requires_grad and grad mode. The merged op also takes in the output layer (`F.linear` and
megatron-core's own `ColumnParallelLinear`). All cases run in one spawn (`_results`).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphpass
from tests import spawned
from bench.tp import profiled
from bench.workloads.tp_losses import (megatron_logprob_entropy, ppo_loss, slime_style_logprob_entropy, verl_style_entropy)
from tests.helpers import mixed_error

pytestmark = pytest.mark.heavy  # a minute or more: xdist starts it early (tests/conftest.py)

T, WIDTH, H, WORLD = 24, 20, 16, 2  # tokens, V/tp, hidden size, tp
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-6, torch.bfloat16: 3e-2}


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


# ---- the loss codes --------------------------------------------------------------------------------
def _logprob_entropy(code, logits, target, target2, temperature):
    """(log-prob, entropy or None, a second log-prob or None) of `code` on this rank's logits."""
    if code == "megatron+verl":
        lp, ent = megatron_logprob_entropy(logits, target, temperature=temperature)
        return lp, ent, None
    if code == "megatron+entropy without grad":  # a logged metric: Dynamo inlines the entropy Function
        lp, _ = megatron_logprob_entropy(logits, target, temperature=temperature, with_entropy=False)
        with torch.no_grad():
            ent = verl_style_entropy(logits / temperature)
        return lp, ent, None
    if code == "megatron+slime entropy":  # the slime-style Function's log-prob is read by nothing
        from megatron.core import tensor_parallel

        x = logits / temperature
        lp = -tensor_parallel.vocab_parallel_cross_entropy(x.clone(), target)
        _, ent = slime_style_logprob_entropy(x, target, _tp_group(), with_entropy=True)
        return lp, ent, None
    if code == "slime log-prob+verl":
        x = logits / temperature
        lp, _ = slime_style_logprob_entropy(x, target, _tp_group())
        return lp, verl_style_entropy(x), None
    if code == "megatron twice":  # the same targets: one log-prob
        from megatron.core import tensor_parallel

        x = logits / temperature
        lp = -tensor_parallel.vocab_parallel_cross_entropy(x.clone(), target)
        return lp, None, -tensor_parallel.vocab_parallel_cross_entropy(x.clone(), target)
    # Must not merge:
    if code == "different temperatures":  # the log-prob of logits / t, the entropy of the logits
        from megatron.core import tensor_parallel

        lp = -tensor_parallel.vocab_parallel_cross_entropy((logits / temperature).clone(), target)
        return lp, verl_style_entropy(logits), None
    if code == "different targets":
        from megatron.core import tensor_parallel

        lp = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), target)
        return lp, None, -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), target2)
    if code == "different groups":  # megatron-core's TP group and the default group: the same ranks
        from megatron.core import tensor_parallel

        lp = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), target)
        return lp, verl_style_entropy(logits, dist.group.WORLD), None
    raise ValueError(code)


def _loss(code, temperature, logits, target, target2, old, adv, mask):
    lp, ent, lp2 = _logprob_entropy(code, logits, target, target2, temperature)
    value = ppo_loss(lp.reshape(-1), old.to(lp.dtype), adv.to(lp.dtype), None if ent is None else ent.reshape(-1),
                     mask=mask)
    if lp2 is not None:  # a second log-prob read by the loss (a KL-like term)
        value = value + 0.1 * (lp2.reshape(-1) * mask).sum() / mask.sum()
    return value


def _reference_terms(code, full, target, target2, temperature):
    """One device, float64: (log-prob, entropy or None, second log-prob or None) of the global logits."""
    def logprob_of(t, temp):
        return (full / temp).log_softmax(-1).gather(-1, t[..., None])[..., 0]

    def entropy_of(temp):
        logp = (full / temp).log_softmax(-1)
        return -(logp.exp() * logp).sum(-1)

    lp = logprob_of(target, temperature if code not in ("different targets", "different groups") else 1.0)
    if code in ("megatron+verl", "megatron+slime entropy", "slime log-prob+verl"):
        return lp, entropy_of(temperature), None
    if code == "megatron+entropy without grad":
        return lp, entropy_of(temperature).detach(), None
    if code == "megatron twice":
        return lp, None, lp
    if code == "different temperatures":
        return lp, entropy_of(1.0), None
    if code == "different targets":
        return lp, None, logprob_of(target2, 1.0)
    return lp, entropy_of(1.0), None  # different groups


def _reference_loss(code, temperature, full, target, target2, old, adv, mask):
    lp, ent, lp2 = _reference_terms(code, full, target, target2, temperature)
    value = ppo_loss(lp.reshape(-1), old.double(), adv.double(), None if ent is None else ent.reshape(-1), mask=mask)
    if lp2 is not None:
        value = value + 0.1 * (lp2.reshape(-1) * mask).sum() / mask.sum()
    return value


# (code, dtype, temperature, inner compiler, the number of sites, the reason ops stay apart)
CASES = [
    ("megatron+verl", torch.float32, 1.0, "aot_eager", 1, None),
    ("megatron+verl", torch.float32, 0.7, "inductor", 1, None),
    ("megatron+verl", torch.float64, 0.7, "aot_eager", 1, None),
    ("megatron+verl", torch.bfloat16, 0.7, "aot_eager", 1, None),
    ("megatron+verl", torch.bfloat16, 0.7, "inductor", 1, None),
    ("megatron+slime entropy", torch.bfloat16, 0.7, "aot_eager", 1, None),
    ("megatron+slime entropy", torch.float32, 0.7, "aot_eager", 1, None),
    ("megatron+entropy without grad", torch.float32, 0.7, "aot_eager", 1, None),
    ("slime log-prob+verl", torch.float64, 0.7, "aot_eager", 1, None),
    ("megatron twice", torch.float32, 0.7, "aot_eager", 1, None),
    ("different temperatures", torch.float32, 0.7, "aot_eager", 2, "different temperatures (0.7, 1)"),
    ("different targets", torch.float32, 1.0, "aot_eager", 2, "both log-probs are read, of different targets"),
    ("different groups", torch.float32, 1.0, "aot_eager", 2, "they all-reduce over different groups"),
]
KINDS = {"megatron+verl": "-logprob+entropy", "megatron+slime entropy": "-logprob+entropy",
         "megatron+entropy without grad": "-logprob+entropy",
         "slime log-prob+verl": "logprob+entropy", "megatron twice": "-logprob+-logprob"}


def _data(rank, dtype, layout="[T, V/tp]"):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(T, WORLD * WIDTH, generator=g, dtype=torch.float64) * 2
    target = torch.randint(0, WORLD * WIDTH, (T,), generator=g)
    target[:4] = torch.arange(4)  # rank 0 owns these
    target2 = torch.randint(0, WORLD * WIDTH, (T,), generator=g)
    old = torch.randn(T, generator=g, dtype=torch.float64) - 3
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    mask = torch.rand(T, generator=g) < 0.7
    local = full[:, rank * WIDTH:(rank + 1) * WIDTH].to(dtype)
    return full, local, target, target2, old, adv, mask


def _sites(backend):
    return [dict(kind=s.kind, tp_size=s.tp_size, lm_head=s.lm_head, collectives=[c.op for c in s.collectives],
                 shape=s.shape, dtype=s.dtype, temperatures=[o.temperature for o in s.outputs],
                 gradients_in_forward=s.gradients_in_forward, recompute_reason=s.recompute_reason)
            for r in backend.records for s in r.sites]


def _case(rank, code, dtype, temperature, inner, n_sites, why):
    full, local, target, target2, old, adv, mask = _data(rank, dtype)
    fn = functools.partial(_loss, code, temperature)

    def run(f):
        logits = local.clone().requires_grad_()
        state = {}

        def step():
            state["loss"] = f(logits, target, target2, old, adv, mask)
            state["loss"].backward()

        issued = profiled(step)
        return state["loss"].detach(), logits.grad, issued

    torch._dynamo.reset()
    backend = graphpass.Backend(inner=inner)
    value, grad, issued = run(torch.compile(fn, backend=backend))
    eager_value, eager_grad, eager_issued = run(fn)
    ref_full = full.clone().requires_grad_()
    ref = _reference_loss(code, temperature, ref_full, target, target2, old, adv, mask)
    ref.backward()
    ref_grad = ref_full.grad[:, rank * WIDTH:(rank + 1) * WIDTH]
    return dict(vs_eager=max(mixed_error(value, eager_value), mixed_error(grad, eager_grad)),
                parts_vs_ref=(mixed_error(value, ref), mixed_error(grad, ref_grad)),
                vs_ref=max(mixed_error(value, ref), mixed_error(grad, ref_grad)),
                eager_vs_ref=max(mixed_error(eager_value, ref), mixed_error(eager_grad, ref_grad)), grad_dtype=grad.dtype,
                sites=_sites(backend), rejected=[c.reason for r in backend.records for c in r.rejected],
                fallbacks=[r.fallback_reason for r in backend.records if r.fallback_reason],
                issued=issued, eager_issued=eager_issued)


# ---- the output layer taken in ---------------------------------------------------------------------
HEAD_CASES = [("F.linear", "megatron+verl", torch.float32), ("F.linear", "slime log-prob+verl", torch.float64),
              ("ColumnParallelLinear", "megatron+verl", torch.float32),
              # The temperature's division in bf16 between the matmul and the loss: the op takes it in
              # (rounded_division), the lm_head ops divide in fp32, so the output layer stays outside.
              ("F.linear", "megatron+verl", torch.bfloat16), ("ColumnParallelLinear", "megatron+verl", torch.bfloat16)]


def _head_case(rank, layer_kind, code, dtype):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(WORLD * WIDTH, H, generator=g, dtype=torch.float64) / H ** 0.5 * 2
    _, _, target, target2, old, adv, mask = _data(rank, dtype)
    shard = slice(rank * WIDTH, (rank + 1) * WIDTH)
    if layer_kind == "ColumnParallelLinear":
        from tests.tensor_parallel.test_megatron_output_layer import _layer

        assert (WORLD, WIDTH) == (2, 20)  # that module's shapes
        layer = _layer(dtype, False, False, weight, None, rank)
        w = layer.weight
        head = lambda h: layer(h)[0]  # noqa: E731
    else:
        w = torch.nn.Parameter(weight[shard].to(dtype))
        head = lambda h: F.linear(h, w)  # noqa: E731

    def fn(h, target, target2, old, adv, mask):
        return _loss(code, 0.7, head(h), target, target2, old, adv, mask)

    def run(f):
        h = hidden.to(dtype, copy=True).requires_grad_()
        w.grad = None
        value = f(h, target, target2, old, adv, mask)
        value.backward()
        return value.detach(), [h.grad, w.grad]

    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")
    value, grads = run(torch.compile(fn, backend=backend))
    eager_value, eager_grads = run(fn)
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = _reference_loss(code, 0.7, ref_h @ ref_w.t(), target, target2, old, adv, mask)
    ref.backward()
    # megatron-core's layer sums the hidden states' gradient over the group; F.linear on a shard
    # gives this rank's part of it.
    ref_grads = [ref_h.grad if layer_kind == "ColumnParallelLinear" else None, ref_w.grad[shard]]
    if ref_grads[0] is None:
        ref_grads[0] = _shard_hidden_grad(code, hidden, weight, target, target2, old, adv, mask, rank)
    return dict(vs_eager=max([mixed_error(value, eager_value)] + [mixed_error(a, b) for a, b in zip(grads, eager_grads)]),
                vs_ref=max([mixed_error(value, ref)] + [mixed_error(a, b) for a, b in zip(grads, ref_grads)]),
                sites=_sites(backend), rejected=[c.reason for r in backend.records for c in r.rejected],
                fallbacks=[r.fallback_reason for r in backend.records if r.fallback_reason])


def _shard_hidden_grad(code, hidden, weight, target, target2, old, adv, mask, rank):
    """This rank's part of the hidden states' gradient, dlogits[:, shard] @ W[shard], in float64."""
    logits = (hidden @ weight.t()).requires_grad_()
    _reference_loss(code, 0.7, logits, target, target2, old, adv, mask).backward()
    shard = slice(rank * WIDTH, (rank + 1) * WIDTH)
    return logits.grad[:, shard] @ weight[shard]


# ---- ranks that differ ---------------------------------------------------------------------------
def _differing(rank, world, code, modes):
    """The loss on each rank in its (requires_grad, grad mode) `modes[rank]`, backward where both:
    (the gloo collectives of the step, the loss's error against one device)."""
    full, local, target, target2, old, adv, mask = _data(rank, torch.float32)
    requires, enabled = modes[rank]
    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")
    fn = torch.compile(functools.partial(_loss, code, 0.7), backend=backend)
    logits = local.clone().requires_grad_(requires)
    state = {}

    def step():
        with torch.set_grad_enabled(enabled):
            state["loss"] = fn(logits, target, target2, old, adv, mask)
        if requires and enabled:
            state["loss"].backward()

    issued = profiled(step)
    ref = _reference_loss(code, 0.7, full, target, target2, old, adv, mask)
    return issued, mixed_error(state["loss"], ref), _sites(backend)


# (code, (requires_grad, grad mode) per rank). A rank whose logits do not require grad, or that runs
# without grad, gets every Function inlined by Dynamo; with the entropy under no_grad in the code,
# the entropy is inlined on every rank and the loss a Function only where it requires grad.
DIFFERING = [("megatron+verl", ((True, True), (False, True))), ("megatron+verl", ((True, True), (True, False))),
             ("megatron+entropy without grad", ((True, True), (False, True)))]


# ---- megatron-core's loss on the logits themselves, read again after it -----------------------------
def _overwritten(rank):
    """megatron-core's loss writes its softmax into the logits it is given; called on the logits
    themselves, an entropy after it reads that softmax in eager. Replacing the Function would lose
    the write: it stays (the graph runs as Dynamo traced it). (value error, logits.grad error
    against eager; the rejections; the fallback)."""
    from megatron.core import tensor_parallel

    _, local, target, _, _, _, _ = _data(rank, torch.float32)

    def fn(logits, target):
        x = logits * 1.0
        lp = -tensor_parallel.vocab_parallel_cross_entropy(x, target)
        return lp.sum() + verl_style_entropy(x).sum()

    def run(f):
        logits = local.clone().requires_grad_()
        value = f(logits, target)
        value.backward()
        return value.detach(), logits.grad

    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")
    (value, grad), (eager_value, eager_grad) = run(torch.compile(fn, backend=backend)), run(fn)
    return (mixed_error(value, eager_value), mixed_error(grad, eager_grad), [c.reason for r in backend.records for c in r.rejected],
            [r.fallback_reason for r in backend.records])


def _ranks(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        return dict(cases=[_case(rank, *case) for case in CASES],
                    heads=[_head_case(rank, *case) for case in HEAD_CASES],
                    differing=[_differing(rank, world, *case) for case in DIFFERING],
                    overwritten=_overwritten(rank))
    finally:
        parallel_state.destroy_model_parallel()


_spawned = spawned.once(_ranks, WORLD, timeout_s=420, requires="megatron.core")


def _case_id(case):
    code, dtype, temperature, inner = case[:4]
    return f"{code}-{str(dtype).removeprefix('torch.')}-t{temperature:g}-{inner}".replace(" ", "_")


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_values_and_gradients_match_eager_and_one_device(index):
    code, dtype, temperature, inner, n_sites, why = CASES[index]
    for rank, result in enumerate(_spawned()):
        r = result["cases"][index]
        where = (_case_id(CASES[index]), rank, r)
        assert r["fallbacks"] == [] and r["grad_dtype"] == dtype, where
        tol = TOLERANCE[dtype]
        # megatron-core returns an fp32 log-prob whatever its input (and the PPO math that reads it
        # then runs in fp32): with it, float64 parity is with eager, one device is fp32's.
        assert r["vs_ref"] <= (tol if code == "slime log-prob+verl" else max(tol, TOLERANCE[torch.float32])), where
        if dtype == torch.bfloat16:  # ours rounds once, eager per op (and verl's entropy runs in bf16)
            assert r["vs_ref"] <= r["eager_vs_ref"] + 1e-2 and r["vs_eager"] <= tol, where
        else:
            assert r["vs_eager"] <= tol, where


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_ops_over_the_same_logits_merge_into_one_site_or_say_why_not(index):
    """docs/frameworks/verl.md's Megatron actor recipe: megatron-core's loss beside verl's entropy Function."""
    code, dtype, temperature, inner, n_sites, why = CASES[index]
    for rank, result in enumerate(_spawned()):
        r = result["cases"][index]
        where = (_case_id(CASES[index]), rank, r)
        assert len(r["sites"]) == n_sites and all(s["tp_size"] == WORLD for s in r["sites"]), where
        if why is None:
            (site,) = r["sites"]
            assert site["kind"] == KINDS[code] and site["collectives"] == ["all_gather"], where
            assert not any("not merged" in reason for reason in r["rejected"]), where
            # The clone and the temperature's division absorbed: the op reads the input logits.
            assert site["shape"] == (T, WIDTH) and site["dtype"] == dtype, where
            # bf16 logits divided in bf16: the op divides each chunk in bf16 as eager does (rounded_division).
            text = f"/ {temperature:.3g}" + (" in bfloat16" if dtype == torch.bfloat16 else "")
            assert set(site["temperatures"]) == {text if temperature != 1.0 else None}, where
            assert not any("stays outside" in reason for reason in r["rejected"]), where
        else:
            assert any("not merged" in reason and why in reason for reason in r["rejected"]), where


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_one_all_gather_per_site_the_same_on_every_rank(index):
    code, dtype, temperature, inner, n_sites, why = CASES[index]
    per_rank = [result["cases"][index] for result in _spawned()]
    issued = [r["issued"] for r in per_rank]
    assert all(log == issued[0] for log in issued), (_case_id(CASES[index]), issued)
    assert issued[0] == ["all_gather"] * n_sites, (_case_id(CASES[index]), issued[0])
    # Eager issues one all-reduce per statistic (here 3 for megatron-core's, 3 for an entropy).
    assert all(log == per_rank[0]["eager_issued"] for log in (r["eager_issued"] for r in per_rank))


@pytest.mark.parametrize("index", range(len(HEAD_CASES)), ids=["-".join(map(str, c)).replace(" ", "_")
                                                               for c in HEAD_CASES])
def test_the_merged_op_takes_in_the_output_layer(index):
    layer_kind, code, dtype = HEAD_CASES[index]
    for rank, result in enumerate(_spawned()):
        r = result["heads"][index]
        where = (HEAD_CASES[index], rank, r)
        assert r["fallbacks"] == [], where
        (site,) = r["sites"]
        tol = TOLERANCE[dtype]
        if dtype == torch.bfloat16:
            assert not site["lm_head"] and site["kind"] == KINDS[code], where
            assert set(site["temperatures"]) == {"/ 0.7 in bfloat16"}, where
            assert any("lm_head not fused" in why and "by the temperature in bfloat16" in why
                       for why in r["rejected"]), where
            assert r["vs_eager"] <= tol and r["vs_ref"] <= tol * 5, where
            continue
        assert site["lm_head"] and site["kind"] == KINDS[code], where
        # A token-mean loss: the gradients computed in forward, one all-gather per block of rows.
        assert site["gradients_in_forward"] and site["recompute_reason"] is None, where
        assert r["vs_eager"] <= (1e-5 if dtype == torch.float32 else tol) and r["vs_ref"] <= tol * 5, where


@pytest.mark.parametrize("index", range(len(DIFFERING)), ids=["no-requires-grad", "no-grad",
                                                               "entropy-without-grad-no-requires-grad"])
def test_ranks_differing_in_requires_grad_or_grad_mode_issue_the_same_collectives(index):
    per_rank = _spawned()
    logs = [result["differing"][index][0] for result in per_rank]
    assert all(log == logs[0] for log in logs) and logs[0] == ["all_gather"], logs
    for result in per_rank:
        issued, err, sites = result["differing"][index]
        assert err <= 1e-5 and len(sites) == 1 and sites[0]["kind"].endswith("entropy"), (err, sites)


def test_a_write_into_logits_read_afterwards_keeps_the_function():
    for rank, result in enumerate(_spawned()):
        value_err, grad_err, rejected, fallbacks = result["overwritten"]
        where = (rank, result["overwritten"])
        assert value_err <= 1e-6 and grad_err <= 1e-6, where
        assert any("writes into its input" in why and "hand it a clone" in why for why in rejected), where
        assert all(f is not None and "mutates its inputs" in f for f in fallbacks), where
