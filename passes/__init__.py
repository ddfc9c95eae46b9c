"""graphpass's graph passes: every rewrite of the captured ATen graph, one module each, in order.

Module `<effect>.py` defines `<effect>_pass(gm, example_inputs, *, config, record) -> gm`.
`PASS_NAMES` is the order the pipeline runs them in. It is plain data, so `graphpass.config` can
check `Config.disable_passes` against it without importing torch; `registry()` imports the passes.
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

__all__ = ["PASS_NAMES", "Pass", "check_pass_names", "registry", *PASS_NAMES]


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


def _load(name: str) -> Callable:
    # Relative to this package, so it works under whichever name the package was imported.
    module = importlib.import_module(f"{__name__}.{name.removesuffix('_pass')}")
    return getattr(module, name)


def __getattr__(name: str):
    # `from graphpass.passes import chunk_rowwise_regions_pass` imports that pass alone
    # (and torch) when only the names are wanted.
    if name in PASS_NAMES:
        return _load(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
