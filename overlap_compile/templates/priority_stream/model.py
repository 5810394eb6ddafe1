"""priority_stream's latency model (resource-aware overlap). config: chunks, optional
block_m / block_n / stages. The pieces it is built from are the predictor's: predictor/models.py.

The GEMM is cut into ``chunks`` row chunks on the compute stream; chunk i's collective runs
on a high-priority stream as soon as chunk i is done (all-gather: chunk i of the gather,
then its GEMMs). Same max-plus recursion; each call pays the launch cost; GEMM pieces pay
``gemm_slowdown`` (cuBLAS at full grid) or, with an explicit tile config chosen to leave
shared-memory slack for the collective, that kernel's time and ``gemm_slowdown_reserved``.
A chunk is priced at the GEMM table's time for its rows, slower than cuBLAS pieces run alone
(``slice_ms``, diagnostics/split_gemm.py): chunks beside NCCL kernels lose more than that, and at
the slice price a W=4 all-to-all measured 0.96x on 4x H200 was predicted 1.13x
(tests/test_decide_measured.py).
"""
from __future__ import annotations

from ...predictor.models import Ctx, Schedule, Site, comm_call_ms, gemm_ms, hbm_ms, overlap_bound, pipeline
from ...predictor.profile import HardwareProfile


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


MODEL = priority_stream
