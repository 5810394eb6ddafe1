"""The pieces every latency model is built from, and the model of a site as written (``baseline``).

A latency model (``MODEL(site, config, profile, ctx) -> Schedule | None`` in each template's
``templates/<name>/model.py``, found through ``templates.get_model``) takes a site under a
configuration to a ``Schedule``: the predicted end (ms), the bars of a two-lane Gantt chart
(``compute``: the GEMM or its pieces; ``comm``: each collective call) and the overlap bound. Its
inputs are the ``HardwareProfile``'s GEMM times, collective curves, per-call launch cost and
contention factors; ``pipeline`` chains pieces over the two lanes. Without a model,
``rank_configs`` falls back to the template's ``spec.predict``.

``baseline``: the site as written, GEMM(s) then one collective call (all-gather: the collective
first), ``T = g + c``; a site's first collective call is enqueued while its GEMM runs, every
further call (a template's groups, chunks, ring steps) pays ``profile.launch(mode)``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .profile import HardwareProfile

COLLECTIVE_OF = {
    "gemm_allreduce": "all_reduce",
    "gemm_reducescatter": "reduce_scatter",
    "gemm_alltoall": "all_to_all",
    "allgather_gemm": "all_gather",
    "moe": "all_to_all",
}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def dtype_name(dtype: Any) -> str:
    """A torch dtype by the name the profiles and the models use ("bfloat16", ...)."""
    return str(dtype).replace("torch.", "")


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
    # of those, what a bmm piece pipeline copies out rather than writes in place: the experts'
    # input (its GEMMs and the elementwise kernel write gate, up and act where backward reads them)
    saved_copy_bytes: int = 0

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
        return Site(match.kind, tuple(tuple(g) for g in match.gemms()), int(match.world_size),
                    dtype_name(match.dtype), cross_node, bool(getattr(match, "output_fuses", False)),
                    moe_saved_bytes(match), moe_saved_bytes(match, roles=("tokens",)))

    @staticmethod
    def from_report(site: Any, cross_node: bool = False) -> "Site":
        return Site(site.kind, tuple(tuple(g) for g in site.gemms), int(site.world_size), site.dtype, cross_node,
                    bool(getattr(site, "output_fuses", False)))


def moe_saved_bytes(match: Any, roles: tuple[str, ...] | None = None) -> int:
    """Bytes of the intermediates a training MoE section saves for backward (Match.saved_nodes):
    the experts' input [E, W*C, H] and the [E, W*C, F] up-projections / product (``roles``: of
    those roles only)."""
    saved = [r for r in (getattr(match, "saved_nodes", None) or {}) if roles is None or r in roles]
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


def slice_ms(site: Site, profile: HardwareProfile, rows: int, kernel: str | None = None) -> float:
    """One row slice of the site's GEMM(s), as the templates cut it (chunks, ring pieces,
    stripes): the whole GEMM's time in proportion to the slice's rows, plus a kernel's fixed cost
    (the profile's GEMM floor) for each slice beyond one, so W slices take the whole GEMM's time and
    (W - 1) floors. cuBLAS picks other tiles for fewer rows, so a slice keeps the whole GEMM's rate
    rather than its own wave quantisation; benchmarks/diagnostics/split_gemm.py measures the pieces,
    and tests/test_predictor_physics.py holds this price to its committed rows."""
    total = 0.0
    for gm, gn, gk in site.gemms:
        whole = profile.gemm.ms(gm, gn, gk, site.dtype, kernel)
        share = min(1.0, rows / gm)
        total += whole * share + profile.gemm.floor_ms * (1.0 - share)
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
    """A copy or elementwise pass moving ``nbytes`` through HBM (reads + writes) at the bandwidth a
    copy kernel reaches (``gemm.copy_gbps``, measured; on H200 about 85% of the HBM's peak,
    benchmarks/diagnostics/standin_copies.py). Profiles without it: ``gemm.mem_gbps``, the peak."""
    return nbytes / (copy_gbps(profile) * 1e9) * 1e3


def copy_gbps(profile: HardwareProfile) -> float:
    """GB/s (read + written) of a device-to-device copy kernel on the profile's GPU."""
    return profile_extra(profile, "copy_gbps", profile.gemm.mem_gbps, "gemm")


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


def hidden_beside(comm: float, compute: float, profile: HardwareProfile) -> float:
    """ms saved when ``compute`` ms of independent GEMMs run beside a collective of ``comm`` ms
    instead of after it (passes/defer_compute.py): each slows the other while both run
    (``comm_slowdown``, ``gemm_slowdown``), so the pair takes max(comm slowed, compute slowed for
    as long as the collective lasts) where one after the other took comm + compute."""
    if comm <= 0 or compute <= 0:
        return 0.0
    c = comm * profile.contention["comm_slowdown"]
    both = max(c, slowed(compute, c, profile.contention["gemm_slowdown"]))
    return max(0.0, comm + compute - both)


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


def shifted(events: list[Event], head: float, label: str) -> list[Event]:
    """The events of a schedule that starts ``head`` ms later, behind a compute bar of that length."""
    if head <= 0:
        return events
    return [Event("compute", label, 0.0, head)] + [Event(e.lane, e.label, e.start + head, e.end + head) for e in events]


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


Model = Callable[[Site, dict, HardwareProfile, Ctx], "Schedule | None"]
