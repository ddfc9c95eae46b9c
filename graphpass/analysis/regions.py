"""Find maximal row-local regions in a pre-dispatch ATen graph.

Starting from an op that normalises over the vocabulary (log_softmax, softmax, logsumexp,
cross_entropy, ...), a region grows over data edges through row-local ops: upward through wide
producers (casts, temperature scaling, -inf masking), downward through every row-local consumer
of a wide value (reductions and gathers that make narrow outputs), and over narrow ops whose
inputs all come from the region (`-sum`, `lse - sum`, squeeze), or that the region reads again
(an online log-sum-exp's running max, carried from one vocabulary block to the next). It stops
at anything else, at values used outside that are still `[rows, V]` wide. A region may span
`no_grad` blocks (an entropy logged from the shared log_softmax, a teacher's log_softmax read
by the student's KL): the chunked op runs in one grad mode, so where it runs with grad, each
value the region computes under no_grad is detached in its program (`Region.detached`), and no
gradient flows through it.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import re

import torch

from graphpass.analysis import catalogue, rowlocal
from graphpass._torch_api import known_equal
from graphpass.analysis.grad_flow import grad_flows, grad_modes
from graphpass.fx_utils import target_name, transitive_inputs, transitive_users
from graphpass.records import Rejection

aten = torch.ops.aten

@dataclasses.dataclass
class Region:
    """A row-local region: its nodes in graph order, where it reads from and what it makes."""

    anchor: torch.fx.Node
    nodes: list[torch.fx.Node]
    rows: object
    layouts: dict
    inputs: list[torch.fx.Node]  # outside nodes the region reads (tensors and sym scalars)
    outputs: list[torch.fx.Node]  # region nodes used outside it (narrow)
    place: torch.fx.Node  # the chunked op goes right after this region node
    detached: frozenset = frozenset()  # nodes computed under no_grad in a region whose op runs with grad


def source_of(node: torch.fx.Node) -> str:
    """The user's `file.py:LINE` that produced `node`, from its stack trace: the innermost frame
    outside graphpass itself (`layout.unshard(y)`, not the line in graphpass/cp.py it calls)."""
    frames = stack_frames(node.meta.get("stack_trace") or "")
    users = [f for f in frames if not f.path.startswith(_PACKAGE_DIR)] or frames
    return users[-1].where if users else "<unknown>"


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame of a node's stack trace."""

    path: str
    line: int
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.rsplit('/', 1)[-1]}:{self.line}"


# 'File "/path/loss.py", line 12, in fn' and the source line under it
_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in [^\n]*(?:\n(?!\s*File )(?P<code>[^\n]*))?')


def stack_frames(stack_trace: str) -> list[Frame]:
    """The frames of an FX node's `stack_trace`, outermost first."""
    return [Frame(m["path"], int(m["line"]), (m["code"] or "").strip()) for m in _FRAME.finditer(stack_trace)]


def _wide(layout, vocab) -> bool:
    return (layout is not None and layout.kind in (rowlocal.ROW, rowlocal.TRANSPOSED)
            and known_equal(layout.width, vocab))


def _is_tensor_node(n) -> bool:
    return isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)


class _Grower:
    """Grows one region from an anchor; see the module docstring."""

    def __init__(self, anchor, modes, claimed):
        self.anchor, self.modes, self.claimed = anchor, modes, claimed
        self.rows, vocab = rowlocal.rows_and_vocab(anchor)
        self.vocabs = [vocab]
        self.layouts: dict = {}
        self.nodes: set = set()

    def is_wide(self, node) -> bool:
        lay = self.layouts.get(node) or rowlocal.node_layout(node, self.rows)
        return any(_wide(lay, v) for v in self.vocabs)

    def try_add(self, node) -> str | None:
        if node in self.nodes:
            return None
        if node in self.claimed:
            return "already part of another region"
        if node.op != "call_function":
            return node.op
        why = rowlocal.check(node, self.rows, self.layouts)
        if why is not None:
            return why
        val = node.meta["val"]
        if node.target is aten.slice.Tensor and not known_equal(val.shape[-1], 1):
            # A slice of the vocabulary (a padded vocab cut to size) is still wide, and so is what
            # it slices; a one-wide slice picks a column, like a gather (Categorical.log_prob's
            # broadcast index).
            self.vocabs.extend([val.shape[-1], node.args[0].meta["val"].shape[-1]])
        if isinstance(val, (tuple, list)):
            self.layouts[node] = rowlocal.layout_of(val[0], self.rows)
        else:
            self.layouts[node] = rowlocal.node_layout(node, self.rows)
        self.nodes.add(node)
        return None

    def grow(self) -> str | None:
        why = self.try_add(self.anchor)
        if why is not None:
            return why
        frontier = [self.anchor]
        while frontier:
            node = frontier.pop()
            wide = self.is_wide(node)
            for p in node.all_input_nodes:
                if not (_is_tensor_node(p) and p not in self.nodes and self.is_wide(p)):
                    continue
                if self.try_add(p) is None:
                    frontier.append(p)
                else:
                    # A wide input (the logits): its other row-local readers belong here too,
                    # e.g. the gather in `gather(x) - logsumexp(x)`.
                    self._add_users(p, frontier)
            if wide or node.target is operator.getitem or isinstance(node.meta.get("val"), (tuple, list)) \
                    or self._one_wide_block(node):
                self._add_users(node, frontier)
        self._absorb_narrow_closure()
        while self._absorb_recurrences() | self._absorb_accumulators():
            self._absorb_narrow_closure()
        self._evict_wide_escapes()
        if not any(catalogue.normalises(n) for n in self.nodes):
            # A plain sum or max over the last dim: nothing to save by chunking it.
            return "no softmax, log-sum-exp or exp over the vocabulary"
        if self.anchor not in self.nodes:
            # The anchor's own value is needed outside; another node may still lead.
            anchors = [n for n in self.nodes if n.target in rowlocal.ANCHORS]
            if not anchors:
                return "its [rows, V] values are needed outside it"
            self.anchor = anchors[0]
        return None

    def _one_wide_block(self, node) -> bool:
        """Whether `node` is a one-wide slice of a wide value, or elementwise math on one (`x[:, 36:45]
        / t` of 37 columns): a loop's last vocabulary block when the block size leaves one column,
        whose readers belong here as the other blocks' do."""
        if not _is_tensor_node(node) or not known_equal(node.meta["val"].shape[-1], 1):
            return False
        if node.target is aten.slice.Tensor:
            return self.is_wide(node.args[0])
        return rowlocal.is_pointwise(node.target) and any(
            a in self.nodes and self._one_wide_block(a) for a in rowlocal.data_inputs(node))

    def _add_users(self, node, frontier):
        """Add every row-local reader of `node` to the region and to the frontier."""
        frontier.extend(u for u in node.users if u not in self.nodes and self.try_add(u) is None)

    def _absorb_narrow_closure(self):
        """Add the narrow ops that finish a quantity: sign flips, views, casts and detaches of a
        region value (`-sum(p * logp)`, `.squeeze(-1)`, `-x.sum(-1).detach()`), and ops combining
        several region values (`lse - sum(p * x)`). Further per-token math (`2 * logp`,
        `logp - old`) stays outside, so each output is the quantity itself."""
        changed = True
        while changed:
            changed = False
            for node in list(self.nodes):
                for u in node.users:
                    if u in self.nodes or u.op != "call_function":
                        continue
                    inputs = [a for a in rowlocal.data_inputs(u) if _is_tensor_node(a)]
                    finishing = (u.target in catalogue.FINISHING or len(set(inputs)) >= 2
                                 or (u.target in catalogue.FINISHING_IF_ONLY_READER and len(node.users) == 1))
                    if finishing and all(a in self.nodes for a in inputs) and self.try_add(u) is None:
                        changed = True

    def _absorb_recurrences(self) -> bool:
        """Add the row-local ops outside the region that are computed from its values and read
        by it again: a loop over vocabulary blocks that carries its statistics from block to
        block (an online log-sum-exp: `m = maximum(m, block.amax(-1))`, `s = s * exp(m_old - m)
        + exp(block - m).sum(-1)`). Left outside, the region would read its own outputs. True
        if the region grew."""
        between = transitive_users(self.nodes) & transitive_inputs(self.nodes) - self.nodes
        added = [self.try_add(n) is None for n in self.anchor.graph.nodes if n in between]
        return any(added)

    def _absorb_accumulators(self) -> bool:
        """Add the running values that a loop over vocabulary blocks folds each block's statistics
        into: starting from a row-wise value computed from nothing (`s = torch.zeros(rows)`), each
        step that combines the running value with the region's values (`s * exp(m_old - m) +
        block.exp().sum(-1)`, `torch.where(in_block, block_logit, target)`). With them, what the
        loop computes (`m + log(s)`) is the region's output, not each block's share. True if the
        region grew."""
        running = {n for n in self.anchor.graph.nodes if _computed_from_nothing(n) and n not in self.nodes}
        grew, todo = False, list(running)
        while todo:
            for step in list(todo.pop().users):
                if step in self.nodes or step.op != "call_function" or not rowlocal.is_pointwise(step.target) \
                        or self.is_wide(step):
                    continue
                others = [a for a in rowlocal.data_inputs(step) if a not in running]
                derived = []  # `exp(m_old - m)`: computed from the region's values alone
                if not others or not all(a in self.nodes or self._derived(a, derived) or _condition_of(step, a)
                                         for a in others):
                    continue
                if all(self.try_add(n) is None for n in derived) and self.try_add(step) is None:
                    running.add(step)
                    todo.append(step)
                    grew = True
        return grew

    def _derived(self, node, found: list) -> bool:
        """Whether `node` is narrow math on the region's values alone (collected in `found`, inputs
        first; `try_add` then says whether it is row-local)."""
        if node in self.nodes or node in found:
            return True
        if node.op != "call_function" or not _is_tensor_node(node) or self.is_wide(node) \
                or not all(self._derived(a, found) for a in rowlocal.data_inputs(node)):
            return False
        found.append(node)
        return True

    def _evict_wide_escapes(self):
        """Drop wide nodes used outside the region (and their in-region producers)."""
        changed = True
        while changed:
            changed = False
            for node in list(self.nodes):
                escapes = any(u not in self.nodes for u in node.users)
                if escapes and self.is_wide(node):
                    self.nodes.discard(node)
                    changed = True
            # A getitem whose tuple-valued source left the region must go too.
            for node in list(self.nodes):
                if node.target is operator.getitem and node.args[0] not in self.nodes:
                    self.nodes.discard(node)
                    changed = True


def _computed_from_nothing(node) -> bool:
    """A tensor made from no other tensor (`torch.zeros(rows)`, `torch.full(..., -inf)`)."""
    return node.op == "call_function" and _is_tensor_node(node) and not any(
        _is_tensor_node(a) for a in node.all_input_nodes)


def _condition_of(node, a) -> bool:
    """Whether `a` is the condition of the `where` `node` (which picks per row, e.g. the block
    a token falls in)."""
    return catalogue.MASK_ARG.get(node.target) == 0 and node.args[0] is a


def find_regions(gm: torch.fx.GraphModule) -> tuple[list[Region], list[Rejection]]:
    """All row-local regions of `gm`, plus the anchors that could not start one and why."""
    modes = grad_modes(gm.graph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    claimed: set = set()
    regions, rejected = [], []
    for node in gm.graph.nodes:
        if node in claimed or node.op != "call_function" or node.target not in rowlocal.ANCHORS:
            continue
        source = node.args[0] if node.args else None
        if not _is_tensor_node(source) or source.meta["val"].ndim < 1:
            continue
        grower = _Grower(node, modes, claimed)
        why = grower.grow()
        if why is None:
            why = _finish(grower, order, regions)
        if why == _OWN_OUTPUTS:
            # A keep-mask computed from the row's own values by an op that is not row-local (a
            # top-k or top-p warper's `sort`): the region ends at the mask, what follows is
            # rewritten, the mask's own math stays as written.
            after = _after_its_own_outputs(grower, order)
            while after is not None and why == _OWN_OUTPUTS:
                why = _finish(after, order, regions)
                after = _after_its_own_outputs(after, order) if why == _OWN_OUTPUTS else None
        if why is not None:
            rejected.append(Rejection(source_of(node), f"{target_name(node)}: {why}"))
    return regions, rejected


def _finish(grower: _Grower, order, regions) -> str | None:
    nodes = sorted(grower.nodes, key=order.__getitem__)
    inside = set(nodes)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    if not outputs:
        return "nothing computed from it is used"
    inputs = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    if not any(grower.is_wide(a) for a in inputs if _is_tensor_node(a)):
        return "it reads no [rows, V] input"
    if not any(n.target in rowlocal.NORMALISERS for n in nodes) and any(
            rowlocal.derives_from_reduction(a) for a in inputs if _is_tensor_node(a) and grower.is_wide(a)):
        # Only a softmax written out by hand gets here; over per-token values (a masked mean of
        # ratios over [B, S]) it is not a vocabulary: chunking it would only add an op.
        return "its [rows, V] input was computed by a reduction or gather: not logits"
    input_layouts = {a: rowlocal.node_layout(a, grower.rows) for a in inputs if _is_tensor_node(a)}
    if any(lay is not None and lay.kind == rowlocal.TRANSPOSED for lay in input_layouts.values()):
        # Its chunks are the chunks of the untransposed tensor, which only the region can see.
        return "its transposed [rows, V] input is needed outside it"
    place = _place(nodes, grower.modes)
    if any(order[a] > order[place] for a in inputs):
        return "it reads a value computed after its last grad-mode op"
    if _reads_its_own_outputs(inside, outputs, inputs):
        # One op cannot both produce a value and read what is computed from it.
        return _OWN_OUTPUTS
    why = _grad_mode_conflict(nodes, outputs, place, grower.modes)
    if why is not None:
        return why
    for a, lay in input_layouts.items():  # views in the region read their source's layout
        grower.layouts.setdefault(a, lay)
    grower.claimed.update(nodes)
    detached = frozenset(n for n in nodes if not grower.modes[n]) if grower.modes[place] else frozenset()
    regions.append(Region(grower.anchor, nodes, grower.rows, grower.layouts, inputs, outputs, place, detached))
    return None


_OWN_OUTPUTS = "it reads a value computed from its own outputs (e.g. an all-reduce of a row sum)"
_COLLECTIVES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")


def _reads_its_own_outputs(inside, outputs, inputs) -> bool:
    """Whether an input of the region is computed, outside it, from one of its outputs."""
    return bool(_inputs_from_outputs(inside, outputs, inputs))


def _inputs_from_outputs(inside, outputs, inputs) -> set:
    """The inputs of the region computed, outside it, from one of its outputs."""
    inputs, seen, todo, found = set(inputs), set(), list(outputs), set()
    while todo:
        for user in todo.pop().users:
            if user in inside or user in seen or user.op == "output":
                continue
            if user in inputs:
                found.add(user)
            seen.add(user)
            todo.append(user)
    return found


def _after_its_own_outputs(grower: _Grower, order) -> _Grower | None:
    """The part of a grown region that reads, directly or through the region, the inputs computed
    from its own outputs (a keep-mask from the row's own probabilities): a region of its own that
    reads the part before as inputs. None where that part normalises nothing."""
    nodes = sorted(grower.nodes, key=order.__getitem__)
    inside = set(nodes)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    inputs = {a for n in nodes for a in n.all_input_nodes if a not in inside}
    cut = _inputs_from_outputs(inside, outputs, inputs)
    between = (transitive_users(outputs) & transitive_inputs(cut)) - inside
    if any(getattr(n.target, "namespace", None) in _COLLECTIVES for n in between | cut):
        return None  # a row statistic combined over ranks (vocab-parallel code): not a keep-mask
    after = {n for n in transitive_users(cut) if n in inside}
    anchors = [n for n in nodes if n in after and n.target in rowlocal.ANCHORS]
    if after == inside:
        return None  # nothing cut off: it would read its own outputs again
    if not anchors or not any(catalogue.normalises(n) for n in after):
        return None
    part = _Grower(anchors[0], grower.modes, grower.claimed)
    part.rows, part.vocabs, part.layouts = grower.rows, grower.vocabs, grower.layouts
    part.nodes = after
    return part


def _place(nodes, modes) -> torch.fx.Node:
    """Where the chunked op goes: after the region's last node, or, when the region ends in a
    no_grad block (an entropy logged from the log_softmax a log-prob needs grad through), after
    its last node computed with grad, so the op runs with grad."""
    with_grad = [n for n in nodes if modes[n]]
    return with_grad[-1] if with_grad else nodes[-1]


def _grad_mode_conflict(nodes, outputs, place, modes) -> str | None:
    """Why the chunked op, placed after `place`, would change grad mode.

    The op runs in the mode at that place. With grad on there, an output computed under no_grad
    must be known not to carry a gradient (the op then marks it non-differentiable). Readers of
    its outputs that sit before that place are moved after the op; they must not change mode.
    """
    inside = set(nodes)
    if modes[place] and any(not modes[o] and grad_flows(o) is not False for o in outputs):
        return "an output computed under no_grad is not tagged gradient-free (tag_grad_flow_pass)"
    moved, node = set(), nodes[0]
    while node is not place:
        if node not in inside and any(a in inside or a in moved for a in node.all_input_nodes):
            if modes[node] != modes[place]:
                return "a reader of its outputs runs in another grad mode before the region ends"
            moved.add(node)
        node = node.next
    return None
