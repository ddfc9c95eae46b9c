"""What the backend compiled: one `GraphRecord` per graph, one `SiteRecord` per rewritten region.

Tests, reports and the memory model read these dataclasses, never the logs nor the op registry:
whatever they need to know about a rewritten site is recorded here when the site is rewritten.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class OutputRecord:
    """One narrow output of a rewritten region."""

    kind: str
    """What it computes: "logprob", "entropy", or "rowwise" when not recognised."""
    keeps_grad: bool
    """False when its gradient cannot reach a differentiable output: computed forward-only."""
    temperature: str | None = None
    """How the logits were scaled before it, as written ("/ 0.7", "* s", ...); None if unscaled."""


def site_kind(labels) -> str:
    """A site's `kind`: its output labels joined by "+", in order of first appearance; a label
    that appears more than twice is written once with its count ("logprob+rowwise x25": the
    running statistics of an online log-sum-exp), so that a report's column stays narrow."""
    counts = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return "+".join("+".join([label] * n) if n <= 2 else f"{label} x{n}" for label, n in counts.items())


@dataclasses.dataclass
class CollectiveRecord:
    """One collective a rewritten site issues per call."""

    op: str
    """The collective, e.g. "all_gather"."""
    group_size: int
    """Ranks in its group."""
    bytes: int
    """Bytes this rank contributes, at the recorded shape (symbolic sizes at their example values)."""


#: node.meta key on the plain math `passes.replace_hand_written_functions` puts for a Function: the
#: Function's source line, which the site that chunks the math records (`SiteRecord.replaced_function`).
REPLACED_FUNCTION = "graphpass_replaced_function"


@dataclasses.dataclass
class SiteRecord:
    """A row-local region replaced by one chunked, recomputing op."""

    kind: str
    """The labels of its outputs joined by "+", e.g. "logprob+entropy" (`site_kind`)."""
    source: str
    """The user's source line that produced the region's first op, "file.py:LINE"."""
    shape: tuple
    """Shape of the wide input (the logits); symbolic sizes print as their names."""
    dtype: torch.dtype
    """Dtype of the wide input."""
    chunk_size: int | None
    """Rows per chunk, or None when chosen at run time from the memory budget."""
    outputs: list[OutputRecord]
    """One entry per narrow output of the region, in order. For a site that computes its gradients
    in forward, the region's outputs before the op took in the loss math that reads them."""
    program_key: str = ""
    """Content hash of the per-chunk program (identifies the op's registered region)."""
    wide_inputs: int = 1
    """How many `[rows, V]` inputs the region reads."""
    chunk_rows: int | None = None
    """Rows per chunk the op uses at the recorded shape (symbolic sizes at their example values):
    `chunk_size` capped at the rows, or the size chosen from the budget. None: not recorded."""
    workspace_bytes: int | None = None
    """Transient bytes of one chunk's kernels, forward or backward, beyond the op's inputs, outputs
    and saved row statistics, at the recorded shape; the memory model adds them while the op runs.
    None: not recorded (read as 0, which is what inductor's fused kernels keep)."""
    tp_size: int = 1
    """Ranks the vocabulary is split across (1: the site holds the whole vocabulary)."""
    group: str | None = None
    """The tensor-parallel process group's name, None when `tp_size == 1`."""
    collectives: list[CollectiveRecord] = dataclasses.field(default_factory=list)
    """The collectives one call issues, forward and backward."""
    lm_head: bool = False
    """True when the op also computes the logits, `hidden @ W.T (+ bias)`, chunk by chunk: they
    never exist as a tensor, and the op's gradients are the hidden states', the weight's (and
    bias's). `shape` is still the logits' shape."""
    hidden_shape: tuple | None = None
    """Shape of the hidden states an lm_head site reads; None otherwise."""
    frozen_lm_heads: int = 0
    """Other wide inputs the op computes chunk by chunk from hidden states, with no gradient (a
    teacher's lm_head under no_grad): their logits never exist as a tensor either."""
    lm_head_reason: str | None = None
    """Why the op reads the logits instead of computing them from the hidden states: they come
    from outside the graph (its input, e.g. after a Dynamo graph break, named), or another op
    computes them, or their matmul cannot be taken in. None when `lm_head` (or not recorded)."""
    forward_workspace_bytes: int | None = None
    """Transient bytes of the forward, when they differ from `workspace_bytes` (which is then the
    backward's); None: the same."""
    gradients_in_forward: bool = False
    """True when the op also takes in the per-token loss math up to one sum over the rows and
    computes every gradient in its forward pass (`graphpass.analysis.summed_loss`): its backward
    only scales them by the loss's gradient (nothing when that is 1). The op's first outputs are
    then those sums."""
    recompute_reason: str | None = None
    """Why the site's backward recomputes its wide values instead (None: it does not, or no
    output keeps a gradient)."""
    replaced_function: str | None = None
    """The source line of the hand-written autograd.Function (one device, its backward checked:
    `passes.replace_hand_written_functions`) whose plain math this site computes; None: none."""

    @property
    def grads_kept(self) -> list[bool]:
        return [o.keeps_grad for o in self.outputs]


@dataclasses.dataclass
class Rejection:
    """A region (or a library Function) the rewrite looked at and left as it was, and why."""

    source: str
    reason: str


@dataclasses.dataclass
class CpRecord:
    """What became of the context-parallel `unshard`s of one graph (`passes.localize_cp_reductions`)."""

    source: str
    """The user's source line of the first `unshard`."""
    rewritten: bool
    """True: the loss reduces local rows and sums the results over ranks; False: `unshard` stays."""
    reason: str | None
    """Why the `unshard`s stay (None when rewritten)."""
    unshards: int
    """How many `unshard` calls the graph has."""
    reductions: list[str] = dataclasses.field(default_factory=list)
    """The reductions over tokens computed locally, e.g. ["sum", "index_add"]."""
    collectives: list[CollectiveRecord] = dataclasses.field(default_factory=list)
    """The collectives one call of the graph issues for them, forward (backward issues none)."""


@dataclasses.dataclass
class GraphRecord:
    """One graph that Dynamo handed to the backend."""

    index: int
    """Order of compilation within this backend, from 0."""
    sites: list[SiteRecord] = dataclasses.field(default_factory=list)
    rejected: list[Rejection] = dataclasses.field(default_factory=list)
    fallback_reason: str | None = None
    """Set when the whole rewrite failed and the graph ran unchanged."""
    collectives: list[CollectiveRecord] = dataclasses.field(default_factory=list)
    """Every collective graphpass inserted or rewrote in this graph, per call of the graph."""
    cp: list[CpRecord] = dataclasses.field(default_factory=list)
    """The context-parallel rewrite of this graph, if it has `unshard`s."""
    passes_run: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    """Where torch.compile itself changes the math of this graph (`graphpass.lint`)."""
    graph_module: object = dataclasses.field(default=None, repr=False)
    """The rewritten ATen-level `torch.fx.GraphModule` handed to the inner compiler."""
    example_inputs: list = dataclasses.field(default_factory=list, repr=False)
    """Fake example inputs of `graph_module` (shapes and dtypes only)."""

    def runs_unchanged(self, reason: str) -> None:
        """The rewrite was abandoned: nothing of it stays recorded, `reason`'s first line says why."""
        self.fallback_reason = (reason.strip().splitlines() or [""])[0]
        self.sites.clear()
        self.cp.clear()
        self.collectives.clear()

    @property
    def rewritten(self) -> bool:
        """Whether any pass changed the graph (else the backend compiles Dynamo's graph as it is)."""
        return bool(self.sites) or any(c.rewritten for c in self.cp)
