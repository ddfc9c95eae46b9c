"""graphpass's graph passes: every rewrite of the captured ATen graph, one module each, in order.

Module `<effect>.py` defines `<effect>_pass(gm, example_inputs, *, config, record) -> gm`.
`PASS_NAMES` is the order the pipeline runs them in. It is plain data, so `graphpass.config` can
check `Config.disable_passes` against it without importing torch; `registry()` imports the passes.
A pass never imports another: where the Function passes read a hand-written `autograd.Function`'s
body, they have it folded by `fold_function_body`, the named sub-pipeline `FUNCTION_BODY_PASSES`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

#: Every pass, in the order the pipeline runs them. A new pass is a module here plus a name here.
PASS_NAMES = (
    "sink_row_slices_pass",  # slice(f(x)) -> f(slice(x)) for elementwise f: regions reach the logits
    "replace_hand_written_functions_pass",  # one-device log-prob Functions, backward checked -> their plain math
    "replace_vocab_parallel_functions_pass",  # Megatron/slime-style TP Functions -> the vocab-parallel op
    "index_rows_as_gather_pass",  # x[arange(T), t] -> gather(x, -1, t): the regions read gathers
    "fold_row_loops_pass",  # stack/cat/buffer of f(x[i]) over a loop's rows -> f(x): one region
    "expose_row_reductions_pass",  # reduced losses, kl_div, full sums -> a sum over the vocabulary, then rows
    "read_sliced_rows_whole_pass",  # a target's log-prob over a row slice of all-rows log-probs -> over all rows
    "tag_grad_flow_pass",  # node.meta: can a gradient from the outputs reach this node?
    "chunk_rowwise_regions_pass",  # each row-local region -> one graphpass::rowwise_chunked op
    "localize_cp_reductions_pass",  # CP: reductions of unshard(y) -> local reductions + one sum over ranks
)

#: What `fold_function_body` runs on a captured `autograd.Function` body, in order: (the pipeline
#: pass each step is, whose name in `Config.disable_passes` skips the step too, the function of that
#: pass's module that the step runs).
FUNCTION_BODY_PASSES = (
    ("sink_row_slices_pass", "sink_row_slices_pass"),
    ("index_rows_as_gather_pass", "index_rows_as_gather_pass"),
    ("fold_row_loops_pass", "fold_function_body_loops"),  # each chunk's all-reduces fold with it
)

__all__ = ["FUNCTION_BODY_PASSES", "PASS_NAMES", "Pass", "check_pass_names", "fold_function_body", "read_folded",
           "registry", *PASS_NAMES]


@dataclasses.dataclass(frozen=True)
class Pass:
    """One registered pass."""

    number: int
    """Its place in the order, from 1 (logs and errors say "pass 2 chunk_rowwise_regions_pass")."""
    name: str
    """The pass function's name, `<effect>_pass`: what `Config.disable_passes` names."""
    fn: Callable
    """`fn(gm, example_inputs, *, config, record) -> gm`."""


def check_pass_names(names) -> tuple[str, ...]:
    """`names` as a tuple; ValueError (one line, listing the known names) on an unknown one."""
    if isinstance(names, str):
        raise ValueError("graphpass: disable_passes must be a tuple of pass names, not a string")
    names = tuple(names)
    unknown = [n for n in names if n not in PASS_NAMES]
    if unknown:
        raise ValueError(f"graphpass: unknown pass {unknown[0]!r} in disable_passes; "
                         f"known passes: {', '.join(PASS_NAMES)}")
    return names


def registry() -> tuple[Pass, ...]:
    """The passes, imported, in order."""
    return tuple(Pass(number, name, _load(name)) for number, name in enumerate(PASS_NAMES, start=1))


def fold_function_body(gm, example_inputs, *, config) -> None:
    """An `autograd.Function`'s captured body as one computation over all rows, to be read (never
    run as it is): the chunk loops a hand-written kernel runs over its rows folded as the pipeline
    folds inline loops (`FUNCTION_BODY_PASSES`: slices sunk, `x[arange(rows), t]` a gather, then
    the loops), each chunk's all-reduces of its rows' statistics with them (an all-reduce is
    elementwise across ranks); a step whose pass `config.disable_passes` names is skipped. Its
    metadata checks, which would keep each chunk's slice alive, go first."""
    from graphpass.analysis.lm_head import METADATA_CHECKS
    from graphpass.records import GraphRecord

    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in METADATA_CHECKS:
            gm.graph.erase_node(node)
    for name, step in FUNCTION_BODY_PASSES:
        if name not in config.disable_passes:
            # What a step cannot rewrite it leaves, and the readers of the body say why they stop:
            # its record is thrown away.
            _load(name, step)(gm, example_inputs, config=config, record=GraphRecord(index=-1))
    gm.recompile()


def read_folded(gm, example_inputs, read, understood, *, config):
    """`read(gm)` of an `autograd.Function`'s captured body as written, or, where that is not
    `understood`, of the body with its chunk loops folded (`fold_function_body`, which changes
    `gm`): what the code says as written stays read so (a fold may rewrite an index into a
    form a reader knows less well), and a loop over chunks is read as one computation."""
    first = read(gm)
    if understood(first):
        return first
    fold_function_body(gm, example_inputs, config=config)
    return read(gm)


def _load(name: str, attribute: str | None = None) -> Callable:
    """Pass `name`'s function, or the function `attribute` of its module."""
    # Relative to this package, so it works under whichever name the package was imported.
    module = importlib.import_module(f"{__name__}.{name.removesuffix('_pass')}")
    return getattr(module, attribute or name)


def __getattr__(name: str):
    # `from graphpass.passes import chunk_rowwise_regions_pass` imports that pass alone
    # (and torch) when only the names are wanted.
    if name in PASS_NAMES:
        return _load(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
