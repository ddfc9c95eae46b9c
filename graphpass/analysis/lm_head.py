"""Whether a region's logits come from an lm_head matmul the chunked op can absorb.

A region's wide input is often `hidden @ W.T` (`F.linear`, `matmul`/`mm` with `W.t()`, `addmm`
with a bias) computed in the same graph. When the region is the logits' only reader, the op can
take `hidden [*rows, H]`, `W` and the bias instead, compute each chunk's logits itself and never
store `[rows, V]` (nor its gradient): `match_lm_head` says how, or why not.

Read-only: nothing here changes the graph.
"""

from __future__ import annotations

import dataclasses

import torch

from graphpass import _torch_api
from graphpass._torch_api import known_equal
from graphpass.analysis import rowlocal
from graphpass.fx_utils import RESHAPES, fake_value, target_name

aten = torch.ops.aten

#: Readers that only check a value's metadata (pre-dispatch export puts one before `.to(dtype)`).
METADATA_CHECKS = {aten._assert_tensor_metadata.default}
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}


@dataclasses.dataclass
class LmHead:
    """`logits = hidden @ W.T (+ bias)` (or `hidden @ W` when `weight_transposed`), read only by a region."""

    logits: torch.fx.Node
    """The matmul's output: the region's wide input."""
    hidden: torch.fx.Node
    """`[*rows, H]`."""
    weight: torch.fx.Node
    """`[V, H]` (as `nn.Linear` and a tied embedding hold it), or `[H, V]` when `weight_transposed`."""
    bias: torch.fx.Node | None
    """`[V]`, or None."""
    weight_transposed: bool
    hidden_size: int
    nodes: list
    """The nodes the op replaces besides the region: the matmul and the metadata checks of its
    output (the weight's transpose, a view, goes with dead-code elimination)."""


def is_matrix_transpose(node) -> bool:
    """`x.T` of a 2-d `x`: `t`, `transpose(0, 1)` or `permute([1, 0])`."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _TRANSPOSES):
        return False
    val = fake_value(node.args[0])
    if not isinstance(val, torch.Tensor) or val.ndim != 2:
        return False
    if node.target is aten.transpose.int:
        return sorted(d % 2 for d in node.args[1:3]) == [0, 1]
    if node.target is aten.permute.default:
        return [d % 2 for d in node.args[1]] == [1, 0]
    return True


def _operands(node):
    """(hidden, right operand [H, V], bias) of a matmul-like node, or None if it is not one."""
    if node.op != "call_function":
        return None
    args = rowlocal.normalized_args(node)
    if args is None:
        return None
    if node.target is aten.linear.default:
        return args["input"], ("weight", args["weight"]), args.get("bias")
    if node.target in (aten.matmul.default, aten.mm.default):
        return args["self"], ("right", args["mat2" if node.target is aten.mm.default else "other"]), None
    if node.target is aten.addmm.default:
        if args.get("beta", 1) != 1 or args.get("alpha", 1) != 1:
            return None
        return args["mat1"], ("right", args["mat2"]), args["self"]
    return None


def match_lm_head(region, logits: torch.fx.Node, modes) -> tuple[LmHead | None, str | None]:
    """The lm_head that computes `logits` (a wide input of `region`), or (None, why not).

    (None, None): `logits` is not computed by a matmul at all (nothing to say). `modes` (grad mode
    per node): the matmul must run in the region's; None for a head no gradient reaches.
    """
    head, why = match_matmul(logits)
    if head is None:
        return None, why
    hidden = fake_value(head.hidden)
    lay = rowlocal.layout_of(hidden, region.rows)
    if lay is None or lay.kind != rowlocal.ROW or lay.row_dims != hidden.ndim - 1:
        return None, "its hidden states are not laid out over the region's rows"
    checks, why = other_readers(logits, set(region.nodes))
    if why is not None:
        return None, why
    if modes is not None and modes[logits] != modes[region.place]:
        return None, "the matmul runs in another grad mode than the region"
    return dataclasses.replace(head, nodes=[logits, *checks]), None


def match_matmul(logits: torch.fx.Node) -> tuple[LmHead | None, str | None]:
    """`logits` as `hidden @ W.T (+ bias)` whatever reads it (`nodes` is `[logits]`), or (None, why not);
    (None, None) when it is not a matmul at all. The part of `match_lm_head` that does not depend
    on who reads the logits (the vocab-parallel op's fusion uses it too)."""
    found = _operands(logits)
    if found is None:
        return None, None
    hidden, (kind, right), bias = found
    h_val, r_val, out_val = fake_value(hidden), fake_value(right), fake_value(logits)
    if not all(isinstance(v, torch.Tensor) for v in (h_val, r_val, out_val)):
        return None, "its operands are not tensors"
    if kind == "weight":
        weight, transposed = right, False
    elif is_matrix_transpose(right):
        weight, transposed = right.args[0], False
    else:
        weight, transposed = right, True
    w_val = fake_value(weight)
    if w_val.ndim != 2 or h_val.ndim < 2 or out_val.ndim != h_val.ndim:
        return None, f"the matmul of {tuple(h_val.shape)} and {tuple(r_val.shape)} is not hidden @ W.T"
    vocab, hidden_size = (w_val.shape[1], w_val.shape[0]) if transposed else (w_val.shape[0], w_val.shape[1])
    if not (isinstance(vocab, int) and isinstance(hidden_size, int)):
        return None, "its vocabulary or hidden size is symbolic"
    if not (known_equal(out_val.shape[-1], vocab) and known_equal(h_val.shape[-1], hidden_size)):
        return None, "its weight does not map the hidden size to the vocabulary"
    if bias is not None:
        b_val = fake_value(bias)
        if not isinstance(b_val, torch.Tensor) or b_val.ndim != 1 or not known_equal(b_val.shape[0], vocab):
            return None, "its bias is not one value per vocabulary entry"
        if b_val.dtype != out_val.dtype:
            return None, "its bias has another dtype than the logits"
    if not (h_val.dtype == w_val.dtype == out_val.dtype and out_val.dtype.is_floating_point):
        return None, "its hidden states, weight and logits differ in dtype"
    if len({h_val.device, w_val.device}) != 1:
        return None, "its hidden states and weight are on different devices"
    return LmHead(logits, hidden, weight, bias, transposed, hidden_size, [logits]), None


def is_vocab_bias(logits: torch.fx.Node, matmul: torch.fx.Node, bias) -> bool:
    """Whether `logits = matmul + bias` adds one value per vocabulary entry, in the logits' dtype,
    without changing their shape (the bias of `hidden @ W.T + b`)."""
    b_val, mm_val, out_val = fake_value(bias), fake_value(matmul), fake_value(logits)
    return (isinstance(b_val, torch.Tensor) and b_val.ndim == 1 and isinstance(out_val, torch.Tensor)
            and isinstance(mm_val, torch.Tensor) and known_equal(b_val.shape[0], mm_val.shape[-1])
            and b_val.dtype == mm_val.dtype == out_val.dtype and out_val.ndim == mm_val.ndim
            and all(known_equal(a, b) for a, b in zip(out_val.shape, mm_val.shape)))


def other_readers(logits: torch.fx.Node, inside: set, reader: str = "the region") -> tuple[list, str | None]:
    """(the metadata checks reading `logits`, None) when nothing but `inside` (`reader`, as the
    reason names it) and such checks reads it, else ([], why not)."""
    checks = []
    for user in logits.users:
        if user in inside:
            continue
        if user.op == "call_function" and user.target in METADATA_CHECKS:
            checks.append(user)
            continue
        if user.op == "output":
            return [], "its logits are also an output of the graph"
        from graphpass.analysis.regions import source_of

        return [], f"its logits are also read outside {reader} ({target_name(user)} at {source_of(user)})"
    return checks, None


#: Ops whose output holds the same logits as their input (the rows reshaped, a copy, a cast).
_SAME_LOGITS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                aten.alias.default, aten._to_copy.default}


def _rows_sliced_from_a_value_read_whole(node: torch.fx.Node):
    """(the sliced value, a reader of all its rows) when `node` slices rows (not the last dim) of a
    value that another op reads whole (the chosen half of a preference batch, `lp[:B]`, beside a
    gather over `lp`); else None."""
    if node.target not in (aten.slice.Tensor, aten.select.int) or not isinstance(node.args[0], torch.fx.Node):
        return None
    base = node.args[0]
    val = fake_value(base)
    dim = node.args[1] if len(node.args) > 1 else 0
    if not isinstance(val, torch.Tensor) or not isinstance(dim, int) or dim % val.ndim == val.ndim - 1:
        return None
    readers = [u for u in base.users if u is not node and u.target not in (aten.slice.Tensor, aten.select.int)]
    return (base, readers[0]) if readers else None


def not_computed_here(logits: torch.fx.Node) -> str:
    """Why `logits`, which are no matmul `match_matmul` takes, cannot be computed by the op from the
    hidden states: they come from outside the graph (a graph input: the compiled function's, or a
    value Dynamo carried over a graph break, named with its reason), or from another op."""
    origin = logits
    while origin.op == "call_function" and origin.target in _SAME_LOGITS and isinstance(origin.args[0], torch.fx.Node):
        origin = origin.args[0]
    if origin.op != "placeholder":
        from graphpass.analysis.regions import source_of

        whole = _rows_sliced_from_a_value_read_whole(origin)
        if whole is not None:
            base, reader = whole
            return (f"it reads rows sliced ({target_name(origin)} at {source_of(origin)}) from {target_name(base)} at "
                    f"{source_of(base)}, which {target_name(reader)} at {source_of(reader)} reads over all rows; "
                    "compute the per-row values over all rows and slice those to take the matmul in")
        return f"its logits are computed by {target_name(origin)} at {source_of(origin)}, not by a matmul of hidden states"
    where = _torch_api.graph_break_before_this_graph()
    if where is None:
        outside = "an input of the compiled function"
    else:
        outside = f"Dynamo broke the graph at {where[0]}" + (f": {where[1]}" if where[1] else "")
    return f"the logits come from outside this graph ({outside}); compile a function that computes them from the hidden states"


#: Reshapes of the logits that, keeping their last dim, keep their rows in order: the same reshape
#: of the hidden states gives the same rows (slime hands megatron-core's fused loss `logits[:, None]`).
ROW_RESHAPES = RESHAPES | {aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims}


def match_head_behind(logits: torch.fx.Node) -> tuple[LmHead | None, str | None]:
    """`match_matmul(logits)`, or `hidden @ W.T + b` written as an addition of a `[V/tp]` bias to
    an unbiased matmul that nothing else reads, or a reshape that keeps the last dim of either
    (`[B, S, V/tp]` to `[B * S, V/tp]`, `[T, V/tp]` to `[T, 1, V/tp]`: the same rows in the same order, as
    for the hidden states).
    `head.logits` is `logits`; `head.nodes` every node the op replaces, with their metadata checks."""
    head, why = match_matmul(logits)
    if head is not None or why is not None:
        return head, why
    if logits.op == "call_function" and logits.target in ROW_RESHAPES and isinstance(logits.args[0], torch.fx.Node):
        source = logits.args[0]
        val, src_val = logits.meta.get("val"), source.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(src_val, torch.Tensor) and val.ndim >= 2
                and src_val.ndim >= 2 and known_equal(val.shape[-1], src_val.shape[-1])):
            return None, None
        head, why = match_head_behind(source)
        if head is None:
            return None, why
        checks, why = other_readers(source, {logits}, "the reshape of its logits")
        if why is not None:
            return None, why
        return dataclasses.replace(head, logits=logits, nodes=[logits, *head.nodes, *checks]), None
    if not (logits.op == "call_function" and logits.target is aten.add.Tensor and len(logits.args) == 2
            and not logits.kwargs):
        return None, None
    for matmul, bias in (logits.args, logits.args[::-1]):
        if isinstance(matmul, torch.fx.Node) and isinstance(bias, torch.fx.Node):
            head, why = match_matmul(matmul)
            if head is not None or why is not None:
                break
    else:
        return None, None
    if head is None:
        return None, why
    if head.bias is not None:
        return None, "its logits add a second bias to a biased matmul"
    if not is_vocab_bias(logits, matmul, bias):
        return None, "the value added to its matmul is not one bias per vocabulary entry in the logits' dtype"
    checks, why = other_readers(matmul, {logits}, "the bias's addition")
    if why is not None:
        return None, f"its matmul (before the bias) {why.removeprefix('its logits ')}"
    return dataclasses.replace(head, logits=logits, bias=bias, nodes=[logits, matmul, *checks]), None
