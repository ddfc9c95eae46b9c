"""`graphpass::vocab_parallel_lm_head_with_gradients` in one process (a group of one rank, no
torch.distributed): block by block, the log-probs, entropies and the gradients of hidden states,
weight and bias for a token-level loss, against autograd of the plain math in float64; its
backward scales them by the loss's gradient. The pass that builds it runs in the TP tests
(`test_megatron_output_layer.py`)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graphpass.ops import vocab_parallel_gradients as vg

ROWS, H, V = 13, 8, 11


def _ppo_terms(logprob, entropy, old, adv, coef):
    """Per-token summands of a masked PPO with an entropy bonus: (policy term, entropy term)."""
    ratio = (logprob - old).exp()
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    return pg, entropy * coef


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, H, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    bias = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    target = torch.randint(0, V, (ROWS,), generator=g)
    target[3] = -100
    old = -torch.rand(ROWS, generator=g, dtype=torch.float64).to(dtype) * 3
    adv = torch.randn(ROWS, generator=g, dtype=torch.float64).to(dtype)
    return hidden, weight, bias, target, old, adv


@pytest.mark.parametrize("dtype,chunk", [(torch.float64, 5), (torch.float64, 0), (torch.float32, 4)])
def test_gradients_in_forward_match_autograd_and_scale_in_backward(dtype, chunk):
    hidden, weight, bias, target, old, adv = _data(dtype)
    coef = torch.tensor(-0.01, dtype=dtype)
    loss_graph = make_fx(_ppo_terms)(torch.zeros(ROWS, dtype=dtype), torch.zeros(ROWS, dtype=dtype), old, adv, coef)
    seeds = [torch.tensor(0.5, dtype=dtype), torch.tensor(2.0, dtype=dtype)]  # d loss / d total
    key = vg.register_loss(loss_graph, dtype, [(dtype, True), (dtype, True), (dtype, False)], [dtype, dtype],
                           ["sum", "mean"], True)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    out = vg.vocab_parallel_lm_head_with_gradients(*leaves, target, [old, adv, coef], seeds, key, "", 0.7, True, True,
                                                   -100, chunk, "eager", True, True, True)
    logprob, entropy, carrier = out[:3]

    ref = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    logp = ((ref[0] @ ref[1].t() + ref[2]) / 0.7).log_softmax(-1)
    ref_lp = torch.where(target == -100, 0.0, logp.gather(1, target.clamp_min(0)[:, None])[:, 0])
    ref_ent = -(logp.exp() * logp).sum(-1)
    pg, ent_term = _ppo_terms(ref_lp, ref_ent, old.double(), adv.double(), coef.double())
    ref_loss = 0.5 * pg.sum() + 2.0 * ent_term.mean()
    ref_grads = torch.autograd.grad(ref_loss, ref)
    tol = 1e-10 if dtype == torch.float64 else 1e-5

    def close(a, b):
        return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1)).item() <= tol

    assert close(logprob, ref_lp.detach()) and close(entropy, ref_ent.detach())
    assert carrier.item() == 0.0 and str(carrier.item()) == "-0.0" and carrier.requires_grad
    assert not logprob.requires_grad and not entropy.requires_grad
    # The loss's value from the op's outputs, its gradient through the carrier: scaled by 3.
    pg_ours, ent_ours = _ppo_terms(logprob, entropy, old, adv, coef)
    (3 * (0.5 * pg_ours.sum() + 2.0 * ent_ours.mean() + carrier)).backward()
    for leaf, ref_grad in zip(leaves, ref_grads):
        assert leaf.grad.dtype == dtype and close(leaf.grad, 3 * ref_grad)


def test_block_rows_are_even_whole_panels_within_half_the_floor():
    hidden, vocab = 256, 16384
    for rows in (1024, 1000, 2048, 4096, 333):
        block = vg.block_rows(0, rows, vocab, hidden, 4)
        floor = (rows + vocab) * hidden * 4
        assert block % 32 == 0 and block * vocab * 4 <= floor * 0.5
        # The fewest blocks that fit: one more row per block would not fit, or not save a block.
        blocks = -(-rows // block)
        assert blocks == vg.block_collective_count(rows, vocab, hidden, 4, 0)
        assert blocks * block - rows < block
    assert vg.block_rows(0, 1024, 16384, 256, 4) == 128  # 8 blocks of 8 MiB at the benchmark's shape
    assert vg.block_rows(7, 1024, vocab, hidden, 4) == 7 and vg.block_rows(0, 5, 3, 2, 4) <= 5
    assert vg.block_rows(0, 0, vocab, hidden, 4) == 1 and vg.block_collective_count(0, vocab, hidden, 4, 0) == 0
