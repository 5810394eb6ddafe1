"""passes/host_pacing.py: in a host-launched graph, an op's host time hides behind the GPU work
queued before it -- and only then. Sites decided under the built-in H200 profile on a fake
2-rank group (no memory, no GPU)."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from overlap_compile import config, predictor
from overlap_compile.passes import host_pacing
from overlap_compile.passes.decide import Candidate, decide
from overlap_compile.passes.find import find
from overlap_compile.passes.pipeline import run_on_graph
from overlap_compile.testing.fake_group import fake_process_group
from overlap_compile.testing.patterns import collective

M, N, K = 8192, 8192, 2048  # an all-reduce site p2p_ring runs 1.34x faster on 2x H200 (CUDA graph)


@pytest.fixture(autouse=True)
def ops_launched_piece_by_piece():
    """These tests are about ops whose host time is large (0.3-0.9 ms, launched piece by piece:
    ``op_graphs=False``), the case pacing exists for; replayed ops are the last test's."""
    with config.patch(op_graphs=False):
        yield


@pytest.fixture
def group():
    with fake_process_group(2) as name:
        yield name


@pytest.fixture
def host_launched():
    from torch._inductor import config as ic

    with ic.patch({"triton.cudagraphs": False}):
        yield


def _chain(group: str, between: int):
    """Three GEMM -> all-reduce sites in a row, ``between`` pointwise pairs (mul, add) after
    each: like a stack of row-parallel projections."""
    def fn(x, w1, w2):
        y = x
        for w in (w1, w2, w2):
            y = collective("gemm_allreduce", y[:, :K] @ w, group, 2)
            for _ in range(between):
                y = y * 1.0001 + 1
        return y

    bf = torch.bfloat16
    return make_fx(fn, tracing_mode="fake")(torch.empty(M, K, dtype=bf), torch.empty(K, N, dtype=bf),
                                            torch.empty(K, N, dtype=bf))


def test_later_sites_rewritten_when_the_gpu_is_ahead(group, host_launched):
    """Alone, each site keeps the baseline (the op's ~0.45 ms host time exposed). In the graph,
    the first site has no GPU work queued before it and stays; the next two find ~0.8-1 ms
    queued and are rewritten -- through the pipeline, as a compiled model would be."""
    gm = _chain(group, between=1)
    alone = decide(find(gm.graph), config.current(), predictor.load_profile("h200"))
    assert [d.template for d in alone] == ["baseline"] * 3
    with config.patch(profile="h200"):
        record = run_on_graph(gm.graph, config.current())
    assert [s.template for s in record.sites] == ["baseline", "p2p_ring", "p2p_ring"], [s.reason for s in record.sites]
    assert "would not hide the op's" in record.sites[0].reason
    assert all("host-launched graph" in s.reason and "queued before it" in s.reason for s in record.sites[1:])
    assert "p2p_ring" in record.after


def test_host_bound_graph_keeps_the_baseline(group, host_launched):
    """60 pointwise pairs after each site: 2.6 ms of launches, more than a site's GPU time, so
    the host is never ahead and no op's host time can hide."""
    gm = _chain(group, between=60)
    ds = decide(find(gm.graph), config.current(), predictor.load_profile("h200"), graph=gm.graph)
    assert [d.template for d in ds] == ["baseline"] * 3
    assert all("would not hide" in d.reason for d in ds)


@pytest.mark.parametrize("why", ["cuda_graph", "host_pacing_off", "forced_baseline"])
def test_pacing_leaves_decisions_alone(group, why):
    """Under CUDA graphs there is no host time to hide; host_pacing=False and force_template
    turn it off: decisions equal the per-site ones."""
    from torch._inductor import config as ic

    gm = _chain(group, between=1)
    matches = find(gm.graph)
    prof = predictor.load_profile("h200")
    patch = {"host_pacing": False} if why == "host_pacing_off" else (
        {"force_template": "baseline"} if why == "forced_baseline" else {})
    with ic.patch({"triton.cudagraphs": why == "cuda_graph"}), config.patch(**patch):
        alone = decide(matches, config.current(), prof)
        paced = decide(matches, config.current(), prof, graph=gm.graph)
    assert [(d.template, d.config, d.reason) for d in paced] == [(d.template, d.config, d.reason) for d in alone]
    if why == "host_pacing_off":  # the same options with pacing on do rewrite: the switch matters
        with ic.patch({"triton.cudagraphs": False}):
            assert any(d.rewrites for d in decide(matches, config.current(), prof, graph=gm.graph))


def test_two_clock_simulation_by_hand():
    """launch 0.1; site A (baseline: GPU 1.0, host 0.05); launch 0.1; site B (op: GPU 0.5, host
    0.4). A: lead 0, gpu = 0.1 + 1.0 + 0.05 = 1.15, host 0.15. Launch: host 0.25, gpu 1.15.
    B: lead 0.9 >= 0.4, gpu = 1.15 + 0.5 = 1.65, host 0.65. End 1.65. With B's host time 1.2:
    gpu = 1.15 + 0.5 + 0.3 = 1.95, host 1.45: end 1.95."""
    a = host_pacing._Site(0, Candidate("baseline", None, 1.05, host_ms=0.05), [])
    b = host_pacing._Site(1, Candidate("baseline", None, 0.55, host_ms=0.05), [])
    op = Candidate("p2p_ring", {}, 0.9, host_ms=0.4)
    slow_op = Candidate("p2p_ring", {}, 1.7, host_ms=1.2)
    steps = [0.1, a, 0.1, b]
    end, leads = host_pacing._simulate(steps, {id(a): a.baseline, id(b): op})
    assert end == pytest.approx(1.65) and leads[id(a)] == 0.0 and leads[id(b)] == pytest.approx(0.9)
    end, _ = host_pacing._simulate(steps, {id(a): a.baseline, id(b): slow_op})
    assert end == pytest.approx(1.95)


def test_option_is_validated():
    with pytest.raises(ValueError, match="host_pacing"):
        config.Options(host_pacing="yes")
    assert config._coerce("host_pacing", "off") is False


def test_clocks_recorded_and_drawn(group, host_launched, tmp_path):
    """Every site of a host-launched graph carries its simulated clocks into the report (the
    first site has no lead, a rewritten one hides its host time behind its lead), and the
    report draws them."""
    from overlap_compile import Report

    gm = _chain(group, between=1)
    with config.patch(profile="h200"):
        record = run_on_graph(gm.graph, config.current())
    clocks = [s.host_clock for s in record.sites]
    assert all(c is not None for c in clocks)
    assert clocks[0]["lead"] == 0.0 and clocks[1]["lead"] > 0
    rewritten = record.sites[1]
    assert rewritten.rewritten and clocks[1]["host_end"] - clocks[1]["host_start"] <= clocks[1]["lead"]
    assert all(a["gpu_end"] <= b["gpu_start"] + 1e-9 for a, b in zip(clocks, clocks[1:]))  # in graph order
    rep = Report()
    rep.add(record)
    rep.dump(str(tmp_path))
    png = tmp_path / f"host_clocks_{record.name}.png"
    assert png.exists() and png.stat().st_size > 1000


def test_lighter_op_chosen_where_the_fastest_cannot_hide_its_host_time(host_launched):
    """Site B (GPU 0.55 ms as written) after site A (1.0 ms) and two launches: ~0.96 ms queued.
    'fast' (GPU 0.3 ms, host 1.5 ms) would end the graph at 1.89 ms, 'light' (GPU 0.4 ms, host
    0.3 ms) at 1.45 ms, the baseline at 1.6 ms: 'light' is taken, though 'fast' is faster on the GPU."""
    import dataclasses
    import torch.fx as fx

    from overlap_compile.passes.decide import Decision

    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.mm.default, (x, x))
    r = g.call_function(torch.ops.aten.relu.default, (a,))
    r = g.call_function(torch.ops.aten.relu.default, (r,))
    b = g.call_function(torch.ops.aten.mm.default, (r, r))
    g.output(b)

    @dataclasses.dataclass
    class Site:
        node: fx.Node
        unsupported: None = None

        def anchor(self):
            return self.node

    class Profile:
        raw = {"model_error": {"cuda_graph": 0.05, "eager": 0.2}}

        @staticmethod
        def launch(mode):
            return 0.02

    base = lambda gpu: Candidate("baseline", None, gpu + 0.05, host_ms=0.05)  # noqa: E731
    da = Decision(Site(a), "baseline", None, "kept", [base(1.0)])
    db = Decision(Site(b), "baseline", None, "kept", [base(0.55), Candidate("fast", {"k": 1}, 1.8, host_ms=1.5),
                                                      Candidate("light", {"k": 2}, 0.7, host_ms=0.3)])
    out = host_pacing.pace(g, [da, db], config.current(), Profile())
    assert out[0].template == "baseline" and out[1].template == "light", out[1].reason
    assert out[1].host_clock["lead"] == pytest.approx(0.96) and out[1].host_clock["gpu_end"] == pytest.approx(1.45)


def test_replayed_ops_cost_less_host_time_than_the_site_so_no_site_waits_for_a_lead(group, host_launched):
    """With runtime.op_graphs (the default) a rewritten site's host time is a fraction of the
    site's own, so even the first site of the chain, with nothing queued before it, is rewritten."""
    gm = _chain(group, between=1)
    with config.patch(profile="h200", op_graphs=True):
        predictor.clear_cache()
        record = run_on_graph(gm.graph, config.current())
    assert [s.template for s in record.sites] == ["p2p_ring"] * 3, [s.reason for s in record.sites]
