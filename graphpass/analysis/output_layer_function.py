"""An `autograd.Function` that multiplies by the output layer itself, read as a Function of its logits.

A hand-written lm_head kernel computes `z = hidden @ W.T (+ b)` (whole, chunk by chunk over
rows, or a vocabulary block `W[a:b]` at a time), log-probs and/or entropies of `z`, and in
backward the logits' gradient `dz` from `z` recomputed, then `dhidden = dz @ W`, `dW = dz.T @
hidden` (and `db = dz.sum(0)`). With its chunk loops folded (`fold_function_body`) and its
vocabulary blocks read as blocks of one product (`fold_weight_blocks`), its joint graph (forward then backward) is checked to be exactly that
chain rule around one product `z`, and its logits-level part is cut out: a joint of `z` alone,
`(z, *other inputs, *grad_outputs) -> (*outputs, dz, None, ...)`, whose forward is matched and
whose backward is checked as any logits Function's is (`backward_check`).

A vocab-parallel lm_head Function (collectives inside) is read from its forward alone
(`cut_forward_at_logits`), its backward trusted as a vocab-parallel logits Function's is, except
for what it does with the hidden states' gradient (`hidden_gradient_collective`).

Changes only the joint it is handed (a copy graphpass captured to read); the cut is a new graph.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from graphpass._torch_api import detect_fake_mode, fake_node, functional_collectives
from graphpass.analysis import catalogue
from graphpass.analysis.lm_head import LmHead, is_matrix_transpose, is_vocab_bias, match_matmul
from graphpass.analysis.vocab_blocks import tiles
from graphpass.analysis.vocab_parallel import VocabParallelMatch
from graphpass.fx_utils import hashable, is_floating, target_name, transitive_inputs, transitive_users

aten = torch.ops.aten


@dataclasses.dataclass
class OutputLayerCut:
    """A lm_head Function's joint, cut at its logits."""

    head: LmHead
    """The product `z = hidden @ W.T (+ bias)` in the joint; `head.hidden`, `head.weight` and
    `head.bias` are placeholders."""
    hidden_position: int
    weight_position: int
    bias_position: int | None
    """Positions of the hidden states, the weight and the bias (None: no bias) among the Function's inputs."""
    detached: set[int]
    """Those of the three positions whose gradient the backward does not return (None): zero."""
    logits_joint: torch.fx.GraphModule
    """`(z, *other inputs, *grad_outputs) -> (*outputs, dz, None per other input)`."""
    other_positions: list[int]
    """The Function's input position of each of `logits_joint`'s inputs after `z` (those its
    math reads besides the hidden states and the weight)."""
    example_inputs: list
    """Fake values of `logits_joint`'s inputs (before the grad outputs)."""


def read_transposes(joint: torch.fx.GraphModule, transposes: dict[int, int]) -> None:
    """Read the joint's input `i` as `t(input j)` for each `i: j` of `transposes`: a Function's
    `weight.T`, which Dynamo hands in beside `weight` (once per use), is the weight's transpose."""
    graph = joint.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    made = {}
    for i, j in transposes.items():
        if j not in made:
            with graph.inserting_after(placeholders[-1]):
                made[j] = graph.call_function(aten.t.default, (placeholders[j],))
            made[j].meta.update(placeholders[i].meta)
        placeholders[i].replace_all_uses_with(made[j], propagate_meta=False)


def transposed_inputs(tensors) -> dict[int, int]:
    """{i: j} where the Function's input `i` is its input `j` transposed (a matrix's `.T`)."""
    found = {}
    for i, t in enumerate(tensors):
        if isinstance(t, torch.fx.Node) and t.op == "call_function" and (t.target is aten.t.default or (
                t.target is aten.permute.default and list(t.args[1]) == [1, 0])) and t.args[0] in tensors:
            found[i] = tensors.index(t.args[0])
    return found


#: The products an output layer's logits come from, as captured: where each reads its two operands.
_PRODUCTS = {aten.matmul.default: slice(0, 2), aten.linear.default: slice(0, 2), aten.mm.default: slice(0, 2),
             aten.bmm.default: slice(0, 2), aten.addmm.default: slice(1, 3)}


def output_layer_inside(gm: torch.fx.GraphModule):
    """The product of two of its float inputs a Function's forward normalises (logits `hidden @ W.T`
    it computes itself), or None for any other Function."""
    inputs = [p for p in gm.graph.find_nodes(op="placeholder") if is_floating(p)]
    from_inputs = set(inputs) | transitive_users(inputs)  # nodes computed from a float input
    for product in gm.graph.nodes:
        operands = product.args[_PRODUCTS[product.target]] if product.target in _PRODUCTS else ()
        if len(operands) < 2 or not all(a in from_inputs for a in operands):
            continue
        if any(catalogue.normalises(n) for n in transitive_users([product])):
            return product
    return None


def issues_collectives(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph calls a functional collective (a vocab-parallel Function's body)."""
    return any(n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
               for n in gm.graph.nodes)


def cut_at_logits(joint: torch.fx.GraphModule, example_inputs: list, n_outputs: int) -> OutputLayerCut | str:
    """The joint of a Function of `len(example_inputs)` inputs and `n_outputs` outputs, cut at
    the output layer's product, or why it is not that chain rule (a phrase about the user's code)."""
    graph = joint.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    inputs, n_inputs = placeholders[:len(example_inputs)], len(example_inputs)
    _merge_repeats(graph)  # the backward's recomputed logits are the forward's
    heads, blocks = [], False
    for node in graph.nodes:
        head, _ = match_matmul(node) if node.op == "call_function" else (None, None)
        if head is not None and head.hidden in inputs and head.weight in inputs:
            heads.append(head)
        blocks = blocks or (head is not None and _is_block_of(head.weight, inputs))
    if blocks:
        return "it multiplies vocabulary blocks of the weight (slices of its rows), not the whole output layer"
    if len(heads) != 1:
        return f"it multiplies its inputs {len(heads)} times where one output layer's product was expected" \
            if heads else "its output layer's product is not one product of its inputs (vocabulary blocks of " \
                          "the weight, casts or views on the way)"
    head = _with_bias(heads[0], inputs)
    if isinstance(head, str):
        return head
    results = list(graph.output_node().args[0])
    outputs, grads = results[:n_outputs], results[n_outputs:]
    h_pos, w_pos = inputs.index(head.hidden), inputs.index(head.weight)
    b_pos = None if head.bias is None else inputs.index(head.bias)
    # An input the backward returns no gradient for gets none from autograd either (the Function's
    # gradient for it is zero): the plain math reads it detached.
    detached = {i for i in (h_pos, w_pos, b_pos) if i is not None and grads[i] is None}
    for i, grad in enumerate(grads):
        if i not in (h_pos, w_pos, b_pos) and grad is not None:
            return f"its backward returns a gradient for its input {i + 1}, not the hidden states, weight or bias"
    dz = _logits_gradient(head, grads[h_pos], grads[w_pos], None if b_pos is None else grads[b_pos])
    if isinstance(dz, str):
        return dz
    # The other inputs the math reads (not a `weight.T` read as the weight's transpose).
    other_positions = [i for i, p in enumerate(inputs) if i not in (h_pos, w_pos, b_pos) and p.users]
    others = [inputs[i] for i in other_positions]
    logits_joint = _cut(graph, head, others, placeholders[n_inputs:], outputs, dz)
    if isinstance(logits_joint, str):
        return logits_joint
    return OutputLayerCut(head, h_pos, w_pos, b_pos, detached, logits_joint, other_positions,
                          [head.logits.meta["val"], *(example_inputs[i] for i in other_positions)])


# ---- an output layer multiplied a vocabulary block at a time --------------------------------------
def fold_weight_blocks(joint: torch.fx.GraphModule, n_inputs: int, n_outputs: int) -> str | None:
    """Read a joint that multiplies vocabulary blocks of the weight (the shape of TRL's and
    prime-rl's kernels) as one product `z = hidden @ W.T`: each `hidden @ W[a:b].T` becomes
    `z[:, a:b]`, and where the blocks tile the vocabulary, the backward's `dhidden += dz_a @ W[a:b]`
    and `dW[a:b] = dz_a.T @ hidden` (or `+=` into zeros, or a `cat` of the blocks) become `dz @ W`
    and `dz.T @ hidden` for `dz = cat_a(dz_a)`. Changes `joint`; None when done (or there are no
    blocks), else why the joint's blocks are not that."""
    graph = joint.graph
    inputs = list(graph.find_nodes(op="placeholder"))[:n_inputs]
    blocks = []
    for node in list(graph.nodes):
        head, _ = match_matmul(node) if node.op == "call_function" else (None, None)
        if head is None or not _is_block_of(head.weight, inputs):
            continue
        if _whole(head.hidden, inputs) is not None:
            if not (_uncast(head.hidden) and _uncast(head.weight)):  # one product would drop the casts
                return "it casts the hidden states or the weight before multiplying vocabulary blocks of the weight"
            blocks.append((node, head))
        elif _is_block_of(head.hidden, inputs):  # (the backward's `dz_a @ W[a:b]` reads no input's rows)
            return "it multiplies vocabulary blocks of the weight by chunks of the hidden states' rows (a loop in a loop)"
    if not blocks:
        return None
    fake_mode = detect_fake_mode([n.meta["val"] for n in inputs if "val" in n.meta])
    products = {}
    for node, head in blocks:
        weight, (a, b) = _block(head.weight)
        if head.bias is not None or head.weight_transposed or node.target not in catalogue.MATRIX_PRODUCTS:
            return "it multiplies vocabulary blocks of the weight other than as hidden @ W[a:b].T"
        key = (_whole(head.hidden, inputs), weight, node.target)
        with graph.inserting_before(node):
            if key not in products:
                transposed = fake_node(graph, fake_mode, aten.t.default, (weight,), like=node)
                products[key] = fake_node(graph, fake_mode, node.target, (key[0], transposed), like=node)
            block = fake_node(graph, fake_mode, aten.slice.Tensor, (products[key], -1, a, b), like=node)
        node.replace_all_uses_with(block)
        graph.erase_node(node)
    if len(products) != 1:
        return "it multiplies vocabulary blocks of more than one weight, or of different hidden states"
    (hidden, weight, product), = products
    results = list(graph.output_node().args[0])
    grads = results[n_outputs:]
    h_pos, w_pos = inputs.index(hidden), inputs.index(weight)
    seeds = [g for g in (grads[h_pos], grads[w_pos]) if isinstance(g, torch.fx.Node)]
    if not any(_is_product(n) and _is_block_of(n.args[1], [weight]) for n in transitive_inputs(seeds) | set(seeds)):
        return None  # a backward that multiplies the whole weight: read as any other
    blocks = _blocks_of_dz(grads[h_pos], grads[w_pos], hidden, weight)
    if isinstance(blocks, str):
        return blocks
    with graph.inserting_before(graph.output_node()):
        dz = fake_node(graph, fake_mode, aten.cat.default, (blocks, -1), like=blocks[-1])
        grads[h_pos] = fake_node(graph, fake_mode, product, (dz, weight), like=dz)
        grads[w_pos] = fake_node(graph, fake_mode, product,
                                 (fake_node(graph, fake_mode, aten.t.default, (dz,), like=dz), hidden), like=dz)
    graph.output_node().args = ((*results[:n_outputs], *grads),)
    graph.eliminate_dead_code()
    joint.recompile()
    return None


def _blocks_of_dz(dhidden, dweight, hidden, weight):
    """[dz_a per vocabulary block, in order] (as `dz_a @ W[a:b]` reads it) when `dhidden` is
    `sum_a dz_a @ W[a:b]` and `dweight` puts `dz_a.T @ hidden` in its rows `[a, b)`, the blocks
    tiling the weight's rows; else why not."""
    vocab = weight.meta["val"].shape[0]
    summed = _writes(dhidden, hidden.meta["val"].shape[0]) if dhidden is not None else None
    by_block = _writes(dweight, vocab) if dweight is not None else None
    if summed is None or by_block is None or len(summed) != 1:
        return "its backward's gradients for the hidden states and the weight are not sums of products by blocks"
    from_dh = {}
    for term in next(iter(summed.values())):
        if not (_is_product(term) and _is_block_of(term.args[1], [weight])) or _block(term.args[1])[1] in from_dh:
            return "its backward does not sum dz @ W[a:b] over vocabulary blocks for the hidden states' gradient"
        from_dh[_block(term.args[1])[1]] = term.args[0]
    from_dw = {}
    for block, terms in by_block.items():
        if len(terms) != 1 or not _is_product(terms[0]) or _whole(terms[0].args[1], [hidden]) is not hidden:
            return "its backward does not put dz.T @ hidden in each vocabulary block of the weight's gradient"
        from_dw[block] = _plain(_untransposed(terms[0].args[0]))
    if not tiles(from_dh, vocab):
        return "its backward's vocabulary blocks do not tile the weight"
    if {block: _plain(dz) for block, dz in from_dh.items()} != from_dw:
        return "its backward puts dz.T @ hidden of other values or blocks in the weight's gradient than dz @ W[a:b] " \
               "in the hidden states'"
    return [from_dh[block] for block in sorted(from_dh)]


def _writes(node, size: int) -> dict | None:
    """{(p, q): [terms]}: `node` as the sums of terms written in its rows `[p, q)` (a chunk of rows
    or a vocabulary block), rows not named zero: an accumulator filled with `buf[p:q] = x` or
    `buf[p:q] += x` (functionalized into `slice_scatter`s), a `cat` of pieces along the rows, or
    a sum over all rows. Casts and copies aside; None where it is none of these."""
    node = _plain(node)
    if node.target in catalogue.ZEROS:
        return {}
    if node.target is aten.cat.default and (node.args[1] if len(node.args) > 1 else 0) == 0:
        written, start = {}, 0
        for piece in node.args[0]:
            end = start + piece.meta["val"].shape[0]
            written[start, end] = _terms(piece)
            start = end
        return None if any(t is None for t in written.values()) else written
    if node.target is not aten.slice_scatter.default:
        terms = _terms(node)
        return None if terms is None else {(0, size): terms}
    base, value = node.args[:2]
    if node.args[2] != 0 or (node.args[5] if len(node.args) > 5 else 1) != 1:
        return None
    region = (node.args[3], min(node.args[4], size))
    written = _writes(base, size)
    if written is None or _overlaps_in_part(region, written):
        return None
    value = _plain(value)
    previous = _plain(base)
    if previous.target is aten.slice_scatter.default and _plain(previous.args[1]) is value and \
            tuple(previous.args[2:5]) == tuple(node.args[2:5]):
        return written  # `buf[p:q] += x` writes the sum back a second time
    terms = _terms(value)  # `buf[p:q] + x` reads what is there (an accumulation)
    if terms is None:
        return None
    written[region] = terms
    return written


def _terms(node):
    """The terms of `node` = a sum (casts aside), zero fills dropped, and `buf[p:q]` read as the
    terms written there (none: zero). None if a term reads part of a write."""
    terms, stack = [], [node]
    while stack:
        node = _plain(stack.pop())
        if node.target is aten.add.Tensor and not node.kwargs:
            stack.extend(node.args)
        elif node.target in catalogue.ZEROS:
            continue
        elif node.target is aten.slice.Tensor and node.args[1] == 0 and \
                (node.args[4] if len(node.args) > 4 else 1) == 1:
            size = node.args[0].meta["val"].shape[0]
            held = _writes(node.args[0], size)
            region = _block(node)[1]
            if held is None or _overlaps_in_part(region, held):
                return None
            terms.extend(held.get(region, []))
        else:
            terms.append(node)
    return terms


def _whole(node, inputs):
    """The input `node` is, itself or all its rows (`x[0:n]`), else None."""
    node = _plain(node)
    if node in inputs:
        return node
    if _is_block_of(node, inputs):
        source, rows = _block(node)
        return source if rows == (0, source.meta["val"].shape[0]) else None
    return None


def _overlaps_in_part(region, regions) -> bool:
    """Whether another of `regions` overlaps `region` (a write over part of another's rows)."""
    return any(r != region and r[0] < region[1] and region[0] < r[1] for r in regions)


def _uncast(node) -> bool:
    """Whether `node` (and, for a slice, what it slices) is read without a cast or a copy."""
    return _plain(node) is node and (node.target not in (aten.slice.Tensor, aten.narrow.default)
                                     or _plain(node.args[0]) is node.args[0])


def _block(node):
    """(the input, (a, b)) of `x[a:b]` along its first dim, `b` at most its size."""
    node = _plain(node)
    source = _plain(node.args[0])
    rows = source.meta["val"].shape[0]
    if node.target is aten.narrow.default:
        return source, (node.args[2], min(node.args[2] + node.args[3], rows))
    start, end = (list(node.args[2:4]) + [None, None])[:2]
    return source, (start or 0, rows if end is None else min(end, rows))


def _is_block_of(weight, inputs) -> bool:
    """Whether `weight` is a slice of an input's rows (a vocabulary block of an output layer)."""
    weight = _plain(weight)
    return isinstance(weight, torch.fx.Node) and weight.target in (aten.slice.Tensor, aten.narrow.default) \
        and _plain(weight.args[0]) in inputs and (weight.args[1] if len(weight.args) > 1 else 0) == 0


def _with_bias(head: LmHead, inputs) -> LmHead | str:
    """`head` with the bias added to its product (`addmm`'s, or `z + b` the product's one reader),
    `head.logits` the sum; or why the bias is not an input of the Function."""
    if head.bias is None and len(head.logits.users) == 1:
        add = next(iter(head.logits.users))
        if add.target is aten.add.Tensor and not add.kwargs and len(add.args) == 2:
            bias = add.args[1] if add.args[0] is head.logits else add.args[0]
            if isinstance(bias, torch.fx.Node) and is_vocab_bias(add, head.logits, bias):
                head = dataclasses.replace(head, logits=add, bias=bias, nodes=[add])
    if head.bias is not None and head.bias not in inputs:
        return "its output layer's bias is not an input of the Function"
    return head


def _logits_gradient(head: LmHead, dhidden, dweight, dbias):
    """(`d`, scaling): the one node `d` with `dhidden = (d @ W) * s`, `dW = (d.T @ hidden) * s`
    and `dbias = d.sum(rows) * s` for one constant scaling `s` (casts and copies aside), so that
    the logits' gradient is `d * s`; or why not."""
    found = []
    if dbias is not None:
        total, scale = _scaled(dbias)
        if not _sums_rows(total):
            return "its backward does not sum the logits' gradient over the rows for the bias's"
        found.append((_plain(total.args[0]), scale))
    if dhidden is not None:
        product, scale = _scaled(dhidden)
        if not _is_product(product) or _plain(_right_operand(product, head.weight_transposed)) is not head.weight:
            return "its backward does not multiply the logits' gradient by the weight for the hidden states'"
        found.append((_plain(product.args[0]), scale))
    if dweight is not None:
        product, scale = _scaled(dweight)
        # dW [V, H] = dz.T @ hidden; for an [H, V] weight, dW = hidden.T @ dz.
        if not _is_product(product):
            return "its backward does not compute the weight's gradient as one product"
        left, right = product.args[:2]
        dz, other = (_plain(right), _untransposed(left)) if head.weight_transposed else (_untransposed(left),
                                                                                       _plain(right))
        if other is None or _plain(other) is not head.hidden or dz is None:
            return "its backward does not multiply the logits' gradient by the hidden states for the weight's"
        found.append((_plain(dz), scale))
    if not found:
        return "its backward returns no gradient for the hidden states or the weight"
    if any(f != found[0] for f in found):
        which = "the hidden states', the weight's and the bias's" if dbias is not None else \
            "the hidden states' and the weight's"
        return f"its backward multiplies different values for {which} gradients"
    return found[0]


def _cut(graph, head: LmHead, others, grad_placeholders, outputs, gradient):
    """The logits-level joint: the nodes `outputs` and the logits' gradient `(d, scale)` need,
    `z` a placeholder; or why not."""
    dz, scale = gradient
    new, env = torch.fx.Graph(), {}
    root = torch.nn.Module()
    env[head.logits] = new.placeholder("logits")
    env[head.logits].meta.update(head.logits.meta)
    for p in [*others, *grad_placeholders]:
        env[p] = new.placeholder(p.name)
        env[p].meta.update(p.meta)
    seeds = [o for o in (*outputs, dz) if isinstance(o, torch.fx.Node)]
    needed = set(seeds) | transitive_inputs(seeds, stop={head.logits})
    for node in graph.nodes:
        if node not in needed or node in env:
            continue
        if node.op == "placeholder":  # the hidden states or the weight, read beside the product
            return "its log-probs or their gradient read the hidden states or the weight beside their product"
        if node.op == "get_attr":
            setattr(root, node.target, getattr(graph.owning_module, node.target))
        env[node] = new.node_copy(node, lambda n: env[n])
    grad = env[dz]
    if scale != 1.0:
        grad = fake_node(new, detect_fake_mode([dz.meta["val"]]), aten.mul.Tensor, (grad, scale), like=dz)
    new.output((*[env[o] if isinstance(o, torch.fx.Node) else o for o in outputs], grad, *[None] * len(others)))
    return torch.fx.GraphModule(root, new)


def _sums_rows(node) -> bool:
    """`x.sum(dims)` over every dim of `x` but the last (the vocabulary)."""
    if not (isinstance(node, torch.fx.Node) and node.target is aten.sum.dim_IntList):
        return False
    ndim = node.args[0].meta["val"].ndim
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return ndim >= 2 and not keepdim and sorted(d % ndim for d in node.args[1]) == list(range(ndim - 1))


def _merge_repeats(graph: torch.fx.Graph) -> None:
    """One node for each deterministic op computed twice on the same operands (a matrix's
    transpose spelled `t` whichever way it was written)."""
    seen = {}
    for node in list(graph.nodes):
        if is_matrix_transpose(node) and node.target is not aten.t.default:
            node.target, node.args, node.kwargs = aten.t.default, (node.args[0],), {}
        if node.op != "call_function" or not _deterministic(node.target):
            continue
        key = (node.target, hashable(node.args), hashable(node.kwargs))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
        else:
            seen[key] = node


def _deterministic(target) -> bool:
    """An op of the captured (functional) graph that draws no random numbers."""
    return hasattr(target, "tags") and torch.Tag.nondeterministic_seeded not in target.tags


def _is_product(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.target in catalogue.MATRIX_PRODUCTS


def _right_operand(product, transposed: bool):
    """The weight as `dz @ W` reads it: `W` for a `[V, H]` weight, `W.T` for an `[H, V]` one."""
    right = product.args[1]
    return _untransposed(right) if transposed else right


def _plain(node):
    """`node` behind casts and copies: `x.to(dtype)`, `clone(x)`, `expand_as(x, y)` of `y`'s shape,
    `zeros + x` (a gradient buffer written once)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target in catalogue.CASTS or node.target is aten.clone.default or (
                node.target is aten.expand_as.default
                and tuple(node.args[0].meta["val"].shape) == tuple(node.meta["val"].shape)):
            node = node.args[0]
        elif node.target is aten.add.Tensor and not node.kwargs and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0].target in catalogue.ZEROS and isinstance(node.args[1], torch.fx.Node):
            node = node.args[1]
        else:
            return node
    return node


def _scaled(node):
    """(`x`, `s`) for `node` = `x * s` (or `x / c`, `s = 1 / c`) of a constant, casts and copies aside."""
    node, scale = _plain(node), 1.0
    while isinstance(node, torch.fx.Node) and node.target in (aten.mul.Tensor, aten.div.Tensor) \
            and isinstance(node.args[1], (int, float)) and not isinstance(node.args[1], bool) and node.args[1] != 0:
        scale = scale * node.args[1] if node.target is aten.mul.Tensor else scale / node.args[1]
        node = _plain(node.args[0])
    return node, scale


def _untransposed(node):
    """`x` if `node` is `x.T` of a matrix (through casts and copies), else None."""
    node = _plain(node)
    return node.args[0] if is_matrix_transpose(node) else None


# ---- a vocab-parallel lm_head Function: its forward, cut at its logits ------------------------------
@dataclasses.dataclass
class ForwardCut:
    """A vocab-parallel lm_head Function's forward, cut where its log-prob/entropy math starts."""

    head: LmHead
    """The product `z = hidden @ W_shard.T` in the forward; `head.weight` is a placeholder."""
    hidden_position: int
    weight_position: int
    """Positions of the hidden states and this rank's weight shard among the Function's inputs."""
    gathered_over: str | None
    """The group whose ranks' hidden rows are all-gathered (along dim 0) before the product
    (sequence parallelism), or None: the product reads the hidden states as they are."""
    logits: torch.fx.Node
    """The logits the math reads in the forward: `z` itself, or `z` cast and its row dims permuted
    (`z.float().transpose(0, 1)` of `[s, b, v]` logits)."""
    logits_forward: torch.fx.GraphModule
    """`(logits, *other inputs) -> outputs`: the forward from the math's logits on."""
    other_positions: list[int]
    """The Function's input position of each of `logits_forward`'s inputs after the logits."""


@dataclasses.dataclass(frozen=True)
class VocabParallelOutputLayerFunction:
    """A vocab-parallel Function that multiplies by this rank's weight shard itself (NeMo-RL's
    `ChunkedDistributedHiddenStatesToLogprobs`), read at its logits."""

    match: VocabParallelMatch
    """The math from its logits on (`logits` None until they are emitted; `target` the caller's)."""
    cut: ForwardCut
    hidden_gradient: str
    """What its backward does with the hidden states' gradient: "reduce_scatter", "all_reduce", "local"."""


def cut_forward_at_logits(forward: torch.fx.GraphModule, n_outputs: int) -> ForwardCut | str:
    """The forward of a Function (folded, its `weight.T` inputs read as transposes) whose first
    `n_outputs` results are computed from one product of its hidden states (or their rows
    all-gathered over a group) and its weight, cut at the logits that product's casts and row
    permutations make; or why not (a phrase about the user's code)."""
    graph = forward.graph
    inputs = list(graph.find_nodes(op="placeholder"))
    heads = []
    for node in graph.nodes:
        head, _ = match_matmul(node) if node.op == "call_function" else (None, None)
        if head is not None and head.weight in inputs and _hidden_input(head.hidden, inputs) is not None:
            heads.append(head)
    if len(heads) != 1:
        return f"it multiplies its inputs {len(heads)} times where one output layer's product was expected" \
            if heads else "its output layer's product is not one product of its hidden states and weight"
    head = heads[0]
    if head.bias is not None:
        return "its output layer has a bias"
    hidden, group = _hidden_input(head.hidden, inputs)
    if hidden.meta["val"].dtype != head.hidden.meta["val"].dtype:
        return "it casts the hidden states before their product"
    logits = _layout_chain(head.logits)
    outputs = list(graph.output_node().args[0])[:n_outputs]
    new, env, root = torch.fx.Graph(), {}, torch.nn.Module()
    env[logits] = new.placeholder("logits")
    env[logits].meta.update(logits.meta)
    seeds = [o for o in outputs if isinstance(o, torch.fx.Node)]
    needed = set(seeds) | transitive_inputs(seeds, stop={logits})
    others = [p for p in inputs if p in needed and p not in (hidden, head.weight)]
    for p in others:
        env[p] = new.placeholder(p.name)
        env[p].meta.update(p.meta)
    for node in graph.nodes:
        if node not in needed or node in env:
            continue
        if node.op == "placeholder":
            return "its log-probs read the hidden states or the weight beside their product"
        if node.op == "get_attr":
            setattr(root, node.target, getattr(forward, node.target))
        env[node] = new.node_copy(node, lambda n: env[n])
    new.output(tuple(env[o] if isinstance(o, torch.fx.Node) else o for o in outputs))
    return ForwardCut(head, inputs.index(hidden), inputs.index(head.weight), group, logits,
                      torch.fx.GraphModule(root, new), [inputs.index(p) for p in others])


def _hidden_input(node, inputs):
    """(the placeholder, None) if `node` is an input behind copies, (the placeholder, group name) if
    it is an input's rows all-gathered over a group; else None."""
    node = _plain(node)
    if node in inputs:
        return node, None
    if isinstance(node, torch.fx.Node) and node.target is _WAIT:
        gather = node.args[0]
        if gather.target is _ALL_GATHER and _plain(gather.args[0]) in inputs:
            return _plain(gather.args[0]), gather.args[2]
    return None


def _layout_chain(z):
    """The logits the math reads: `z` followed through casts, copies and transposes of its row
    dims (the vocabulary stays last), each the one reader of the last."""
    node, ndim = z, z.meta["val"].ndim
    while len(node.users) == 1:
        user = next(iter(node.users))
        same_shape = user.target in catalogue.CASTS and user.meta["val"].shape == node.meta["val"].shape
        row_transpose = user.target is aten.transpose.int and all(d % ndim < ndim - 1 for d in user.args[1:3])
        if not (same_shape or row_transpose):
            break
        node = user
    return node


def emit_product(graph: torch.fx.Graph, end: torch.fx.Node, env: dict, like: torch.fx.Node) -> torch.fx.Node:
    """`end` of a Function's body computed in the caller's `graph` before `like`: the body's nodes
    it is computed from, copied, each of `env`'s body nodes read as the caller's node it maps to."""
    fake_mode = detect_fake_mode([n.meta["val"] for n in env.values()])
    computed = ({end} | transitive_inputs([end], stop=set(env))) - set(env)
    with graph.inserting_before(like):
        for node in [n for n in end.graph.nodes if n in computed]:
            args = torch.fx.node.map_arg(node.args, lambda n: env[n])
            env[node] = fake_node(graph, fake_mode, node.target, args, dict(node.kwargs), like=like)
    return env[end]


_WAIT = functional_collectives.wait_tensor.default
_ALL_GATHER = functional_collectives.all_gather_into_tensor.default


def hidden_gradient_collective(joint: torch.fx.GraphModule, n_outputs: int, cut: ForwardCut,
                               group_name: str) -> tuple[str | None, str | None]:
    """(what a vocab-parallel lm_head Function's backward, its `joint`, does with the hidden
    states' gradient over `group_name`, None): "reduce_scatter" (the adjoint of gathering their
    rows), "all_reduce" or "local"; or (None, why that is not what its forward implies)."""
    results = list(joint.graph.output_node().args[0])
    grads = results[n_outputs:]
    for i, grad in enumerate(grads):
        if i not in (cut.hidden_position, cut.weight_position) and grad is not None:
            return None, f"its backward returns a gradient for its input {i + 1}, not the hidden states or the weight"
    if grads[cut.hidden_position] is None or grads[cut.weight_position] is None:
        return None, "its backward returns no gradient for the hidden states or the weight"
    grad = _plain(grads[cut.hidden_position])
    collective = grad.args[0] if isinstance(grad, torch.fx.Node) and grad.target is _WAIT else None
    kind = "local"
    if collective is not None and collective.target is _REDUCE_SCATTER and collective.args[1] == "sum" \
            and collective.args[3] == group_name:
        kind = "reduce_scatter"
    elif collective is not None and collective.target is _ALL_REDUCE and collective.args[1:3] == ("sum", group_name):
        kind = "all_reduce"
    elif collective is not None:
        return None, f"its backward applies {target_name(collective)} to the hidden states' gradient"
    if (kind == "reduce_scatter") != (cut.gathered_over is not None):
        return None, ("its backward does not reduce-scatter the gradient of the hidden states it gathered"
                      if kind != "reduce_scatter" else "its backward reduce-scatters the gradient of hidden states it "
                                                       "did not gather")
    return kind, None


_REDUCE_SCATTER = functional_collectives.reduce_scatter_tensor.default
_ALL_REDUCE = functional_collectives.all_reduce.default
