"""Closed-form latency models: a site under a template configuration -> a predicted schedule.

Every model returns a ``Schedule``: the predicted end time, the bars of a two-lane Gantt chart
(``compute`` lane: the GEMM or its pieces; ``comm`` lane: each collective call) and the overlap
bound. All times are milliseconds; all inputs come from the ``HardwareProfile``:

* ``profile.gemm.ms(M, N, K, dtype, kernel)``: GEMM time (table / interpolation / roofline);
* ``profile.comm_ms(collective, bytes, world, cross_node)``: one collective call (curves);
* ``profile.launch(mode)``: per-call cost on top of a curve (``mode`` "eager" or "cuda_graph");
* ``profile.contention``: ``gemm_slowdown`` (a full-grid GEMM beside a collective),
  ``gemm_slowdown_reserved`` (a GEMM that leaves the collective's SMs free, or beside copy-engine
  traffic), ``comm_slowdown`` (a collective beside a GEMM).

Models
------
baseline
    The site as written: GEMM(s), then one collective call (all-gather: the collective first).
    ``T = g + c``. Launch costs: a site's first collective call is enqueued while its GEMM runs
    and pays nothing extra; every further call (a template's groups, chunks, ring steps) pays
    ``profile.launch(mode)``.

signal_reorder  (FlashOverlap, Hong et al., EuroSys '26 / arXiv 2504.19519, §4 Algorithm 1)
    One persistent GEMM of ``programs = (SMs - NCCL SMs) * blocks/SM`` programs (rounded down to a
    multiple of the stripe count: 1 for all-reduce, W for reduce-scatter / all-to-all) walks
    ``tiles`` output tiles in ``T = ceil(tiles / programs)`` waves. Waves are cut into groups
    ``G1..GP``; group i's collective starts when its last wave is done and the previous group's
    collective has finished::

        t_p += |G_i| * t_wave                    # compute time when group i is complete
        t_m  = max(t_p, t_m) + comm(bytes(G_i))  # its collective, serialised on the comm stream

    and the prediction is the final ``t_m``. ``t_wave`` is the kernel's full-occupancy GEMM time
    over its full-occupancy wave count (the wave model), times ``gemm_slowdown_reserved``;
    ``comm`` is the curve at the group's bytes (padded tiles, as sent) times ``comm_slowdown``
    (not for the last group, which runs alone) plus the launch cost (not for the first group).
    Candidates are partitions with ``|G1| <= wave_group_first_max`` and ``|GP| <= wave_group_last_max``;
    ``best_wave_partitions`` finds the minimum over all of them exactly (dynamic programming
    over (groups, waves done): ``t_m`` is non-decreasing in the previous ``t_m``, so keeping the
    smallest one per state loses nothing; tests check it against enumeration).

p2p_ring  (CommFuse, arXiv 2604.24013)   config: slices, bidirectional, transport ("p2p"|"nccl")
    Reduce-scatter / all-to-all: the GEMM is cut into W row chunks (one per destination rank),
    each into ``slices`` pieces; the chunks for the W-1 peers are computed first, each piece sent
    (RS: with the partial sum received from the previous neighbour added) as soon as it is done,
    the chunk that stays local last, so no transfer trails the GEMM (RS adds the last received
    partial: one elementwise pass). All-gather: the local shard's GEMM runs while the shards
    travel the ring; the piece of step i waits for its shard. Transfers are serialised on the
    comm lane: ``t_x = max(t_p, t_x) + xfer`` (RS/A2A) or ``t_p = max(t_p, t_x) + piece`` (AG).
    ``xfer`` is the ``copy_engine`` curve (transport "p2p": peer copies, no SMs; GEMM slowdown
    ``gemm_slowdown_copy_engine``) or the ``p2p`` curve times ``comm_slowdown`` (transport "nccl":
    send/recv kernels; GEMM slowdown ``gemm_slowdown``) at the piece's bytes (halved when
    bidirectional: two rings in opposite directions on full-duplex links), plus the launch cost.
    A piece is slowed only while a transfer runs beside it (``slowed``); pieces are row slices
    of the GEMM at its rate per tile (``slice_ms``). Copy engine: the all-gather first stages the
    shard (one read + write) and meets its peers (``peer_sync_ms``); the reduce-scatter ends with
    its fp32 sums (``rs_accumulate_bytes``), the all-to-all with placing the received blocks.

priority_stream  (resource-aware overlap)   config: chunks, optional block_m/block_n/stages
    The GEMM is cut into ``chunks`` row chunks on the compute stream; chunk i's collective runs
    on a high-priority stream as soon as chunk i is done (all-gather: chunk i of the gather,
    then its GEMMs). Same max-plus recursion; each call pays the launch cost; GEMM pieces pay
    ``gemm_slowdown`` (cuBLAS at full grid) or, with an explicit tile config chosen to leave
    shared-memory slack for the collective, that kernel's time and ``gemm_slowdown_reserved``.

tile_fused  (TileLink, MLSys '25)   config: block_m, block_n, group_m, comm_ctas
    GEMM + reduce-scatter: one persistent GEMM on ``SMs - comm_ctas`` SMs walks the W row stripes,
    the peers' first (rank r+1, r+2, ...) and its own last; ``comm_ctas`` CTAs push every finished
    tile of stripe d straight into rank d's receive buffer (NVLink stores, no collective call) and
    then reduce the own stripe. Pieces: W stripe GEMMs of ``gemm(M/W) * SMs / (SMs - comm_ctas) *
    gemm_slowdown_reserved``; after each peer stripe its push, at ``min(copy_engine curve,
    comm_ctas * TF_PUSH_GBPS_PER_CTA)`` (stores from a few CTAs: the per-CTA rate is an assumed
    constant until measured), serialised on the comm lane; the tail is the reduce of the own
    stripe, (W + 1) stripe-sized passes over HBM at ``min(mem_gbps, comm_ctas *
    TF_REDUCE_GBPS_PER_CTA)`` -- it follows the own stripe's tiles as they finish, so only its
    last round (``comm_ctas`` of the stripe's tiles) trails the GEMM. Launch: the op adds 3 kernels (barrier,
    push, reduce) beside the GEMM: ``3 * launch(mode)``.
    All-gather + GEMM: the copy engine pulls the W-1 peer shards back to back (``copy_engine``
    curve per shard, no SMs, ``launch(mode)`` each) while the GEMM (full grid,
    ``gemm_slowdown_reserved``) computes the own shard's rows first and each peer's rows once its
    rank_notify lands: ``pipeline(comm_first=True)`` over W stripe pieces. Multiple consumers: the
    first is fused; the others run after the gather as plain GEMMs.

Adding a model: write ``def model(site, config, profile, ctx) -> Schedule``
from the template's schedule (use ``pipeline`` for a chain of pieces) and register it in
``MODELS`` under the template's name. Until then ``rank_configs`` falls back to the template's
own ``spec.predict`` and, failing that, reports the candidate without a prediction.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from ..tiling import cdiv
from .profile import HardwareProfile, Kernel

COLLECTIVE_OF = {
    "gemm_allreduce": "all_reduce",
    "gemm_reducescatter": "reduce_scatter",
    "gemm_alltoall": "all_to_all",
    "allgather_gemm": "all_gather",
    "moe": "all_to_all",
}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
MAX_LISTED_GROUPS = 6  # signal_reorder: best partition listed per group count up to this
# signal_reorder: the partition search is O(groups x waves^2); beyond this many waves (a CPU
# profile's few "SMs" on a GPU-sized GEMM: thousands) it runs on units of several waves
MAX_SEARCHED_WAVES = 128


@dataclasses.dataclass(frozen=True)
class Site:
    """The geometry of a site, all the models need (built from a Match or a SiteReport)."""

    kind: str
    gemms: tuple[tuple[int, int, int], ...]
    world: int
    dtype: str
    cross_node: bool = False
    output_fuses: bool = False  # the result's readers fuse a permuted read (Match.output_fuses)
    saved_bytes: int = 0  # intermediates a rewrite must also hand out (a training MoE section's)

    @property
    def m(self) -> int:
        return self.gemms[0][0]

    @property
    def n(self) -> int:
        return self.gemms[0][1]

    @property
    def k(self) -> int:
        return self.gemms[0][2]

    @property
    def itemsize(self) -> int:
        return ITEMSIZE.get(self.dtype, 2)

    @property
    def collective(self) -> str:
        return COLLECTIVE_OF[self.kind]

    def coll_bytes(self) -> int:
        """Bytes of the collective in the curves' convention (the full, unsplit buffer)."""
        if self.kind == "allgather_gemm":
            return self.m * self.k * self.itemsize
        if self.kind == "moe":
            return self.m * self.k * self.itemsize  # tokens x hidden dispatched
        return self.m * self.n * self.itemsize

    @staticmethod
    def from_match(match: Any, cross_node: bool = False) -> "Site":
        from ..passes.matches import dtype_name

        return Site(match.kind, tuple(tuple(g) for g in match.gemms()), int(match.world_size),
                    dtype_name(match.dtype), cross_node, bool(getattr(match, "output_fuses", False)),
                    moe_saved_bytes(match))

    @staticmethod
    def from_report(site: Any, cross_node: bool = False) -> "Site":
        return Site(site.kind, tuple(tuple(g) for g in site.gemms), int(site.world_size), site.dtype, cross_node,
                    bool(getattr(site, "output_fuses", False)))


def moe_saved_bytes(match: Any) -> int:
    """Bytes of the intermediates a training MoE section saves for backward (Match.saved_nodes):
    the experts' input [E, W*C, H] and the [E, W*C, F] up-projections / product."""
    saved = getattr(match, "saved_nodes", None) or {}
    rows = getattr(match, "e_local", 0) * getattr(match, "capacity", 0) * getattr(match, "world_size", 0)
    width = {"tokens": getattr(match, "hidden", 0)}
    return sum(rows * width.get(role, getattr(match, "ffn", 0)) for role in saved) * int(getattr(match, "itemsize", 2))


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What the models need besides the site and the profile."""

    mode: str = "eager"  # "eager" | "cuda_graph": which per-call launch cost applies
    first_max: int = 2  # FlashOverlap S1
    last_max: int = 4  # FlashOverlap SP


@dataclasses.dataclass
class Event:
    lane: str  # "compute" | "comm"
    label: str
    start: float
    end: float


@dataclasses.dataclass
class Schedule:
    total_ms: float
    events: list[Event]
    bound_ms: float | None = None
    note: str = ""


# ---- shared pieces -----------------------------------------------------------------------------


def gemm_ms(site: Site, profile: HardwareProfile, m: int | None = None, kernel: str | None = None) -> float:
    """Sum of the site's GEMMs (rows ``m`` instead of the site's M when given)."""
    return sum(profile.gemm.ms(m if m is not None else gm, gn, gk, site.dtype, kernel) for gm, gn, gk in site.gemms)


# cuBLAS's usual bf16/fp16 tile on Hopper: what sets how many waves a GEMM's output takes.
CUBLAS_TILE = (128, 256)


def _wave_efficiency(rows: int, n: int, sms: int) -> float:
    """Fraction of the last wave's SM slots a GEMM of ``rows x n`` outputs fills, averaged over its
    waves (tiles / (waves * SMs)): 1.0 when the tile count is a multiple of the SM count."""
    tiles = cdiv(rows, CUBLAS_TILE[0]) * cdiv(n, CUBLAS_TILE[1])
    return tiles / (cdiv(tiles, sms) * sms)


def slice_ms(site: Site, profile: HardwareProfile, rows: int, kernel: str | None = None) -> float:
    """One row slice of the site's GEMM(s), as the templates cut it (chunks, ring pieces,
    stripes): the same kernel on fewer rows runs at the whole GEMM's rate per tile, corrected for
    wave quantisation, with the GEMM floor as the lower bound. (The table's own small-M entries
    are single short measurements, 10-28% slower than repeated ones -- see the profile's notes --
    and a slice's time must be consistent with the whole: W slices of a GEMM do not take 15-20%
    longer than the GEMM.)"""
    total = 0.0
    for gm, gn, gk in site.gemms:
        if rows >= gm:
            total += profile.gemm.ms(gm, gn, gk, site.dtype, kernel)
            continue
        whole = profile.gemm.ms(gm, gn, gk, site.dtype, kernel)
        quant = _wave_efficiency(gm, gn, profile.sm_count) / _wave_efficiency(rows, gn, profile.sm_count)
        total += max(profile.gemm.floor_ms, whole * rows / gm * quant)
    return total


def comm_call_ms(site: Site, profile: HardwareProfile, nbytes: float, ctx: Ctx, collective: str | None = None,
                 contended: bool = False, launch: bool = True) -> float:
    """One collective call: the curve, times ``comm_slowdown`` when a GEMM runs beside it, plus the
    per-call launch cost when ``launch`` (every call of a site but its first: the first one is
    enqueued while the GEMM runs, as in the baseline, whose single call pays none)."""
    curve = collective or site.collective
    t = profile.comm_ms(curve, nbytes, site.world, site.cross_node)
    if contended:
        t *= profile.contention["comm_slowdown"]
    if not launch:
        return t
    # the call's start-up runs during its launch gap; only what exceeds the gap adds
    return t + max(profile.launch(ctx.mode), nccl_call_ms(site, profile, curve))


def nccl_call_ms(site: Site, profile: HardwareProfile, curve: str) -> float:
    """GPU time each further NCCL call of a site costs beyond its curve. The curves time one call
    repeated back to back, where the next call's start-up (kernel launch, the ranks' handshake,
    the ring's pipeline fill) overlaps the previous call's drain: their small-message time is less
    than an isolated call's start-up latency ``nccl_call_ms``. A site's further calls are isolated
    (each waits for its GEMM group / chunk first), so each pays the difference (default 0: as the
    curve). It overlaps the call's host launch (comm_call_ms takes the larger of the two): under
    CUDA graphs it shows, host-launched the launch gap mostly hides it. Copy-engine transfers are
    plain peer copies: no NCCL start-up."""
    latency = profile_extra(profile, "nccl_call_ms", 0.0)
    if curve == "copy_engine" or latency <= 0:
        return 0.0
    return max(0.0, latency - profile.comm_ms(curve, 0, site.world, site.cross_node))


def hbm_ms(profile: HardwareProfile, nbytes: float) -> float:
    """An elementwise pass moving ``nbytes`` through HBM (reads + writes) at ``gemm.mem_gbps``."""
    return nbytes / (profile.gemm.mem_gbps * 1e9) * 1e3


def profile_extra(profile: HardwareProfile, key: str, default: float, section: str | None = None) -> float:
    """A number the profile JSON may carry beyond what profile.py validates (``raw[key]`` or
    ``raw[section][key]``). Older and seeded profiles lack it: ``default`` is the model as it was
    before the quantity was measured."""
    table = profile.raw.get(section, {}) if section else profile.raw
    value = table.get(key, default) if isinstance(table, dict) else default
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def copy_engine_slowdown(profile: HardwareProfile) -> float:
    """A cuBLAS GEMM beside copy-engine peer copies: the copies take no SMs and a few percent of
    HBM bandwidth, so this is much smaller than a collective's ``gemm_slowdown``
    (``contention.gemm_slowdown_copy_engine``; profiles without it: ``gemm_slowdown_reserved``)."""
    return profile_extra(profile, "gemm_slowdown_copy_engine", profile.contention["gemm_slowdown_reserved"],
                         "contention")


def peer_sync_ms(profile: HardwareProfile) -> float:
    """One cross-GPU flag handshake of the copy-engine paths (a flag written into a peer's memory
    over NVLink, then a one-thread spin-wait kernel that sees it): ``peer_sync_ms`` (default 0)."""
    return profile_extra(profile, "peer_sync_ms", 0.0)


def slowed(piece: float, beside: float, slow: float) -> float:
    """A GEMM piece of ``piece`` ms (alone) that shares the GPU with a transfer of ``beside`` ms
    started with it: it runs ``slow`` times slower while the transfer lasts, at full speed after.
    (Charging the whole piece, as a flat factor did, overstates the cost of short transfers.)"""
    if beside <= 0 or slow <= 1:
        return piece
    if piece * slow <= beside:
        return piece * slow
    return piece + beside * (1 - 1 / slow)


def overlap_bound(g: float, c: float, first_compute: float, last_comm: float) -> float:
    """FlashOverlap §6.4 / ANCHORS "The limit": max(g, c) plus what cannot overlap: the last
    group's communication when g >= c, else the first group's GEMM."""
    return max(g, c) + (last_comm if g >= c else first_compute)


def pipeline(compute: list[float], comm: list[float | None], comm_first: bool = False,
             compute_labels: list[str] | None = None, comm_labels: list[str] | None = None,
             tail: float = 0.0) -> tuple[float, list[Event]]:
    """A chain of pieces on two lanes (the max-plus recursion every model uses).

    ``comm_first=False``: piece i is computed, then its transfer ``comm[i]`` (None: no transfer)
    starts at ``max(compute end i, previous transfer end)``. ``comm_first=True``: transfers run
    back to back from t=0; piece i is computed at ``max(previous compute end, transfer i end)``.
    ``tail`` is added after both lanes end (e.g. a final add). Returns (end time, events).
    """
    n = len(compute)
    cl = compute_labels or [f"GEMM {i}" for i in range(n)]
    ml = comm_labels or [f"comm {i}" for i in range(n)]
    events: list[Event] = []
    t_p = t_m = 0.0
    if not comm_first:
        for i in range(n):
            events.append(Event("compute", cl[i], t_p, t_p + compute[i]))
            t_p += compute[i]
            if comm[i] is not None:
                start = max(t_p, t_m)
                t_m = start + comm[i]
                events.append(Event("comm", ml[i], start, t_m))
    else:
        for i in range(n):
            if comm[i] is not None:
                events.append(Event("comm", ml[i], t_m, t_m + comm[i]))
                t_m += comm[i]
                ready = t_m
            else:
                ready = 0.0
            start = max(t_p, ready)
            t_p = start + compute[i]
            events.append(Event("compute", cl[i], start, t_p))
    end = max(t_p, t_m)
    if tail:
        events.append(Event("compute", "final add", end, end + tail))
        end += tail
    return end, events


# ---- baseline ---------------------------------------------------------------------------------


def baseline(site: Site, profile: HardwareProfile, ctx: Ctx) -> Schedule | None:
    if site.kind not in COLLECTIVE_OF:
        return None
    g = gemm_ms(site, profile)
    c = comm_call_ms(site, profile, site.coll_bytes(), ctx, launch=False)
    name = site.collective
    if site.kind == "allgather_gemm":
        ev = [Event("comm", name, 0.0, c), Event("compute", "GEMM", c, c + g)]
    elif site.kind == "moe":
        c2 = comm_call_ms(site, profile, site.coll_bytes(), ctx)  # a second call
        ev = [Event("comm", "dispatch all_to_all", 0.0, c), Event("compute", "experts", c, c + g),
              Event("comm", "combine all_to_all", c + g, c + g + c2)]
        return Schedule(c + g + c2, ev, max(g, c + c2), "dispatch + expert GEMMs + combine")
    else:
        ev = [Event("compute", "GEMM", 0.0, g), Event("comm", name, g, g + c)]
    return Schedule(g + c, ev, max(g, c), f"GEMM {g:.3f} ms + {name} {c:.3f} ms")


# ---- signal_reorder (FlashOverlap Algorithm 1) ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WaveGeometry:
    """Tiles, programs and waves of the signal_reorder GEMM for one kernel config."""

    block_m: int
    block_n: int
    stripes: int
    num_exec: int  # tiles over all stripes
    programs: int
    full_programs: int  # programs at full occupancy (no SMs left to NCCL)
    kernel: str | None
    gemm_full_ms: float  # the kernel's GEMM time at full occupancy

    @property
    def waves(self) -> int:
        return cdiv(self.num_exec, self.programs)

    @property
    def full_waves(self) -> int:
        return cdiv(self.num_exec, self.full_programs)

    def tiles_in(self, first_wave: int, end_wave: int) -> int:
        return min(end_wave * self.programs, self.num_exec) - first_wave * self.programs


def _generic_kernel(block_m: int, block_n: int) -> Kernel:
    return Kernel(name=f"{block_m}x{block_n}", block_m=block_m, block_n=block_n)


def sr_programs(site: Site, profile: HardwareProfile, kernel: Kernel) -> tuple[int, int]:
    """(programs, full-occupancy programs) of the persistent kernel: (SMs - NCCL SMs) x blocks/SM,
    rounded down to a multiple of the stripe count, at most the tile count."""
    stripes = 1 if site.kind == "gemm_allreduce" else site.world
    bps = kernel.blocks_per_sm(profile, site.itemsize)
    sms = max(1, profile.sm_count - profile.sms_of(site.collective))
    full = profile.sm_count * bps
    return max(stripes, sms * bps // stripes * stripes), max(stripes, full // stripes * stripes)


def sr_geometry(site: Site, config: dict, profile: HardwareProfile) -> WaveGeometry:
    bm, bn = int(config["block_m"]), int(config["block_n"])
    stripes = 1 if site.kind == "gemm_allreduce" else site.world
    rows = site.m if stripes == 1 else site.m // site.world
    num_exec = cdiv(rows, bm) * cdiv(site.n, bn) * stripes
    kern = profile.gemm.kernel_for(bm, bn)
    if kern is None:
        kern_obj, gemm_full = _generic_kernel(bm, bn), gemm_ms(site, profile) / 0.9
        kname = None
    else:
        kern_obj, kname = kern, kern.name
        gemm_full = gemm_ms(site, profile, kernel=kern.name)
    _, full = sr_programs(site, profile, kern_obj)
    return WaveGeometry(bm, bn, stripes, num_exec, int(config["programs"]), min(full, max(num_exec, stripes)),
                        kname, gemm_full)


def sr_wave_ms(geo: WaveGeometry, profile: HardwareProfile) -> float:
    """Time of one wave of the persistent kernel beside the collectives.

    At full occupancy the kernel runs ``full_waves`` waves in ``gemm_full_ms``; a wave of
    ``programs`` programs, more than fit at once, takes proportionally longer."""
    per_wave = geo.gemm_full_ms / geo.full_waves
    return per_wave * max(1.0, geo.programs / geo.full_programs) * profile.contention["gemm_slowdown_reserved"]


def sr_comm_fn(site: Site, geo: WaveGeometry, profile: HardwareProfile, ctx: Ctx) -> Callable[[int, int, bool], float]:
    tile_bytes = geo.block_m * geo.block_n * site.itemsize
    memo: dict = {}

    def comm(a: int, b: int, last: bool) -> float:
        key = (b - a, b == geo.waves, last, a == 0)
        if key not in memo:
            memo[key] = comm_call_ms(site, profile, geo.tiles_in(a, b) * tile_bytes, ctx, contended=not last,
                                     launch=a > 0)
        return memo[key]

    return comm


def algorithm1(groups: list[int] | tuple[int, ...], wave_ms: float,
               comm: Callable[[int, int, bool], float], ready_delay: float = 0.0) -> tuple[float, list[Event]]:
    """FlashOverlap Algorithm 1 for one partition: accumulate t_p (compute) and t_m (comm).

    ``comm(first_wave, end_wave, is_last_group)`` is the group's collective time. ``ready_delay``:
    how long after its last wave a group other than the last is signalled (the "next_tile"
    signalling point counts a group in the next wave's epilogue)."""
    t_p = t_m = 0.0
    w = 0
    events = []
    for i, g in enumerate(groups):
        events.append(Event("compute", f"waves {w}-{w + g - 1}" if g > 1 else f"wave {w}", t_p, t_p + g * wave_ms))
        t_p += g * wave_ms
        start = max(t_p + (ready_delay if i < len(groups) - 1 else 0.0), t_m)
        t_m = start + comm(w, w + g, i == len(groups) - 1)
        events.append(Event("comm", f"group {i} ({g} wave{'s' if g > 1 else ''})", start, t_m))
        w += g
    return t_m, events


def valid_partition(groups: tuple[int, ...] | list[int], waves: int, first_max: int, last_max: int) -> bool:
    if not groups or any(g < 1 for g in groups) or sum(groups) != waves:
        return False
    return groups[0] <= first_max and groups[-1] <= last_max


def enumerate_partitions(waves: int, first_max: int, last_max: int, limit: int = 100_000):
    """Every composition of ``waves`` with |G1| <= first_max and |GP| <= last_max (for tests and
    small searches; raises past ``limit``)."""
    out: list[tuple[int, ...]] = []

    def rec(prefix: list[int], left: int) -> None:
        if left == 0:
            if valid_partition(prefix, waves, first_max, last_max):
                out.append(tuple(prefix))
                if len(out) > limit:
                    raise ValueError(f"more than {limit} partitions of {waves} waves")
            return
        hi = min(left, first_max) if not prefix else left
        for g in range(1, hi + 1):
            rec(prefix + [g], left - g)

    rec([], waves)
    return out


def best_wave_partitions(waves: int, wave_ms: float, comm: Callable[[int, int, bool], float], first_max: int,
                         last_max: int, max_groups: int | None = None) -> dict[int, tuple[float, tuple[int, ...]]]:
    """For every group count P (up to ``max_groups``), the partition minimising Algorithm 1's t_m
    among those with |G1| <= first_max and |GP| <= last_max: {P: (t_m, groups)}.

    Dynamic programming over (groups so far, waves done) keeping the smallest t_m: exact because
    t_m' = max(t_p, t_m) + comm is non-decreasing in t_m. Ties keep the earlier-found partition
    (smaller last group, then smaller groups first): deterministic.
    """
    T = waves
    P = T if max_groups is None else min(T, max_groups)
    INF = math.inf
    out: dict[int, tuple[float, tuple[int, ...]]] = {}
    if T <= first_max and T <= last_max:
        out[1] = (T * wave_ms + comm(0, T, True), (T,))
    # best[p][w]: min t_m after p non-final groups covering waves [0, w); back[p][w] = last group size
    best = [[INF] * (T + 1) for _ in range(P + 1)]
    back = [[0] * (T + 1) for _ in range(P + 1)]
    for w in range(1, min(first_max, T - 1) + 1):
        best[1][w] = w * wave_ms + comm(0, w, False)
        back[1][w] = w
    for p in range(2, P):
        for w in range(p, T):
            bw, bs, tp = INF, 0, w * wave_ms
            for s in range(1, w - p + 2):
                prev = best[p - 1][w - s]
                if prev == INF:
                    continue
                v = max(tp, prev) + comm(w - s, w, False)
                if v < bw:
                    bw, bs = v, s
            best[p][w], back[p][w] = bw, bs
    for p in range(2, P + 1):
        bv, bsz, tp = INF, 0, T * wave_ms
        for s in range(1, min(last_max, T - p + 1) + 1):
            prev = best[p - 1][T - s]
            if prev == INF:
                continue
            v = max(tp, prev) + comm(T - s, T, True)
            if v < bv:
                bv, bsz = v, s
        if bv == INF:
            continue
        groups = [bsz]
        w, q = T - bsz, p - 1
        while q >= 1:
            s = back[q][w]
            groups.append(s)
            w, q = w - s, q - 1
        out[p] = (bv, tuple(reversed(groups)))
    return out


def coarse_partitions(waves: int, wave_ms: float, comm: Callable[[int, int, bool], float], first_max: int,
                      last_max: int) -> list[tuple[int, ...]]:
    """best_wave_partitions on units of q = ceil(waves / MAX_SEARCHED_WAVES) waves (the last unit
    takes the remainder), returned in waves. The first / last group bounds become one unit where
    q exceeds them: with this many waves they are a small share of the GEMM either way."""
    q = cdiv(waves, MAX_SEARCHED_WAVES)
    units = cdiv(waves, q)

    def unit_comm(lo: int, hi: int, last: bool) -> float:
        return comm(lo * q, min(hi * q, waves), last)

    found = best_wave_partitions(units, wave_ms * q, unit_comm, max(1, first_max // q), max(1, last_max // q),
                                 MAX_LISTED_GROUPS)
    out = []
    for _, groups in (v for _, v in sorted(found.items())):
        sizes = [g * q for g in groups]
        sizes[-1] -= units * q - waves  # the last unit is short
        out.append(tuple(sizes))
    return out


def best_any_count(waves: int, wave_ms: float, comm: Callable[[int, int, bool], float], first_max: int,
                   last_max: int) -> tuple[float, tuple[int, ...]] | None:
    """The minimum over all group counts at once (O(T^2)): (t_m, groups) or None if none is valid."""
    T = waves
    INF = math.inf
    best = [INF] * (T + 1)  # min t_m with [0, w) covered by non-final groups
    back = [0] * (T + 1)
    cands = []
    if T <= first_max and T <= last_max:
        cands.append((T * wave_ms + comm(0, T, True), (T,)))
    for w in range(1, T):
        if w <= first_max:
            best[w], back[w] = w * wave_ms + comm(0, w, False), w
        for s in range(1, w):
            if best[w - s] == INF:
                continue
            v = max(w * wave_ms, best[w - s]) + comm(w - s, w, False)
            if v < best[w]:
                best[w], back[w] = v, s
    bv, bs = INF, 0
    for s in range(1, min(last_max, T - 1) + 1):
        if best[T - s] == INF:
            continue
        v = max(T * wave_ms, best[T - s]) + comm(T - s, T, True)
        if v < bv:
            bv, bs = v, s
    if bv < INF:
        groups = [bs]
        w = T - bs
        while w > 0:
            groups.append(back[w])
            w -= back[w]
        cands.append((bv, tuple(reversed(groups))))
    return min(cands, key=lambda c: (c[0], len(c[1]))) if cands else None


def signal_reorder_configs(site: Site, profile: HardwareProfile, ctx: Ctx, group_m: int = 8) -> list[dict]:
    """signal_reorder's candidates: for each kernel config of the profile that fits the site, the
    best wave-group partition per group count (Algorithm 1 within the S1/SP bounds), plus the best
    over any group count when it needs more than MAX_LISTED_GROUPS groups."""
    stripes = 1 if site.kind == "gemm_allreduce" else site.world
    rows = site.m if stripes == 1 else site.m // site.world
    kernels = sorted(profile.gemm.kernels, key=lambda k: (k.block_m * k.block_n, k.name)) or [_generic_kernel(16, 16)]
    fitting = [k for k in kernels if k.block_m <= rows and k.block_n <= site.n] or kernels[:1]
    configs = []
    for kern in fitting:
        programs, _ = sr_programs(site, profile, kern)
        base = {"block_m": kern.block_m, "block_n": kern.block_n, "group_m": group_m}
        num_exec = cdiv(rows, kern.block_m) * cdiv(site.n, kern.block_n) * stripes
        programs = max(stripes, min(programs, num_exec) // stripes * stripes)
        cfg0 = dict(base, programs=programs, wave_groups=[1])
        geo = sr_geometry(site, cfg0, profile)
        wave = sr_wave_ms(geo, profile)
        comm = sr_comm_fn(site, geo, profile, ctx)
        if geo.waves > MAX_SEARCHED_WAVES:
            configs += [dict(base, programs=programs, wave_groups=list(g))
                        for g in coarse_partitions(geo.waves, wave, comm, ctx.first_max, ctx.last_max)]
            continue
        found = best_wave_partitions(geo.waves, wave, comm, ctx.first_max, ctx.last_max, MAX_LISTED_GROUPS)
        parts = [g for _, (_, g) in sorted(found.items())]
        if geo.waves > MAX_LISTED_GROUPS:
            anyc = best_any_count(geo.waves, wave, comm, ctx.first_max, ctx.last_max)
            listed = min((t for t, _ in found.values()), default=math.inf)
            if anyc is not None and len(anyc[1]) > MAX_LISTED_GROUPS and anyc[0] < listed:
                parts.append(anyc[1])
        for g in parts:
            configs.append(dict(base, programs=programs, wave_groups=list(g)))
    return configs


def signal_reorder(site: Site, config: dict, profile: HardwareProfile, ctx: Ctx) -> Schedule | None:
    if site.kind not in ("gemm_allreduce", "gemm_reducescatter", "gemm_alltoall"):
        return None
    geo = sr_geometry(site, config, profile)
    groups = tuple(int(g) for g in config["wave_groups"])
    if sum(groups) != geo.waves:
        raise ValueError(f"signal_reorder config wave_groups {list(groups)} do not sum to the {geo.waves} waves of "
                         f"{geo.num_exec} tiles / {geo.programs} programs")
    wave = sr_wave_ms(geo, profile)
    delay = 0.0
    if config.get("signal_at", "group_end") != "group_end":
        epi = sr_epilogue(profile)
        if epi is None or config["signal_at"] not in epi:
            return None  # no measured cost of that signalling point: not priced
        wave *= (1 + epi[config["signal_at"]]) / (1 + epi["group_end"])
        delay = wave  # counted in the next tile's epilogue: one wave later
    comm = sr_comm_fn(site, geo, profile, ctx)
    total, events = algorithm1(groups, wave, comm, delay)
    g_base, c_base = gemm_ms(site, profile), comm_call_ms(site, profile, site.coll_bytes(), ctx, launch=False)
    first_compute = groups[0] * wave
    last_comm = comm(geo.waves - groups[-1], geo.waves, True)
    reorder = sr_reorder_ms(site, config, profile)
    note = (f"{geo.num_exec} tiles of {geo.block_m}x{geo.block_n} on {geo.programs} programs = {geo.waves} waves "
            f"of {wave:.4f} ms; groups {list(groups)}; +{reorder:.4f} ms un-reordering the received tiles")
    return Schedule(total + reorder, events, overlap_bound(g_base, c_base, first_compute, last_comm), note)


def sr_epilogue(profile: HardwareProfile) -> dict[str, float] | None:
    """The signalling epilogue's measured cost per signalling point, as a fraction of the plain
    kernel's time (``signal_epilogue`` in the profile: {"group_end": x, "next_tile": y}, from
    benchmarks/gemm.py --signal-at). The wave model's calibration already holds group_end's cost,
    so another point is priced by the ratio of the two. None until both are measured."""
    table = profile.raw.get("signal_epilogue")
    if not isinstance(table, dict):
        return None
    try:
        out = {k: float(v) for k, v in table.items()}
    except (TypeError, ValueError):
        return None
    return out if "group_end" in out and len(out) > 1 else None


# HBM passes over the received tile-order buffer that its un-reorder costs. Read in place by a
# fused consumer (pointwise / reduction readers: Site.output_fuses), nothing: a residual + RMSNorm
# consumer compiled with static shapes measured -1.3% to +0.3% over the plain consumer under CUDA
# graphs on 6 all-reduce output shapes, 2048-16384 x 8192-16384 bf16, on H100 and H200
# (benchmarks/results/reorder-consumer-*-2026-11-23.json; the +44-68% of 2026-11-22 was that
# benchmark recompiling with dynamic shapes, which the finder never rewrites). Materialised for
# any other reader (a GEMM, a collective, the graph output): a copy, read + write = 2.
SR_REORDER_PASSES_FUSED = 0.0
SR_REORDER_PASSES_COPY = 2.0


def sr_reorder_ms(site: Site, config: dict, profile: HardwareProfile) -> float:
    """The consumer-side cost of the tile order (FlashOverlap's post-communication reorder). The
    subtile reduce-scatter form moves its row fix past a later all-gather: charged there, not here."""
    if config.get("rs_layout") == "subtile":
        return 0.0
    recv_rows = site.m // site.world if site.kind == "gemm_reducescatter" else site.m
    nbytes = recv_rows * site.n * site.itemsize
    passes = SR_REORDER_PASSES_FUSED if site.output_fuses else SR_REORDER_PASSES_COPY
    return passes * nbytes / (profile.gemm.mem_gbps * 1e9) * 1e3


# ---- p2p_ring (CommFuse) -------------------------------------------------------------------------


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
        head = (ag_stage_ms(site, profile) + sync) if copy_engine else 0.0
        end, events = pipeline(compute, comm, comm_first=True,
                               compute_labels=[f"GEMM shard {i // s}.{i % s}" for i in range(W * s)],
                               comm_labels=[f"recv {i // s}.{i % s}" if i >= s else "" for i in range(W * s)])
        events = shifted(events, head, "stage shard + peer handshake")
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
    copies of several peers share this GPU's links), plus, on the copy engine, the own stripe
    staged into the symmetric buffer and one handshake. Unfitted, it replays the first 2x H200 runs
    (ops-...-2026-11-23-p2p_ring-allreduce.json) within 4.2% mean |error|."""
    W, copy_engine = site.world, config.get("transport", "nccl") == "p2p"
    stripe_bytes = (site.m // W) * site.n * site.itemsize
    curve = "copy_engine" if copy_engine else "p2p"
    hop = comm_call_ms(site, profile, stripe_bytes, ctx, collective=curve, contended=False)
    gather = (W - 1) * hop + ((hbm_ms(profile, 2 * stripe_bytes) + peer_sync_ms(profile)) if copy_engine else 0.0)
    return reduce_scatter_then_gather(p2p_ring, site, config, profile, ctx, gather,
                                      f"gather {W - 1} reduced stripes", "the reduced stripes gathered")


def reduce_scatter_then_gather(rs_model: Callable, site: Site, config: dict, profile: HardwareProfile, ctx: Ctx,
                               gather_ms: float, label: str, what: str) -> Schedule | None:
    """An all-reduce built as the template's reduce-scatter over W row stripes of the output
    (``rs_model`` on the same site as a reduce-scatter), then ``gather_ms`` of gathering the
    reduced stripes with nothing left to hide it. None where the rows do not split in W."""
    if site.m % site.world:
        return None
    rs = rs_model(dataclasses.replace(site, kind="gemm_reducescatter"), config, profile, ctx)
    if rs is None:
        return None
    events = rs.events + [Event("comm", label, rs.total_ms, rs.total_ms + gather_ms)]
    g_base, c_base = gemm_ms(site, profile), comm_call_ms(site, profile, site.coll_bytes(), ctx, launch=False)
    note = rs.note + f"; then {what}: {gather_ms:.4f} ms"
    return Schedule(rs.total_ms + gather_ms, events, overlap_bound(g_base, c_base, 0.0, gather_ms), note)


def ag_stage_ms(site: Site, profile: HardwareProfile) -> float:
    """Copy-engine all-gathers (p2p_ring, tile_fused) first copy the local shard into the symmetric
    buffer the peers pull from: one read + one write of the shard, before any GEMM."""
    return hbm_ms(profile, 2 * (site.m // site.world) * site.k * site.itemsize)


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


def shifted(events: list[Event], head: float, label: str) -> list[Event]:
    """The events of a schedule that starts ``head`` ms later, behind a compute bar of that length."""
    if head <= 0:
        return events
    return [Event("compute", label, 0.0, head)] + [Event(e.lane, e.label, e.start + head, e.end + head) for e in events]


# ---- priority_stream ------------------------------------------------------------------------------


def priority_stream(site: Site, config: dict, profile: HardwareProfile, ctx: Ctx) -> Schedule | None:
    if site.kind not in ("gemm_allreduce", "gemm_reducescatter", "gemm_alltoall", "allgather_gemm"):
        return None
    c = max(1, int(config.get("chunks", 1)))
    rows = max(1, site.m // c)
    kern = None
    if config.get("block_m") and config.get("block_n"):
        k = profile.gemm.kernel_for(int(config["block_m"]), int(config["block_n"]))
        kern = k.name if k else None
    slow = profile.contention["gemm_slowdown_reserved" if config.get("block_m") else "gemm_slowdown"]
    piece = gemm_ms(site, profile, m=rows, kernel=kern)
    if config.get("block_m") and kern is None:
        piece /= 0.9  # a tile config the profile does not know: a generic Triton kernel
    place = ps_place_ms(site, profile, c)
    comm_full = comm_call_ms(site, profile, site.coll_bytes() / c, ctx, contended=True) + place
    comm_last = comm_call_ms(site, profile, site.coll_bytes() / c, ctx, contended=False) + place
    comm_alone_first = comm_call_ms(site, profile, site.coll_bytes() / c, ctx, contended=False, launch=False) + place
    comm_first = comm_call_ms(site, profile, site.coll_bytes() / c, ctx, contended=True, launch=False) + place
    g_base, c_base = gemm_ms(site, profile), comm_call_ms(site, profile, site.coll_bytes(), ctx, launch=False)
    if site.kind == "allgather_gemm":
        compute = [piece * slow] * (c - 1) + [piece]  # the last chunk's GEMM runs alone
        comm = [comm_alone_first] + [comm_full] * (c - 1)  # the first gather runs alone
        end, events = pipeline(compute, comm, comm_first=True,
                               compute_labels=[f"GEMM chunk {i}" for i in range(c)],
                               comm_labels=[f"{site.collective} {i}" for i in range(c)])
        first_compute, last_comm = piece, comm_full
    else:
        compute = [piece] + [piece * slow] * (c - 1)  # the first chunk runs alone
        comm = ([comm_first] + [comm_full] * (c - 2) + [comm_last]) if c > 1 else [comm_alone_first]
        end, events = pipeline(compute, comm, comm_first=False,
                               compute_labels=[f"GEMM chunk {i}" for i in range(c)],
                               comm_labels=[f"{site.collective} {i}" for i in range(c)])
        first_compute, last_comm = piece, comm_last
    note = f"{c} chunks of {rows} rows: GEMM {piece:.4f} ms, {site.collective} {comm_full:.4f} ms each"
    return Schedule(end, events, overlap_bound(g_base, c_base, first_compute, last_comm), note)


def ps_place_ms(site: Site, profile: HardwareProfile, chunks: int) -> float:
    """priority_stream's all-to-all / all-gather with several chunks receive each chunk source-major
    into a scratch buffer and copy it to its strided rows on the comm stream (kernels.py
    place_received / place_gathered): one read + one write of the chunk after its collective."""
    if chunks <= 1 or site.kind not in ("gemm_alltoall", "allgather_gemm"):
        return 0.0
    return hbm_ms(profile, 2 * site.coll_bytes() / chunks)


# ---- tile_fused (TileLink) ------------------------------------------------------------------------

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
    W-1 received stripes by up to every SM. Not yet measured on a GPU."""
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


Model = Callable[[Site, dict, HardwareProfile, Ctx], "Schedule | None"]

# ---- moe_fused (expert-parallel section as a piece pipeline) ---------------------------------------


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
    if config.get("transport") == "p2p":
        if config.get("experts") == "fused":
            ratio = profile_extra(profile, "expert_kernel_vs_bmm", 0.0, "moe")
            return moe_fused_copy_engine(site, profile, ctx, ratio) if ratio > 0 else None
        return moe_fused_copy_engine(site, profile, ctx)
    W = max(1, site.world)
    source = config.get("split") == "source"
    p = W if source else max(1, int(config.get("pieces", 1)))
    slow_g, slow_c = profile.contention["gemm_slowdown"], profile.contention["comm_slowdown"]
    e = gemm_ms(site, profile) / p * (slow_g if p > 1 else 1.0)
    nbytes = site.coll_bytes() / (W - 1) if source and W > 1 else site.coll_bytes() / p
    moves = [i for i in range(p) if not (source and i == 0)]  # pieces with a transfer
    calls = 0

    def call(contended: bool) -> float:
        nonlocal calls
        calls += 1
        return comm_call_ms(site, profile, nbytes, ctx, contended=contended, launch=calls > 1)

    events, t_comm, d_end = [], 0.0, {}
    for i in moves:
        d = call(contended=i > 0)
        events.append(Event("comm", f"dispatch {i}", t_comm, t_comm + d))
        t_comm += d
        d_end[i] = t_comm
    t_exp = 0.0
    for i in range(p):
        start = max(t_exp, d_end.get(i, 0.0))
        events.append(Event("compute", f"experts {i}", start, start + e))
        t_exp = start + e
        if i in d_end:
            c_start = max(t_comm, t_exp)
            c = call(contended=i < p - 1)
            events.append(Event("comm", f"combine {i}", c_start, c_start + c))
            t_comm = c_start + c
    base = baseline(site, profile, ctx)
    how = f"{W} source pieces (own first)" if source else f"{p} capacity pieces"
    return Schedule(max(t_comm, t_exp) + moe_save_ms(site, profile), events, base.bound_ms if base else None,
                    f"{how} of {nbytes / 2**20:.1f} MiB")


def moe_save_ms(site: Site, profile: HardwareProfile) -> float:
    """A training section's saved intermediates, copied out of each piece into the layout backward
    reads (reference.Saved): one read and one write of them."""
    return hbm_ms(profile, 2 * site.saved_bytes)


def moe_fused_copy_engine(site: Site, profile: HardwareProfile, ctx: Ctx, fused_ratio: float | None = None
                          ) -> Schedule | None:
    """``{"split": "source", "transport": "p2p"}`` (templates/moe_fused/kernels.py): the source
    pieces over the copy engine. Before any GEMM: the W-1 peers' slots staged into the symmetric
    buffer (read + write) and one handshake. The copy stream pulls the W-1 peer pieces back to
    back (the copy curve, one copy at a time), then pushes each result home once its experts are
    done. The compute stream: the own tokens' first half, each peer piece once pulled, the own
    second half; expert GEMMs run ``copy_engine_slowdown`` slower while a copy runs beside them.
    Last, the W-1 returned pieces copied into the output (read + write) after one handshake.

    ``fused_ratio`` (``"experts": "fused"``, expert_kernel.py, its measured time over bmm's): one
    persistent kernel, the own tokens whole and first (plus their local copy), a peer piece's
    tiles once it has landed (its per-expert chunks, which let tiles start earlier, are not
    credited), each piece's result pushed when its tiles are counted; the last push has nothing
    left to hide behind.
    Not yet measured on a GPU."""
    W = max(1, site.world)
    piece_bytes = site.coll_bytes() / W
    xfer = comm_call_ms(site, profile, piece_bytes, ctx, collective="copy_engine", contended=False)
    slow = copy_engine_slowdown(profile)
    e_piece = slice_ms(site, profile, max(1, site.m // W))
    sync = peer_sync_ms(profile)
    stage = hbm_ms(profile, 2 * (W - 1) * piece_bytes) + sync
    events = [Event("compute", "stage peer slots + handshake", 0.0, stage)]
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
    if fused:
        e_piece *= fused_ratio
        own_copy = hbm_ms(profile, 2 * piece_bytes)
        t = experts("experts own (fused kernel)", stage + own_copy, e_piece)
    else:
        t = experts("experts own[0]", stage, e_piece / 2)
    for k, ready in enumerate(pulled, start=1):
        t = experts(f"experts {k}", max(t, ready), e_piece)
        start = max(t, t_copy)
        events.append(Event("comm", f"push {k}", start, start + xfer))
        t_copy = start + xfer
    if not fused:
        t = experts("experts own[1]", t, e_piece / 2)
    place = hbm_ms(profile, 2 * (W - 1) * piece_bytes)
    start = max(t, t_copy + sync if W > 1 else t)
    events.append(Event("compute", "place returned pieces", start, start + place))
    base = baseline(site, profile, ctx)
    return Schedule(start + place + moe_save_ms(site, profile), events, base.bound_ms if base else None,
                    f"{W} source pieces over the copy engine: {xfer:.4f} ms per piece each way, "
                    f"experts {e_piece:.4f} ms per piece")


MODELS: dict[str, Model] = {
    "signal_reorder": signal_reorder,
    "p2p_ring": p2p_ring,
    "priority_stream": priority_stream,
    "tile_fused": tile_fused,
    "moe_fused": moe_fused,
}

# Transports that need every rank of the group on one node with peer access (symmetric memory,
# peer copies). A config is judged by its "transport" key; these templates need it always.
PEER_TRANSPORTS = ("p2p", "symm_mem", "copy_engine")
PEER_ONLY_TEMPLATES = ("tile_fused",)  # moe_fused's pieces: NCCL unless "transport": "p2p"


def needs_peer_access(template: str, config: dict | None) -> bool:
    if template in PEER_ONLY_TEMPLATES:
        return not (config and config.get("transport") == "nccl")
    return bool(config) and config.get("transport") in PEER_TRANSPORTS
