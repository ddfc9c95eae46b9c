"""Unit tests of `read_sliced_rows_whole_pass`: a per-row NLL or gather over a row slice of
log-probs that other code reads over all rows reads all rows (the other rows an index of no
effect), so the log-probs are one region with a fused lm_head; values and gradients unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import graphpass
from bench.fuzz import run as fuzz
from graphpass.passes.read_sliced_rows_whole import read_sliced_rows_whole_pass
from tests.helpers import run_passes

aten = torch.ops.aten
B, S, H, V = 2, 5, 8, 33  # 2B sequences: the first B chosen, the rest rejected


def preference_chunk(hidden, weight, target, ignore_index=-100):
    """Liger-Kernel's preference `chunk_forward` (restated from
    src/liger_kernel/chunked_loss/fused_linear_preference.py, `LigerFusedLinearPreferenceBase`),
    with a DPO loss on its outputs: the chosen half's NLL over `log_probs[:B]`, every row's
    average log-prob from one gather over all rows."""
    log_probs = F.log_softmax((hidden @ weight.t()).float(), dim=-1)
    chosen_nll = F.nll_loss(log_probs[:B].view(-1, log_probs.shape[-1]), target[:B].view(-1),
                            reduction="sum", ignore_index=ignore_index)
    mask = target != ignore_index
    labels = torch.where(mask, target, 0)
    per_token = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    average = (per_token * mask).sum(-1) / mask.sum(-1)
    chosen, rejected = average[:B], average[B:]
    return chosen_nll / mask[:B].sum() - F.logsigmoid(0.1 * (chosen - rejected)).sum()


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, V, (2 * B, S), generator=g)
    target[0, :2] = target[3, 4] = -100  # ignored tokens in both halves
    return (torch.randn(2 * B, S, H, generator=g, dtype=dtype), torch.randn(V, H, generator=g, dtype=dtype) / 3,
            target)


def _run(fn, hidden, weight, target, dtype):
    h, w = (x.detach().to(dtype).clone().requires_grad_() for x in (hidden, weight))
    out = fn(h, w, target)
    out.backward()
    return out.detach(), h.grad, w.grad


def test_a_preference_chunk_is_one_site_with_its_lm_head_fused_and_eager_accuracy():
    hidden, weight, target = _inputs()
    backend = graphpass.Backend(chunk_size=4)
    compiled = _run(torch.compile(preference_chunk, backend=backend), hidden, weight, target, torch.float32)
    sites = [s for r in backend.records for s in r.sites]
    assert [(s.kind, s.lm_head) for s in sites] == [("-logprob+logprob", True)]
    eager = _run(preference_chunk, hidden, weight, target, torch.float32)
    reference = _run(preference_chunk, hidden, weight, target, torch.float64)
    for name, c, e, r in zip(("loss", "hidden.grad", "weight.grad"), compiled, eager, reference):
        assert not fuzz.compare(name, c, e, r, fuzz.RTOL[torch.float32], min_scale=0.0)


def _rewritten(fn, *args):
    after = run_passes(fn, *args, passes=[read_sliced_rows_whole_pass])
    return after.gm, after


def _sliced_readers(gm) -> int:
    """Readers (an NLL, a gather) whose log-probs are a row slice."""
    readers = [n for t in (aten.nll_loss_nd.default, aten.gather.default)
               for n in gm.graph.find_nodes(op="call_function", target=t)]
    def sliced(n):
        x = n.args[0]
        while x.target in (aten.view.default, aten.reshape.default):
            x = x.args[0]
        return x.target is aten.slice.Tensor
    return sum(sliced(n) for n in readers)


def test_a_gather_over_the_chosen_rows_reads_all_rows_with_index_zero_elsewhere():
    def fn(logits, target):
        lp = F.log_softmax(logits, -1)
        return lp[:B].gather(-1, target[:B].unsqueeze(-1)).squeeze(-1), lp.logsumexp(-1)

    logits, target = torch.randn(2 * B, S, V), torch.randint(0, V, (2 * B, S))
    target[B:] = V + 7  # rows outside the slice: an index the gather would reject, never read
    gm, c = _rewritten(fn, logits, target)
    assert _sliced_readers(gm) == 0
    for got, want in zip(gm(logits, target), fn(logits, target)):
        torch.testing.assert_close(got, want)


def test_readers_that_are_not_a_slice_of_the_same_rows_stay():
    def other_labels(logits, target, chosen_target):  # Liger's chosen_nll_target: its own tensor
        lp = F.log_softmax(logits, -1)
        nll = F.nll_loss(lp[:B].reshape(-1, V), chosen_target.reshape(-1), reduction="none")
        return nll, lp.gather(-1, target.unsqueeze(-1))

    def other_rows(logits, target):  # the index from rows the log-probs do not come from
        lp = F.log_softmax(logits, -1)
        nll = F.nll_loss(lp[:B].reshape(-1, V), target[B:].reshape(-1), reduction="none")
        return nll, lp.gather(-1, target.unsqueeze(-1))

    def alone(logits, target):  # nothing reads all rows: the slice's region is the slice's
        lp = F.log_softmax(logits, -1)
        return (F.nll_loss(lp[:B].reshape(-1, V), target[:B].reshape(-1), reduction="none"),)

    logits, target = torch.randn(2 * B, S, V), torch.randint(0, V, (2 * B, S))
    for fn, args in ((other_labels, (logits, target, target[:B].clone())), (other_rows, (logits, target)),
                     (alone, (logits, target))):
        gm, _ = _rewritten(fn, *args)
        assert _sliced_readers(gm) == 1, fn.__name__


def rpo_loss(hidden, weight, labels, mask):
    """TRL's DPO with `rpo_alpha` (restated from trl/trainer/dpo_trainer.py, `concatenated_forward`):
    a cross-entropy over the chosen half of the logits, `selective_log_softmax` over all rows."""
    logits = hidden @ weight.T
    nll = F.cross_entropy(torch.flatten(logits[:B], end_dim=1), torch.flatten(labels[:B], end_dim=1),
                          ignore_index=0)
    per_token = torch.gather(logits.log_softmax(-1), -1, torch.where(mask, labels, 0).unsqueeze(-1)).squeeze(-1)
    summed = (per_token * mask).sum(-1)
    return -F.logsigmoid(0.1 * (summed[:B] - summed[B:])).mean() + nll


def test_a_cross_entropy_over_the_chosen_logits_joins_the_log_probs_of_all_rows():
    hidden, weight, target = _inputs()
    mask = target != -100
    labels = torch.where(mask, target, 0)  # TRL pads labels with 0, its ignore_index here
    fn = lambda h, w, _: rpo_loss(h, w, labels, mask)  # noqa: E731
    backend = graphpass.Backend(chunk_size=4)
    compiled = _run(torch.compile(fn, backend=backend), hidden, weight, None, torch.float32)
    assert [(s.kind, s.lm_head) for r in backend.records for s in r.sites] == [("-logprob+logprob", True)]
    eager, reference = (_run(fn, hidden, weight, None, dtype) for dtype in (torch.float32, torch.float64))
    for name, c, e, r in zip(("loss", "hidden.grad", "weight.grad"), compiled, eager, reference):
        assert not fuzz.compare(name, c, e, r, fuzz.RTOL[torch.float32], min_scale=0.0)
