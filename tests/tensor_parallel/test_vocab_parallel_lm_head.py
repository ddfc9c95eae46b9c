"""The lm_head fused into the vocab-parallel op: `F.linear(hidden, W_shard)` / `hidden @ W_shard.t()`
(with a bias shard, a cast, a `[B, S, H]` batch reshaped to rows) feeding a vocab-parallel Function
(slime-style, megatron-core's, its fused one as slime calls it) or functional all-reduce code, compiled with graphpass on 2 gloo ranks.

Checked per case against one device in float64: the PPO loss (temperature, entropy with and
without gradient, a masked token mean) and the gradients of the hidden states (this rank's
partial, `dlogits_r @ W_r`), the weight shard and the bias shard; the site says `lm_head` with the
hidden states' shape; the collectives of each forward and backward are those of today's op (the
same code given the logits as an input) and the same on every rank. Where the logits have another
reader the matmul stays outside, with the reason recorded. A group of one rank, ranks that differ
in grad mode, and the memory model of a fused site run in the same spawn (`_spawned`); the op
itself is checked in one process without torch.distributed.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphpass
from graphpass.ops.groups import ALL_GATHER
from bench.harness.ranks import collectives
from bench.workloads.tp_losses import megatron_fused_logprob, megatron_logprob, slime_style_logprob_entropy
from graphpass.ops import vocab_parallel_lm_head_logprob_entropy, vocab_parallel_logprob_entropy
from tests.tensor_parallel.test_vocab_parallel_functions import _funcol_logprob
from tests.helpers import mixed_error
from tests import spawned

T, H, WIDTH, WORLD = 12, 16, 20, 2  # rows, hidden size, V/tp, tp
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-2}


def _masked_ppo(logprob, entropy, old, adv, mask, ent_coef=0.01):
    ratio = (logprob - old.to(logprob.dtype)).exp()
    adv = adv.to(logprob.dtype)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    if entropy is not None:
        pg = pg - ent_coef * entropy
    mask = mask.to(logprob.dtype)
    return (pg * mask).sum() / mask.sum()


def _logprob_entropy(code, logits, target, group, kw):
    if code == "funcol":
        return _funcol_logprob(logits, target, group if group is not None else dist.group.WORLD), None
    if code == "megatron":
        return megatron_logprob(logits, target, temperature=kw.get("temperature", 1.0)), None
    if code == "megatron fused":  # [T, 1] log-probs of [T, 1, V/tp] logits
        return megatron_fused_logprob(logits, target)[:, 0], None
    return slime_style_logprob_entropy(logits, target, group, **kw)


def _head(spelling, hidden, weight, bias):
    if spelling == "linear":
        return F.linear(hidden, weight, bias)
    if spelling == "transposed":  # an [H, V/tp] copy of the weight: hidden @ W, not fused
        logits = hidden @ weight.t().contiguous()
        return logits if bias is None else logits + bias
    if spelling == "batched":  # [B, S, H] -> [B, S, V/tp] -> [B * S, V/tp]
        return F.linear(hidden.view(3, -1, hidden.shape[-1]), weight, bias).view(-1, weight.shape[0])
    logits = hidden @ weight.t()
    return logits if bias is None else logits + bias


def _from_hidden(code, kw, spelling, z_loss, group, hidden, weight, bias, target, old, adv, mask):
    logits = _head(spelling, hidden, weight, bias)
    logprob, entropy = _logprob_entropy(code, logits, target, group, kw)
    loss = _masked_ppo(logprob, entropy, old, adv, mask)
    if z_loss:  # a second reader of the logits: the matmul must stay outside
        loss = loss + 1e-3 * logits.pow(2).mean()
    return loss


def _from_logits(code, kw, z_loss, group, logits, target, old, adv, mask):
    """Today's op: the same loss given the logits as an input."""
    logprob, entropy = _logprob_entropy(code, logits, target, group, kw)
    loss = _masked_ppo(logprob, entropy, old, adv, mask)
    return loss + 1e-3 * logits.pow(2).mean() if z_loss else loss


# (code, kwargs, dtype, spelling, bias, z_loss)
CASES = [
    ("slime", {"with_entropy": True, "temperature": 0.7}, torch.float64, "linear", False, False),
    ("slime", {"with_entropy": True, "with_entropy_grad": False, "temperature": 0.7}, torch.float64, "linear", True,
     False),
    ("slime", {"with_entropy": True}, torch.float64, "matmul", True, False),
    ("slime", {}, torch.float64, "matmul", False, False),
    ("slime", {"with_entropy": True, "temperature": 0.7}, torch.float32, "batched", True, False),
    ("slime", {"with_entropy": True, "temperature": 0.7}, torch.bfloat16, "linear", True, False),  # the fp32 cast
    ("megatron", {"temperature": 0.7}, torch.float32, "linear", True, False),
    ("megatron fused", {}, torch.bfloat16, "matmul", False, False),  # a bf16 lm_head, slime's log-prob call
    ("funcol", {}, torch.float64, "matmul", True, False),  # inlined code, its gradient summed over ranks
    ("slime", {"with_entropy": True}, torch.float64, "linear", False, True),  # not fused
    ("slime", {}, torch.float64, "transposed", False, False),  # not fused
]
# Why a case is not fused, in the reason recorded (None: fused).
NOT_FUSED = {"zloss": "its logits are also read outside the vocab-parallel op (pow",
             "transposed": "its weight is [H, V/tp]"}


def _not_fused(case):
    return NOT_FUSED["zloss"] if case[5] else NOT_FUSED.get(case[3])


def _data(world, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = world * WIDTH
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, H, generator=g, dtype=torch.float64) / H ** 0.5 * 2
    bias = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.5
    target = torch.randint(0, vocab, (T,), generator=g)
    target[:3] = torch.arange(3)  # rank 0 owns these
    old = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    mask = torch.rand(T, generator=g) < 0.7
    mask[0] = True
    return hidden, weight, bias, target, old, adv, mask


def _reference(world, code, kw, spelling, with_bias, z_loss, data):
    """Per rank, the loss and (hidden partial, weight shard, bias shard) gradients in float64 on one
    device: one hidden copy per rank, so that each copy's gradient is that rank's partial. (A
    rank's z-loss is over its own slice: the sum of all ranks' has the same gradients.)"""
    hidden, weight, bias, target, old, adv, mask = data
    hs = [hidden.detach().clone().requires_grad_() for _ in range(world)]
    ws = [weight[r * WIDTH:(r + 1) * WIDTH].detach().clone().requires_grad_() for r in range(world)]
    bs = [bias[r * WIDTH:(r + 1) * WIDTH].detach().clone().requires_grad_() for r in range(world)] if with_bias \
        else None
    logits = torch.cat([_head(spelling, hs[r], ws[r], bs[r] if with_bias else None) for r in range(world)], -1)
    logp = (logits / kw.get("temperature", 1.0)).log_softmax(-1)
    logprob = logp.gather(1, target[:, None])[:, 0]
    entropy = None
    if kw.get("with_entropy"):
        entropy = -(logp.exp() * logp).sum(-1)
        if not kw.get("with_entropy_grad", True):
            entropy = entropy.detach()
    loss = _masked_ppo(logprob, entropy, old, adv, mask)
    z = [1e-3 * piece.pow(2).mean() if z_loss else loss.new_zeros(()) for piece in logits.split(WIDTH, -1)]
    (loss + sum(z)).backward()
    return [(loss.detach() + z[r].detach(), (hs[r].grad, ws[r].grad, bs[r].grad if with_bias else None))
            for r in range(world)]


def _site(record):
    return [dict(kind=s.kind, lm_head=s.lm_head, hidden_shape=s.hidden_shape, shape=s.shape, tp_size=s.tp_size,
                 collectives=[(c.op, c.group_size, c.bytes) for c in s.collectives]) for s in record.sites]


def _case(rank, world, code, kw, dtype, spelling, with_bias, z_loss, group=None, group_rank=None):
    group_rank = rank if group_rank is None else group_rank
    group_world = world if group is None else dist.get_world_size(group)
    data = _data(group_world)
    hidden, weight, bias, target, old, adv, mask = data
    if code.startswith("megatron"):
        group = None  # megatron-core's loss gets its group from parallel_state
    shard = slice(group_rank * WIDTH, (group_rank + 1) * WIDTH)
    h = hidden.to(dtype).clone().requires_grad_()
    w = weight[shard].to(dtype).clone().requires_grad_()
    b = bias[shard].to(dtype).clone().requires_grad_() if with_bias else None
    rest = (target, old, adv, mask)

    torch._dynamo.reset()
    # The op that recomputes in backward, with today's collectives: its losses are token means, whose
    # gradients the op would compute in forward, block by block (test_megatron_output_layer.py).
    backend = graphpass.Backend(inner="aot_eager", gradients_in_forward=False)
    fn = torch.compile(functools.partial(_from_hidden, code, kw, spelling, z_loss, group), backend=backend)
    with collectives() as forward_log:
        loss = fn(h, w, b, *rest)
    with collectives() as backward_log:
        loss.backward()
    record = backend.records[0]

    # Today's op: the logits given as an input of the compiled loss (its matmul outside).
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b2 = b.detach().clone().requires_grad_() if with_bias else None
    torch._dynamo.reset()  # a second shape of the Function would compile it dynamic
    today_backend = graphpass.Backend(inner="aot_eager")
    today = torch.compile(functools.partial(_from_logits, code, kw, z_loss, group), backend=today_backend)
    logits = _head(spelling, h2, w2, b2)
    with collectives() as today_forward:
        today_loss = today(logits, *rest)
    with collectives() as today_backward:
        today_loss.backward()

    ref_loss, ref_grads = _reference(group_world, code, kw, spelling, with_bias, z_loss, data)[group_rank]
    # Functional all-reduces sum each rank's (equal) loss's gradient over the ranks in backward.
    ref_h, ref_w, ref_b = [None if g is None else g * (group_world if code == "funcol" else 1) for g in ref_grads]
    return dict(
        loss=mixed_error(loss, ref_loss), hidden=mixed_error(h.grad, ref_h), weight=mixed_error(w.grad, ref_w),
        bias=mixed_error(b.grad, ref_b) if with_bias else 0.0,
        grad_dtypes=[t.grad.dtype for t in (h, w, b) if t is not None],
        vs_today=max(mixed_error(h.grad, h2.grad), mixed_error(w.grad, w2.grad), mixed_error(b.grad, b2.grad) if with_bias else 0.0),
        sites=_site(record), today_sites=_site(today_backend.records[0]),
        rejected=[c.reason for c in record.rejected], fallback=record.fallback_reason,
        log=(forward_log, backward_log), today_log=(today_forward, today_backward))


def _differing(rank, world):
    """Rank 0 trains; rank 1 runs under no_grad with hidden states that do not require grad."""
    hidden, weight, bias, target, *_ = _data(world, seed=1)
    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")

    def fn(h, w, b, t):
        return slime_style_logprob_entropy(F.linear(h, w, b), t, None, with_entropy=True)

    compiled = torch.compile(fn, backend=backend)
    shard = slice(rank * WIDTH, (rank + 1) * WIDTH)
    h = hidden.float().requires_grad_(rank == 0)
    w, b = weight[shard].float().requires_grad_(rank == 0), bias[shard].float()
    with collectives() as log:
        with torch.set_grad_enabled(rank == 0):
            logprob, entropy = compiled(h, w, b, target)
        if rank == 0:
            (logprob.sum() + entropy.sum()).backward()
    ref = (F.linear(hidden, weight, bias)).log_softmax(-1).gather(1, target[:, None])[:, 0]
    return log, mixed_error(logprob, ref), [s.lm_head for r in backend.records for s in r.sites]


def _memory(rank, world):
    """The memory model of a fused site: its floor is the head's gradients, no [T, V/tp] value lives."""
    from graphpass.memory import estimate_peak

    hidden, weight, bias, target, old, adv, mask = _data(world)
    shard = slice(rank * WIDTH, (rank + 1) * WIDTH)
    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")
    fn = torch.compile(functools.partial(_from_hidden, "slime", {"with_entropy": True}, "linear", False, None),
                       backend=backend)
    fn(hidden.requires_grad_(), weight[shard].clone().requires_grad_(), bias[shard].clone().requires_grad_(),
       target, old, adv, mask).backward()
    record = backend.records[0]
    assert record.fallback_reason is None and record.graph_module is not None, record.fallback_reason
    est = estimate_peak(record.graph_module, record.example_inputs, record.sites)
    return est.floor_bytes, [lt.shape for lt in est.live_at_peak], est.peak_bytes


def _ranks(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        cases = [_case(rank, world, *case) for case in CASES]
    finally:
        parallel_state.destroy_model_parallel()
    single, _ = dist.new_subgroups(group_size=1)
    one = _case(rank, world, "slime", {"with_entropy": True, "temperature": 0.7}, torch.float64, "linear", True,
                False, group=single, group_rank=0)
    return dict(cases=cases, one=one, differing=_differing(rank, world), memory=_memory(rank, world))


_spawned = spawned.once(_ranks, WORLD, timeout_s=240, requires="megatron.core")


def _case_id(case):
    code, kw, dtype, spelling, bias, z_loss = case
    return (f"{code}-{spelling}{'+bias' if bias else ''}{'-zloss' if z_loss else ''}-"
            f"{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'plain'}-{str(dtype).removeprefix('torch.')}")


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_loss_and_every_gradient_match_one_device(index):
    code, kw, dtype, spelling, with_bias, z_loss = CASES[index]
    for rank, result in enumerate(_spawned()):
        r = result["cases"][index]
        where = (_case_id(CASES[index]), rank, r)
        tol = TOLERANCE[dtype]
        assert r["fallback"] is None, where
        assert max(r["loss"], r["hidden"], r["weight"], r["bias"]) <= tol, where
        assert r["grad_dtypes"] == [dtype] * (3 if with_bias else 2), where
        if dtype != torch.bfloat16:
            assert r["vs_today"] <= tol, where


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_the_site_says_lm_head_and_issues_todays_collectives_on_every_rank(index):
    code, kw, dtype, spelling, with_bias, z_loss = CASES[index]
    per_rank = _spawned()
    for rank, result in enumerate(per_rank):
        r = result["cases"][index]
        where = (_case_id(CASES[index]), rank, r)
        (site,) = r["sites"]
        (today,) = r["today_sites"]
        why = _not_fused(CASES[index])
        assert site["lm_head"] is (why is None) and not today["lm_head"], where
        lead = (T, 1) if code == "megatron fused" else (T,)  # it reads logits[:, None]
        assert site["hidden_shape"] == (None if why else (*lead, H)), where
        assert site["shape"] == today["shape"] == (*lead, WIDTH) and site["tp_size"] == WORLD, where
        assert site["kind"] == today["kind"] and site["collectives"] == today["collectives"], where
        summed = [("all_reduce in backward", WORLD)] if code == "funcol" else []
        assert [c[:2] for c in site["collectives"]] == [("all_gather", WORLD)] + summed, where
        fused_rejections = [why for why in r["rejected"] if why.startswith("lm_head not fused")]
        if why:
            assert len(fused_rejections) == 1 and why in fused_rejections[0], where
        else:
            assert fused_rejections == [], where
        forward, backward = r["log"]
        assert r["log"] == r["today_log"], where
        assert [entry[0] for entry in forward] == [ALL_GATHER], where
        assert [entry[0] for entry in backward] == (["all_reduce"] if code == "funcol" else []), where
        assert r["log"] == per_rank[0]["cases"][index]["log"], where


def test_a_group_of_one_rank_fuses_and_issues_no_collective():
    for rank, result in enumerate(_spawned()):
        r = result["one"]
        assert max(r["loss"], r["hidden"], r["weight"], r["bias"]) <= 1e-10, (rank, r)
        (site,) = r["sites"]
        assert site["lm_head"] and site["tp_size"] == 1 and site["hidden_shape"] == (T, H), (rank, r)
        assert r["log"] == r["today_log"] == ([], []), (rank, r)


def test_ranks_differing_in_grad_mode_issue_the_same_collectives():
    per_rank = _spawned()
    logs = [result["differing"][0] for result in per_rank]
    assert all(log == logs[0] for log in logs) and [e[0] for e in logs[0]] == [ALL_GATHER], logs
    for result in per_rank:
        _, err, fused = result["differing"]
        assert err < 1e-5 and fused == [True], (err, fused)


def test_memory_model_of_a_fused_site():
    for floor, live, peak in (result["memory"] for result in _spawned()):
        assert floor == (T * H + WIDTH * H + WIDTH) * 8, floor  # hidden.grad, W.grad, b.grad in float64
        assert (T, WIDTH) not in live, live
        assert peak > 0


# ---- one process -----------------------------------------------------------------------------------
def test_op_without_torch_distributed_matches_linear_then_todays_op():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    g = torch.Generator().manual_seed(3)
    for dtype, with_bias, leading in ((torch.float64, True, (2, 5)), (torch.float32, False, (9,))):
        hidden = torch.randn(*leading, H, generator=g).to(dtype).requires_grad_()
        weight = torch.randn(WIDTH, H, generator=g).to(dtype).requires_grad_()
        bias = torch.randn(WIDTH, generator=g).to(dtype).requires_grad_() if with_bias else None
        target = torch.randint(0, WIDTH, leading, generator=g)
        target.view(-1)[1] = -100
        tensors = [t for t in (hidden, weight, bias) if t is not None]
        lp, ent = vocab_parallel_lm_head_logprob_entropy(hidden, weight, target, bias=bias, temperature=0.7,
                                                         with_entropy=True, chunk_size=4)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads = [t.grad for t in tensors]
        copies = [t.detach().clone().requires_grad_() for t in tensors]
        logits = F.linear(copies[0], copies[1], copies[2] if with_bias else None)
        ref_lp, ref_ent = vocab_parallel_logprob_entropy(logits, target, temperature=0.7, with_entropy=True)
        (ref_lp.sum() + 0.1 * ref_ent.sum()).backward()
        tol = TOLERANCE[dtype]
        assert mixed_error(lp, ref_lp) <= tol and mixed_error(ent, ref_ent) <= tol
        for mine, theirs in zip(grads, copies):
            assert mine.dtype == dtype and mixed_error(mine, theirs.grad) <= tol
