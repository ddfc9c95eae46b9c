"""megatron-core's own output layer compiled with graphpass: its real `ColumnParallelLinear` at
TP=2 on gloo ranks (`use_cpu_initialization`, no gradient accumulation fusion; also sequence
parallel), then a vocab-parallel loss: a slime-style Function, or megatron-core's
`vocab_parallel_cross_entropy` on a clone of the logits.

graphpass's stand-in for megatron-core's linear Function (`graphpass.integrations.megatron`) lets
Dynamo trace the layer whole, so the vocab-parallel op takes in its matmul: an lm_head site, the
`[s, b, v/tp]` logits and their gradient never stored, and the losses (token means) are taken in:
the gradients are computed in forward, block by block (`gradients_in_forward=False`: recomputed
in backward). Checked per case: the loss and the
gradients of the hidden states, the weight shard and the bias shard against eager megatron-core
(the same function, uncompiled) and against one device in float64; the collectives each rank
issued (the profiler's gloo events, forward and backward), the same on every rank, also when the
ranks differ in which inputs require grad. Where the logits are also returned, or come from
outside the compiled graph, the matmul stays outside and the site says why. All cases run in one
spawn (`_spawned`); the registration itself is checked in one process.
"""

from __future__ import annotations

import contextlib
import sys
import unittest.mock

import pytest
import torch
import torch.distributed as dist

import graphpass
from tests import spawned
from bench.tp import profiled
from bench.workloads.tp_losses import slime_style_logprob_entropy
from tests.helpers import mixed_error
from tests.tensor_parallel.test_vocab_parallel_lm_head import TOLERANCE, _masked_ppo

pytestmark = pytest.mark.heavy  # a minute or more: xdist starts it early (tests/conftest.py)

S, B, H, WIDTH, WORLD = 8, 2, 16, 20, 2  # sequence, batch, hidden size, V/tp, tp
TEMPERATURE = 0.7

# (loss, dtype, sequence_parallel, bias, variant, inner compiler); variant: "" plain, "returned" (the
# logits are also an output: not fused), "frozen" (the weight does not require grad), "differing"
# (rank 1's hidden states do not require grad), "recompute" (`gradients_in_forward=False`), and two
# losses that are no sum of per-token terms (`_token_loss`).
CASES = [
    ("slime", torch.float64, False, False, "", "aot_eager"),
    ("slime", torch.float64, True, True, "", "aot_eager"),
    ("megatron", torch.float32, False, True, "", "inductor"),
    ("megatron", torch.float32, True, False, "", "aot_eager"),
    ("slime", torch.float32, False, True, "differing", "aot_eager"),
    ("slime", torch.float64, True, False, "frozen", "aot_eager"),
    ("slime", torch.float64, False, False, "returned", "aot_eager"),
    ("slime", torch.float64, True, True, "recompute", "aot_eager"),
    ("megatron", torch.float32, False, False, "recompute", "aot_eager"),
    ("slime", torch.float64, False, False, "on-policy", "aot_eager"),
    ("megatron", torch.float32, True, False, "per-sequence", "aot_eager"),
]
# Why the op recomputes in backward, per variant (the rest compute their gradients in forward).
RECOMPUTE = {"recompute": "gradients_in_forward=False",
             "on-policy": "its loss math reads detach, computed from its own outputs",
             "per-sequence": "its outputs reach the loss through sum"}


def _case_id(case):
    loss, dtype, sp, bias, variant, inner = case
    return "-".join(filter(None, [loss, str(dtype).removeprefix("torch."), "sp" if sp else "", "bias" if bias else "",
                                  variant, inner]))


def _loss(loss, logits, target, old, adv, mask, variant=""):
    """The PPO loss of megatron's `[s, b, v/tp]` logits: per-token log-probs (and slime's entropy)."""
    if loss == "megatron":
        from megatron.core import tensor_parallel

        logprob, entropy = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), target), None
    else:
        logprob, entropy = slime_style_logprob_entropy(logits.view(-1, logits.shape[-1]), target.view(-1),
                                                       with_entropy=True, temperature=TEMPERATURE)
    return _token_loss(variant, logprob.reshape(-1), entropy, old, adv, mask)


def _token_loss(variant, logprob, entropy, old, adv, mask):
    """`_masked_ppo`; "on-policy": against the detached log-probs themselves (GRPO's single step);
    "per-sequence": of each sequence's summed log-prob (GSPO-like)."""
    if variant == "on-policy":
        return _masked_ppo(logprob, entropy, logprob.detach(), adv, mask)
    if variant == "per-sequence":
        per_sequence = logprob.view(S, B).sum(0)
        return _masked_ppo(per_sequence, None, old.view(S, B).sum(0), adv[:B], mask[:B])
    return _masked_ppo(logprob, entropy, old, adv, mask)


def _data(dtype):
    g = torch.Generator().manual_seed(0)
    vocab = WORLD * WIDTH
    hidden = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, H, generator=g, dtype=torch.float64) / H ** 0.5 * 2
    bias = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.5
    target = torch.randint(0, vocab, (S, B), generator=g)
    target[:2] = torch.arange(4).view(2, 2)  # rank 0 owns these
    old = -torch.rand(S * B, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(S * B, generator=g, dtype=torch.float64)
    mask = torch.rand(S * B, generator=g) < 0.7
    mask[:B] = True  # the per-sequence loss reads the first B
    return hidden, weight, bias, target, old.to(dtype), adv.to(dtype), mask


def _reference(loss, data, with_bias, variant):
    """(loss, hidden.grad [S, B, H], weight.grad [V, H], bias.grad [V]) on one device in float64."""
    hidden, weight, bias, target, old, adv, mask = data
    hidden, weight, bias = (t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    logits = hidden @ weight.t() + (bias if with_bias else 0)
    logp = (logits / (TEMPERATURE if loss == "slime" else 1.0)).log_softmax(-1)
    logprob = logp.gather(-1, target[..., None]).reshape(-1)
    entropy = -(logp.exp() * logp).sum(-1).reshape(-1) if loss == "slime" else None
    value = _token_loss(variant, logprob, entropy, old.double(), adv.double(), mask)
    value.backward()
    return value.detach(), hidden.grad, weight.grad, bias.grad


@contextlib.contextmanager
def _megatron_on_the_cpu():
    """Eager megatron-core under sequence parallelism allocates its gather buffers on
    `torch.cuda.current_device()`: the CPU here (the reference only; compiled code never asks)."""
    with unittest.mock.patch("torch.cuda.current_device", lambda: torch.device("cpu")):
        yield


def _layer(dtype, sequence_parallel, with_bias, weight, bias, rank):
    from megatron.core import tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(tensor_model_parallel_size=WORLD, sequence_parallel=sequence_parallel,
                                 use_cpu_initialization=True, gradient_accumulation_fusion=False, params_dtype=dtype)
    layer = tensor_parallel.ColumnParallelLinear(H, WORLD * WIDTH, config=config, init_method=torch.nn.init.zeros_,
                                                 bias=with_bias, gather_output=False)
    shard = slice(rank * WIDTH, (rank + 1) * WIDTH)
    with torch.no_grad():
        layer.weight.copy_(weight[shard])
        if with_bias:
            layer.bias.copy_(bias[shard])
    return layer


def _case(rank, loss, dtype, sequence_parallel, with_bias, variant, inner):
    data = _data(dtype)
    hidden, weight, bias, target, old, adv, mask = data
    layer = _layer(dtype, sequence_parallel, with_bias, weight, bias, rank)
    if variant == "frozen":
        layer.weight.requires_grad_(False)
    rows = slice(rank * S // WORLD, (rank + 1) * S // WORLD) if sequence_parallel else slice(None)
    local = hidden[rows].to(dtype)

    def head_and_loss(h, target, old, adv, mask):
        logits, _ = layer(h)
        value = _loss(loss, logits, target, old, adv, mask, variant)
        return (value, logits) if variant == "returned" else value

    def run(fn, requires_grad=True):
        """(loss, [hidden, weight, bias] gradients, the step's gloo collectives) of one forward + backward."""
        h = local.clone().requires_grad_(requires_grad)
        for p in layer.parameters():
            p.grad = None
        state = {}

        def step():
            out = fn(h, target, old, adv, mask)
            state["loss"] = out[0] if variant == "returned" else out
            state["loss"].backward()

        issued = profiled(step)
        params = [layer.weight] + ([layer.bias] if with_bias else [])
        return state["loss"].detach(), [h.grad] + [p.grad for p in params], issued

    requires_grad = not (variant == "differing" and rank == 1)
    torch._dynamo.reset()
    backend = graphpass.Backend(inner=inner, gradients_in_forward=variant != "recompute")
    value, grads, issued = run(torch.compile(head_and_loss, backend=backend), requires_grad)
    with _megatron_on_the_cpu():
        eager_value, eager_grads, eager_issued = run(head_and_loss, requires_grad)
        eager_function = type(layer(local.clone().requires_grad_())[0].grad_fn).__name__
    ref_value, ref_h, ref_w, ref_b = _reference(loss, data, with_bias, variant)
    shard = slice(rank * WIDTH, (rank + 1) * WIDTH)
    ref_grads = [ref_h[rows] if requires_grad else None, None if variant == "frozen" else ref_w[shard]]
    ref_grads += [ref_b[shard]] if with_bias else []

    return dict(
        vs_ref=_max_err(value, grads, ref_value, ref_grads), vs_eager=_max_err(value, grads, eager_value, eager_grads),
        eager_vs_ref=_max_err(eager_value, eager_grads, ref_value, ref_grads), eager_function=eager_function,
        grad_dtypes=[g.dtype for g in grads if g is not None],
        sites=[dict(kind=s.kind, lm_head=s.lm_head, hidden_shape=s.hidden_shape, shape=s.shape, tp_size=s.tp_size,
                    lm_head_reason=s.lm_head_reason, gradients_in_forward=s.gradients_in_forward,
                    recompute_reason=s.recompute_reason, collectives=[c.op for c in s.collectives])
               for r in backend.records for s in r.sites],
        rejected=[c.reason for r in backend.records for c in r.rejected],
        fallbacks=[r.fallback_reason for r in backend.records if r.fallback_reason], graphs=len(backend.records),
        issued=issued, eager_issued=eager_issued)


def _max_err(value, grads, ref_value, ref_grads) -> float:
    """The largest error of the loss and of every gradient; the same gradients must be None."""
    assert [g is None for g in grads] == [g is None for g in ref_grads], (grads, ref_grads)
    return max([mixed_error(value, ref_value)] + [mixed_error(a, b) for a, b in zip(grads, ref_grads) if a is not None])


def _outside(rank, spelling):
    """The site of the loss alone, its logits from outside its graph: given as an input, or carried
    over a graph break after the output layer."""
    hidden, weight, bias, target, old, adv, mask = _data(torch.float32)
    layer = _layer(torch.float32, False, False, weight, bias, rank)

    def after_a_break(h, target, old, adv, mask):
        logits, _ = layer(h)
        torch._dynamo.graph_break()
        return _loss("slime", logits, target, old, adv, mask)

    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager")
    h = hidden.float().requires_grad_()
    if spelling == "input":
        fn = torch.compile(lambda logits, *rest: _loss("slime", logits, *rest), backend=backend)
        fn(layer(h)[0], target, old, adv, mask).backward()
    else:
        torch.compile(after_a_break, backend=backend)(h, target, old, adv, mask).backward()
    return [(s.lm_head, s.lm_head_reason) for r in backend.records for s in r.sites]


def _grad_modes(rank, modes, gradients_in_forward):
    """The loss's forward on each rank in its grad mode `modes[rank]` (forward only: the layer's
    backward all-reduce would wait for a rank without grad, in eager megatron-core too): (the
    forward's gloo collectives, the loss's error against one device)."""
    data = _data(torch.float64)
    hidden, weight, bias, target, old, adv, mask = data
    layer = _layer(torch.float64, False, False, weight, bias, rank)
    torch._dynamo.reset()
    backend = graphpass.Backend(inner="aot_eager", gradients_in_forward=gradients_in_forward)
    fn = torch.compile(lambda h, *rest: _loss("slime", layer(h)[0], *rest), backend=backend)
    state = {}

    def forward():
        with torch.set_grad_enabled(modes[rank]):
            state["loss"] = fn(hidden.clone().requires_grad_(), target, old, adv, mask)

    issued = profiled(forward)
    return issued, mixed_error(state["loss"], _reference("slime", data, False, "")[0])


# (grad mode per rank, gradients_in_forward): without grad on every rank, the op's blocks; ranks in
# different grad modes trace different graphs (Dynamo inlines the Function where no input requires
# grad), which issue the same one all-gather only when the op recomputes in backward.
GRAD_MODES = [((False, False), True), ((True, False), False)]


def _ranks(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        return dict(cases=[_case(rank, *case) for case in CASES],
                    outside={spelling: _outside(rank, spelling) for spelling in ("input", "break")},
                    grad_modes=[_grad_modes(rank, *case) for case in GRAD_MODES])
    finally:
        parallel_state.destroy_model_parallel()


_spawned = spawned.once(_ranks, WORLD, timeout_s=300, requires="megatron.core")


def _per_rank(index):
    """(rank, that rank's results of case `index`, what a failed assertion shows) per rank."""
    for rank, result in enumerate(_spawned()):
        r = result["cases"][index]
        yield rank, r, (_case_id(CASES[index]), rank, r)


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_loss_and_every_gradient_match_eager_megatron_and_one_device(index):
    loss, dtype, sp, with_bias, variant, inner = CASES[index]
    for _, r, where in _per_rank(index):
        assert r["fallbacks"] == [], where
        # megatron-core's cross-entropy computes in fp32 whatever its input: float64 parity is the slime loss's.
        tol = TOLERANCE[dtype]
        assert r["vs_ref"] <= tol and r["vs_eager"] <= tol and r["eager_vs_ref"] <= tol, where
        assert set(r["grad_dtypes"]) == {dtype}, where
        # Eager megatron-core runs its own Function (the stand-in is for traced code only).
        assert r["eager_function"] == ("LinearWithFrozenWeightBackward" if variant == "frozen" else
                                       "LinearWithGradAccumulationAndAsyncCommunicationBackward"), where


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_the_output_layer_is_fused_into_one_graph_with_the_loss(index):
    loss, dtype, sp, with_bias, variant, inner = CASES[index]
    for _, r, where in _per_rank(index):
        assert r["graphs"] == 1, where  # no graph break in megatron-core's layer
        (site,) = r["sites"]
        assert site["tp_size"] == WORLD and site["shape"][-1] == WIDTH, where
        assert site["kind"] == ("-logprob" if loss == "megatron" else "logprob+entropy"), where
        if variant == "returned":
            assert not site["lm_head"] and site["lm_head_reason"] == "its logits are also an output of the graph", where
            assert any(why.startswith("lm_head not fused") and "output of the graph" in why for why in r["rejected"])
            continue
        assert site["lm_head"] and site["lm_head_reason"] is None, where
        assert not any(why.startswith("lm_head not fused") for why in r["rejected"]), where
        # Under sequence parallelism, the gathered rows; the slime-style Function reads them as [s * b, h].
        assert site["hidden_shape"] == ((S, B, H) if loss == "megatron" else (S * B, H)), where
        # Both losses are token means: the op computes the gradients in forward, one block at a time.
        if variant in RECOMPUTE:
            assert not site["gradients_in_forward"] and RECOMPUTE[variant] in site["recompute_reason"], where
            assert site["collectives"] == ["all_gather"], where
        else:
            assert site["gradients_in_forward"] and site["recompute_reason"] is None, where
            assert len(site["collectives"]) > 1 and set(site["collectives"]) == {"all_gather"}, where


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_every_rank_issues_the_same_collectives(index):
    loss, dtype, sp, with_bias, variant, inner = CASES[index]
    per_rank = [result["cases"][index] for result in _spawned()]
    where = (_case_id(CASES[index]), [r["issued"] for r in per_rank])
    assert all(r["issued"] == per_rank[0]["issued"] for r in per_rank), where
    # Forward: the hidden rows' all-gather (sequence parallel), the op's all-gathers of row
    # statistics (one per call, or one per block where it computes its gradients in forward, as
    # its site records); backward: the hidden states' gradient reduce-scattered (sequence
    # parallel; gloo runs it as an all-reduce) or all-reduced, as megatron-core's Function does,
    # whichever inputs require grad.
    (site,) = per_rank[0]["sites"]
    assert per_rank[0]["issued"] == (["all_gather"] if sp else []) + site["collectives"] + ["all_reduce"], where


@pytest.mark.parametrize("index", range(len(GRAD_MODES)), ids=["no-grad", "mixed-recompute"])
def test_ranks_in_either_grad_mode_issue_the_same_collectives(index):
    per_rank = [result["grad_modes"][index] for result in _spawned()]
    logs = [issued for issued, _ in per_rank]
    assert logs[0] == logs[1] and logs[0] and set(logs[0]) == {"all_gather"}, logs
    assert all(err <= 1e-10 for _, err in per_rank), per_rank


@pytest.mark.parametrize("spelling", ["input", "break"])
def test_logits_from_outside_the_graph_say_why_they_are_not_fused(spelling):
    for rank, result in enumerate(_spawned()):
        sites = result["outside"][spelling]
        ((lm_head, why),) = sites
        where = (spelling, rank, sites)
        assert not lm_head and why.startswith("the logits come from outside this graph ("), where
        assert why.endswith("); compile a function that computes them from the hidden states"), where
        if spelling == "input":
            assert "(an input of the compiled function)" in why, where
        else:
            assert f"Dynamo broke the graph at {__name__.rsplit('.', 1)[-1]}.py:" in why, where
            assert "graph_break()" in why, where


# ---- one process ---------------------------------------------------------------------------------
def test_registration_is_idempotent_and_leaves_megatron_core_as_it_is():
    pytest.importorskip("megatron.core")
    from megatron.core.tensor_parallel import layers

    from graphpass.integrations import megatron

    originals = (layers.linear_with_grad_accumulation_and_async_allreduce, layers.linear_with_frozen_weight)
    assert megatron.register() and megatron.register()
    assert (layers.linear_with_grad_accumulation_and_async_allreduce, layers.linear_with_frozen_weight) == originals


def test_a_library_imported_later_gets_its_stand_ins_once(tmp_path, monkeypatch):
    from graphpass import integrations

    (tmp_path / "late_library").mkdir()
    (tmp_path / "late_library" / "__init__.py").write_text("")
    (tmp_path / "late_library" / "layers.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    integrations._when_imported("late_library.layers", lambda module: seen.append(module.VALUE))
    integrations._when_imported("late_library.layers", lambda module: seen.append("twice"))
    assert seen == []
    import late_library.layers  # noqa: F401

    assert seen == [3] and not any(isinstance(f, integrations._AfterImport) and f.name == "late_library.layers"
                                   for f in sys.meta_path)
    integrations._when_imported("late_library.layers", lambda module: seen.append(module.VALUE * 2))
    assert seen == [3, 6]
    monkeypatch.delitem(sys.modules, "late_library.layers")
    monkeypatch.delitem(sys.modules, "late_library")
