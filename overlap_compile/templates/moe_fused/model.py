"""moe_fused's latency model: the expert-parallel section as a piece pipeline, over NCCL or, with
``"transport": "p2p"``, over the copy engine. The pieces it is built from are the predictor's:
predictor/models.py.
"""
from __future__ import annotations

import dataclasses

from ...predictor.models import (ITEMSIZE, Ctx, Event, Schedule, Site, baseline, comm_call_ms, copy_engine_slowdown,
                                 gemm_ms, hbm_ms, peer_sync_ms, profile_extra, slice_ms, slowed)
from ...predictor.profile import HardwareProfile


def moe_fused(site: Site, config: dict, profile: HardwareProfile, ctx: Ctx) -> Schedule | None:
    """The section as a piece pipeline (templates/moe_fused/reference.py, kernels.py). NCCL runs
    the calls in issue order on one stream: every dispatch piece D_i first, then the combines C_i;
    the experts E_i of a piece start when D_i has landed (and E_{i-1} is done); C_i starts after
    E_i and after the previous call on the NCCL stream. Collectives beside expert GEMMs pay
    ``comm_slowdown``, expert GEMMs beside collectives ``gemm_slowdown``; every call after the
    first pays the launch cost. Total = end of the last combine (or of the last experts).

    ``{"pieces": p}``: p all-to-alls of 1/p of the bytes each way, experts 1/p of the GEMM time.
    ``{"split": "source"}``: W pieces; piece 0 is the own tokens (no transfer, its experts start
    at t=0), piece r a pairwise exchange with one peer. That exchange moves bytes/W off the rank,
    what an all-to-all of bytes/(W-1) moves, so it is priced on the all-to-all curve at
    bytes/(W-1) (on a switched fabric a pair gets the per-rank bandwidth)."""
    if site.kind != "moe":
        return None
    if backward_site(site):
        return moe_fused_backward(site, config, profile, ctx)
    if config.get("transport") == "p2p":
        if config.get("experts") == "fused":
            ratio = expert_kernel_ratio(profile)
            if ratio is None:
                return None
            return moe_fused_copy_engine(site, profile, ctx, ratio, skip_padding=bool(config.get("skip_padding")))
        return moe_fused_copy_engine(site, profile, ctx, packed=config.get("experts") == "packed")
    W = max(1, site.world)
    source = config.get("split") == "source"
    p = W if source else max(1, int(config.get("pieces", 1)))
    routed, fill, setup = _routed_terms(site, config, profile, ctx)
    events, end, nbytes = _pipeline(site, profile, ctx, p, source, gemm_ms(site, profile), fill=fill, setup_ms=setup)
    base = baseline(site, profile, ctx)
    how = f"{W} source pieces (own first)" if source else f"{p} capacity pieces"
    if routed:
        how += f", routed rows only (assumed {fill:.0%} of the slots)"
    return Schedule(end + moe_save_ms(site, profile, in_place=source), events, base.bound_ms if base else None,
                    f"{how} of {nbytes / 2**20:.1f} MiB")


def expert_kernel_ratio(profile: HardwareProfile) -> float | None:
    """The persistent expert kernel's time over the bmm experts' (``moe.expert_kernel_vs_bmm`` in
    the profile, measured by benchmarks/moe_experts.py); None (no prediction) until measured."""
    value = profile_extra(profile, "expert_kernel_vs_bmm", 0.0, "moe")
    return value if value > 0 else None


def _pipeline(site: Site, profile: HardwareProfile, ctx: Ctx, p: int, source: bool, piece_gemms_ms: float,
              tail_ms: float = 0.0, fill: float = 1.0, setup_ms: float = 0.0) -> tuple[list[Event], float, float]:
    """(events, end, bytes per call) of the piece pipeline ``moe_fused`` describes: ``p`` pieces
    whose GEMMs take ``piece_gemms_ms`` in all, then ``tail_ms`` of GEMMs that need every piece
    (the backward's weight gradients), beside the transfers still in flight. ``fill``: the share
    of the slots that travels and meets the experts (the routed payload), after ``setup_ms``."""
    W = max(1, site.world)
    slow_g = profile.contention["gemm_slowdown"]
    e = piece_gemms_ms / p * (slow_g if p > 1 else 1.0) * fill
    nbytes = (site.coll_bytes() / (W - 1) if source and W > 1 else site.coll_bytes() / p) * fill
    moves = [i for i in range(p) if not (source and i == 0)]  # pieces with a transfer
    calls = 0

    def call(contended: bool) -> float:
        nonlocal calls
        calls += 1
        return comm_call_ms(site, profile, nbytes, ctx, contended=contended, launch=calls > 1)

    events, t_comm, d_end = [], 0.0, {}
    if setup_ms > 0:  # routed payload: sizes scan, their exchange and one host round trip first
        t_comm = setup_ms
        events.append(Event("compute", "routed sizes + host synchronisation", 0.0, t_comm))
    t_exp = t_comm
    for i in moves:
        d = call(contended=i > 0)
        events.append(Event("comm", f"dispatch {i}", t_comm, t_comm + d))
        t_comm += d
        d_end[i] = t_comm
    for i in range(p):
        start = max(t_exp, d_end.get(i, 0.0))
        events.append(Event("compute", f"experts {i}", start, start + e))
        t_exp = start + e
        if i in d_end:
            c_start = max(t_comm, t_exp)
            c = call(contended=i < p - 1 or tail_ms > 0)
            events.append(Event("comm", f"combine {i}", c_start, c_start + c))
            t_comm = c_start + c
    if tail_ms > 0:
        end = t_exp + slowed(tail_ms, max(0.0, t_comm - t_exp), slow_g)
        events.append(Event("compute", "weight gradients", t_exp, end))
        t_exp = end
    return events, max(t_comm, t_exp), nbytes


BACKWARD_GEMMS = 6


def backward_site(site: Site) -> bool:
    """A backward MoE section (passes.matches.MoeBackwardMatch) has six GEMMs, in this order: the
    three each piece runs (d_act and the two d_h terms), then the three weight gradients."""
    return len(site.gemms) == BACKWARD_GEMMS


def moe_fused_backward(site: Site, config: dict, profile: HardwareProfile, ctx: Ctx) -> Schedule | None:
    """The backward section by source (backward_reference.py): the forward's rounds with the
    data-gradient GEMMs (half the backward's, as much as the forward's three) in the pieces and
    the weight gradients over all rows after the last piece, beside the last d_h transfers
    (the last one then pays ``comm_slowdown`` too). Same bytes as the forward each way. Only
    ``{"split": "source"}`` over NCCL has a backward path; ``"payload": "routed"`` scales the
    pieces' bytes and GEMMs by the expected fill after the routed setup (the weight gradients
    stay whole). ``"transport": "p2p"`` (backward_p2p.py) is the forward's copy-engine schedule
    with the own slots whole and first and the weight gradients after the last piece."""
    if config.get("split") != "source" or config.get("transport", "nccl") not in ("nccl", "p2p"):
        return None
    data = dataclasses.replace(site, gemms=site.gemms[:3])
    grads = dataclasses.replace(site, gemms=site.gemms[3:])
    if config.get("transport") == "p2p":  # backward_p2p.py: own slots whole first, weight gradients last
        return moe_fused_copy_engine(data, profile, ctx, tail_ms=gemm_ms(grads, profile), own_split=False,
                                     packed=config.get("experts") == "packed")
    W = max(1, site.world)
    routed, fill, setup = _routed_terms(site, config, profile, ctx)
    events, end, nbytes = _pipeline(site, profile, ctx, W, True, gemm_ms(data, profile), gemm_ms(grads, profile),
                                    fill=fill, setup_ms=setup)
    base = baseline(site, profile, ctx)
    how = f", routed rows only (assumed {fill:.0%} of the slots)" if routed else ""
    return Schedule(end, events, base.bound_ms if base else None,
                    f"backward: {W} source pieces (own first) of {nbytes / 2**20:.1f} MiB{how}, weight gradients last")


def _routed_terms(site: Site, config: dict, profile: HardwareProfile, ctx: Ctx) -> tuple[bool, float, float]:
    """(routed, fill, setup ms) of a config in either direction: the routed payload scales the
    pieces by the expected fill after its setup; under CUDA graphs the capacity pipeline runs
    (no host read inside a capture), so it is priced as that."""
    routed = config.get("payload") == "routed" and ctx.mode != "cuda_graph"
    if not routed:
        return False, 1.0, 0.0
    return True, routed_fill(profile), routed_setup_ms(site, profile, ctx)


DEFAULT_FILL = 0.8


def routed_fill(profile: HardwareProfile | None) -> float:
    """The share of the dispatch slots a ``"payload": "routed"`` section expects to hold tokens
    (``moe.routed_fill`` in the profile): routing is data, unknown at compile time; the default
    0.8 is uniform routing at capacity factor 1.25 (1 / 1.25), what demo.moe and
    benchmarks/moe.py use. Skewed routing fills less and gains more. No profile: that default."""
    if profile is None:
        return DEFAULT_FILL
    return min(1.0, max(0.05, profile_extra(profile, "routed_fill", DEFAULT_FILL, "moe")))


def routed_setup_ms(site: Site, profile: HardwareProfile, ctx: Ctx) -> float:
    """Before the first routed piece (templates/moe_fused/routed.py): the sizes scan (at most one
    read of the dispatch buffer), their all-to-all (W * E_local int32), packing and unpacking
    every routed row (a read and a write each way), and the host round trip
    (``moe.routed_host_ms``, default 1.2). The round trip drains the GPU's queue: what the host
    issues after it (the op's own launches, then the rest of the step) runs exposed until the GPU
    is behind again, so the default is what the whole layer lost to it (benchmarks/moe.py), not
    the section alone (benchmarks/diagnostics/moe_routed_experts.py)."""
    fill = routed_fill(profile)
    scan = hbm_ms(profile, site.coll_bytes())
    sizes = comm_call_ms(site, profile, 4096.0, ctx, contended=False)  # W * E_local int32: latency-bound
    pack = hbm_ms(profile, 4 * fill * site.coll_bytes())
    return scan + sizes + profile_extra(profile, "routed_host_ms", 1.2, "moe") + pack


def moe_save_ms(site: Site, profile: HardwareProfile, in_place: bool) -> float:
    """A training section's saved intermediates copied out of each piece into the layout backward
    reads (reference.Saved): one read and one write of them. Pieces by source write gate, up and
    act in place (their GEMMs and swiglu_kernels.silu_mul store into the saved layout's column
    blocks, ``in_place``), so only the experts' input is copied; capacity pieces copy them all."""
    return hbm_ms(profile, 2 * (site.saved_copy_bytes if in_place else site.saved_bytes))


def moe_fused_copy_engine(site: Site, profile: HardwareProfile, ctx: Ctx, fused_ratio: float | None = None,
                          skip_padding: bool = False, tail_ms: float = 0.0, own_split: bool = True,
                          packed: bool = False) -> Schedule | None:
    """``{"split": "source", "transport": "p2p"}`` (templates/moe_fused/kernels.py): the source
    pieces over the copy engine. Before any GEMM: the W-1 peers' slots staged into the symmetric
    buffer (read + write) and one handshake. The copy stream pulls the W-1 peer pieces back to
    back (the copy curve, one copy at a time), then pushes each result home once its experts are
    done. The compute stream: the own tokens' first half, each peer piece once pulled, the own
    second half; expert GEMMs run ``copy_engine_slowdown`` slower while a copy runs beside them.
    Last, the W-1 returned pieces copied into the output (read + write) after one handshake.

    ``fused_ratio`` (``"experts": "fused"``: the expert kernel's time over bmm's): one persistent
    kernel in the same order, after the own tokens' local copy. ``skip_padding``: a scan of the
    padding first, then the kernel's GEMMs scaled by the expected fill (an upper bound: it skips
    whole row blocks only). ``tail_ms``, ``own_split=False`` (the backward): the own slots whole
    and first, then ``tail_ms`` of weight-gradient GEMMs after the last piece. ``packed``: every
    GEMM scaled by the expected fill after a scan of the padding, plus packed_overhead_ms."""
    W = max(1, site.world)
    piece_bytes = site.coll_bytes() / W
    xfer = comm_call_ms(site, profile, piece_bytes, ctx, collective="copy_engine", contended=False)
    slow = copy_engine_slowdown(profile)
    e_piece = slice_ms(site, profile, max(1, site.m // W))
    sync = peer_sync_ms(profile)
    stage = hbm_ms(profile, 2 * (W - 1) * piece_bytes) + sync
    if skip_padding or packed:
        fill = routed_fill(profile)
        stage += hbm_ms(profile, (1.0 - fill) * site.coll_bytes())
        e_piece *= fill
        if packed:
            tail_ms *= fill
    scan = " + sizes scan" if skip_padding or packed else ""
    events = [Event("compute", f"stage peer slots{scan} + handshake", 0.0, stage)]
    t_copy = stage
    pulled = []
    for k in range(1, W):
        events.append(Event("comm", f"pull {k}", t_copy, t_copy + xfer))
        t_copy += xfer
        pulled.append(t_copy)

    def experts(label: str, start: float, alone: float) -> float:
        busy = max(0.0, t_copy - start)  # copies still running when this piece starts
        end = start + slowed(alone, busy, slow)
        events.append(Event("compute", label, start, end))
        return end

    fused = fused_ratio is not None
    start = stage
    if fused:  # one kernel: the own tokens' local copy first, every GEMM at the measured ratio
        e_piece *= fused_ratio
        start += hbm_ms(profile, 2 * piece_bytes)
    if own_split:
        t = experts("experts own[0]" + (" (fused kernel)" if fused else ""), start, e_piece / 2)
    else:
        t = experts("experts own", start, e_piece)
    for k, ready in enumerate(pulled, start=1):
        t = experts(f"experts {k}", max(t, ready), e_piece)
        start = max(t, t_copy)
        events.append(Event("comm", f"push {k}", start, start + xfer))
        t_copy = start + xfer
    if own_split:
        t = experts("experts own[1]", t, e_piece / 2)
    if tail_ms > 0:
        t = experts("weight gradients", t, tail_ms)
    if packed:
        moves = packed_overhead_ms(site, profile, backward=not own_split)
        events.append(Event("compute", "packed rows: moves and index maps", t, t + moves))
        t += moves
    place = hbm_ms(profile, 2 * (W - 1) * piece_bytes)
    start = max(t, t_copy + sync if W > 1 else t)
    events.append(Event("compute", "place returned pieces", start, start + place))
    base = baseline(site, profile, ctx)
    # a training section's intermediates: the bmm path copies the experts' input out (a read and
    # a write; the rest it writes in place); the kernel stores them all where backward reads
    # them, at most one more write (gate and up)
    save = hbm_ms(profile, site.saved_bytes) if fused else moe_save_ms(site, profile, in_place=True)
    return Schedule(start + place + save, events, base.bound_ms if base else None,
                    f"{W} source pieces over the copy engine: {xfer:.4f} ms per piece each way, "
                    f"experts {e_piece:.4f} ms per piece")


def packed_overhead_ms(site: Site, profile: HardwareProfile, backward: bool) -> float:
    """What ``"experts": "packed"`` (packed.py) adds to a section beyond its GEMMs, with X the
    slots' bytes (rows x H) and Y rows x F, f the expected fill (routed_fill):

    forward   per piece the tokens packed and the result unpacked (f X read, X written, each), and
              silu_mul_unpack's writes of gate, up and act into every slot beside the packed
              product (3 f Y more than silu_mul on every slot): (2 + 2 f) X + 3 f Y
    backward  per piece the gradient packed and d_h unpacked, (2 + 2 f) X; the elementwise step on
              the routed rows only, 5 (1 - f) Y less; after the last piece the tokens and the
              gradient (2 + 2 f) X and act, d_gate and d_up (3 + 3 f) Y gathered expert by expert

    priced at ``moe.packed_move_factor`` times an elementwise pass over those bytes, plus
    ``moe.packed_piece_ms`` per piece (the index maps' small kernels; the backward's gathers
    count as one more; the copy-engine waits behind the pieces' extra kernels count in the factor).
    The defaults are fitted by benchmarks/fitting/fit_packed_overhead.py."""
    move_ms, pieces = packed_overhead_terms(site, profile, backward)
    return (profile_extra(profile, "packed_move_factor", 2.93, "moe") * move_ms
            + pieces * profile_extra(profile, "packed_piece_ms", 0.0535, "moe"))


def packed_overhead_terms(site: Site, profile: HardwareProfile, backward: bool) -> tuple[float, int]:
    """packed_overhead_ms's two terms before their constants: (one elementwise pass over the bytes
    the packed path moves, ms; pieces). benchmarks/fitting/fit_packed_overhead.py fits to them."""
    fill = routed_fill(profile)
    x = float(site.coll_bytes())
    y = float(site.m * site.n * site.itemsize)  # the first GEMM's output: rows x F, either direction
    if backward:
        nbytes = 2 * (2 + 2 * fill) * x + (3 + 3 * fill) * y - 5 * (1 - fill) * y
    else:
        nbytes = (2 + 2 * fill) * x + 3 * fill * y
    # backward: W pieces and the gathers after them; forward: the own tokens in two halves
    # (reference.own_parts) and W - 1 peer pieces
    return hbm_ms(profile, max(0.0, nbytes)), max(1, site.world) + 1


def section_sites(world: int, e_local: int, capacity: int, hidden: int, ffn: int,
                  dtype: str = "bfloat16") -> tuple[Site, Site]:
    """An expert-parallel layer's two training sections as the finder hands them over (each bmm's
    batch folded into its rows, MoeLayerMatch.gemms): the forward with what backward saves (the
    experts' input, gate, up and act), and the backward (d_act and the two d_h terms, then dw1,
    dw3 and dw2 over the W * C rows of each expert). For fits and tests of this model."""
    m, wc, item = world * e_local * capacity, world * capacity, ITEMSIZE.get(dtype, 2)
    forward = Site("moe", ((m, ffn, hidden), (m, ffn, hidden), (m, hidden, ffn)), world, dtype,
                   saved_bytes=m * (hidden + 3 * ffn) * item, saved_copy_bytes=m * hidden * item)
    backward = Site("moe", ((m, ffn, hidden), (m, hidden, ffn), (m, hidden, ffn), (e_local * hidden, ffn, wc),
                            (e_local * hidden, ffn, wc), (e_local * ffn, hidden, wc)), world, dtype)
    return forward, backward


MODEL = moe_fused
