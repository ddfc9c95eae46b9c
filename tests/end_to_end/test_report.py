"""Report dataclasses and their rendering: table content, measured columns, JSON, the backend hook."""

from __future__ import annotations

import io
import json
import types

import torch

from graphpass import report
from graphpass.memory import MemoryEstimate, PeakEstimate
from graphpass.records import CollectiveRecord, GraphRecord, OutputRecord, Rejection, SiteRecord, site_kind

MiB = 2**20


def peak(nbytes, floor=256 * MiB):
    return PeakEstimate(peak_bytes=nbytes, baseline_bytes=256 * MiB, floor_bytes=floor, saved_bytes=0,
                        peak_node="n", peak_phase="backward")


def site(source="ppo_loss.py:25", keeps_entropy=False, chunk=1024):
    return SiteRecord(kind="logprob+entropy", source=source, shape=(4096, 32768), dtype=torch.bfloat16,
                      chunk_size=chunk, outputs=[OutputRecord("logprob", True, "/ 0.7"),
                                                 OutputRecord("entropy", keeps_entropy, "/ 0.7")])


def one_site_graph(**kw):
    record = GraphRecord(index=0, sites=[site()], rejected=[Rejection("other.py:9", "wide output escapes")])
    est = MemoryEstimate(before=peak(2560 * MiB), after=peak(300 * MiB))
    return report.build_graph_report(record, est, **kw)


def test_site_row_has_everything():
    g = one_site_graph()
    text = report.render_table(g)
    for expected in ["ppo_loss.py:25", "logprob+entropy", "4096x32768 bf16", "1024", "dropped",
                     "2.50 GiB as written -> 0.29 GiB (88.3% less)", "floor", "0.25 GiB",
                     "1.17 x floor"]:
        assert expected in text, expected
    assert g.sites[0].entropy_grad == "dropped"
    assert g.bytes_saved == 2260 * MiB
    assert "total" not in text  # one site: no total row repeating it


def test_every_line_fits_100_columns():
    # Every optional column at once, a long source path, several sites, a CP note: the widest case.
    sites = [SiteRecord(kind="logprob+entropy", source="verl/utils/megatron/tensor_parallel_entropy.py:1234",
                        shape=(131072, 75968), dtype=torch.bfloat16, chunk_size=None,
                        outputs=[OutputRecord("logprob", True)], tp_size=2, lm_head=True, gradients_in_forward=True,
                        collectives=[CollectiveRecord("all_gather", 2, 131072 * 5 * 4)]), site()]
    record = GraphRecord(index=0, sites=sites, rejected=[Rejection("a_rather_long_module_name.py:77", "x " * 80)])
    g = report.build_graph_report(record, MemoryEstimate(before=peak(900 * 2**30), after=peak(3 * 2**30)))
    text = report.render_text(report.Report([g], function="some/where/loss.py:loss",
                                            inputs={f"input_{i}": "131072x75968:bfloat16 (grad)" for i in range(6)}))
    assert max(map(len, text.splitlines())) <= report.WIDTH, text
    assert "tensor_parallel_entropy" in text and "all_gather 2.5 MiB" in text


def test_vocab_parallel_sites_show_the_group_size_and_what_each_call_communicates():
    tp = SiteRecord(kind="-logprob", source="cross_entropy.py:232", shape=(4096, 16384), dtype=torch.float32,
                    chunk_size=None, outputs=[OutputRecord("-logprob", True)], tp_size=2, group="12",
                    collectives=[CollectiveRecord("all_gather", 2, 4096 * 5 * 4)])
    record = GraphRecord(index=0, sites=[tp, site()])
    est = MemoryEstimate(before=peak(900 * MiB), after=peak(300 * MiB))
    g = report.build_graph_report(record, est)
    headers, rows = report.table_rows(g)
    assert len(headers) == len(rows[0]) == 5  # the logits shape is the rank's slice: the note says so
    assert "cross_entropy.py:232: vocab-parallel over 2 ranks, per call all_gather 80.0 KiB" in report.render_table(g)
    assert "tp" not in report.table_rows(one_site_graph())[0]  # no column where nothing is vocab-parallel


def test_candidates_say_why_not():
    text = report.render_candidates(one_site_graph())
    assert "ppo_loss.py:25: rewritten (logprob+entropy)" in text
    assert "other.py:9: not rewritten: wide output escapes" in text


def test_no_sites_is_the_graph_peak_alone():
    est = MemoryEstimate(before=peak(100 * MiB), after=peak(100 * MiB))
    g = report.build_graph_report(GraphRecord(index=3), est)
    headers, rows = report.table_rows(g)
    assert g.sites == [] and rows == []
    text = report.render_table(g)
    assert "no site rewritten" in text and "100.0 MiB; floor" in text and "rewritten peak" not in text
    assert "no log-prob / entropy candidates found" in report.render_candidates(g)


def test_several_sites_share_the_graph_peak():
    record = GraphRecord(index=0, sites=[site("a.py:1", keeps_entropy=True), site("a.py:2", chunk=None)])
    est = MemoryEstimate(before=peak(4 * 1024 * MiB), after=peak(1024 * MiB))
    g = report.build_graph_report(record, est)
    headers, rows = report.table_rows(g)
    assert len(rows) == 2 and len(headers) == 5
    assert rows[0][4] == "kept" and rows[1][3] == "auto"
    assert "4.00 GiB as written -> 1.00 GiB (75.0% less)" in report.render_table(g)


def test_chunk_column_reads_the_record():
    auto = site(chunk=None)
    assert report.table_rows(report.build_graph_report(GraphRecord(index=0, sites=[auto]), None))[1][0][3] == "auto"
    auto.chunk_rows = 512  # recorded by the rewrite: what the op chose for this shape
    assert report.table_rows(report.build_graph_report(GraphRecord(index=0, sites=[auto]), None))[1][0][3] == "512 (auto)"
    fixed = site(chunk=1024)
    fixed.chunk_rows = 1024
    assert report.table_rows(report.build_graph_report(GraphRecord(index=0, sites=[fixed]), None))[1][0][3] == "1024"


def test_json_round_trips():
    rep = report.Report(graphs=[one_site_graph()], function="f.py:loss", inputs={"logits": "4096x32768:bfloat16"})
    data = json.loads(report.to_json(rep))
    g = data["graphs"][0]
    assert g["sites"][0]["dtype"] == "bfloat16" and "bytes_saved" not in g["sites"][0]
    assert g["bytes_saved"] == 2260 * MiB and data["peak_before"] == 2560 * MiB
    assert g["candidates"][1]["rewritten"] is False


def test_human_bytes():
    assert report.human_bytes(512) == "512 B"
    assert report.human_bytes(3 * MiB // 2) == "1.5 MiB"
    assert report.human_bytes(19914555392) == "18.55 GiB"
    assert report.human_bytes(-2 * MiB) == "-2.0 MiB"
    assert report.human_bytes(128 * MiB, like=5 * 2**30) == "0.12 GiB"  # side by side, one unit


def test_print_graph_report_from_record_and_estimate():
    buf = io.StringIO()
    g = report.print_graph_report(GraphRecord(index=0, sites=[site()]),
                                  MemoryEstimate(peak(10 * MiB), peak(5 * MiB)), file=buf)
    assert "ppo_loss.py:25" in buf.getvalue() and g.bytes_saved == 5 * MiB


def test_print_graph_report_from_a_rewrite_result_never_raises():
    # The backend hands over a RewriteResult; a failing estimate is reported, not raised.
    result = types.SimpleNamespace(before=None, after=None, fake_inputs=[], record=GraphRecord(index=1))
    buf = io.StringIO()
    g = report.print_graph_report(result, file=buf)
    assert "memory estimate failed for graph 1" in buf.getvalue() and g.index == 1


def test_reporting_enabled(monkeypatch):
    monkeypatch.delenv("GRAPHPASS_REPORT", raising=False)
    assert not report.reporting_enabled(types.SimpleNamespace(report=False))
    assert report.reporting_enabled(types.SimpleNamespace(report=True))
    monkeypatch.setenv("GRAPHPASS_REPORT", "1")
    assert report.reporting_enabled(types.SimpleNamespace(report=False))


def test_explain_returns_the_report_the_cli_renders():
    import os
    import sys

    import graphpass

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
    from examples.ppo_loss import example_inputs, ppo_loss

    torch.compiler.reset()
    rep = graphpass.explain(ppo_loss, *example_inputs(32, 64, torch.bfloat16), temperature=0.5)
    assert isinstance(rep, report.Report) and len(rep.graphs) == 1
    (s,) = rep.sites
    assert s.source.startswith("ppo_loss.py:") and s.shape == [32, 64]
    assert rep.peak_after < rep.peak_before
    assert "rewritten peak = 1.0" in report.render_text(rep)

    torch.compiler.reset()
    x = torch.randn(32, 64, requires_grad=True)
    plain = graphpass.explain(lambda a: (a * a).sum(), x)
    assert plain.sites == [] and plain.graphs[0].bytes_saved == 0


def test_lm_head_sites_say_the_logits_are_never_stored():
    head = SiteRecord(kind="logprob+entropy", source="model.py:40", shape=(2048, 32768), dtype=torch.float32,
                      chunk_size=None, outputs=[OutputRecord("logprob", True)], lm_head=True,
                      hidden_shape=(2048, 1024))
    record = GraphRecord(index=0, sites=[head, site()])
    est = MemoryEstimate(before=peak(900 * MiB), after=peak(300 * MiB))
    g = report.build_graph_report(record, est)
    headers, rows = report.table_rows(g)
    assert headers[5] == "lm_head" and rows[0][5] == "fused" and rows[1][5] == "-"
    assert "lm_head fused" in report.render_table(g)
    assert json.loads(report.to_json(g))["sites"][0]["lm_head"] is True
    assert "lm_head" not in report.table_rows(one_site_graph())[0]  # no column without such a site


def test_site_kind_counts_a_label_repeated_more_than_twice():
    assert site_kind(["logprob", "entropy"]) == "logprob+entropy"
    assert site_kind(["logprob", "logprob"]) == "logprob+logprob"
    assert site_kind(["rowwise", "logprob"] + ["rowwise"] * 24) == "rowwise x25+logprob"
