"""The Report: readable table, JSON, dump_dir files and timeline PNGs."""
import json
import os

import pytest
import torch

from overlap_compile import Report, config
from overlap_compile.passes.pipeline import run_on_graph
from overlap_compile.testing.fake_group import fake_process_group
from tests import graph_cases as gc


@pytest.fixture
def report():
    with fake_process_group(4) as group:
        rep = Report()
        for case, kw in ((gc.gemm_allreduce, {"m": 512, "n": 1024, "k": 256}), (gc.gemm_used_twice, {})):
            fn, shapes = case(group, 4, **kw)
            gm = gc.trace(fn, [torch.randn(s) for s in shapes])
            rep.add(run_on_graph(gm.graph, config.current()))
        yield rep


def test_table_lists_every_site_with_reason(report):
    text = str(report)
    assert len(report.sites) == 2 and report.graphs.keys() == {"forward", "forward_1"}
    assert "gemm_allreduce" in text and "512x1024x256" in text and "also used by" in text
    assert "profile: cpu-gloo" in text
    chosen = report.sites[0]
    assert "baseline" in chosen.predicted_ms and len(chosen.predicted_ms) > 1  # every candidate's prediction


def test_a_record_shared_with_another_report_keeps_its_name_there(report):
    """The pass adds each record to the caller's report and to the process-wide one: a name taken
    in one ("forward" there already) is suffixed on that report's copy only."""
    (first,) = [r for r in report.records if r.name == "forward"]
    mine = Report()
    mine.add(first)
    report.add(first)  # "forward" and "forward_1" taken here
    assert mine.records[0].name == "forward" and {s.graph for s in mine.sites} == {"forward"}
    assert report.records[-1].name == "forward_2" and report.records[-1].sites[0].graph == "forward_2"
    assert first.name == "forward" and first.sites[0].graph == "forward"


def test_dump_writes_graphs_report_and_timelines(report, tmp_path):
    report.dump(str(tmp_path))
    files = set(os.listdir(tmp_path))
    assert {"forward.before.py", "forward.after.py", "report.txt", "report.json"} <= files
    pngs = [f for f in files if f.startswith("timeline_") and f.endswith(".png")]
    assert len(pngs) == 1  # the analysable site only
    with open(tmp_path / pngs[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # host-launched (CPU): the analysable site's graph on the simulated clocks, once per graph with one
    assert [f for f in files if f.startswith("host_clocks_")] == ["host_clocks_forward.png"]
    data = json.loads((tmp_path / "report.json").read_text())
    assert [s["kind"] for g in data["graphs"] for s in g["sites"]] == ["gemm_allreduce", "gemm_allreduce"]


def test_a_failing_analysis_leaves_the_graph_unchanged_and_says_so(monkeypatch):
    """An unexpected error while finding sites (the pass's own bug, e.g. a dtype it did not
    foresee) must not break the user's compile: the graph is kept as it was, a warning is given
    and the report carries the error."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from overlap_compile import Report, config
    from overlap_compile.passes import pipeline

    def broken(graph, name):
        raise RuntimeError("BFloat16 did not match Float")

    monkeypatch.setattr(pipeline, "find", broken)
    gm = make_fx(lambda a, b: torch.relu(a @ b))(torch.randn(4, 3), torch.randn(3, 5))
    before = gm.graph.python_code(root_module="self").src
    with pytest.warns(UserWarning, match="left unchanged"):
        record = pipeline.run_on_graph(gm.graph, config.current())
    assert gm.graph.python_code(root_module="self").src == before == record.after
    assert record.sites == [] and "BFloat16 did not match Float" in record.error
    rep = Report()
    rep.add(record)
    assert "finding sites in the forward graph failed" in rep.table()
    assert '"error": "overlap_compile: finding sites' in rep.to_json()


def test_forecast_counts_gpu_time_where_the_graph_hides_the_host_time():
    """Host-launched: a rewritten op whose host time (0.08 ms) is larger than the site's (0.05 ms)
    is priced with both in it; where the GPU work queued ahead hides both, the forecast compares
    GPU time with GPU time; where it does not, with the host times in."""
    from overlap_compile.report import forecast

    site = {"graph": "forward", "rewritten": True, "measured": None, "predicted_ms": {"baseline": 1.05},
            "comm_ms": 0.2, "hidden_ms": 0.0, "chosen_ms": 0.98, "baseline_host_ms": 0.05, "chosen_host_ms": 0.08}
    hidden = forecast([{**site, "host_clock": {"lead": 0.5}}])["all"]
    exposed = forecast([{**site, "host_clock": {"lead": 0.06}}])["all"]
    graphed = forecast([{**site, "baseline_host_ms": 0.0, "chosen_host_ms": 0.0}])["all"]
    assert hidden["hidden_ms"] == pytest.approx(0.1)  # (1.05 - 0.05) - (0.98 - 0.08)
    assert exposed["hidden_ms"] == pytest.approx(0.07) == graphed["hidden_ms"]
