"""p2p_ring's latency model (CommFuse, arXiv 2604.24013). config: slices, bidirectional, transport
("p2p" | "nccl"), built from predictor/models.py.

RS / A2A: W row chunks (one per destination), each in ``slices`` pieces, the peers' first and the
local one last, each piece sent once done. AG: the local shard's GEMM runs while shards travel;
piece i waits for its shard. Transfers serialise on the comm lane::

    t_x = max(t_p, t_x) + xfer   (RS/A2A)        t_p = max(t_p, t_x) + piece   (AG)

``xfer``: the ``copy_engine`` curve ("p2p"; GEMM slowdown ``gemm_slowdown_copy_engine``) or the
``p2p`` curve x ``comm_slowdown`` ("nccl"; ``gemm_slowdown``) at the piece's bytes (halved when
bidirectional) plus launch. Pieces are slowed only beside a transfer (``slowed``). Copy engine
adds ``peer_sync_ms`` (AG) and the fp32 sums ``rs_accumulate_bytes`` (RS).
"""
from __future__ import annotations

from ...predictor.models import (Ctx, Event, Schedule, Site, comm_call_ms, copy_engine_slowdown, gemm_ms,
                                 hbm_ms, overlap_bound, peer_sync_ms, pipeline, reduce_scatter_then_gather,
                                 shifted, slice_ms, slowed)
from ...predictor.profile import HardwareProfile


def p2p_ring(site: Site, config: dict, profile: HardwareProfile, ctx: Ctx) -> Schedule | None:
    if site.kind == "gemm_allreduce":
        return p2p_ring_allreduce(site, config, profile, ctx)
    if site.kind not in ("gemm_reducescatter", "allgather_gemm", "gemm_alltoall"):
        return None
    W = site.world
    s = max(1, int(config.get("slices", 1)))
    bidir = bool(config.get("bidirectional", False))
    copy_engine = config.get("transport", "nccl") == "p2p"
    curve = "copy_engine" if copy_engine else "p2p"
    # NCCL send/recv kernels take SMs: the GEMM slows by gemm_slowdown and they by comm_slowdown.
    # Copy engines take no SMs: the GEMM barely slows and the copy runs at its curve.
    slow = copy_engine_slowdown(profile) if copy_engine else profile.contention["gemm_slowdown"]
    rows = max(1, site.m // (W * s))
    piece = slice_ms(site, profile, rows)
    width = site.k if site.kind == "allgather_gemm" else site.n
    nbytes = rows * width * site.itemsize / (2 if bidir else 1)
    xfer = comm_call_ms(site, profile, nbytes, ctx, collective=curve, contended=not copy_engine)
    xfer0 = comm_call_ms(site, profile, nbytes, ctx, collective=curve, contended=not copy_engine, launch=False)
    n_remote = (W - 1) * s
    g_base, c_base = gemm_ms(site, profile), comm_call_ms(site, profile, site.coll_bytes(), ctx, launch=False)
    sync = peer_sync_ms(profile) if copy_engine else 0.0
    if site.kind == "allgather_gemm":
        # local shard first (no transfer), then step i's pieces wait for shard i; a piece runs
        # beside the transfer of the next one, the last alone
        comm: list[float | None] = [None] * s + [xfer0] + [xfer] * (n_remote - 1)
        compute = [slowed(piece, xfer if i + 1 < W * s else 0.0, slow) for i in range(W * s)]
        head = sync  # copy engine: the wait for the peers' slots (kernels.run_allgather); no staging
        end, events = pipeline(compute, comm, comm_first=True,
                               compute_labels=[f"GEMM shard {i // s}.{i % s}" for i in range(W * s)],
                               comm_labels=[f"recv {i // s}.{i % s}" if i >= s else "" for i in range(W * s)])
        events = shifted(events, head, "peer handshake")
        first_compute, last_comm = piece, xfer
        end += head
    else:
        # peers' chunks first, each sent once computed; a piece runs beside the previous send
        comm = [xfer0] + [xfer] * (n_remote - 1) + [None] * s
        compute = [slowed(piece, xfer if 0 < i <= n_remote else 0.0, slow) for i in range(W * s)]
        tail = sync + ring_tail_ms(site, profile, rows * s, copy_engine)
        end, events = pipeline(compute, comm, comm_first=False, tail=tail,
                               compute_labels=[f"GEMM chunk {i // s}.{i % s}" for i in range(W * s)],
                               comm_labels=[f"send {i // s}.{i % s}" for i in range(W * s)])
        first_compute, last_comm = piece, 0.0
    note = f"{W}x{s} pieces of {rows} rows: GEMM {piece:.4f} ms, {curve} {xfer:.4f} ms each"
    return Schedule(end, events, overlap_bound(g_base, c_base, first_compute, last_comm), note)


def p2p_ring_allreduce(site: Site, config: dict, profile: HardwareProfile, ctx: Ctx) -> Schedule | None:
    """All-reduce = the ring reduce-scatter over W row stripes of the output, then the W-1
    reduced stripes of the peers brought here with nothing left to hide them: W-1 transfers of
    a stripe, counted one after the other (the copy curve is measured one copy at a time; the
    copies of several peers share this GPU's links), plus, on the copy engine, each received
    stripe copied out of the inbox (read + write) and one handshake."""
    W, copy_engine = site.world, config.get("transport", "nccl") == "p2p"
    if int(config.get("chunks", 1)) > 1:
        return p2p_ring_allreduce_chunked(site, config, profile, ctx)
    stripe_bytes = (site.m // W) * site.n * site.itemsize
    curve = "copy_engine" if copy_engine else "p2p"
    hop = comm_call_ms(site, profile, stripe_bytes, ctx, collective=curve, contended=False)
    gather = (W - 1) * hop + ((hbm_ms(profile, 2 * stripe_bytes) + peer_sync_ms(profile)) if copy_engine else 0.0)
    return reduce_scatter_then_gather(p2p_ring, site, config, profile, ctx, gather,
                                      f"gather {W - 1} reduced stripes", "the reduced stripes gathered")


# A chunk GEMM's ms beyond the whole GEMM's rate, and a bounded wait kernel's ms on the compute
# stream (phase 2 has two per chunk): read off replays by benchmarks/diagnostics/op_timeline.py.
CHUNK_GEMM_MS = 0.003
WAIT_MS = 0.002


def p2p_ring_allreduce_chunked(site: Site, config: dict, profile: HardwareProfile, ctx: Ctx) -> Schedule | None:
    """``"chunks": c`` (kernels.run_allreduce; the reference computes the same chunk by chunk):
    c row chunks in two phases on two lanes. Phase 1: every chunk's peer stripes' GEMMs, each
    partial pushed once computed. Phase 2, per chunk: wait for the peers' partials of the chunk
    (pushed in phase 1), my stripe's GEMM with them added (W = 2: one addmm, the partial copied
    into the output first; W > 2: the GEMM, then the fp32 sums of rs_accumulate_bytes), its
    reduced stripe pushed to every peer, then the previous chunk's reduced stripes waited for and
    copied out of the inbox on the copy lane. After the last chunk: its reduced stripes waited for
    and copied out. The copy lane is one queue (pushes and copy-outs in issue order); GEMMs beside
    it run ``copy_engine_slowdown`` slower. NCCL transport: None (the pipeline is the copy
    engine's)."""
    W, c = site.world, int(config.get("chunks", 1))
    if config.get("transport", "nccl") != "p2p" or site.m % (W * c):
        return None
    stripe_rows = site.m // (W * c)
    stripe_bytes = stripe_rows * site.n * site.itemsize
    hop = comm_call_ms(site, profile, stripe_bytes, ctx, collective="copy_engine", contended=False)
    g = slice_ms(site, profile, stripe_rows) * copy_engine_slowdown(profile) + CHUNK_GEMM_MS
    # W = 2: the partial copied into the output, then read again as C of the addmm; else the sums
    sum_bytes = 3 * stripe_bytes if W == 2 else stripe_rows * site.n * rs_accumulate_bytes(W, site.itemsize)
    own = g + hbm_ms(profile, sum_bytes) + 2 * WAIT_MS  # and its two waits
    copy_out = hbm_ms(profile, 2 * (W - 1) * stripe_bytes)
    t_c, t_x = peer_sync_ms(profile), 0.0
    events: list[Event] = []

    def compute(label: str, ms: float) -> None:
        nonlocal t_c
        events.append(Event("compute", label, t_c, t_c + ms))
        t_c += ms

    def copy(label: str, ms: float) -> float:
        nonlocal t_x
        t_x = max(t_x, t_c)
        events.append(Event("comm", label, t_x, t_x + ms))
        t_x += ms
        return t_x

    arrived = []  # per chunk: when the peers' partials are in my slots (theirs are pushed as mine)
    for i in range(c):
        for j in range(W - 1):
            compute(f"GEMM chunk {i} stripe {j}", g)
            done = copy(f"push partial {i}.{j}", hop)
        arrived.append(done)
    landed = None
    for i in range(c):
        t_c = max(t_c, arrived[i])
        compute(f"GEMM + sum chunk {i}", own)
        pushed = copy(f"push reduced {i}", (W - 1) * hop)
        if landed is not None:
            t_c = max(t_c, landed)
            copy(f"copy out chunk {i - 1}", copy_out)
        landed = pushed
    t_c = max(t_c, landed)
    copy(f"copy out chunk {c - 1}", copy_out)
    end = max(t_c, t_x)
    g_base, c_base = gemm_ms(site, profile), comm_call_ms(site, profile, site.coll_bytes(), ctx, launch=False)
    note = f"{c} chunks of {W} stripes of {stripe_rows} rows: GEMM {g:.4f} ms, copy {hop:.4f} ms each"
    return Schedule(end, events, overlap_bound(g_base, c_base, 0.0, hop + copy_out), note)


def rs_accumulate_bytes(world: int, itemsize: int) -> int:
    """Bytes per output element that p2p_ring's copy-engine reduce-scatter moves summing the
    partials (kernels.run_reducescatter): arrivals before the own GEMM into an fp32 sum (the
    first widened: read + write fp32; each further one: read sum, read slot, write sum), then one
    pass (sum_kernel.py) reading the own partial, the last arrival and the sum, writing the result."""
    early = 0 if world <= 2 else (itemsize + 4) + (world - 3) * (8 + itemsize)
    return early + 3 * itemsize + (4 if world > 2 else 0)


def ring_tail_ms(site: Site, profile: HardwareProfile, stripe_rows: int, copy_engine: bool) -> float:
    """What follows the last GEMM piece of a p2p_ring reduce-scatter / all-to-all on the compute
    stream. Copy engine: the reduce-scatter's fp32 sums (rs_accumulate_bytes), the all-to-all's
    placement of every received block into the output (read + write). NCCL transport: the sum of
    the local chunk and the last received partial (three passes)."""
    elems = stripe_rows * site.n
    if not copy_engine:
        return hbm_ms(profile, 3 * elems * site.itemsize) if site.kind == "gemm_reducescatter" else 0.0
    if site.kind == "gemm_reducescatter":
        return hbm_ms(profile, elems * rs_accumulate_bytes(site.world, site.itemsize))
    return hbm_ms(profile, 2 * (site.world - 1) * elems * site.itemsize)


MODEL = p2p_ring
