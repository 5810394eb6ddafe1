"""signal_reorder's latency model (FlashOverlap, arXiv 2504.19519, §4 Algorithm 1), and the
search of its candidate configurations, built from predictor/models.py.

One persistent GEMM of ``programs = (SMs - NCCL SMs) * blocks/SM`` programs (rounded down to a
multiple of the stripe count) walks its tiles in ``T = ceil(tiles / programs)`` waves, cut into
groups ``G1..GP``; group i's collective starts once its last wave and the previous collective end::

    t_p += |G_i| * t_wave                    # compute time when group i is complete
    t_m  = max(t_p, t_m) + comm(bytes(G_i))  # its collective, serialised on the comm stream

The prediction is the final ``t_m``; ``t_wave`` is scaled by ``gemm_slowdown_reserved``, ``comm``
by ``comm_slowdown`` (not the last group) plus launch (not the first). ``best_wave_partitions``
finds the best partition exactly; ``CONFIGS`` lists the best per group count.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from ...predictor.models import Ctx, Event, Schedule, Site, comm_call_ms, gemm_ms, overlap_bound
from ...predictor.gemm_table import Kernel
from ...predictor.profile import HardwareProfile
from ...tiling import cdiv

MAX_LISTED_GROUPS = 6  # best partition listed per group count up to this
# the partition search is O(groups x waves^2); beyond this many waves (a CPU
# profile's few "SMs" on a GPU-sized GEMM: thousands) it runs on units of several waves
MAX_SEARCHED_WAVES = 128


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
    waves = geo.waves
    memo: dict = {}

    def comm(a: int, b: int, last: bool) -> float:
        key = (b - a, b == waves, last, a == 0)
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
# fused consumer (pointwise / reduction readers: Site.output_fuses), nothing: Inductor fuses the
# gather into the consumer's own read (benchmarks/diagnostics/reorder_consumer.py measures it).
# Materialised for any other reader (a GEMM, a collective, the graph output): a copy, read + write = 2.
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


MODEL = signal_reorder
CONFIGS = signal_reorder_configs
