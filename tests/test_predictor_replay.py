"""CPU tests of benchmarks/fitting/predictor_replay.py's row selection and best/chosen metric."""
from benchmarks.fitting import predictor_replay as pr


def _row(method, ms, config=None, mode="cuda_graph", **kw):
    return {"method": method, "config": config, "mode": mode, "ms": ms, "kind": "gemm_alltoall",
            "shape": [8192, 4096, 2048], "world_size": 2, "date": "2026-11-23", **kw}


def test_rows_of_the_python_reference_are_not_replayed():
    assert pr.ran_reference(_row("p2p_ring", 4.0, {"slices": 1, "transport": "nccl"}, date="2026-11-22"))
    assert pr.ran_reference(_row("p2p_ring", 4.0, {"slices": 2, "transport": "nccl"}))
    assert not pr.ran_reference(_row("p2p_ring", 0.3, {"slices": 1, "transport": "p2p"}))
    assert not pr.ran_reference(_row("signal_reorder", 0.3, {}, date="2026-11-22"))


def test_best_chosen_within_a_template_and_for_the_decision():
    seq = _row("sequential", 1.0)
    a, b = _row("priority_stream", 0.8, {"chunks": 2}), _row("priority_stream", 0.9, {"chunks": 4})
    # the model ranks chunks=4 first (0.7 < 0.75) but chunks=2 measured faster: 0.8 / 0.9
    preds = [(seq, 1.0), (a, 0.75), (b, 0.7)]
    out = pr.best_chosen(preds, {"cuda_graph": 1.0, "eager": 1.0})
    assert out[("cuda_graph", "priority_stream")] == [0.8 / 0.9]
    assert out[("cuda_graph", "argmin")] == [0.8 / 0.9]
    # a margin the predicted gain (1.0 / 0.7) does not clear keeps the baseline: 0.8 / 1.0
    assert pr.best_chosen(preds, {"cuda_graph": 1.5, "eager": 1.5})[("cuda_graph", "decide")] == [0.8]


def test_a_config_measured_twice_keeps_its_best_time():
    seq = _row("sequential", 1.0)
    a1, a2 = _row("p2p_ring", 0.9, {"transport": "p2p"}), _row("p2p_ring", 0.7, {"transport": "p2p"})
    out = pr.best_chosen([(seq, 1.0), (a1, 0.8), (a2, 0.8)], {"cuda_graph": 1.0, "eager": 1.0})
    assert out[("cuda_graph", "argmin")] == [1.0]  # p2p_ring at its best 0.7 is the fastest and chosen
    assert ("cuda_graph", "p2p_ring") not in out  # one config: nothing to choose between


def test_signed_errors_are_grouped_per_mode_method_and_kind():
    errs = [(_row("sequential", 1.0), 0.1), (_row("p2p_ring", 1.0, {}), -0.2)]
    g = pr.error_groups(errs)
    assert g[("cuda_graph", "all", "all")] == [0.1, -0.2]
    assert g[("cuda_graph", "p2p_ring", "gemm_alltoall")] == [-0.2]


def test_per_template_bars_follow_each_templates_overpromise():
    """A template whose predicted gains overshoot what was measured gets a higher bar than one that
    keeps its promises; a site's decision takes the fastest rewrite clearing its own bar."""
    R = pr

    seq = ("sequential", "")
    sites = {}
    for i in range(10):  # honest: predicted gain 1.2, measured 1.2; boastful: predicted 1.25, measured 1.0
        sites[("gemm_reducescatter", (i,), 2, "cuda_graph")] = {
            seq: (1.0, 1.0), ("honest", "{}"): (1 / 1.2, 1 / 1.2), ("boastful", "{}"): (1.0, 1 / 1.25)}
    bars = R.template_bars(sites, 1.03)
    assert bars[("cuda_graph", "honest", "gemm_reducescatter")] < bars[("cuda_graph", "boastful", "gemm_reducescatter")]
    cands = sites[("gemm_reducescatter", (0,), 2, "cuda_graph")]
    assert R.decide_per_template(cands, bars, "cuda_graph", "gemm_reducescatter")[0] == "honest"


def test_auto_rows_replay_as_the_template_auto_chose():
    cfg = {"chosen": "p2p_ring", "slices": 1, "bidirectional": False, "transport": "p2p"}
    row = pr.as_template_row(_row("auto", 0.3, cfg))
    assert row["method"] == "p2p_ring" and row["config"] == {"slices": 1, "bidirectional": False, "transport": "p2p"}
    kept = pr.as_template_row(_row("auto", 0.5, {"chosen": "baseline"}))
    assert kept["method"] == "sequential" and kept["config"] is None
    assert pr.as_template_row(_row("async_tp", 0.4, {"rewritten": True}))["method"] == "async_tp"


def test_host_launched_rows_since_op_graphs_are_priced_as_replays():
    """A host-launched p2p_ring row recorded with op_graphs on is priced as the decision prices it
    (the CUDA-graph schedule plus the replay's host time), not as an op launched piece by piece."""
    import pytest

    from overlap_compile import predictor, templates
    from overlap_compile.predictor.models import Ctx
    from overlap_compile.testing.fake_group import fake_process_group
    from overlap_compile.testing.patterns import traced_site

    profile = predictor.load_profile("h100")
    cfg = {"slices": 1, "bidirectional": False, "transport": "p2p"}
    with fake_process_group(2):
        match = traced_site("gemm_reducescatter", 8192, 4096, 2048, 2)
        row = _row("p2p_ring", 0.3, cfg, mode="eager", kind="gemm_reducescatter", shape=[8192, 4096, 2048],
                   date="2026-11-26")
        got = pr.predict_row(row, match, profile)
        site = predictor.site_of(match, profile)
        sched, host = predictor.price_config(templates.get_spec("p2p_ring"), match, cfg, profile, Ctx("eager"), site)
        graphed, _ = predictor.price_config(templates.get_spec("p2p_ring"), match, cfg, profile, Ctx("cuda_graph"), site)
        launched = pr.predict_row({**row, "date": "2026-11-24"}, match, profile)
    assert got == pytest.approx(sched.total_ms + host) and sched.total_ms == pytest.approx(graphed.total_ms)
    assert host < 0.2 < launched - got  # piece by piece: 0.3-0.9 ms of host time per call
