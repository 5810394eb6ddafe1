"""tile_fused's latency model (TileLink, MLSys '25). config: block_m, block_n, group_m, comm_ctas;
built from predictor/models.py.

GEMM + reduce-scatter: W stripe GEMMs (peers' first, own last) of ``gemm(M/W) * SMs / (SMs -
comm_ctas) * gemm_slowdown_reserved``; after each peer stripe its push at ``min(copy_engine curve,
comm_ctas * TF_PUSH_GBPS_PER_CTA)`` (an assumed per-CTA rate), serialised on the comm lane; the
tail is the last round of the own stripe's reduce, (W + 1) stripe-sized HBM passes at
``min(mem_gbps, comm_ctas * TF_REDUCE_GBPS_PER_CTA)``; plus ``3 * launch(mode)``.
All-gather + GEMM: ``pipeline(comm_first=True)`` over W stripe pieces, the copy engine pulling
the W-1 peer shards back to back (``copy_engine`` curve, ``launch(mode)`` each) beside the full-grid
GEMM (``gemm_slowdown_reserved``); consumers past the first run after the gather as plain GEMMs.
"""
from __future__ import annotations

from ...predictor.models import (Ctx, Event, Schedule, Site, ag_stage_ms, comm_call_ms, copy_engine_slowdown,
                                 gemm_ms, overlap_bound, peer_sync_ms, pipeline, reduce_scatter_then_gather,
                                 shifted, slowed)
from ...predictor.profile import HardwareProfile
from ...tiling import cdiv

TF_PUSH_GBPS_PER_CTA = 12.0  # NVLink store rate of one push CTA (assumed; calibrate on GPU)
TF_REDUCE_GBPS_PER_CTA = 60.0  # HBM rate of one reduce CTA (assumed; calibrate on GPU)


def tile_fused(site: Site, config: dict, profile: HardwareProfile, ctx: Ctx) -> Schedule | None:
    if site.kind == "gemm_allreduce":
        return tile_fused_allreduce(site, config, profile, ctx)
    if site.kind not in ("gemm_reducescatter", "allgather_gemm"):
        return None
    W = site.world
    g_base, c_base = gemm_ms(site, profile), comm_call_ms(site, profile, site.coll_bytes(), ctx, launch=False)
    rows = max(1, site.m // W)
    slow = profile.contention["gemm_slowdown_reserved"]
    launch = profile.launch(ctx.mode)
    if site.kind == "allgather_gemm":
        # as p2p_ring's copy-engine all-gather: the shard staged, a barrier, then the pulls, each
        # stripe's GEMM beside the next pull (copy engines: gemm_slowdown_copy_engine)
        first = site.gemms[0]
        piece = profile.gemm.ms(rows, first[1], first[2], site.dtype)
        rest = sum(profile.gemm.ms(m, n, k, site.dtype) for m, n, k in site.gemms[1:])
        shard = rows * site.k * site.itemsize
        xfer = profile.comm_ms("copy_engine", shard, W, site.cross_node) + launch
        comm: list[float | None] = [None] + [xfer] * (W - 1)
        compute = [slowed(piece, xfer if i + 1 < W else 0.0, copy_engine_slowdown(profile)) for i in range(W)]
        head = ag_stage_ms(site, profile) + peer_sync_ms(profile)
        end, events = pipeline(compute, comm, comm_first=True,
                               compute_labels=[f"GEMM rows of rank r+{i}" for i in range(W)],
                               comm_labels=[""] + [f"pull shard r+{i}" for i in range(1, W)])
        events = shifted(events, head, "stage shard + barrier")
        end += head
        if rest:
            events.append(Event("compute", "other consumers", end, end + rest))
            end += rest
        note = f"{W} stripes of {rows} rows: GEMM {piece:.4f} ms, copy-engine pull {xfer:.4f} ms each"
        return Schedule(end, events, overlap_bound(g_base, c_base, piece, xfer), note)
    ctas = max(1, int(config.get("comm_ctas", 8)))
    sms = max(2, profile.sm_count)
    share = sms / max(1, sms - ctas)
    piece = gemm_ms(site, profile, m=rows) * share * slow
    stripe = rows * site.n * site.itemsize
    # A push is bounded by the copy engines' peer bandwidth and by what comm_ctas CTAs can store.
    push = max(profile.comm_ms("copy_engine", stripe, W, site.cross_node),
               stripe / (ctas * TF_PUSH_GBPS_PER_CTA * 1e6))
    gbps = stripe / (push * 1e6)
    bm, bn = int(config.get("block_m", 128)), int(config.get("block_n", 128))
    tiles = max(1, cdiv(rows, bm) * cdiv(site.n, bn))
    reduce_all = (W + 1) * stripe / (min(profile.gemm.mem_gbps, ctas * TF_REDUCE_GBPS_PER_CTA) * 1e6)
    # The reduce follows the own stripe's tiles as they finish: only its last round (comm_ctas
    # tiles in parallel) trails the GEMM.
    tail = reduce_all * min(1.0, ctas / tiles) + 3 * launch
    comm = [push] * (W - 1) + [None]
    end, events = pipeline([piece] * W, comm, comm_first=False, tail=tail,
                           compute_labels=[f"GEMM stripe r+{i + 1}" for i in range(W)],
                           comm_labels=[f"push to r+{i + 1}" for i in range(W)])
    note = (f"{W} stripes of {rows} rows on {sms - ctas} SMs: GEMM {piece:.4f} ms, push {push:.4f} ms "
            f"({gbps:.0f} GB/s from {ctas} CTAs) each")
    return Schedule(end, events, overlap_bound(g_base, c_base, piece, 0.0), note)


def tile_fused_allreduce(site: Site, config: dict, profile: HardwareProfile, ctx: Ctx) -> Schedule | None:
    """All-reduce = tile_fused's reduce-scatter over W row stripes, whose reduce CTAs also push
    every reduced tile to the W-1 peers, then the gather kernel copying the peers' tiles into the
    output. The own stripe is the GEMM's last, so both trail it with nothing to hide them: W-1
    pushes of a stripe from comm_ctas CTAs (or the peer bandwidth), and a read + write of the
    W-1 received stripes by up to every SM."""
    W = site.world
    ctas = max(1, int(config.get("comm_ctas", 8)))
    stripe = (site.m // W) * site.n * site.itemsize
    push = (W - 1) * max(profile.comm_ms("copy_engine", stripe, W, site.cross_node),
                         stripe / (ctas * TF_PUSH_GBPS_PER_CTA * 1e6))
    # the gather kernel runs after the GEMM on up to every SM (kernels.gather_grid)
    gather_ctas = max(ctas, profile.sm_count)
    copy_out = 2 * (W - 1) * stripe / (min(profile.gemm.mem_gbps, gather_ctas * TF_REDUCE_GBPS_PER_CTA) * 1e6)
    return reduce_scatter_then_gather(tile_fused, site, config, profile, ctx, push + copy_out + profile.launch(ctx.mode),
                                      f"push reduced tiles to {W - 1} peers, copy theirs out",
                                      "the reduced stripe pushed and the peers' copied out")


MODEL = tile_fused
# Every configuration pushes tiles into the peers' memory: it needs all ranks of the group on one
# node with peer access (a config with "transport": "nccl" would not).
PEER_ONLY = True
