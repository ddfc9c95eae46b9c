"""TRL's default GRPO path compiled with graphpass (`graphpass.integrations.trl`).

The stand-in for TRL's fused head (`ChunkedLogProbFunction`) alone: compiled, an lm_head site, its
values and every gradient against TRL's own Function; arguments it does not model keep TRL's
Function. Then `GRPOTrainer.train()` with `_get_per_token_logps_and_entropies` compiled with
graphpass against eager TRL (logged losses) and against inductor (parameters): a tiny random Qwen2,
a character tokenizer built locally, a Python reward, an in-memory dataset; no downloads.
"""

from __future__ import annotations

import pytest
import torch

import graphpass

trl = pytest.importorskip("trl", reason="TRL is not installed (the `test` extra installs it)")
from trl.kernels.chunked_logprob import ChunkedLogProbFunction  # noqa: E402

from bench.trl import char_tokenizer, grpo_trainer, tiny_qwen2  # noqa: E402
from graphpass.integrations import trl as trl_integration  # noqa: E402

N, H, V = 24, 8, 40


def _function_call(hidden, weight, bias, targets, *args):
    return ChunkedLogProbFunction.apply(hidden, weight, bias, targets, *args)


def _run(fn, args, seed=0):
    """fn's outputs and the gradients of hidden, weight and bias for random output gradients."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(V, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    outputs = fn(hidden, weight, bias, targets, *args)
    differentiable = [o for o in outputs[:2] if o is not None]
    loss = sum((o * torch.randn(N, dtype=o.dtype, generator=g)).sum() for o in differentiable)
    loss.backward()
    return outputs, (hidden.grad, weight.grad, bias.grad)


def test_registered_when_trl_is_imported():
    assert trl_integration._registered  # graphpass was imported first: registered on TRL's import
    assert trl_integration.register()


@pytest.mark.parametrize("outputs", [("log_probs", "entropy"), ("log_probs",)])
@pytest.mark.parametrize("temperature, softcap, scale", [(1.0, None, 1.0), (0.7, None, 1.0), (0.7, 3.0, 0.5)])
def test_stand_in_matches_trl_function(outputs, temperature, softcap, scale):
    """float64 inputs (TRL folds its tiles in fp32, and so does the stand-in: fp32 tolerance)."""
    args = (temperature, 16, softcap, scale, outputs)
    expected, expected_grads = _run(_function_call, args)
    backend = graphpass.Backend(inner="aot_eager")
    got, grads = _run(torch.compile(_function_call, backend=backend, fullgraph=True), args)
    [site] = [s for r in backend.records for s in r.sites]
    assert site.lm_head and site.kind == ("logprob+entropy" if "entropy" in outputs else "logprob")
    for e, o in zip(expected, got):
        assert (e is None) == (o is None)
        if e is not None:
            assert o.dtype == e.dtype
            torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)
    for e, o in zip(expected_grads, grads):
        assert o.dtype == e.dtype
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", ["mean_logits", "is_top1", "log_sum_sq_probs"])
def test_outputs_it_does_not_model_keep_trls_function(extra):
    """An output the stand-in does not compute: TRL's Function runs (a graph break), never a guess.

    Dynamo then compiles the frames of TRL's own forward, where graphpass may chunk a tile's
    row-local math (a rowwise site, exact); what must not appear is the stand-in's lm_head site.
    """
    args = (0.7, 16, None, 1.0, ("log_probs", "entropy", extra))
    expected, expected_grads = _run(_function_call, args)
    backend = graphpass.Backend(inner="aot_eager")
    got, grads = _run(torch.compile(_function_call, backend=backend), args)
    sites = [s for r in backend.records for s in r.sites]
    assert not [s for s in sites if s.lm_head or not s.kind.startswith("rowwise")]
    for e, o in zip(expected, got):
        assert (e is None) == (o is None)
        if e is not None:
            torch.testing.assert_close(o, e, rtol=0, atol=0)
    for e, o in zip(expected_grads, grads):
        torch.testing.assert_close(o, e, rtol=0, atol=0)


def test_target_outside_the_vocabulary_raises():
    """TRL's kernel returns -logsumexp for it; compiled, graphpass's op refuses it (as eager gather)."""
    compiled = torch.compile(_function_call, backend=graphpass.Backend(inner="aot_eager"))
    targets = torch.tensor([1, 2, V, 3])
    with pytest.raises(IndexError, match="outside the vocabulary"):
        compiled(torch.randn(4, H), torch.randn(V, H), None, targets, 1.0, 16, None, 1.0, ("log_probs",))


def test_zero3_keeps_trls_function(monkeypatch):
    monkeypatch.setattr(trl_integration, "_zero3_enabled", lambda: True)
    assert "ZeRO-3" in trl_integration._unsupported(("entropy",))


# ---- GRPOTrainer.train() ---------------------------------------------------------------------------

STEPS = 3


def _train(backend, tmp_path):
    """GRPO for STEPS steps from seed 0 (GRPOConfig's defaults otherwise: bf16 autocast); the user's
    one change: `_get_per_token_logps_and_entropies` compiled with `backend` (None: eager).
    Returns the logged losses and the final parameters."""
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer))
    trainer = grpo_trainer(
        model, tokenizer, str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_steps=STEPS,
        logging_steps=1, seed=0,
        # Equal prompt lengths and completions of max_completion_length: one shape, one compile.
        max_completion_length=8, generation_kwargs={"min_new_tokens": 8},
        # SGD: Adam's first steps are sign-like, they would turn rounding into differences of a learning rate.
        optim="sgd", learning_rate=0.1, entropy_coef=0.01,  # the entropy's gradient is used too
        # transformers adds an input hook each time TRL toggles checkpointing: a recompile every step.
        gradient_checkpointing=False)
    if backend is not None:
        trainer._get_per_token_logps_and_entropies = torch.compile(trainer._get_per_token_logps_and_entropies,
                                                                   backend=backend)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == STEPS
    return torch.tensor(losses, dtype=torch.float64), [p.detach().clone() for p in model.parameters()]


def test_grpo_trainer_default_path(tmp_path):
    """docs/frameworks/trl.md's recipe: GRPOTrainer with its log-prob method compiled, against eager."""
    eager_losses, eager_params = _train(None, tmp_path)
    backend = graphpass.Backend()  # what backend="graphpass" runs, with its records kept
    losses, params = _train(backend, tmp_path)
    sites = [s for r in backend.records for s in r.sites]
    assert sites and all(s.lm_head and s.kind == "logprob+entropy" for s in sites)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=1e-9)
    torch._dynamo.reset()
    _, inductor_params = _train("inductor", tmp_path)
    for p, e, i in zip(params, eager_params, inductor_params):
        assert (p - e).abs().max() <= max(2 * (i - e).abs().max(), 1e-6)


def test_completion_lengths_that_vary_stay_fused(tmp_path):
    """TRL's log-prob method at three completion lengths: from the second on, Dynamo makes the
    sizes symbolic; that graph is rewritten too (an lm_head site in each), gradients as eager's."""
    from bench.trl import ENTROPY_COEF

    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer))
    trainer = grpo_trainer(model, tokenizer, str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=16, gradient_checkpointing=False, bf16=False)
    eager = trainer._get_per_token_logps_and_entropies
    backend = graphpass.Backend()
    compiled = torch.compile(eager, backend=backend)
    g = torch.Generator().manual_seed(1)
    for completion in (6, 10, 8):
        ids = torch.randint(2, len(tokenizer), (4, 4 + completion), generator=g)
        mask = torch.ones_like(ids)
        advantages = torch.randn(4, 1, generator=g)
        grads = []
        for fn in (eager, compiled):
            model.zero_grad(set_to_none=True)
            logps, entropies, _ = fn(model, ids, mask, completion, compute_entropy=True)
            loss = -(advantages * (logps - logps.detach()).exp()).mean() - ENTROPY_COEF * entropies.mean()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for ours, ref in zip(grads[1], grads[0]):
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6)
    assert len(backend.records) >= 2, "the second length compiles a graph with symbolic sizes"
    for record in backend.records:
        assert [s.lm_head for s in record.sites] == [True], record.rejected


@pytest.mark.parametrize("tokens", [64, 128, 300])
def test_classic_helpers_fuse_at_any_token_count(tokens):
    """TRL's own `selective_log_softmax` and `entropy_from_logits` (128-row chunks) after an lm_head:
    one chunk or several, one `logprob+entropy` site with the lm_head; loss and gradients as eager's."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    def loss(hidden, weight, ids, advantages):
        logits = (hidden @ weight.t()) / 0.7
        logps, entropy = selective_log_softmax(logits, ids), entropy_from_logits(logits)
        return -(advantages * (logps - logps.detach()).exp()).mean() - 0.01 * entropy.mean()

    g = torch.Generator().manual_seed(tokens)
    args = [torch.randn(tokens, 16, generator=g), torch.randn(96, 16, generator=g) * 0.3,
            torch.randint(0, 96, (tokens,), generator=g), torch.randn(tokens, generator=g)]
    backend = graphpass.Backend(inner="aot_eager")
    results = []
    for fn in (loss, torch.compile(loss, backend=backend)):
        leaves = [a.clone().requires_grad_(a.is_floating_point() and i < 2) for i, a in enumerate(args)]
        out = fn(*leaves)
        out.backward()
        results.append([out.detach(), leaves[0].grad, leaves[1].grad])
    assert [(s.kind, s.lm_head) for r in backend.records for s in r.sites] == [("logprob+entropy", True)]
    for ours, ref in zip(results[1], results[0]):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
