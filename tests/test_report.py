"""Report dataclasses and their rendering: table content, measured columns, JSON, the backend hook."""

from __future__ import annotations

import io
import json
import types

import torch

from graphpass import report
from graphpass.memory import MemoryEstimate, PeakEstimate
from graphpass.records import Candidate, CollectiveRecord, GraphRecord, OutputRecord, SiteRecord

MiB = 2**20


def peak(nbytes, floor=256 * MiB):
    return PeakEstimate(peak_bytes=nbytes, baseline_bytes=256 * MiB, floor_bytes=floor, saved_bytes=0,
                        peak_node="n", peak_phase="backward")


def site(source="ppo_loss.py:25", keeps_entropy=False, chunk=1024):
    return SiteRecord(kind="logprob+entropy", source=source, shape=(4096, 32768), dtype=torch.bfloat16,
                      chunk_size=chunk, outputs=[OutputRecord("logprob", True, "/ 0.7"),
                                                 OutputRecord("entropy", keeps_entropy, "/ 0.7")])


def one_site_graph(**kw):
    record = GraphRecord(index=0, sites=[site()], rejected=[Candidate("other.py:9", "wide output escapes")])
    est = MemoryEstimate(before=peak(2560 * MiB), after=peak(300 * MiB), site_bytes_saved=[2260 * MiB])
    return report.build_graph_report(record, est, **kw)


def test_site_row_has_everything():
    g = one_site_graph()
    text = report.render_table(g)
    for expected in ["ppo_loss.py:25", "logprob+entropy", "4096x32768 bf16", "1024", "dropped",
                     "2.50 GiB", "300.0 MiB", "2.21 GiB", "88.3%", "total (graph 0, 1 site)"]:
        assert expected in text, expected
    assert g.sites[0].bytes_saved > 0
    assert g.sites[0].entropy_grad == "dropped"
    assert g.bytes_saved == 2260 * MiB


def test_vocab_parallel_sites_show_the_group_size_and_what_each_call_communicates():
    tp = SiteRecord(kind="-logprob", source="cross_entropy.py:232", shape=(4096, 16384), dtype=torch.float32,
                    chunk_size=None, outputs=[OutputRecord("-logprob", True)], tp_size=2, group="12",
                    collectives=[CollectiveRecord("all_gather", 2, 4096 * 5 * 4)])
    record = GraphRecord(index=0, sites=[tp, site()])
    est = MemoryEstimate(before=peak(900 * MiB), after=peak(300 * MiB), site_bytes_saved=[300 * MiB, 300 * MiB])
    headers, rows = report.table_rows(report.build_graph_report(record, est))
    assert headers[5:7] == ["tp", "collectives per call"]
    assert rows[0][5:7] == ["2", "all_gather 80.0 KiB"] and rows[1][5:7] == ["1", "none"]
    assert len(rows[-1]) == len(headers)
    assert "tp" not in report.table_rows(one_site_graph())[0]  # no column where nothing is vocab-parallel


def test_candidates_say_why_not():
    text = report.render_candidates(one_site_graph())
    assert "ppo_loss.py:25: rewritten (logprob+entropy)" in text
    assert "other.py:9: not rewritten: wide output escapes" in text


def test_measured_columns_sit_beside_estimates():
    headers, rows = report.table_rows(one_site_graph(measured_before=2560 * MiB, measured_after=310 * MiB))
    assert headers[-3:] == ["meas. before", "meas. after", "meas. saved"]
    assert rows[-1][-3:] == ["2.50 GiB", "310.0 MiB", "2.20 GiB"]
    assert "meas. before" not in report.table_rows(one_site_graph())[0]


def test_no_sites_is_a_total_row_only():
    est = MemoryEstimate(before=peak(100 * MiB), after=peak(100 * MiB), site_bytes_saved=[])
    g = report.build_graph_report(GraphRecord(index=3), est)
    headers, rows = report.table_rows(g)
    assert g.sites == [] and len(rows) == 1
    assert rows[0][0] == "total (graph 3, 0 sites)" and rows[0][7] == "0 B"
    assert "no log-prob / entropy candidates found" in report.render_candidates(g)


def test_multi_site_rows_leave_graph_peaks_to_the_total():
    record = GraphRecord(index=0, sites=[site("a.py:1", keeps_entropy=True), site("a.py:2", chunk=None)])
    est = MemoryEstimate(before=peak(4 * 1024 * MiB), after=peak(1024 * MiB), site_bytes_saved=[1536 * MiB] * 2)
    g = report.build_graph_report(record, est)
    _, rows = report.table_rows(g)
    assert rows[0][4] == "kept" and rows[0][5] == "" and rows[1][3] == "auto"
    assert rows[-1][5:9] == ["4.00 GiB", "1.00 GiB", "3.00 GiB", "75.0%"]


def test_chunk_column_reads_the_record():
    auto = site(chunk=None)
    assert report.table_rows(report.build_graph_report(GraphRecord(index=0, sites=[auto]), None))[1][0][3] == "auto"
    auto.chunk_rows = 512  # recorded by the rewrite: what the op chose for this shape
    assert report.table_rows(report.build_graph_report(GraphRecord(index=0, sites=[auto]), None))[1][0][3] == "auto (512)"
    fixed = site(chunk=1024)
    fixed.chunk_rows = 1024
    assert report.table_rows(report.build_graph_report(GraphRecord(index=0, sites=[fixed]), None))[1][0][3] == "1024"


def test_json_round_trips():
    rep = report.Report(graphs=[one_site_graph()], function="f.py:loss", inputs={"logits": "4096x32768:bfloat16"})
    data = json.loads(report.to_json(rep))
    g = data["graphs"][0]
    assert g["sites"][0]["dtype"] == "bfloat16" and g["sites"][0]["bytes_saved"] == 2260 * MiB
    assert g["bytes_saved"] == 2260 * MiB and data["peak_before"] == 2560 * MiB
    assert g["candidates"][1]["rewritten"] is False


def test_human_bytes():
    assert report.human_bytes(512) == "512 B"
    assert report.human_bytes(3 * MiB // 2) == "1.5 MiB"
    assert report.human_bytes(19914555392) == "18.55 GiB"
    assert report.human_bytes(-2 * MiB) == "-2.0 MiB"


def test_print_graph_report_from_record_and_estimate():
    buf = io.StringIO()
    g = report.print_graph_report(GraphRecord(index=0, sites=[site()]),
                                  MemoryEstimate(peak(10 * MiB), peak(5 * MiB), [5 * MiB]), file=buf)
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

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples.ppo_loss import example_inputs, ppo_loss

    torch.compiler.reset()
    rep = graphpass.explain(ppo_loss, *example_inputs(32, 64, torch.bfloat16), temperature=0.5)
    assert isinstance(rep, report.Report) and len(rep.graphs) == 1
    (s,) = rep.sites
    assert s.bytes_saved > 0 and s.source.startswith("ppo_loss.py:") and s.shape == [32, 64]
    assert rep.peak_after < rep.peak_before
    assert "total (graph 0, 1 site)" in report.render_text(rep)

    torch.compiler.reset()
    x = torch.randn(32, 64, requires_grad=True)
    plain = graphpass.explain(lambda a: (a * a).sum(), x)
    assert plain.sites == [] and plain.graphs[0].bytes_saved == 0


def test_lm_head_sites_say_the_logits_are_never_stored():
    head = SiteRecord(kind="logprob+entropy", source="model.py:40", shape=(2048, 32768), dtype=torch.float32,
                      chunk_size=None, outputs=[OutputRecord("logprob", True)], lm_head=True,
                      hidden_shape=(2048, 1024))
    record = GraphRecord(index=0, sites=[head, site()])
    est = MemoryEstimate(before=peak(900 * MiB), after=peak(300 * MiB), site_bytes_saved=[300 * MiB, 300 * MiB])
    g = report.build_graph_report(record, est)
    headers, rows = report.table_rows(g)
    assert headers[5] == "lm_head" and rows[0][5] == "fused (never stored)" and rows[1][5] == "-"
    assert len(rows[-1]) == len(headers)
    assert "lm_head fused" in report.render_table(g)
    assert json.loads(report.to_json(g))["sites"][0]["lm_head"] is True
    assert "lm_head" not in report.table_rows(one_site_graph())[0]  # no column without such a site
