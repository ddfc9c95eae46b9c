"""What the tests share: capture a function and run passes on its graph (`run_passes`), the
float64 three-way comparison (`three_ways`: graphpass's result and eager's, each against float64,
by the fuzzer's rule: at most twice eager's error plus a dtype's slack), and grids whose every
pair of values runs by default (`covering_grid`)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Sequence

import pytest
import torch

import graphpass
from bench.fuzz import run as fuzz
from graphpass.capture import capture_function
from graphpass.config import Config
from graphpass.passes import registry
from graphpass.records import GraphRecord


@dataclasses.dataclass
class Rewritten:
    """A captured graph after some passes."""

    gm: torch.fx.GraphModule
    fakes: list
    """The graph's example inputs (fake tensors), in its placeholders' order."""
    record: GraphRecord
    """What the passes recorded."""
    code_before: str
    """The graph's code as captured, before any pass."""


def run_passes(fn, *args, passes: Sequence[str | Callable], config: Config | None = None) -> Rewritten:
    """`fn(*args)`'s captured ATen graph after `passes` (registered names such as
    "fold_row_loops_pass", or pass functions), in that order, all with one `config` and record."""
    captured = capture_function(fn, *args)
    config = config or Config()
    record, code_before = GraphRecord(index=0), captured.gm.code
    registered = {p.name: p.fn for p in registry()}
    gm = captured.gm
    for step in passes:
        gm = (registered[step] if isinstance(step, str) else step)(gm, captured.fakes, config=config, record=record)
    gm.graph.lint()
    gm.recompile()
    return Rewritten(gm, captured.fakes, record, code_before)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|, in float64."""
    want = want.double()
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def mixed_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| relative to max(1, |want|), elementwise, in float64 (0 for empty tensors):
    absolute for small values, relative for large ones."""
    if got.numel() == 0:
        return 0.0
    got, want = got.double(), want.double()
    return ((got - want).abs() / want.abs().clamp_min(1)).max().item()


@dataclasses.dataclass
class ThreeWays:
    """One function's values and input gradients run three ways."""

    compiled: list
    eager: list
    float64: list
    names: list[str]
    backend: graphpass.Backend

    def problems(self, dtype: torch.dtype = torch.float32) -> list[str]:
        """Each value or gradient where graphpass is less accurate than eager (empty: none)."""
        rtol = fuzz.RTOL.get(dtype, fuzz.RTOL[torch.float32])
        found = (fuzz.compare(n, c, e, r, rtol) for n, c, e, r in zip(self.names, self.compiled, self.eager,
                                                                        self.float64))
        return [p for p in found if p]


def three_ways(fn, *args, backend: graphpass.Backend | None = None) -> ThreeWays:
    """`fn(*args)` compiled by graphpass, eager, and eager on float64 copies of its floating
    inputs; each back-propagates its first output (a scalar loss) into fresh leaf copies."""
    backend = backend or graphpass.Backend(inner="aot_eager")

    def run(call, to_float64: bool):
        copies = [_leaf(a, to_float64) for a in args]
        outputs = call(*copies)
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        outputs[0].backward()
        grads = [c.grad for c in copies if isinstance(c, torch.Tensor) and c.requires_grad]
        return [o.detach() for o in outputs] + grads

    compiled = run(torch.compile(fn, backend=backend), False)
    eager, exact = run(fn, False), run(fn, True)
    names = [f"output {i}" for i in range(len(compiled) - len(_grad_inputs(args)))]
    names += [f"grad of input {i}" for i in _grad_inputs(args)]
    return ThreeWays(compiled, eager, exact, names, backend)


def _grad_inputs(args) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]


def _leaf(value, to_float64: bool):
    if not isinstance(value, torch.Tensor):
        return value
    copy = value.detach().clone()
    if to_float64 and copy.is_floating_point():
        copy = copy.double()
    return copy.requires_grad_(value.requires_grad)


def decisions(records: Sequence[GraphRecord]) -> list:
    """Per graph: whether it runs unchanged, its sites (kind, lm_head fused) and its warnings."""
    return [(r.fallback_reason is not None, sorted((s.kind, s.lm_head) for s in r.sites), r.warnings) for r in records]


def explained_records(fn, args, kwargs, config: Config) -> list[GraphRecord]:
    """What `graphpass.explain` records for `fn(*args, **kwargs)` (run on fakes of the inputs)."""
    from graphpass import _torch_api, inspection

    torch.compiler.reset()
    fake_mode = _torch_api.new_fake_mode(allow_real_tensors=True)
    fakes = inspection.fakeify(args, fake_mode)
    fake_kwargs = dict(zip(kwargs, inspection.fakeify(kwargs.values(), fake_mode)))
    records = [r.record for r in inspection.rewrite_results(fn, fakes, fake_kwargs, config)]
    torch.compiler.reset()
    return records


def covering_grid(*factors: Sequence) -> list:
    """Every combination of the factors' values as `pytest.param`s, for one parametrize of as many
    names; those beyond a set that holds every pair of values of two factors are marked `slow`:
    by default each pair runs once, with --runslow the whole product."""
    combos = list(itertools.product(*factors))

    def pairs(combo):
        return {(i, combo[i], j, combo[j]) for i, j in itertools.combinations(range(len(combo)), 2)}

    uncovered, chosen = set().union(*map(pairs, combos)), set()
    while uncovered:
        best = max(combos, key=lambda combo: len(pairs(combo) & uncovered))
        chosen.add(best)
        uncovered -= pairs(best)
    return [pytest.param(*combo, marks=() if combo in chosen else pytest.mark.slow,
                         id="-".join(str(v).removeprefix("torch.") for v in combo)) for combo in combos]
