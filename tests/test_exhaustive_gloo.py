"""search="exhaustive" for real over gloo (2 processes): the baseline and every candidate of a
GEMM + all-reduce site run on both ranks while Inductor compiles, the times are agreed, both
ranks decide the same. Several outstanding functional collectives on the compiling thread hung
both ranks (torch 2.13 CPU); the measurements now run on a fresh thread: this test hung before."""
import torch
import torch.distributed as dist

from overlap_compile.testing.multiprocess import run_distributed


def _measured_decision() -> list:
    import overlap_compile as oc
    from torch.distributed._functional_collectives import all_reduce

    group = dist.group.WORLD.group_name

    def f(a, b):
        return all_reduce(a @ b, "sum", group) + 1

    torch.manual_seed(dist.get_rank())
    report = oc.explain(f, torch.randn(64, 32), torch.randn(32, 48), search="exhaustive", min_speedup=1.0,
                        templates=("p2p_ring", "priority_stream"))
    (site,) = report.sites
    return [site.template, site.config, site.predicted_ms]


def test_exhaustive_search_over_gloo_completes_and_agrees():
    per_rank = run_distributed(_measured_decision, world_size=2, timeout_s=300)
    assert per_rank[0] == per_rank[1]  # the same measured numbers and the same choice on both ranks
    template, config, measured = per_rank[0]
    assert measured["baseline"] > 0 and len(measured) >= 4, measured
    assert all(v is not None and v > 0 for v in measured.values()), measured
    # a rewrite is taken only when it measured fastest (the margin may still keep the baseline)
    if template != "baseline":
        mine = min(v for k, v in measured.items() if k.startswith(template))
        assert mine == min(measured.values()) and mine < measured["baseline"], (template, measured)


def _measured_gains() -> list:
    import overlap_compile as oc
    from torch.distributed._functional_collectives import all_reduce

    group = dist.group.WORLD.group_name

    def f(a, b):
        return all_reduce(a @ b, "sum", group) + 1

    torch.manual_seed(dist.get_rank())
    report = oc.explain(f, torch.randn(64, 32), torch.randn(32, 48), search="measure",
                        templates=("p2p_ring", "priority_stream"))
    (site,) = report.sites
    return [site.template, site.measured, str(report)]


def test_search_measure_reports_measured_beside_predicted_gain():
    """search="measure": the decision is the predictor's; the site as written and the rewrite it
    weighed are timed on both ranks (the same agreed numbers), and the Report shows both gains."""
    per_rank = run_distributed(_measured_gains, world_size=2, timeout_s=300)
    assert [r[:2] for r in per_rank] == [per_rank[0][:2]] * 2
    template, measured, text = per_rank[0]
    assert measured["baseline_ms"] > 0 and measured["ms"] > 0, measured
    assert measured["template"] in ("p2p_ring", "priority_stream")
    if template != "baseline":
        assert measured["template"] == template
    assert measured["measured_gain"] == measured["baseline_ms"] / measured["ms"]
    assert measured["predicted_gain"] > 0
    assert f"measured {measured['measured_gain']:.2f}x vs predicted {measured['predicted_gain']:.2f}x" in text


def test_search_measure_keeps_the_predicted_decision():
    """With a measuring hook that makes every rewrite slower, the decision is still the predicted
    one (measure never decides), and each site says so in its measured gain."""
    from overlap_compile import config, predictor
    from overlap_compile.passes.decide import decide
    from overlap_compile.predictor import exhaustive
    from overlap_compile.testing.fake_group import fake_process_group
    from overlap_compile.testing.patterns import traced_site

    exhaustive.set_measure(lambda template, match, cfg, options: 1.0 if template == "baseline" else 2.0)
    try:
        with fake_process_group(2):
            sites = [traced_site("gemm_reducescatter", 8192, 4096, 2048, 2)]
            profile = predictor.load_profile("h200")
            with config.patch(measure_uncertain=False):  # the prediction alone: nothing measured
                (predicted,) = decide(sites, config.current(), profile)
            with config.patch(search="measure"):
                (measured,) = decide(sites, config.current(), profile)
    finally:
        exhaustive.set_measure(None)
    assert (measured.template, measured.config) == (predicted.template, predicted.config)
    assert measured.measured["measured_gain"] == 0.5 and measured.measured["baseline_ms"] == 1.0
    assert predicted.measured is None


def test_items_of_a_site_share_their_operands():
    """The k-th operand every item of a site asks for is one tensor (same data, one copy)."""
    import torch

    from overlap_compile.predictor.exhaustive import _Operands

    rnd = _Operands("cpu", torch.float32)
    a, b = rnd.item()(4, 3), rnd(3, 5)
    a2, b2 = rnd.item()(4, 3), rnd(3, 5)
    assert a2 is a and b2 is b and a.shape == (4, 3) and b.shape == (3, 5)
    c = rnd.item()(2, 2)  # another shape in that slot: a new tensor there
    assert c.shape == (2, 2) and rnd.item()(2, 2) is c


def _buffers_after_timing() -> dict:
    """A template's timing that makes a symmetric buffer (as tile_fused's and p2p_ring's do on
    GPUs) leaves none behind; a buffer made before the timing stays."""
    import overlap_compile as oc
    from overlap_compile.predictor import exhaustive
    from overlap_compile.runtime import symm
    from torch.distributed._functional_collectives import all_reduce

    group = dist.group.WORLD.group_name
    before = (group, "test/made-before", (4,), torch.float32, "cpu", 0)
    symm._cache[before] = "made before"
    made = []
    site_call = exhaustive._site_call

    def making_a_buffer(template, *args, **kwargs):
        if template != "baseline":
            key = (group, f"test/{template}/{len(made)}", (4,), torch.float32, "cpu", 0)
            symm._cache[key] = "made by the timing"
            made.append(key)
        return site_call(template, *args, **kwargs)

    exhaustive._site_call = making_a_buffer
    try:
        oc.explain(lambda a, b: all_reduce(a @ b, "sum", group) + 1, torch.randn(64, 32), torch.randn(32, 48),
                   search="exhaustive", min_speedup=1.0, templates=("p2p_ring",))
    finally:
        exhaustive._site_call = site_call
    return {"made": len(made), "left": [k for k in made if k in symm._cache], "before": before in symm._cache}


def test_timing_leaves_no_symmetric_buffer_behind():
    for r in run_distributed(_buffers_after_timing, world_size=2, timeout_s=300):
        assert r["made"] >= 1 and r["left"] == [] and r["before"], r
