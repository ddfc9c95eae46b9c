"""The recomputing vocab-parallel lm_head op's CPU backward by vocabulary tiles, in one process (a
group of one rank, no torch.distributed): for each tile of `W_r`'s rows, the tile's logits for all
rows, the gradient kernel over them in place, `dW[tile]` complete in one GEMM and `dh` accumulated.

Checked against autograd of the plain math in float64 (<= 1e-10): several tiles with a ragged last
one, bias, temperature, ignore_index, the entropy with and without its gradient, a frozen hidden
state; which path ran (tiles where the weight needs a gradient, the row blocks otherwise, whose
chunks' gradients now overwrite their logits; for bf16 row chunks for `dh` first, then tiles for
`dW`); fp32 and bf16 against the logits-given op. The
collectives are unchanged (one all-gather in forward, none in backward): the TP tests
(`test_vocab_parallel_lm_head.py`, `test_megatron_output_layer.py`'s "recompute" cases) run these
paths on 2 gloo ranks against one device and eager megatron-core.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from graphpass.ops import vocab_parallel_lm_head as vp
from graphpass.ops.groups import group_name
from graphpass.ops import vocab_parallel_lm_head_logprob_entropy, vocab_parallel_logprob_entropy

ROWS, H, V = 11, 6, 37


@pytest.fixture(autouse=True)
def _one_process():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")


@pytest.fixture()
def paths(monkeypatch):
    """Counts of the backward's calls by tiles and by row blocks."""
    calls = {"tiles": 0, "rows": 0}
    tiles, rows = vp._head_backward_by_tiles, vp.backward_rows

    def by_tiles(*args, **kwargs):
        calls["tiles"] += 1
        return tiles(*args, **kwargs)

    def by_rows(logits, *args, **kwargs):
        calls["rows"] += isinstance(logits, vp.HeadLogits)
        return rows(logits, *args, **kwargs)

    monkeypatch.setattr(vp, "_head_backward_by_tiles", by_tiles)
    monkeypatch.setattr(vp, "backward_rows", by_rows)
    return calls


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, H, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    bias = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    target = torch.randint(0, V, (ROWS,), generator=g)
    target[2] = -100
    target[5] = V - 1  # the last tile's last column
    target[7] = 0
    coef = torch.randn(ROWS, generator=g, dtype=torch.float64).to(dtype)
    return hidden, weight, bias, target, coef


def _reference(hidden, weight, bias, target, coef, temperature, entropy_grad, needs):
    leaves = [t.detach().double().requires_grad_(need) for t, need in zip((hidden, weight, bias), needs)]
    logp = ((leaves[0] @ leaves[1].t() + leaves[2]) / temperature).log_softmax(-1)
    lp = torch.where(target == -100, 0.0, logp.gather(1, target.clamp_min(0)[:, None])[:, 0])
    ent = -(logp.exp() * logp).sum(-1)
    loss = (coef.double() * lp).sum() + (0.3 * ent.sum() if entropy_grad else 0)
    wanted = [t for t in leaves if t.requires_grad]
    return lp.detach(), ent.detach(), torch.autograd.grad(loss, wanted)


def _err(mine, ref):
    return ((mine.double() - ref).abs().max() / ref.abs().max().clamp_min(1)).item()


@pytest.mark.parametrize("chunk", [1, 3, 0])  # tiles of 3, 10 and 13 columns (the last ragged)
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_tiles_match_autograd_in_float64(paths, chunk, entropy_grad):
    hidden, weight, bias, target, coef = _data(torch.float64)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    lp, ent = vocab_parallel_lm_head_logprob_entropy(*leaves[:2], target, bias=leaves[2], temperature=0.7,
                                                     with_entropy=True, entropy_grad=entropy_grad,
                                                     chunk_size=chunk or None)
    ((coef * lp).sum() + 0.3 * ent.sum()).backward()
    ref_lp, ref_ent, ref_grads = _reference(hidden, weight, bias, target, coef, 0.7, entropy_grad, (True,) * 3)
    assert _err(lp, ref_lp) <= 1e-10 and _err(ent, ref_ent) <= 1e-10
    for leaf, ref in zip(leaves, ref_grads):
        assert leaf.grad.dtype == torch.float64 and _err(leaf.grad, ref) <= 1e-10
    assert paths == {"tiles": 1, "rows": 0}


def test_tile_widths_cover_the_vocabulary_in_whole_panels_within_half_the_floor():
    assert vp._tile_columns(1, ROWS, V, H, 8) == 3 and vp._tile_columns(3, ROWS, V, H, 8) == 10
    assert vp._tile_columns(0, ROWS, V, H, 8) == 13  # half the floor: 13 of 11 rows in float64
    assert vp._tile_columns(0, ROWS, V, H, 1) == 13 and vp._tile_columns(50, ROWS, V, H, 8) == V
    rows, vocab, hidden = 1024, 16384, 256
    tile = vp._tile_columns(0, rows, vocab, hidden, 4)
    floor = (rows + vocab) * hidden * 4
    assert tile % 32 == 0 and rows * tile * 4 <= floor / 2 and -(-vocab // tile) == 8
    assert vp._tile_columns(0, 0, vocab, hidden, 4) == vocab


def test_a_frozen_hidden_state_takes_tiles_and_a_frozen_weight_takes_row_blocks(paths):
    hidden, weight, bias, target, coef = _data(torch.float64, seed=1)
    for needs, path in (((False, True, True), "tiles"), ((True, False, False), "rows")):
        paths.update(tiles=0, rows=0)
        leaves = [t.clone().requires_grad_(need) for t, need in zip((hidden, weight, bias), needs)]
        lp, ent = vocab_parallel_lm_head_logprob_entropy(*leaves[:2], target, bias=leaves[2], temperature=1.3,
                                                         with_entropy=True, chunk_size=4)
        ((coef * lp).sum() + 0.3 * ent.sum()).backward()
        _, _, ref_grads = _reference(hidden, weight, bias, target, coef, 1.3, True, needs)
        mine = [leaf.grad for leaf in leaves if leaf.requires_grad]
        assert all(leaf.grad is None for leaf in leaves if not leaf.requires_grad)
        for grad, ref in zip(mine, ref_grads):
            assert _err(grad, ref) <= 1e-10
        assert paths[path] == 1 and paths["tiles" if path == "rows" else "rows"] == 0


@pytest.mark.parametrize("kernels", ["eager", "inductor"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_tiles_in_narrower_dtypes_match_linear_then_the_logits_op(paths, dtype, tol, kernels, monkeypatch):
    """bf16 with compiled kernels (the backend's): row chunks give `dhidden` first, then the tiles
    `dW` alone, with no product of fp32 copies (`devices.mm_into` with operands narrower than its
    accumulator); with eager kernels one pass of tiles."""
    upcast, mm_into = [], vp.devices.mm_into

    def spy(acc, left, right, **kwargs):
        upcast.append(left.dtype != acc.dtype)
        return mm_into(acc, left, right, **kwargs)

    monkeypatch.setattr(vp.devices, "mm_into", spy)
    hidden, weight, bias, target, coef = _data(dtype, seed=2)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    lp, ent, _, _ = vp._vocab_parallel_head_op(*leaves[:2], leaves[2], target, None, group_name(None), 1.0, True,
                                               True, -100, 2, kernels)
    ((coef.float() * lp).sum() + 0.3 * ent.sum()).backward()
    copies = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref_lp, ref_ent = vocab_parallel_logprob_entropy(F.linear(*copies), target, with_entropy=True)
    ((coef.float() * ref_lp).sum() + 0.3 * ref_ent.sum()).backward()
    assert _err(lp, ref_lp.double()) <= tol and _err(ent, ref_ent.double()) <= tol
    for leaf, ref in zip(leaves, copies):
        assert leaf.grad.dtype == dtype and _err(leaf.grad, ref.grad.double()) <= tol
    two_passes = dtype == torch.bfloat16 and kernels == "inductor"
    assert paths == {"tiles": 1, "rows": int(two_passes)}
    assert any(upcast) == (dtype == torch.bfloat16 and not two_passes)  # one pass: dhidden's fp32 product


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta takes the accelerator's path (`ops.devices`)
def test_the_schedule_takes_the_smaller_accumulator(device):
    def schedule(rows, vocab, dtype, keep_mask=None, need_hidden=True, need_weight=True, kernels="inductor"):
        hidden = torch.empty(rows, H, dtype=dtype, device=device)
        weight = torch.empty(vocab, H, dtype=dtype, device=device)
        return vp.backward_schedule(hidden, weight, keep_mask, need_hidden, need_weight, kernels)

    assert schedule(8, 32, torch.bfloat16, keep_mask=torch.ones(8, dtype=torch.bool)) == "rows"
    assert schedule(8, 32, torch.bfloat16, need_weight=False) == "rows"
    if device == "cpu":  # tiles always, bf16 with compiled kernels after row chunks for dh
        assert schedule(64, 32, torch.bfloat16) == "rows, then tiles"
        assert schedule(8, 32, torch.bfloat16, kernels="eager") == "tiles"
        assert schedule(8, 32, torch.float32) == "tiles"
    else:  # the [rows, H] accumulator where it is no larger than the [V/tp, H] one; fp32 accumulates in place
        assert schedule(32, 32, torch.bfloat16) == "tiles"
        assert schedule(33, 32, torch.bfloat16) == "rows"
        assert schedule(8, 32, torch.float32) == "rows"


@pytest.mark.parametrize("kernels", ["eager", "inductor"])
def test_the_accelerators_schedule_matches_linear_then_the_logits_op(paths, kernels, monkeypatch):
    """bf16 as an accelerator schedules it (one pass of tiles, `dhidden` accumulated in fp32),
    computed here with the CPU's arithmetic: the values and gradients of the logits-given op."""
    chosen, schedule = [], vp.backward_schedule

    def as_on_an_accelerator(hidden, weight, *args):
        chosen.append(schedule(hidden.to("meta"), weight.to("meta"), *args))
        return chosen[-1]

    monkeypatch.setattr(vp, "backward_schedule", as_on_an_accelerator)
    hidden, weight, bias, target, coef = _data(torch.bfloat16, seed=3)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    lp, ent, _, _ = vp._vocab_parallel_head_op(*leaves[:2], leaves[2], target, None, group_name(None), 0.8, True,
                                               True, -100, 2, kernels)
    ((coef.float() * lp).sum() + 0.3 * ent.sum()).backward()
    copies = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    ref_lp, ref_ent = vocab_parallel_logprob_entropy(F.linear(*copies), target, temperature=0.8, with_entropy=True)
    ((coef.float() * ref_lp).sum() + 0.3 * ref_ent.sum()).backward()
    assert chosen == ["tiles"] and paths == {"tiles": 1, "rows": 0}
    for leaf, ref in zip(leaves, copies):
        assert leaf.grad.dtype == torch.bfloat16 and _err(leaf.grad, ref.grad.double()) <= 5e-2
