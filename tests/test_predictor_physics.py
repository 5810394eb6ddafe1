"""CPU tests of the physical terms the latency models gained with the 2x/4x H200 replay: partial
contention beside a transfer, M-slices of a GEMM, copy-engine local passes and handshake, host
cost per call when host-launched."""
import copy
import dataclasses

import pytest

from overlap_compile import predictor
from overlap_compile.predictor import models
from overlap_compile.predictor.models import Ctx, Site
from overlap_compile.predictor.profile import profile_from_dict
from overlap_compile.templates.moe_fused import model as moe_model
from overlap_compile.templates.p2p_ring import model as ring_model
from overlap_compile.templates.priority_stream import model as ps_model
from overlap_compile.templates.signal_reorder import model as sr_model


def h200(**extra):
    p = predictor.load_profile("h200")
    raw = copy.deepcopy(p.raw)
    for key, value in extra.items():
        if key == "contention":
            raw["contention"].update(value)
        else:
            raw[key] = value
    return profile_from_dict(raw, source="test")


def test_slowed_only_while_the_transfer_lasts():
    assert models.slowed(1.0, 0.0, 1.5) == 1.0  # alone
    assert models.slowed(1.0, 2.0, 1.5) == pytest.approx(1.5)  # beside it throughout
    # 0.5 ms beside the transfer at 1/1.5 speed (1/3 of the work), the other 2/3 at full speed
    assert models.slowed(1.0, 0.5, 1.5) == pytest.approx(0.5 + 2 / 3)
    assert models.slowed(1.0, 0.5, 1.0) == 1.0


def test_row_slices_of_a_gemm_add_up_to_the_gemm():
    p = h200()
    site = Site("gemm_alltoall", ((16384, 4096, 4096),), 2, "bfloat16")
    whole = models.gemm_ms(site, p)
    # W slices take the whole GEMM's time and a kernel's fixed cost (the GEMM floor) per extra slice
    for pieces in (2, 4, 8):
        assert pieces * models.slice_ms(site, p, 16384 // pieces) == pytest.approx(whole + (pieces - 1) * p.gemm.floor_ms)
    assert models.slice_ms(site, p, 16384) == pytest.approx(whole)
    assert models.slice_ms(site, p, 1) >= p.gemm.floor_ms
    # a narrow GEMM's slices are not priced at their own wave quantisation (one 128x256 tile row
    # per slice): on one H200 eight slices of 8192x512x4096 took 1.83x the whole, not 8x
    narrow = Site("allgather_gemm", ((8192, 512, 4096),), 8, "bfloat16")
    assert 8 * models.slice_ms(narrow, p, 1024) < 2 * models.gemm_ms(narrow, p)


def test_slice_prices_follow_the_measured_pieces():
    """benchmarks/diagnostics/split_gemm.py on one H200: cuBLAS run as 2, 4 and 8 row pieces back to
    back (CUDA graphs) against the whole GEMM, over shapes.json's GEMMs and the Llama blocks' sites.
    The models' price of the pieces (slice_ms) follows the measured ratio: within 6% on average and
    30% at worst (the wave-quantised price it replaced: 21% and 400%)."""
    import json
    import os
    import statistics

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                        "split_gemm-NVIDIA_H200-w1-torch2.11.0-2026-11-29.json")
    with open(path) as f:
        rows = [r for r in json.load(f) if r["mode"] == "cuda_graph"]
    whole = {tuple(r["shape"]): r["ms"] for r in rows if r["pieces"] == 1}
    p = h200()
    errors = []
    for r in rows:
        if r["pieces"] == 1:
            continue
        m, n, k = r["shape"]
        site = Site("allgather_gemm", ((m, n, k),), r["pieces"], "bfloat16")
        priced = r["pieces"] * models.slice_ms(site, p, m // r["pieces"]) / models.gemm_ms(site, p)
        errors.append(priced / (r["ms"] / whole[(m, n, k)]) - 1)
    assert len(errors) >= 100
    assert statistics.mean(abs(e) for e in errors) < 0.06 and max(abs(e) for e in errors) < 0.30, errors


def test_copy_engine_all_to_all_is_gemm_bound_plus_placement_and_handshake():
    """W=2 copy-engine all-to-all: both halves' GEMMs back to back (the copy takes no SMs), then
    the received block copied into place (read + write) and one flag handshake."""
    p = h200(contention={"gemm_slowdown_copy_engine": 1.0}, peer_sync_ms=0.01)
    site = Site("gemm_alltoall", ((16384, 4096, 4096),), 2, "bfloat16")
    s = ring_model.p2p_ring(site, {"slices": 1, "bidirectional": False, "transport": "p2p"}, p, Ctx(mode="cuda_graph"))
    half = models.slice_ms(site, p, 8192)
    place = 2 * 8192 * 4096 * 2 / (models.copy_gbps(p) * 1e9) * 1e3  # a copy kernel's bandwidth
    assert s.total_ms == pytest.approx(2 * half + place + 0.01)
    slower = h200(contention={"gemm_slowdown_copy_engine": 1.1}, peer_sync_ms=0.01)
    assert ring_model.p2p_ring(site, {"slices": 1, "bidirectional": False, "transport": "p2p"}, slower,
                           Ctx(mode="cuda_graph")).total_ms > s.total_ms
    # without the measured quantity a profile keeps the older behaviour (gemm_slowdown_reserved)
    old = dataclasses.replace(p, raw={k: v for k, v in p.raw.items() if k != "peer_sync_ms"})
    assert models.peer_sync_ms(old) == 0.0


def test_copy_engine_all_gather_waits_for_the_slots_only():
    """p2p_ring's copy-engine all-gather pushes the shard from where it lies (kernels.run_allgather):
    the one handshake (peer_sync_ms) comes before everything, no staging copy of the shard."""
    p = h200(peer_sync_ms=0.02)
    site = Site("allgather_gemm", ((8192, 3584, 4096),), 2, "bfloat16")
    s = ring_model.p2p_ring(site, {"slices": 1, "bidirectional": False, "transport": "p2p"}, p, Ctx(mode="cuda_graph"))
    head = s.events[0]
    assert head.label == "peer handshake" and head.start == 0.0
    assert head.end == pytest.approx(0.02)
    assert min(e.start for e in s.events[1:]) == pytest.approx(head.end)  # nothing before it


def test_reduce_scatter_sum_traffic():
    # W=2: read the own partial and the arrival, write the result (sum_kernel.py, one pass)
    assert ring_model.rs_accumulate_bytes(2, 2) == 6
    # W=4: the first early arrival widened to fp32 (2 + 4), one more added (8 + 2), then the
    # one pass also reads the fp32 sum (3 * 2 + 4)
    assert ring_model.rs_accumulate_bytes(4, 2) == 6 + 10 + 10


def test_host_cost_per_call_and_site_latency():
    p = h200(op_overhead_ms={"eager": 0.5, "cuda_graph": 0.0, "per_template": {"priority_stream": 0.3},
                             "per_call": {"eager": 0.05, "cuda_graph": 0.0},
                             "site": {"eager": 0.04, "cuda_graph": 0.0}})
    assert predictor.op_overhead_ms(p, "priority_stream", "eager", calls=4) == pytest.approx(0.3 + 3 * 0.05)
    assert predictor.op_overhead_ms(p, "priority_stream", "eager") == pytest.approx(0.3)
    assert predictor.op_overhead_ms(p, "priority_stream", "cuda_graph", calls=4) == 0.0
    assert predictor.site_host_ms(p, "eager") == 0.04 and predictor.site_host_ms(p, "cuda_graph") == 0.0
    site = Site("gemm_allreduce", ((8192, 8192, 4096),), 4, "bfloat16")
    sched = ps_model.priority_stream(site, {"chunks": 4}, p, Ctx(mode="eager"))
    assert predictor.host_calls(sched) == 4  # one collective call per chunk


def test_priority_stream_places_chunked_all_to_all_on_the_comm_stream():
    p = h200()
    site = Site("gemm_alltoall", ((8192, 4096, 2048),), 4, "bfloat16")
    assert ps_model.ps_place_ms(site, p, 1) == 0.0
    assert ps_model.ps_place_ms(site, p, 4) == pytest.approx(2 * 8192 * 4096 * 2 / 4 / (models.copy_gbps(p) * 1e9) * 1e3)
    assert ps_model.ps_place_ms(Site("gemm_allreduce", ((8192, 4096, 2048),), 4, "bfloat16"), p, 4) == 0.0


def test_nccl_call_startup_beyond_the_curve_and_the_launch_gap():
    """nccl_call_ms: each further NCCL call pays the start-up latency its curve's back-to-back
    small-message time does not hold, hidden behind a longer host launch gap; not the first call,
    not copy-engine copies; absent (the built-in h200 today) it changes nothing."""
    site = Site("gemm_allreduce", ((8192, 8192, 4096),), 2, "bfloat16")
    graph, eager = Ctx(mode="cuda_graph"), Ctx(mode="eager")
    off, on = h200(), h200(nccl_call_ms=0.04)
    nbytes = 16 * 2**20
    alpha = on.comm_ms("all_reduce", 0, 2)
    assert models.nccl_call_ms(site, off, "all_reduce") == 0.0
    assert models.nccl_call_ms(site, on, "all_reduce") == pytest.approx(0.04 - alpha)
    assert models.nccl_call_ms(site, on, "copy_engine") == 0.0
    base = models.comm_call_ms(site, off, nbytes, graph)
    assert models.comm_call_ms(site, on, nbytes, graph) == pytest.approx(base - off.launch("cuda_graph") + 0.04 - alpha)
    assert models.comm_call_ms(site, on, nbytes, graph, launch=False) == models.comm_call_ms(site, off, nbytes, graph,
                                                                                             launch=False)
    # host-launched: the start-up runs during the launch gap, the larger of the two counts
    assert models.comm_call_ms(site, on, nbytes, eager) == pytest.approx(
        models.comm_call_ms(site, off, nbytes, eager) - off.launch("eager") + max(off.launch("eager"), 0.04 - alpha))
    # signal_reorder: one group issues one call (nothing changes); several groups pay it where
    # the comm lane is the critical path
    cfg = {"block_m": 128, "block_n": 256, "group_m": 8, "programs": 108}
    grow = [sr_model.signal_reorder(site, c, on, graph).total_ms - sr_model.signal_reorder(site, c, off, graph).total_ms
            for c in (dict(cfg, wave_groups=[19]), dict(cfg, wave_groups=[2, 2, 3, 3, 3, 3, 3]))]
    assert grow[0] == 0.0 and grow[1] > 0.0


@pytest.mark.parametrize("world", [2, 4])
def test_p2p_ring_allreduce_is_its_reduce_scatter_then_the_gather(world):
    """All-reduce = the ring reduce-scatter over W row stripes, then W-1 reduced stripes moved
    with nothing to hide them (and, on the copy engine, the own stripe staged + one handshake)."""
    p = h200()
    ce = {"slices": 1, "bidirectional": False, "transport": "p2p"}
    ar = Site("gemm_allreduce", ((8192, 8192, 4096),), world, "bfloat16")
    rs = ring_model.p2p_ring(dataclasses.replace(ar, kind="gemm_reducescatter"), ce, p, Ctx(mode="cuda_graph"))
    s = ring_model.p2p_ring(ar, ce, p, Ctx(mode="cuda_graph"))
    stripe = 8192 // world * 8192 * 2
    hop = models.comm_call_ms(ar, p, stripe, Ctx(mode="cuda_graph"), collective="copy_engine", contended=False)
    stage = models.hbm_ms(p, 2 * stripe) + models.peer_sync_ms(p)
    assert s.total_ms == pytest.approx(rs.total_ms + (world - 1) * hop + stage)
    assert s.events[-1].lane == "comm" and s.events[-1].start == pytest.approx(rs.total_ms)
    assert ring_model.p2p_ring(Site("gemm_allreduce", ((8191, 8192, 4096),), world, "bfloat16"), ce, p, Ctx()) is None


def test_signal_reorder_search_stays_fast_with_thousands_of_waves():
    """A CPU profile's few "SMs" give a GPU-sized GEMM thousands of waves; the O(groups x
    waves^2) search then runs on units of several waves (it ran for many minutes before) and
    every partition still covers every wave exactly once."""
    import time

    p = predictor.load_profile("cpu-gloo")
    site = Site("gemm_allreduce", ((8192, 8192, 4096),), 4, "float32")
    start = time.monotonic()
    configs = sr_model.signal_reorder_configs(site, p, Ctx())
    assert time.monotonic() - start < 10 and configs
    for cfg in configs:
        geo = sr_model.sr_geometry(site, cfg, p)
        assert sum(cfg["wave_groups"]) == geo.waves and min(cfg["wave_groups"]) >= 1, cfg
    assert any(sr_model.sr_geometry(site, c, p).waves > sr_model.MAX_SEARCHED_WAVES for c in configs)
    # a coarse partition of 1000 waves in units of 8: first/last one unit, the rest in between
    assert all(sum(g) == 1000 for g in sr_model.coarse_partitions(1000, 1.0, lambda lo, hi, last: 0.1, 2, 4))


def test_moe_copy_engine_pipeline_hides_the_transfers_behind_the_experts():
    """moe_fused over the copy engine at W = 2: stage + the own first half (the pull runs beside
    it) + the peer piece + the own second half (the push runs beside it) + placing the returned
    piece; the NCCL pipeline pays its all-to-alls with contention and comes out slower."""
    p = h200()
    E, C, H, F = 4, 1024, 4096, 14336
    m = E * 2 * C
    site = Site("moe", ((m, F, H), (m, F, H), (m, H, F)), 2, "bfloat16")
    ctx = Ctx(mode="cuda_graph")
    ce = moe_model.moe_fused(site, {"split": "source", "transport": "p2p"}, p, ctx)
    piece = site.coll_bytes() / 2
    xfer = models.comm_call_ms(site, p, piece, ctx, collective="copy_engine")
    e_piece = models.slice_ms(site, p, m // 2)
    stage = models.hbm_ms(p, 2 * piece) + models.peer_sync_ms(p)
    slow = models.copy_engine_slowdown(p)
    own0 = models.slowed(e_piece / 2, xfer, slow)  # the pull runs beside it (experts >> pull here)
    want = stage + own0 + e_piece + e_piece / 2 + models.hbm_ms(p, 2 * piece)
    assert xfer < e_piece / 2  # so the push hides behind the own second half
    assert ce.total_ms == pytest.approx(want)
    labels = [e.label for e in ce.events]
    assert labels.index("pull 1") < labels.index("experts 1") < labels.index("push 1")
    nccl = moe_model.moe_fused(site, {"split": "source"}, p, ctx)
    base = models.baseline(site, p, ctx)
    assert ce.total_ms < base.total_ms < nccl.total_ms


def test_moe_fused_expert_kernel_is_priced_only_once_measured():
    """``"experts": "fused"``: no prediction without the profile's measured kernel/bmm ratio;
    with it, the experts scale by the ratio, after the own tokens' local copy, in the kernel's
    tile order: own first half, the peer piece, own second half behind the last push."""
    E, C, H, F = 4, 2560, 2048, 1536
    m = E * 2 * C
    site = Site("moe", ((m, F, H), (m, F, H), (m, H, F)), 2, "bfloat16")
    ctx = Ctx(mode="cuda_graph")
    cfg = {"split": "source", "transport": "p2p", "experts": "fused"}
    assert moe_model.moe_fused(site, cfg, h200(moe={}), ctx) is None  # not measured
    fast, slow = h200(moe={"expert_kernel_vs_bmm": 0.8}), h200(moe={"expert_kernel_vs_bmm": 1.2})
    t_fast, t_slow = moe_model.moe_fused(site, cfg, fast, ctx), moe_model.moe_fused(site, cfg, slow, ctx)
    assert t_fast.total_ms < t_slow.total_ms
    labels = [e.label for e in t_fast.events]
    assert (labels.index("experts own[0] (fused kernel)") < labels.index("experts 1") < labels.index("push 1")
            < labels.index("experts own[1]"))
    push = next(e for e in t_fast.events if e.label == "push 1")
    own_last = next(e for e in t_fast.events if e.label == "experts own[1]")
    assert own_last.start < push.end  # the own second half runs beside the last push
    bmm = moe_model.moe_fused(site, {"split": "source", "transport": "p2p"}, fast, ctx)
    own_copy = models.hbm_ms(fast, 2 * site.coll_bytes() / 2)
    kernel_first, bmm_first = (next(e for e in s.events if e.label.startswith("experts own[0]")) for s in (t_fast, bmm))
    assert kernel_first.start == pytest.approx(bmm_first.start + own_copy)  # the kernel's local copy
    # skip_padding: the scan of the padding first, then the kernel's GEMMs scaled by the fill
    skewed = h200(moe={"expert_kernel_vs_bmm": 0.8, "routed_fill": 0.25})
    plain = moe_model.moe_fused(site, cfg, skewed, ctx)
    skipping = moe_model.moe_fused(site, {**cfg, "skip_padding": True}, skewed, ctx)
    assert skipping.events[0].label == "stage peer slots + sizes scan + handshake"
    assert skipping.events[0].end > plain.events[0].end
    experts = [e for e in skipping.events if e.label.startswith("experts")]
    plain_experts = [e for e in plain.events if e.label.startswith("experts")]
    assert sum(e.end - e.start for e in experts) < 0.5 * sum(e.end - e.start for e in plain_experts)


def test_a_training_sections_saved_intermediates_are_charged():
    """A training MoE section's rewrite also hands out what backward saves. Pieces by source (NCCL
    or the copy engine, bmm experts) copy out the experts' input, one read and one write of it,
    and write gate, up and act in place; capacity pieces copy them all; the kernel path writes
    them all in place, at most one write."""
    p = h200()
    E, C, H, F = 4, 1024, 4096, 2048
    m = E * 2 * C
    site = Site("moe", ((m, F, H), (m, F, H), (m, H, F)), 2, "bfloat16")
    saving = dataclasses.replace(site, saved_bytes=m * (H + 3 * F) * 2, saved_copy_bytes=m * H * 2)
    ctx = Ctx(mode="cuda_graph")
    for cfg, copied in (({"split": "source"}, saving.saved_copy_bytes), ({"pieces": 2}, saving.saved_bytes),
                        ({"split": "source", "transport": "p2p"}, saving.saved_copy_bytes)):
        extra = moe_model.moe_fused(saving, cfg, p, ctx).total_ms - moe_model.moe_fused(site, cfg, p, ctx).total_ms
        assert extra == pytest.approx(models.hbm_ms(p, 2 * copied)), cfg
    # the persistent expert kernel stores them where backward reads them: one write at most
    measured = h200(moe={"expert_kernel_vs_bmm": 1.0})
    fused = {"split": "source", "transport": "p2p", "experts": "fused"}
    extra = moe_model.moe_fused(saving, fused, measured, ctx).total_ms - moe_model.moe_fused(site, fused, measured, ctx).total_ms
    assert extra == pytest.approx(models.hbm_ms(measured, saving.saved_bytes))


def test_copy_engine_all_reduce_chunk_pipeline():
    """p2p_ring's all-reduce in c row chunks (model.p2p_ring_allreduce_chunked): every chunk's
    partials for the peer are computed and pushed first, then each chunk's own stripe is summed
    (after its partials landed) and its reduced stripe travels while the next chunk's GEMM runs,
    so on a communication-heavy all-reduce 4 chunks end earlier than the whole (whose gather
    trails the GEMM); only the copy engine has it, and rows that do not split into W * c stripes
    get no schedule."""
    p = h200(contention={"gemm_slowdown_copy_engine": 1.02}, peer_sync_ms=0.01)
    site = Site("gemm_allreduce", ((16384, 16384, 2048),), 2, "bfloat16")
    ctx = Ctx(mode="cuda_graph")
    cfg = {"slices": 1, "bidirectional": False, "transport": "p2p"}
    whole = ring_model.p2p_ring(site, cfg, p, ctx)
    four = ring_model.p2p_ring(site, {**cfg, "chunks": 4}, p, ctx)
    assert four.total_ms < whole.total_ms
    ev = {e.label: e for e in four.events}
    assert ev["push reduced 0"].start < ev["GEMM + sum chunk 1"].end  # the gather hides behind chunk 1
    assert ev["copy out chunk 3"].end == pytest.approx(four.total_ms)  # the last chunk's gather trails
    assert ev["GEMM chunk 3 stripe 0"].end <= ev["GEMM + sum chunk 0"].start + 1e-12  # phase 1 first
    for i in range(4):  # a chunk is summed only once its partials are in
        assert ev[f"GEMM + sum chunk {i}"].start >= ev[f"push partial {i}.0"].end - 1e-12
    gemms = [e for e in four.events if e.label.startswith("GEMM")]
    assert len(gemms) == 4 * 2 and all(a.end <= b.start + 1e-12 for a, b in zip(gemms, gemms[1:]))
    assert ring_model.p2p_ring(site, {**cfg, "transport": "nccl", "chunks": 4}, p, ctx) is None
    odd = Site("gemm_allreduce", ((16384 + 2, 16384, 2048),), 2, "bfloat16")
    assert ring_model.p2p_ring(odd, {**cfg, "chunks": 4}, p, ctx) is None
