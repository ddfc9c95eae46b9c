"""graphpass.cp on one process: the layouts' tables, the ops' values and gradients, bad input.

The tables are checked against a direct reading of each layout's definition for every rank of
cp = 1..4 (a table does not need the group, only its size); the multi-process behaviour is in
tests/context_parallel/test_cp.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from bench.workloads import cp_losses
from graphpass import cp
from graphpass.cp import _rows  # the tables of every rank, without a process group

LENS = [5, 2, 8, 3, 1]


def _zigzag_by_definition(lens, size):
    """Each sequence padded to a multiple of 2·size, cut into 2·size chunks; rank r holds chunks r and 2·size−1−r."""
    per_rank = [[] for _ in range(size)]
    start = 0
    for n in lens:
        chunk = math.ceil(n / (2 * size))
        for r in range(size):
            for piece in (r, 2 * size - 1 - r):
                per_rank[r] += [start + p if p < n else -1 for p in range(piece * chunk, (piece + 1) * chunk)]
        start += n
    return per_rank


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_zigzag_tables_follow_the_definition(size):
    assert _rows("zigzag", LENS, size, 1).tolist() == _zigzag_by_definition(LENS, size)


def test_zigzag_pads_each_ranks_rows_to_a_multiple_like_slime():
    # slime pads the concatenated zigzag chunks of each rank to a multiple of tp x 128.
    padded = _rows("zigzag", LENS, 2, 16)
    plain = _zigzag_by_definition(LENS, 2)
    assert padded.shape[1] == 16 * -(-len(plain[0]) // 16)
    assert [row[:len(plain[0])] for row in padded.tolist()] == plain
    assert (padded[:, len(plain[0]):] == -1).all()


@pytest.mark.parametrize("size, multiple", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 8)])
def test_contiguous_tables_split_the_padded_stream(size, multiple):
    total = sum(LENS)
    padded = -(-total // (size * multiple)) * size * multiple
    stream = [g if g < total else -1 for g in range(padded)]
    piece = padded // size
    assert _rows("contiguous", LENS, size, multiple).tolist() == [stream[r * piece:(r + 1) * piece] for r in range(size)]
    assert cp.rows_per_rank("allgather", LENS, size, multiple) == piece


@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
def test_every_token_is_on_exactly_one_rank(kind):
    for size in (1, 2, 3, 4):
        rows = _rows(kind, LENS, size, 1)
        held = rows[rows >= 0].sort().values
        assert held.tolist() == list(range(sum(LENS))), (kind, size)


def test_one_process_layout_round_trips_with_gradients():
    layout = cp.Layout.zigzag(None, LENS)
    assert (layout.size, layout.rank, layout.total_rows) == (1, 0, sum(LENS))
    x = torch.randn(sum(LENS), 3, dtype=torch.float64, requires_grad=True)
    local = layout.shard(x)
    assert local.shape == (layout.local_row_count, 3)
    assert (local[layout.local_rows < 0] == 0).all()  # padding rows are zero
    back = layout.unshard(local)
    torch.testing.assert_close(back, x, rtol=0, atol=0)
    weights = torch.randn_like(x)
    (back * weights).sum().backward()
    torch.testing.assert_close(x.grad, weights, rtol=0, atol=0)


def test_shifted_targets_are_the_next_token_within_each_sequence():
    tokens = torch.randint(0, 100, (sum(LENS),))
    reference = cp_losses.shifted_targets(tokens, LENS, ignore_index=-7)
    layout = cp.Layout.zigzag(None, LENS)
    local = layout.shifted_targets(tokens, ignore_index=-7)
    rows = layout.local_rows
    assert local.tolist() == [int(reference[g]) if g >= 0 else -7 for g in rows.tolist()]


# ---- bad input: one line that says what to do -------------------------------------------------------
def _one_line(fn, *fragments):
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and message.startswith("graphpass"), message
    for fragment in fragments:
        assert fragment in message, message


def test_bad_layouts_raise_one_line():
    _one_line(lambda: cp.Layout.allgather(None, LENS), "at least 2 ranks", "Layout.contiguous")
    _one_line(lambda: cp.Layout.allgather(None, LENS, packing="bshd"), "packing='thd'")
    _one_line(lambda: cp.Layout("ring", None, LENS), "unknown layout 'ring'", "zigzag")
    _one_line(lambda: cp.rows_per_rank("ring", LENS, 2), "unknown layout")
    _one_line(lambda: cp.Layout.zigzag(None, []), "non-empty list of positive ints")
    _one_line(lambda: cp.Layout.zigzag(None, [3, 0]), "positive ints")
    _one_line(lambda: cp.Layout.zigzag(None, [3, 2.5]), "positive ints")
    _one_line(lambda: cp.Layout.zigzag(None, 7), "list of positive ints")
    _one_line(lambda: cp.Layout.zigzag("world", LENS), "ProcessGroup or None")
    _one_line(lambda: cp.Layout.contiguous(None, LENS, pad_multiple=0), "pad_multiple")


def test_tensors_whose_rows_do_not_match_the_layout_raise_one_line():
    layout = cp.Layout.zigzag(None, LENS)
    total, local = layout.total_rows, layout.local_row_count
    _one_line(lambda: layout.shard(torch.zeros(total + 1)), f"shard got {total + 1} rows", f"are {total}", "seq_lens")
    _one_line(lambda: layout.unshard(torch.zeros(total)), f"unshard got {total} rows", f"are {local}")
    _one_line(lambda: layout.shifted_targets(torch.zeros(total)), "integer token ids")
    _one_line(lambda: layout.shifted_targets(torch.zeros(total - 1, dtype=torch.long)), "shifted_targets got")
    _one_line(lambda: layout.shard(3.0), "takes a tensor with rows")


def test_megatron_layout_needs_initialised_parallel_state():
    pytest.importorskip("megatron.core")
    _one_line(lambda: cp.Layout.from_megatron("zigzag", LENS), "parallel_state is not initialised")


def test_a_compiled_loss_checks_rows_too():
    layout = cp.Layout.zigzag(None, LENS)
    fn = torch.compile(lambda y: layout.unshard(y).sum(), backend="graphpass")
    _one_line(lambda: fn(torch.zeros(layout.local_row_count + 2)), "unshard got")
