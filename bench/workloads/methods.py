"""The implementations compared: how the same user loss is executed."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Callable

import torch

from bench.workloads import losses


@dataclasses.dataclass(frozen=True)
class Method:
    """One way to run a workload's loss; `inductor_config` is set in the worker before it compiles."""

    name: str
    description: str
    compiled: bool = False
    chunked_loop: bool = False
    backend: str | None = None
    inductor_config: tuple[tuple[str, object], ...] = ()

    def build(self, workload: losses.Workload, compiler: str = "inductor",
              chunk_size: int | None = None) -> tuple[Callable, Callable[[], dict]]:
        """The step function and a callback returning notes about what the method did.

        `compiler` replaces inductor as the `inductor` method's backend and graphpass's inner
        compiler (`aot_eager` for a quick smoke run); the auto-chunker is inductor's own.
        `chunk_size`: graphpass's rows per chunk (None: its own choice).
        """
        lp_ent = losses.chunked_logprob_entropy if self.chunked_loop else losses.logprob_entropy
        fn = workload.loss_fn(lp_ent)
        if not self.compiled:
            return fn, dict
        if self.inductor_config:
            import torch._inductor.config as config

            for key, value in self.inductor_config:
                setattr(config, key, value)
        if self.backend == "graphpass":
            backend = _graphpass_backend(compiler, chunk_size)
        else:
            backend = compiler if self.name == "inductor" else self.backend
        return torch.compile(fn, backend=backend), lambda: _compile_notes(backend)

    def available(self) -> str | None:
        """None when this method can run here, else why not."""
        if self.backend == "graphpass":
            if importlib.util.find_spec("graphpass.backend") is None:
                return "graphpass.backend not importable yet"
        return None


def _graphpass_backend(inner: str = "inductor", chunk_size: int | None = None):
    import graphpass

    return graphpass.Backend(inner=inner, chunk_size=chunk_size)


def _compile_notes(backend) -> dict:
    """Graph count (graph breaks/recompiles show up here) and what each compiler claims it did."""
    from torch._dynamo.utils import counters

    notes = {"graphs": counters["stats"]["unique_graphs"],
             # First-call time means little without knowing whether the on-disk caches answered.
             "compile_cache_hits": counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
             "compile_cache_misses": counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]}
    if backend == "inductor":
        from torch._inductor import config, metrics

        if config.auto_chunker.enable:
            notes["auto_chunked_graphs"] = metrics.num_auto_chunking
    elif hasattr(backend, "records"):
        # graphpass may torch.compile its per-chunk kernels, which Dynamo's counter also counts.
        notes["graphs"] = len(backend.records)
        notes["graphpass_sites"] = sum(len(r.sites) for r in backend.records)
        notes["graphpass_fallbacks"] = [r.fallback_reason for r in backend.records if r.fallback_reason]
        notes["graphpass_kinds"] = [s.kind for r in backend.records for s in r.sites]
        notes["graphpass_grads_kept"] = [s.grads_kept for r in backend.records for s in r.sites]
        notes["chunk_rows"] = [s.chunk_rows for r in backend.records for s in r.sites]
    return notes


def warning(notes: dict) -> str | None:
    """A method that ran but did not do its thing (nothing rewritten, chunker not applied)."""
    if notes.get("graphpass_fallbacks"):
        return "graphpass fell back: " + "; ".join(notes["graphpass_fallbacks"])
    if notes.get("graphpass_sites") == 0:
        return "graphpass rewrote no site"
    if notes.get("auto_chunked_graphs") == 0:
        return "auto-chunker did not apply"
    if notes.get("graphs", 1) > 1:
        return f"{notes['graphs']} graphs compiled (graph break or recompile)"
    return None


METHODS = {
    m.name: m
    for m in (
        Method("eager", "plain PyTorch, no compile"),
        Method("inductor", "torch.compile, default inductor", compiled=True, backend="inductor"),
        # What TORCHINDUCTOR_AUTO_CHUNKER=1 sets (torch/_inductor/config.py in torch 2.13); set here
        # because the worker's inductor config was imported before the worker existed.
        Method("autochunk", "inductor + TORCHINDUCTOR_AUTO_CHUNKER=1", compiled=True, backend="inductor",
               inductor_config=(("auto_chunker.enable", True),)),
        Method("chunked", f"hand-written chunk loop ({losses.SLIME_CHUNK} rows), eager autograd",
               chunked_loop=True),
        Method("graphpass", "torch.compile(backend=graphpass.Backend())", compiled=True, backend="graphpass"),
    )
}
