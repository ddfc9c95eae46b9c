"""What graphpass did to a loss and what it saves: dataclasses first, rendering second.

`build_graph_report(record, estimate)` turns a `GraphRecord` and its `MemoryEstimate` into a
`GraphReport`; `render_table` draws it with tabulate, `to_json` serialises a whole `Report`.
The backend calls `print_graph_report(result)` for every compiled graph when `Config.report` is on
or `GRAPHPASS_REPORT=1` (see `reporting_enabled`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap

import torch

from graphpass.records import GraphRecord, SiteRecord

_DTYPE_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


@dataclasses.dataclass
class SiteReport:
    """One rewritten region, as a row of the table."""

    source: str
    kind: str
    shape: list
    dtype: str
    chunk_size: int | None
    """Rows per chunk as configured, or the size the op picks for these shapes when automatic."""
    chunk_auto: bool
    entropy_grad: str
    """"kept", "dropped", or "-" when the site computes no entropy."""
    temperature: str | None = None
    tp_size: int = 1
    """Ranks the vocabulary is split across (1: not vocab-parallel)."""
    collectives: str = ""
    """What one call communicates, e.g. "all_gather 2.5 KiB" (bytes this rank contributes)."""
    lm_head: bool = False
    """The op computes the logits from the hidden states itself (`SiteRecord.lm_head`)."""
    frozen_lm_heads: int = 0
    """And this many gradient-free lm_heads beside them (`SiteRecord.frozen_lm_heads`)."""
    gradients_in_forward: bool = False
    """The op computes its gradients in forward (`SiteRecord.gradients_in_forward`)."""


@dataclasses.dataclass
class CandidateReport:
    """A region the rewrite looked at: rewritten, or not and why."""

    source: str
    rewritten: bool
    kind: str = ""
    reason: str = ""


@dataclasses.dataclass
class CpReport:
    """What became of a graph's context-parallel `unshard`s."""

    source: str
    rewritten: bool
    reason: str | None
    reductions: list[str]
    collectives: str
    """What one call communicates for them, e.g. "all_reduce 40 B over 2 ranks"."""


@dataclasses.dataclass
class GraphReport:
    """One graph: its sites, its candidates, and its estimated (and measured) peak memory."""

    index: int
    sites: list[SiteReport]
    candidates: list[CandidateReport]
    peak_before: int
    """Estimated peak bytes above the inputs of one forward+backward, as written (eager)."""
    peak_after: int
    """The same after graphpass's rewrite."""
    floor_bytes: int
    """Bytes of the input gradients (e.g. logits.grad): no implementation goes below."""
    baseline_bytes: int
    fallback_reason: str | None = None
    passes_run: list[str] = dataclasses.field(default_factory=list)
    graph_before: str | None = None
    """Readable code of the captured ATen graph (CLI and explain only)."""
    graph_after: str | None = None
    cp: list[CpReport] = dataclasses.field(default_factory=list)

    @property
    def bytes_saved(self) -> int:
        return self.peak_before - self.peak_after

    @property
    def fraction_saved(self) -> float:
        return self.bytes_saved / self.peak_before if self.peak_before else 0.0


@dataclasses.dataclass
class Report:
    """Everything `graphpass inspect` and `graphpass.explain` found, one entry per graph."""

    graphs: list[GraphReport]
    function: str = ""
    inputs: dict = dataclasses.field(default_factory=dict)
    """Input name -> "shape:dtype" (or the scalar's value) as given."""

    @property
    def sites(self) -> list[SiteReport]:
        return [s for g in self.graphs for s in g.sites]

    @property
    def peak_before(self) -> int:
        return max((g.peak_before for g in self.graphs), default=0)

    @property
    def peak_after(self) -> int:
        return max((g.peak_after for g in self.graphs), default=0)


# ---- building ------------------------------------------------------------------------------------
def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _chunk_rows(site: SiteRecord) -> int | None:
    """Rows per chunk: as configured, else what the op chose for the site's shape (recorded), else
    None ("auto")."""
    return site.chunk_size if site.chunk_size is not None else site.chunk_rows


def _entropy_grad(site: SiteRecord) -> str:
    ent = [o for o in site.outputs if o.kind == "entropy"]
    if not ent:
        return "-"
    return "kept" if any(o.keeps_grad for o in ent) else "dropped"


def build_graph_report(record: GraphRecord, estimate, *, graph_before: str | None = None,
                       graph_after: str | None = None) -> GraphReport:
    """A `GraphReport` from what the backend recorded and the memory model's `MemoryEstimate`."""
    sites = []
    for site in record.sites:
        temps = [o.temperature for o in site.outputs if o.temperature]
        sites.append(SiteReport(
            source=site.source, kind=site.kind, shape=[str(s) if not isinstance(s, int) else s for s in site.shape],
            dtype=_dtype_name(site.dtype), chunk_size=_chunk_rows(site), chunk_auto=site.chunk_size is None,
            entropy_grad=_entropy_grad(site), temperature=temps[0] if temps else None,
            tp_size=site.tp_size, collectives=", ".join(f"{c.op} {human_bytes(c.bytes)}" for c in site.collectives),
            lm_head=site.lm_head, frozen_lm_heads=site.frozen_lm_heads, gradients_in_forward=site.gradients_in_forward))
    candidates = [CandidateReport(s.source, True, kind=s.kind) for s in record.sites]
    candidates += [CandidateReport(c.source, False, reason=c.reason) for c in record.rejected]
    before = estimate.before if estimate is not None else None
    after = estimate.after if estimate is not None else None
    return GraphReport(
        index=record.index, sites=sites, candidates=candidates,
        peak_before=before.peak_bytes if before else 0, peak_after=after.peak_bytes if after else 0,
        floor_bytes=before.floor_bytes if before else 0, baseline_bytes=before.baseline_bytes if before else 0,
        fallback_reason=record.fallback_reason, passes_run=list(record.passes_run),
        graph_before=graph_before, graph_after=graph_after,
        cp=[CpReport(c.source, c.rewritten, c.reason, list(c.reductions), _collectives_text(c.collectives))
            for c in record.cp])


def _collectives_text(collectives) -> str:
    return ", ".join(f"{c.op} {human_bytes(c.bytes)} over {c.group_size} ranks" for c in collectives) or "none"


# ---- rendering ------------------------------------------------------------------------------------
WIDTH = 100
"""Every line the text report prints fits this many columns (tables and notes alike)."""
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def human_bytes(n: int | None, like: int | None = None) -> str:
    """1536 -> "1.5 KiB"; MiB below 1 GiB, GiB above. With `like`, in the unit `like` would take,
    so that numbers read side by side share one ("1.25 GiB -> 0.13 GiB", not "-> 128.0 MiB")."""
    if n is None:
        return ""
    ref = abs(n if like is None else like)
    unit, scale = next(((u, s) for u, s in _UNITS if ref >= s), ("B", 1))
    if unit == "B":
        return f"{n} B"
    return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"


def describe_value(v) -> str:
    """An input as the report lists it: "4096x32768:bfloat16 (grad)", a scalar's repr."""
    if isinstance(v, torch.Tensor):
        shape = "x".join(str(s) for s in v.shape) or "scalar"
        return f"{shape}:{str(v.dtype).replace('torch.', '')}" + (" (grad)" if v.requires_grad else "")
    return repr(v)


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _shape_text(site: SiteReport) -> str:
    short = _DTYPE_SHORT.get(getattr(torch, site.dtype, None), site.dtype)
    return "x".join(str(s) for s in site.shape) + " " + short


def _chunk_text(site: SiteReport) -> str:
    if site.chunk_size is None:
        return "auto"
    return f"{site.chunk_size} (auto)" if site.chunk_auto else str(site.chunk_size)


def _lm_head_text(site: SiteReport) -> str:
    frozen = f"{'+' if site.lm_head else ''}{site.frozen_lm_heads} no-grad" if site.frozen_lm_heads else ""
    if not site.lm_head:
        return frozen or "-"
    return ("fused+fwd" if site.gradients_in_forward else "fused") + frozen


def table_rows(graph: GraphReport) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of a graph's site table, one row per site. Memory is the graph's, below
    the table (`summary_lines`): sites share one peak, a site alone has no share of it."""
    # An lm_head column only where a site computes its logits from the hidden states. A
    # vocab-parallel site (its logits shape is the rank's slice) says so below the table.
    head = any(s.lm_head or s.frozen_lm_heads for s in graph.sites)
    headers = ["site", "computes", "logits", "rows/chunk", "entropy grad"] + ["lm_head"] * head
    rows = [[s.source, s.kind, _shape_text(s), _chunk_text(s), s.entropy_grad] + [_lm_head_text(s)] * head
            for s in graph.sites]
    return headers, rows


def summary_lines(graph: GraphReport) -> list[str]:
    """The graph's estimated peak before and after, its floor, and what the table's cells mean."""
    before, after, floor = graph.peak_before, graph.peak_after, graph.floor_bytes
    peak = "peak (estimated, forward+backward, above the inputs): "
    if not before:
        lines = ["no memory estimate for this graph"]
    elif graph.sites:
        lines = [f"{peak}{human_bytes(before)} as written -> {human_bytes(after, like=before)} "
                 f"({_pct(graph.bytes_saved, before)} less)",
                 f"floor (bytes of the inputs' gradients): {human_bytes(floor, like=before)}"
                 + (f"; rewritten peak = {after / floor:.2f} x floor" if floor else "")]
    else:
        lines = [f"{peak}{human_bytes(before)}; floor (bytes of the inputs' gradients): "
                 f"{human_bytes(floor, like=before)}"]
    if any(s.lm_head for s in graph.sites):
        lines.append("lm_head fused: the op computes the logits a block at a time from the hidden states"
                     + ("; fused+fwd: and their gradients, in the forward"
                        if any(s.gradients_in_forward for s in graph.sites) else ""))
    if any(s.frozen_lm_heads for s in graph.sites):
        lines.append("no-grad: lm_heads no gradient reaches (a teacher's), computed a block at a time beside the logits")
    lines += [f"{s.source}: vocab-parallel over {s.tp_size} ranks, per call {s.collectives or 'no collective'}"
              for s in graph.sites if s.tp_size > 1]
    if graph.fallback_reason:
        lines.append(f"graph ran unchanged: {graph.fallback_reason}")
    lines += [render_cp(c) for c in graph.cp]
    return lines


def _wrapped(line: str) -> str:
    return textwrap.fill(line, WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def render_table(graph: GraphReport) -> str:
    """The sites table of one graph (tabulate) and its memory summary, within `WIDTH` columns."""
    import tabulate

    headers, rows = table_rows(graph)
    # A long source path wraps within its column rather than push the table past the width, and
    # headers get no padding beyond the columns' two-space gaps (tabulate's MIN_PADDING, a global).
    padding, tabulate.MIN_PADDING = tabulate.MIN_PADDING, 0
    try:
        table = tabulate.tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True,
                                  maxcolwidths=[24] + [None] * (len(headers) - 1)) if rows else "no site rewritten"
    finally:
        tabulate.MIN_PADDING = padding
    return "\n".join([table, *map(_wrapped, summary_lines(graph))])


def render_cp(c: CpReport) -> str:
    """One line: how a graph's context-parallel `unshard`s communicate."""
    if c.rewritten:
        return (f"context parallel ({c.source}): reduced on local rows ({', '.join(c.reductions)}), "
                f"per call: {c.collectives}")
    return f"context parallel ({c.source}): unshard kept ({c.reason}), per call: {c.collectives}"


def render_candidates(graph: GraphReport) -> str:
    if not graph.candidates:
        return "no log-prob / entropy candidates found"
    lines = []
    for c in graph.candidates:
        what = f"rewritten ({c.kind})" if c.rewritten else f"not rewritten: {c.reason}"
        lines.append(textwrap.fill(f"  {c.source}: {what}", WIDTH, subsequent_indent="      ",
                                   break_long_words=False, break_on_hyphens=False))
    return "\n".join(lines)


def render_text(report: Report, *, show_graphs: bool = True) -> str:
    """The whole report as the CLI prints it."""
    out = []
    if report.function:
        out.append(f"graphpass inspect {report.function}")
    if report.inputs:
        out.append(_wrapped("inputs: " + ", ".join(f"{k}={v}" for k, v in report.inputs.items())))
    if not report.graphs:
        out.append("no graph was captured (nothing for Dynamo to trace)")
    for g in report.graphs:
        out.append("")
        if show_graphs and g.graph_before:
            out.append(f"== graph {g.index}: captured (ATen, before rewrite) ==")
            out.append(g.graph_before.rstrip())
        if show_graphs and g.graph_after and g.sites:
            out.append(f"== graph {g.index}: after rewrite ==")
            out.append(g.graph_after.rstrip())
        out.append(f"== graph {g.index}: candidates ==")
        out.append(render_candidates(g))
        out.append(f"== graph {g.index}: memory ==")
        out.append(render_table(g))
    return "\n".join(out) + "\n"


def _jsonable(obj):
    if isinstance(obj, torch.dtype):
        return _dtype_name(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return str(obj)


def to_dict(report: Report | GraphReport) -> dict:
    """Plain data (json-serialisable), with the derived totals added."""
    if isinstance(report, GraphReport):
        d = dataclasses.asdict(report)
        d["bytes_saved"] = report.bytes_saved
        d["fraction_saved"] = report.fraction_saved
        return _jsonable(d)
    return _jsonable({"function": report.function, "inputs": report.inputs,
                      "graphs": [to_dict(g) for g in report.graphs],
                      "peak_before": report.peak_before, "peak_after": report.peak_after})


def to_json(report: Report | GraphReport, **kwargs) -> str:
    return json.dumps(to_dict(report), indent=kwargs.pop("indent", 2), **kwargs)


# ---- the backend's hook ------------------------------------------------------------------------------
def reporting_enabled(config) -> bool:
    """`Config.report`, or the environment variable GRAPHPASS_REPORT=1 for code one cannot edit."""
    return bool(getattr(config, "report", False)) or os.environ.get("GRAPHPASS_REPORT", "") not in ("", "0")


def print_graph_report(result_or_record, estimate=None, *, file=None) -> GraphReport:
    """Print one compiled graph's candidates and table, and return its `GraphReport`.

    Called by the backend as `print_graph_report(result)` with a `RewriteResult` (the memory
    model runs here), or as `print_graph_report(record, estimate)`. Never raises on a failed
    estimate: reports are extras, a compile must not fail because of one.
    """
    file = file if file is not None else sys.stdout
    record = result_or_record
    if estimate is None and hasattr(result_or_record, "record"):
        record = result_or_record.record
        estimate = _safe_estimate(result_or_record, file)
    graph = build_graph_report(record, estimate)
    print(f"graphpass: graph {graph.index}", file=file)
    print(render_candidates(graph), file=file)
    print(render_table(graph), file=file, flush=True)
    return graph


def _safe_estimate(result, file):
    from graphpass import memory

    try:
        return memory.estimate_rewrite(result)
    except Exception as exc:
        print(f"graphpass: memory estimate failed for graph {result.record.index}: "
              f"{type(exc).__name__}: {exc}", file=file)
        return None
