"""Whole transformers models compiled with their loss (issue 47, item 2): the temperature divides
the logits before the row slice (out of place or in place, on the logits or on a slice of them),
and the lm_head is still fused: the slice sinks through the elementwise math to the matmul.
A site that reads its logits instead says why (`SiteRecord.lm_head_reason`).

A tiny `LlamaForCausalLM` with random weights, built in code; every parameter's gradient and the
loss against eager and float64 (`bench.fuzz`'s rule).
"""

from __future__ import annotations

import copy

import pytest
import torch

import graphpass
from bench.fuzz import run as fuzz

transformers = pytest.importorskip("transformers")

VOCAB, KEEP = 96, 7
TEMPERATURE = 0.7


def _model():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def shift_then_temperature(model, ids):
    logits = model(input_ids=ids, logits_to_keep=KEEP).logits[:, :-1] / TEMPERATURE
    return logits


def temperature_then_shift(model, ids):
    logits = model(input_ids=ids, logits_to_keep=KEEP).logits / TEMPERATURE
    return logits[:, :-1]


def verl_post_process_logits(model, ids):
    """verl/utils/torch_functional.py (verl <= 0.2): post_process_logits divides the full logits
    in place ("inplace operation to avoid OOM"); the actor then takes the response's rows."""
    logits = model(input_ids=ids, logits_to_keep=KEEP).logits
    logits = logits.div_(TEMPERATURE)
    return logits[:, -KEEP:-1]


def trl_divide_a_slice_in_place(model, ids):
    """TRL's older `_get_per_token_logps`: `logits = logits[:, :-1, :]`, then `logits /= temperature`."""
    logits = model(input_ids=ids, logits_to_keep=KEEP).logits
    logits = logits[:, :-1, :]
    logits /= TEMPERATURE
    return logits


def _loss(logits_of, model, ids):
    logits = logits_of(model, ids)
    targets = ids[:, -(KEEP - 1):]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -logp.mean()


def _run(fn, model, ids):
    model.zero_grad()
    loss = fn(model, ids)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("logits_of", [shift_then_temperature, temperature_then_shift, verl_post_process_logits,
                                       trl_divide_a_slice_in_place])
def test_the_lm_head_is_fused_whatever_the_order(logits_of):
    model = _model()
    reference = copy.deepcopy(model).double()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = lambda m, i: _loss(logits_of, m, i)

    torch.compiler.reset()
    backend = graphpass.Backend(inner="aot_eager")
    ours = _run(torch.compile(loss, backend=backend), model, ids)
    eager = _run(loss, model, ids)
    ref = _run(loss, reference, ids)

    sites = [s for r in backend.records for s in r.sites]
    assert [(s.kind, s.lm_head) for s in sites] == [("logprob", True)], [
        (s.lm_head_reason, [c.reason for r in backend.records for c in r.rejected]) for s in sites]
    rtol = fuzz.RTOL[torch.float32]
    assert (why := fuzz.compare("loss", ours[0], eager[0], ref[0], rtol, min_scale=1.0)) is None, why
    for name in eager[1]:
        assert (why := fuzz.compare(name, ours[1][name], eager[1][name], ref[1][name], rtol)) is None, why


def test_logits_read_elsewhere_say_why_the_head_is_not_fused():
    """The twin: the scaled logits are also returned, so the matmul stays; the site says why."""
    model = _model()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))

    def loss_and_logits(model, ids):
        logits = temperature_then_shift(model, ids)
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, -(KEEP - 1):].unsqueeze(-1)).squeeze(-1)
        return -logp.mean(), logits

    backend = graphpass.Backend(inner="aot_eager")
    value, logits = torch.compile(loss_and_logits, backend=backend)(model, ids)
    expected, expected_logits = loss_and_logits(model, ids)
    torch.testing.assert_close(value, expected)
    torch.testing.assert_close(logits, expected_logits)
    (site,) = [s for r in backend.records for s in r.sites]
    assert not site.lm_head
    # The returned scaled logits keep the division (and the matmul) out of the region.
    assert site.lm_head_reason.startswith("its logits are computed by div.Tensor at test_whole_models.py"), \
        site.lm_head_reason


def test_logits_given_to_the_compiled_function_say_so():
    def logprob(logits, ids):
        return torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)

    backend = graphpass.Backend(inner="aot_eager")
    torch.compile(logprob, backend=backend)(torch.randn(4, 10), torch.randint(0, 10, (4,)))
    (site,) = [s for r in backend.records for s in r.sites]
    assert not site.lm_head
    assert site.lm_head_reason.startswith("the logits come from outside this graph (an input of the compiled function)")
