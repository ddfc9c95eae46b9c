"""The chunk-size policy (`graphpass.ops.chunk_sizes`): each op's share of its floor, bounded by
`Config.chunk_budget_bytes`, and the vocab-parallel op honouring that budget when it runs."""

from __future__ import annotations

import torch

from graphpass.ops import chunk_sizes
from graphpass.ops import vocab_parallel as vp
from graphpass.ops.vocab_parallel_lm_head import block_rows

MiB = 2**20


def test_one_device_chunks_take_their_share_of_the_floor_at_least_the_budget():
    assert chunk_sizes.at_least_budget(64 * MiB, chunk_sizes.LOGITS_SHARE, 16 * MiB) == 16 * MiB
    assert chunk_sizes.at_least_budget(4096 * MiB, chunk_sizes.LOGITS_SHARE, 16 * MiB) == 64 * MiB
    assert chunk_sizes.at_least_budget(17, chunk_sizes.LM_HEAD_BACKWARD_SHARE, 1) == 2  # rounded down, exactly
    assert chunk_sizes.fitting(10 * 4096, 4096, 100) == 10
    assert chunk_sizes.fitting(1, 4096, 100) == 1 and chunk_sizes.fitting(10**12, 4096, 100) == 100


def test_vocab_parallel_logits_take_a_160th_of_the_floor_at_most_the_budget_on_a_cpu():
    floor = 160 * MiB
    assert chunk_sizes.vocab_parallel_logits_bytes(floor, 16 * MiB, host=False) == MiB
    assert chunk_sizes.vocab_parallel_logits_bytes(floor, MiB // 4, host=True) == MiB // 4
    assert chunk_sizes.vocab_parallel_logits_bytes(floor, 16 * MiB, host=True) == MiB


def test_even_panels_split_evenly_in_whole_panels_within_the_limit():
    assert chunk_sizes.even_panels(1000, 5000) == 1000
    assert chunk_sizes.even_panels(1024, 300) == 256  # four even pieces of whole panels
    assert chunk_sizes.even_panels(1000, 300) == 256  # 250 rounded up to whole panels still fits
    assert chunk_sizes.even_panels(1000, 250) == 224  # 256 would not: the whole panels that fit
    assert chunk_sizes.even_panels(100, 20) == 20  # below a panel: the even split
    assert block_rows(0, 1024, 16384, 256, 4) == 128  # the TP benchmark's shape: 8 blocks


def test_the_vocab_parallel_op_honours_chunk_budget_bytes(monkeypatch):
    """At 4096 x 1024 fp32 a 160th of the logits is 25 rows of fp32 `[rows, V]`; a 64 KiB budget
    caps the CPU chunk at 16 rows, a larger one leaves 25. Forward and backward chunk alike, and
    the values do not depend on the chunking."""
    seen = []
    row_chunks = vp.row_chunks
    monkeypatch.setattr(vp, "row_chunks", lambda logits, chunk: (seen.append(chunk), row_chunks(logits, chunk))[1])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, 1024, generator=g)
    target = torch.randint(0, 1024, (4096,), generator=g)
    op = torch.ops.graphpass.vocab_parallel_logprob_entropy.default
    results = {}
    for budget in (64 * 1024, 16 * MiB):
        seen.clear()
        x = logits.clone().requires_grad_()
        logprob, entropy, *_ = op(x, target, None, "", 0.7, True, True, None, 0, "eager", False, budget)
        (logprob.sum() + entropy.sum()).backward()
        results[budget] = (seen[:], logprob.detach(), x.grad)
    assert results[64 * 1024][0] == [16, 16] and results[16 * MiB][0] == [25, 25]
    for a, b in zip(results[64 * 1024][1:], results[16 * MiB][1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
