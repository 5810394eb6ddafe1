"""passes/settle.py: a site whose decision lies within the model's error (kept as written with a
predicted gain within the error of min_speedup, or rewritten with a rival template predicted
within the error) is timed on its group and decided by the measured gain. Sites decided under the
built-in H200 profile on a fake 2-rank group; the timings come from ``exhaustive.set_measure``
(on a CPU machine nothing else can time a GPU), including the committed 2x H200 measurements."""
import glob
import json
import math
import os

import pytest

from overlap_compile import config, predictor
from overlap_compile.passes import settle
from overlap_compile.passes.decide import decide
from overlap_compile.passes.decision import required_gain
from overlap_compile.predictor import exhaustive
from overlap_compile.testing.fake_group import fake_process_group
from overlap_compile.testing.patterns import traced_site

# under the h200 profile at W=2 in the CUDA-graph launch mode: inside the band (predicted
# 1.10x, bar 1.125x) and well above it (predicted 1.40x)
IN_BAND = ("gemm_reducescatter", 8192, 4096, 14336)
CLEAR = ("gemm_reducescatter", 8192, 4096, 2752)
# host-launched (eager) under the h200 profile at W=2: predicted 1.16x, under the bar 1.22x
EAGER_IN_BAND = ("gemm_reducescatter", 8192, 8192, 7168)


@pytest.fixture(autouse=True)
def graphs_captured():
    from torch._inductor import config as ic

    settle.clear_cache()
    predictor.clear_cache()
    with ic.patch({"triton.cudagraphs": True}), fake_process_group(2):
        yield
    exhaustive.set_measure(None)
    settle.clear_cache()


@pytest.fixture
def h200():
    return predictor.load_profile("h200")


def _timings(gains: dict):
    """A measure hook: the site as written 1.0 ms, a rewrite 1/gain ms (gain by the site's kind
    and shape); every call recorded."""
    calls = []

    def measure(template, match, cfg, options):
        calls.append((template, match.signature()))
        if template == "baseline":
            return 1.0
        return 1.0 / gains[match.signature()]

    exhaustive.set_measure(measure)
    return calls


def test_in_band_site_measured_faster_is_rewritten(h200):
    site = traced_site(*IN_BAND, 2)
    (before,) = decide([site], config.current(), h200)
    assert before.template == "baseline" and before.measured["note"].startswith("within the model error")
    settle.clear_cache()
    calls = _timings({site.signature(): 1.15})
    (d,) = decide([site], config.current(), h200)
    assert d.template == "p2p_ring", d.reason
    assert "measured on the group: p2p_ring 1.15x" in d.reason and "under the bar" in d.reason
    assert d.measured["settled"] and d.measured["measured_gain"] == pytest.approx(1.15)
    assert d.measured["predicted_gain"] < required_gain(config.current(), h200)
    assert calls[0][0] == "baseline" and "p2p_ring" in [t for t, _ in calls]


def test_the_fastest_measured_template_wins_over_the_predicted_best(h200):
    """AR 2048x8192x8192 at W=2 (in the band): p2p_ring and priority_stream are both timed, each at
    its best predicted configuration; the one predicted second measures fastest (on 2x H200 the
    predicted order and the measured one disagreed on this site) and is taken."""
    site = traced_site("gemm_allreduce", 2048, 8192, 8192, 2)
    with config.patch(measure_uncertain=False):
        (predicted,) = decide([site], config.current(), h200)
    ranked = sorted((c for c in predicted.candidates[1:] if c.predicted_ms), key=lambda c: c.predicted_ms)
    first = ranked[0].template
    second = next(c.template for c in ranked if c.template != first)
    assert {first, second} == {"p2p_ring", "priority_stream"}
    exhaustive.set_measure(lambda t, m, c, o: {"baseline": 1.0, second: 1 / 1.137}.get(t, 1 / 1.048))
    (d,) = decide([site], config.current(), h200)
    assert d.template == second and d.measured["measured_gain"] == pytest.approx(1.137)
    assert {"priority_stream", "p2p_ring"} <= set(d.measured["tried"]) and len(d.measured["tried"]) <= settle.MAX_TRIES


def test_in_band_site_measured_slower_stays(h200):
    site = traced_site(*IN_BAND, 2)
    _timings({site.signature(): 0.97})
    (d,) = decide([site], config.current(), h200)
    assert d.template == "baseline"
    assert "measured on the group: p2p_ring 0.97x" in d.reason and d.reason.endswith("kept as written")
    assert d.measured["measured_gain"] == pytest.approx(0.97)


def test_failed_measurement_keeps_the_site(h200):
    site = traced_site(*IN_BAND, 2)
    exhaustive.set_measure(lambda t, m, c, o: 1.0 if t == "baseline" else exhaustive.FAILED_MS)
    (d,) = decide([site], config.current(), h200)
    assert d.template == "baseline" and "failed to run on some rank" in d.reason
    assert d.measured["measured_gain"] is None


def test_only_sites_inside_the_band_are_measured(h200):
    """A site whose predicted gain clears the bar is rewritten without a measurement."""
    band, clear = traced_site(*IN_BAND, 2), traced_site(*CLEAR, 2)
    calls = _timings({band.signature(): 1.2, clear.signature(): 0.5})
    d_band, d_clear = decide([band, clear], config.current(), h200)
    assert d_clear.template == "p2p_ring" and d_clear.measured is None
    assert {sig for _, sig in calls} == {band.signature()}
    assert d_band.template == "p2p_ring"


def test_measured_once_per_site(h200):
    """The same site again (a repeated layer, a recompile) reuses the measurement."""
    calls = _timings({traced_site(*IN_BAND, 2).signature(): 1.2})
    first, _ = decide([traced_site(*IN_BAND, 2), traced_site(*IN_BAND, 2)], config.current(), h200)
    predictor.clear_cache()
    decide([traced_site(*IN_BAND, 2)], config.current(), h200)
    # the site as written (timed before and after the tries) and each try, in one measurement
    assert len(calls) == 2 + len(first.measured["tried"])


@pytest.mark.parametrize("patch", [{"measure_uncertain": False}, {"search": "measure"},
                                   {"force_template": "baseline"}])
def test_off_when_asked_or_another_search_decides(h200, patch):
    calls = _timings({traced_site(*IN_BAND, 2).signature(): 1.2})
    with config.patch(**patch):
        (d,) = decide([traced_site(*IN_BAND, 2)], config.current(), h200)
    assert d.template == "baseline"
    assert not (d.measured or {}).get("settled")
    if patch.get("search") != "measure":  # search="measure" times sites for its report
        assert calls == []


def test_groups_off_the_gpu_are_not_measured(h200):
    """Without a hook, the fake group cannot be timed: the prediction stands and the note says why."""
    (d,) = decide([traced_site(*IN_BAND, 2)], config.current(), h200)
    assert d.template == "baseline" and "not measured" in d.measured["note"]


def test_env_switch(monkeypatch):
    monkeypatch.setenv("OVERLAP_COMPILE_MEASURE_UNCERTAIN", "0")
    assert config.current().measure_uncertain is False
    monkeypatch.setenv("OVERLAP_COMPILE_MEASURE_UNCERTAIN", "maybe")
    with pytest.raises(ValueError, match="measure_uncertain"):
        config.current()


RESULTS = sorted(p for bench in ("ops", "predictor") for p in glob.glob(os.path.join(
    os.path.dirname(__file__), "..", "benchmarks", "results", f"{bench}-NVIDIA_H200-w2-*.json")))


def test_committed_measurements_replayed(h200):
    """The committed 2x H200 CUDA-graph rows as the timings (each method's best run): every site
    of shapes.json's operator sets, decided with and without settling. Settling takes every
    in-band site that measured a win, rewrites none that measured a loss, and raises the
    geomean of what "auto" runs over sequential."""
    if not RESULTS:
        pytest.skip("no 2x H200 ops results committed")
    best: dict = {}
    for r in (r for p in RESULTS for r in json.load(open(p))):
        if r["mode"] == "cuda_graph" and r["ms"] == r["ms"] and r["method"] != "auto" and r.get("correct", True):
            key = (r["kind"], tuple(r["shape"]), r["method"])
            best[key] = min(r["ms"], best.get(key, r["ms"]))
    shapes = json.load(open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "shapes.json")))
    sites = {}
    for kind in ("gemm_allreduce", "gemm_reducescatter", "allgather_gemm", "gemm_alltoall"):
        for shape in shapes[kind]:
            if (kind, tuple(shape), "sequential") in best:
                site = traced_site(kind, *shape, 2)
                sites[site.signature()] = (kind, tuple(shape), site)
    exhaustive.set_measure(lambda t, m, c, o: best[sites[m.signature()][:2] + (
        "sequential" if t == "baseline" else t,)])
    measured = {t for (_, _, t) in best}
    # each shape decided among the templates measured there, as test_decide_measured does
    outcome = {}
    for sig, (kind, shape, site) in sites.items():
        here = tuple(t for t in config.current().templates if (kind, shape, t) in best)
        for on in (False, True):
            with config.patch(templates=here, measure_uncertain=on):
                (d,) = decide([site], config.current(), h200)
            method = "sequential" if d.template == "baseline" else d.template
            assert method in measured
            outcome[(sig, on)] = (d, best[(kind, shape, "sequential")] / best[(kind, shape, method)])
    settled = [outcome[(sig, True)] for sig in sites if (outcome[(sig, True)][0].measured or {}).get("settled")]
    assert len(settled) >= 3, "the committed shapes hold in-band sites"
    for d, speedup in settled:
        assert (d.template != "baseline") == (d.measured["measured_gain"] >= config.current().min_speedup)
        assert d.template == "baseline" or speedup >= 1.0
    geo = {on: math.exp(sum(math.log(outcome[(s, on)][1]) for s in sites) / len(sites)) for on in (False, True)}
    assert geo[True] > geo[False], geo
    assert min(outcome[(s, True)][1] for s in sites) >= min(outcome[(s, False)][1] for s in sites)


@pytest.mark.parametrize("lead,timing", [(None, "idle"), (0.0, "idle"), (0.001, "idle"), (2.0, "queued")])
def test_host_launched_site_is_timed_on_a_busy_gpu_where_the_graph_hides_the_host_time(h200, monkeypatch, lead, timing):
    """Host-launched: where host_pacing's clocks put more GPU work ahead of the site than the op's
    host time, the site and its rewrites are timed issued behind a busy GPU (what the GPU does, as
    in the graph), else from an idle GPU (the host time counts, as at the head of a graph)."""
    import dataclasses

    from torch._inductor import config as ic

    asked = []

    def measure_items(items, match, options, gpu_only=False, queued=False, profile=None):
        asked.append(queued)
        return [1.0] + [1 / 1.1] * (len(items) - 2) + [1.0]  # the site as written first and last

    monkeypatch.setattr(exhaustive, "measure_items", measure_items)
    with ic.patch({"triton.cudagraphs": False}):
        assert predictor.launch_mode() == "eager"
        site = traced_site(*EAGER_IN_BAND, 2)
        with config.patch(measure_uncertain=False):
            (kept,) = decide([site], config.current(), h200)
        assert kept.template == "baseline"
        clock = None if lead is None else {"lead": lead, "host_start": 0.0, "host_end": 0.0, "gpu_start": 0.0,
                                           "gpu_end": 0.0}
        (d,) = settle.settle([dataclasses.replace(kept, host_clock=clock)], config.current(), h200)
    assert asked == [timing == "queued"]
    assert d.measured["timing"] == timing and d.template == "p2p_ring"
    assert ("timed on the GPU with the host ahead" in d.reason) == (timing == "queued")


# host-launched under the h200 profile at W=2: rewritten for a predicted 1.28x, 22% of the op's
# price host time (bar 1.22x x 1.22 = 1.49x); and a rewrite predicted 1.29x with 3% host share
EAGER_SMALL_REWRITE = ("gemm_reducescatter", 4096, 8192, 2048)
EAGER_CLEAR_REWRITE = ("gemm_allreduce", 16384, 8192, 4096)


@pytest.mark.parametrize("measured_gain,kept", [(1.1, True), (0.9, False)])
def test_host_launched_rewrite_within_the_host_share_is_measured(h200, measured_gain, kept):
    """A host-launched rewrite whose predicted gain is under the bar grown by the op's host share
    is measured; it stays only if the measurement clears min_speedup, else the site is left as
    written with the measurement in the reason."""
    from torch._inductor import config as ic

    with ic.patch({"triton.cudagraphs": False}):
        site = traced_site(*EAGER_SMALL_REWRITE, 2)
        with config.patch(measure_uncertain=False):
            (predicted,) = decide([site], config.current(), h200)
        assert predicted.template == "p2p_ring"
        calls = _timings({site.signature(): measured_gain})
        (d,) = decide([site], config.current(), h200)
    # a measurement against the prediction (0.9x where 1.28x was predicted) is taken once more
    assert [t for t, _ in calls] == ["baseline", "p2p_ring", "baseline"] * (1 if kept else 2)
    assert d.measured["settled"] and d.measured["measured_gain"] == pytest.approx(measured_gain)
    assert "host share of its price" in d.reason
    if kept:
        assert (d.template, d.config) == (predicted.template, predicted.config)
    else:
        assert d.template == "baseline" and "< min_speedup" in d.reason and "kept as written" in d.reason


def test_a_single_slow_run_of_a_predicted_rewrite_is_timed_again(h200):
    """Host-launched, a rewrite predicted 1.28x: its first timing reads 0.51x (a run disturbed by a
    late peer, as seen once on 2x H200 in a prefill compile); it is timed again, each item keeps
    its better time, and the rewrite stands on the second run's 1.25x."""
    from torch._inductor import config as ic

    calls = []

    def measure(template, match, cfg, options):
        calls.append(template)
        if template == "baseline":
            return 1.0
        return 1.0 / 0.51 if calls.count(template) == 1 else 1.0 / 1.25

    with ic.patch({"triton.cudagraphs": False}):
        site = traced_site(*EAGER_SMALL_REWRITE, 2)
        exhaustive.set_measure(measure)
        (d,) = decide([site], config.current(), h200)
    assert calls == ["baseline", "p2p_ring", "baseline"] * 2
    assert d.template == "p2p_ring" and d.measured["measured_gain"] == pytest.approx(1.25), d.reason


def test_clear_rewrites_and_captured_graphs_are_not_measured(h200):
    from torch._inductor import config as ic

    calls = _timings({})
    with ic.patch({"triton.cudagraphs": False}):
        (d,) = decide([traced_site(*EAGER_CLEAR_REWRITE, 2)], config.current(), h200)
    assert d.template != "baseline" and d.measured is None and calls == []
    (g,) = decide([traced_site(*EAGER_SMALL_REWRITE, 2)], config.current(), h200)  # CUDA graphs (fixture)
    assert g.template == "p2p_ring" and g.measured is None and calls == []


@pytest.fixture
def h100():
    return predictor.load_profile("h100")


@config.patch(min_speedup=1.15)
def test_site_predicted_just_under_min_speedup_is_measured(h100):
    """RS 8192x4608x9216 at W=2 under the H100 profile in a captured graph, with min_speedup 1.15:
    p2p_ring predicted 1.13x (on 2x H100 it measured 1.13x), under min_speedup but within the
    model error of it. It is timed and rewritten when it measures 1.20x; measured below
    min_speedup it stays as written."""
    site = traced_site("gemm_reducescatter", 8192, 4608, 9216, 2)
    needed = required_gain(config.current(), h100)
    low = config.current().min_speedup ** 2 / needed
    with config.patch(measure_uncertain=False):
        (predicted,) = decide([site], config.current(), h100)
    gain = predicted.candidates[0].predicted_ms / min(c.predicted_ms for c in predicted.candidates[1:] if c.predicted_ms)
    assert predicted.template == "baseline" and low <= gain < config.current().min_speedup, gain
    for measured, want in ((1.20, "p2p_ring"), (1.13, "baseline")):
        settle.clear_cache()
        calls = _timings({site.signature(): measured})
        (d,) = decide([site], config.current(), h100)
        assert d.template == want, d.reason
        assert calls[0][0] == "baseline" and "p2p_ring" in [t for t, _ in calls]
        assert d.measured["settled"] and f"measured on the group: p2p_ring {measured:.2f}x" in d.reason


def test_rewrite_with_a_rival_within_the_model_error_is_measured(h100, monkeypatch):
    """AG 8192x7392x8192 at W=2 under the H100 profile in a captured graph: p2p_ring predicted
    ahead of tile_fused (1.20x and 1.15x), inside the model error of each other; on 2x H100
    tile_fused measured 1.02x and p2p_ring 1.14x. Both are timed and the faster taken; a rewrite
    no other template comes near is not timed (test_only_sites_inside_the_band_are_measured).
    tile_fused's all-gather is offered here as it is once its race loop passed
    (spec.ALLGATHER_RACE_LOOP_PASSED)."""
    from overlap_compile.passes.decision import model_error
    from overlap_compile.templates.tile_fused import spec

    monkeypatch.setattr(spec, "ALLGATHER_RACE_LOOP_PASSED", True)
    site = traced_site("allgather_gemm", 8192, 7392, 8192, 2)
    with config.patch(measure_uncertain=False):
        (predicted,) = decide([site], config.current(), h100)
    best = {t: min(c.predicted_ms for c in predicted.candidates if c.template == t and c.predicted_ms)
            for t in ("p2p_ring", "tile_fused")}
    assert predicted.template == "p2p_ring" and best["tile_fused"] / best["p2p_ring"] < 1 + model_error(h100)
    exhaustive.set_measure(lambda t, m, c, o: {"baseline": 1.0, "p2p_ring": 1 / 1.14, "tile_fused": 1 / 1.02}[t])
    (d,) = decide([site], config.current(), h100)
    assert d.template == "p2p_ring" and d.measured["measured_gain"] == pytest.approx(1.14)
    assert set(d.measured["tried"]) == {"tile_fused", "p2p_ring"} and "model error" in d.reason
    exhaustive.set_measure(lambda t, m, c, o: {"baseline": 1.0, "p2p_ring": 1 / 1.01, "tile_fused": 1 / 1.02}[t])
    settle.clear_cache()
    (lost,) = decide([site], config.current(), h100)  # neither clears min_speedup: as written
    assert lost.template == "baseline" and "kept as written" in lost.reason


def test_configurations_of_one_template_within_the_model_error_are_measured(h100):
    """AR 4096x8192x2048 at W=2 under the H100 profile in a captured graph: p2p_ring's all-reduce
    in 2 chunks is predicted best, 4 chunks within the model error of it; on 2x H100 4 chunks
    measured 1.13x and 2 chunks 1.19x. Both configurations are timed (named apart in ``tried``)
    and the faster taken: here the one predicted best, timed 4 chunks faster the other."""
    from overlap_compile.passes.decision import model_error

    site = traced_site("gemm_allreduce", 4096, 8192, 2048, 2)
    with config.patch(measure_uncertain=False):
        (predicted,) = decide([site], config.current(), h100)
    chunks = {c.config.get("chunks"): c.predicted_ms for c in predicted.candidates
              if c.template == "p2p_ring" and c.predicted_ms and c.config.get("chunks") in (2, 4)}
    assert predicted.template == "p2p_ring" and predicted.config.get("chunks") == 2
    assert chunks[4] / chunks[2] < 1 + model_error(h100)
    for gains, want in (({4: 1.13, 2: 1.19}, 2), ({4: 1.19, 2: 1.13}, 4)):
        settle.clear_cache()
        exhaustive.set_measure(lambda t, m, c, o, gains=gains: 1.0 if t == "baseline" else 1 / gains.get((c or {}).get("chunks"), 1.0))
        (d,) = decide([site], config.current(), h100)
        assert d.template == "p2p_ring" and d.config.get("chunks") == want, d.reason
        # the predicted best is tried under the template's name, the other named apart
        tried = d.measured["tried"]
        assert "p2p_ring" in tried and any(k.startswith("p2p_ring {") and '"chunks":4' in k for k in tried)
        assert d.measured["measured_gain"] == pytest.approx(1.19)
