"""Unit tests of `sink_row_slices_pass`: slices move above elementwise ops, values unchanged."""

from __future__ import annotations

import torch

from graphpass.passes.sink_row_slices import sink_row_slices_pass
from tests.helpers import run_passes

aten = torch.ops.aten


def sunk(fn, *args):
    """`fn`'s captured ATen graph after the pass."""
    return run_passes(fn, *args, passes=[sink_row_slices_pass]).gm


def _first_op_reading_input(gm):
    placeholder = next(iter(gm.graph.find_nodes(op="placeholder")))
    return next(iter(placeholder.users)).target


def test_shifted_slice_moves_onto_the_logits():
    def fn(logits, bias):
        return ((logits / 0.7 + bias)[:, :-1],)

    logits, bias = torch.randn(2, 5, 7), torch.randn(7)
    gm = sunk(fn, logits, bias)
    assert _first_op_reading_input(gm) is aten.slice.Tensor  # the division now reads a slice
    torch.testing.assert_close(gm(logits, bias)[0], fn(logits, bias)[0])


def test_split_chunks_each_scale_their_own_slice():
    def fn(logits):
        return tuple(chunk.exp() for chunk in (logits * 2.0).split(3))

    logits = torch.randn(8, 5)
    gm = sunk(fn, logits)
    assert not gm.graph.find_nodes(op="call_function", target=aten.split.Tensor)
    for a, b in zip(gm(logits), fn(logits)):
        torch.testing.assert_close(a, b)


def test_a_split_into_one_piece_is_the_tensor_itself():
    """A chunk loop over no more rows than a chunk (TRL's `entropy_from_logits` at <= 128 tokens):
    the region reads the scaled logits as the gather beside it does, not a slice of them."""
    def fn(logits, ids):
        scaled = logits / 0.7
        picked = scaled.gather(-1, ids[:, None])
        (chunk,) = scaled.split(128)
        return picked, torch.log_softmax(chunk, -1).exp().sum(-1)

    logits, ids = torch.randn(6, 9), torch.randint(0, 9, (6,))
    gm = sunk(fn, logits, ids)
    assert not gm.graph.find_nodes(op="call_function", target=aten.split.Tensor)
    assert not gm.graph.find_nodes(op="call_function", target=aten.slice.Tensor)
    (div,) = gm.graph.find_nodes(op="call_function", target=aten.div.Tensor)
    assert {u.target for u in div.users} == {aten.gather.default, aten.log_softmax.int}
    for a, b in zip(gm(logits, ids), fn(logits, ids)):
        torch.testing.assert_close(a, b)


def test_an_op_read_whole_elsewhere_stays():
    def fn(logits):
        scaled = logits / 0.7
        return scaled[:, :-1].sum(), scaled.sum()

    logits = torch.randn(4, 6)
    gm = sunk(fn, logits)
    assert _first_op_reading_input(gm) is aten.div.Tensor
    for a, b in zip(gm(logits), fn(logits)):
        torch.testing.assert_close(a, b)


def test_a_random_op_never_moves():
    def fn(logits):
        return (torch.nn.functional.dropout(logits, 0.5)[:, :-1],)

    gm = sunk(fn, torch.randn(4, 6))
    assert _first_op_reading_input(gm) is not aten.slice.Tensor


def test_per_sequence_loop_and_contiguous_reshape_move():
    def fn(logits):
        scaled = logits / 0.7
        rows = tuple(scaled[i].sum() for i in range(logits.shape[0]))  # select(scaled, 0, i)
        return rows

    logits = torch.randn(3, 4, 5)
    gm = sunk(fn, logits)
    placeholder = next(iter(gm.graph.find_nodes(op="placeholder")))
    assert {u.target for u in placeholder.users} == {aten.select.int}  # each row scaled on its own
    for a, b in zip(gm(logits), fn(logits)):
        torch.testing.assert_close(a, b)


def test_reshape_of_a_strided_slice_stays_put():
    def fn(logits):
        scaled = logits[:, :-1] / 0.7  # strided: reshaping it would copy
        return tuple(c.exp() for c in scaled.reshape(-1, logits.shape[-1]).split(2))

    logits = torch.randn(2, 4, 5)
    gm = sunk(fn, logits)
    for a, b in zip(gm(logits), fn(logits)):
        torch.testing.assert_close(a, b)


def test_row_slice_of_an_lm_head_moves_onto_the_hidden_states():
    import torch.nn.functional as F

    def fn(hidden, weight, bias):
        return (F.linear(hidden, weight, bias)[:, :-1], (hidden @ weight.t())[:, -1])

    hidden, weight, bias = torch.randn(2, 5, 3), torch.randn(7, 3), torch.randn(7)
    gm = sunk(fn, hidden, weight, bias)
    matmuls = [n for n in gm.graph.nodes if n.target in (aten.linear.default, aten.matmul.default)]
    assert len(matmuls) == 2
    for n in matmuls:  # each reads picked rows of the hidden states, the weight as it is
        assert n.args[0].target in (aten.slice.Tensor, aten.select.int)
        assert n.args[1].op == "placeholder" or n.args[1].target is aten.t.default
    for a, b in zip(gm(hidden, weight, bias), fn(hidden, weight, bias)):
        torch.testing.assert_close(a, b)


def test_vocabulary_slice_of_an_lm_head_stays():
    import torch.nn.functional as F

    def fn(hidden, weight):
        return (F.linear(hidden, weight)[..., :5],)  # a padded vocabulary cut: columns, not rows

    hidden, weight = torch.randn(4, 3), torch.randn(7, 3)
    gm = sunk(fn, hidden, weight)
    (matmul,) = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    assert matmul.args[0].op == "placeholder"
    torch.testing.assert_close(gm(hidden, weight)[0], fn(hidden, weight)[0])
