"""tile_fused on NVIDIA GPUs: TileLink-style (MLSys '25) tile-fused GEMM + reduce-scatter and
all-gather + GEMM over torch symmetric memory, in stock Triton (primitives.py). Runs the ops
(``run``, ``run_allgather``) and re-exports jit_kernels.py and launch.py.

    RS  comm stream (highest priority): barrier, push, reduce;  compute stream: GEMM;  join
    AG  comm stream: barrier, my shard into my symmetric buffer, barrier (the compute stream waits
        for these), then per peer r+1, r+2, ... a copy-engine pull into the gathered matrix +
        rank notify;  compute stream: my shard into the gathered matrix, the fused GEMM of the
        first consumer (per-tile waits, ``AG_FREE_SMS`` left free), the flag reset; other
        consumers as plain GEMMs after the join

Signals return to zero after every call (waits consume; AG chunk flags reset by a memset), so a
call is capturable and a replay is a fresh call. Waits are bounded (plan.timeout_ms); a failed
wait makes every later one return at once and ``check_errors`` raises TileWaitTimeout.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ...tiling import TileGrid
from ..plans import AllGatherGemmPlan, GemmCollectivePlan, allreduce_stripes
from . import primitives as P
from .reference import check_config, check_plan, stripe_grid
from .jit_kernels import MODE_AG, MODE_RS, SR, _HAVE_TRITON, tl, triton  # noqa: F401  (re-exported)
from .launch import (  # noqa: F401  (re-exported: kernels.<name>)
    TEMPLATE, TileWaitTimeout, _after_call, _comm_stream, _driver_checked, _err, _err_buf, _err_host, _fallbacks,
    _first_call, _format_error, _gemm_cfg, _grown, _launch_gemm, _launch_small, _loaded, _local, _num_sms, _state_lock,
    _streams, _stream_driver, _symm, _symm_api, _symm_ok, _T, _timeouts, _use_asm, _warmed, _zeros_cached, available,
    barrier, check_errors, stream_notify, usable)

if _HAVE_TRITON:
    from .jit_kernels import (  # noqa: F401  (re-exported: kernels.<name>)
        _barrier_kernel, _gather_kernel, _notify_kernel, _push_kernel, _reduce_kernel, _sub_tile_layout,
        _tile_gemm_kernel, _wait_kernel, rank_ordered_jit)


# ------------------------------------------------------------------------------------------
# The ops
# ------------------------------------------------------------------------------------------

def run(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
        plan: GemmCollectivePlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMM + reduce-scatter: my reduced stripe as [outer*chunk, n] rows; GEMM + all-reduce:
    [m, n] (the reduce-scatter over W row stripes, the reduced tiles pushed to every peer)."""
    from ...runtime.comm import resolve_group

    check_plan(plan)
    key = (plan.kind, a.device.index, group_name, plan.to_json(), a.dtype, bias is not None, a.stride(), b.stride())
    _first_call(key, resolve_group(group_name), a.device, lambda: _run_rs(a, b, bias, group_name, plan))
    return _run_rs(a, b, bias, group_name, plan, out)


def gather_grid(sms: int, comm_ctas: int, world: int, tiles: int) -> int:
    """CTAs of the all-reduce's gather kernel: one per peer tile, at most the SM count, at least
    the reduce-scatter's comm CTAs."""
    return max(1, min(max(comm_ctas, sms), (world - 1) * tiles))


def _rs_buffers(group_name: str, plan: GemmCollectivePlan, grid: TileGrid, dtype: torch.dtype, device: torch.device,
                gather: bool) -> tuple:
    """A call's part of its site's buffers: ``(recv, recv_tbl, arrived, arrived_tbl, ready,
    gathered)``. ``recv``: [W*T, BM, BN] tiles the peers push into, ``arrived``: an int32 flag per
    tile the peers raise, each with its table of every rank's address of it; ``ready``: the local
    flags the GEMM raises; ``gathered``: the all-reduce's ``(gat, gat_tbl, done, done_tbl)``, the
    same pair for the reduced tiles, else None. One set per (group, N, tile, W, dtype) whatever M
    and K, each grown to the largest call (``_grown``) and a call using its start (``face``: the
    buffer's own address, which the tables hold), so a symbolic site's lengths do not each add one."""
    tiles, bm, bn = plan.world * grid.num_tiles, grid.block_m, grid.block_n
    tag = f"n{plan.n}/{bm}x{bn}/w{plan.world}"

    # The flags are shared across M like the data: every call leaves them at 0, so the next call,
    # whatever its tile numbering, starts from zeros (no epochs). Each is raised once a call and
    # consumed once (P.consume subtracts the wait's target): ready[slot] by the GEMM, consumed by
    # the push (peer stripes) or the reduce (mine); arrived[q*T+t] by peer q's push, done[q*T+t]
    # by its reduce, consumed by my reduce and gather; flags past W*T are not touched. A peer
    # signals my flags in the next call only once past its call-start barrier, which needs my
    # arrival, queued on my comm stream behind this call's reduce and gather; my next GEMM follows
    # this call's join. A grown buffer starts zeroed; the smaller, kept for captured graphs,
    # keeps the zeros its last call left. (A timed-out wait leaves its call's flags as they were,
    # for one M as for many: check_errors.)
    def grown(name: str, shape: tuple[int, ...], dt: torch.dtype, zero: bool = False) -> tuple:
        buf = _grown(group_name, f"{name}/{tag}", math.prod(shape), dt, device, zero)
        return _symm_api().face(buf.local, shape), buf

    recv, recv_buf = grown("recv", (tiles, bm, bn), dtype)
    arrived, arrived_buf = grown("arrived", (tiles,), torch.int32, zero=True)
    # local, as many as arrived: one set per capacity (a captured graph may address a smaller one)
    cap = arrived_buf.local.numel()
    ready = _zeros_cached(("ready", device.index, group_name, tag, cap), cap, device)[:tiles]
    if not gather:
        return recv, recv_buf.ptrs, arrived, arrived_buf.ptrs, ready, None
    gat, gat_buf = grown("gather", (tiles, bm, bn), dtype)
    done, done_buf = grown("done", (tiles,), torch.int32, zero=True)
    return recv, recv_buf.ptrs, arrived, arrived_buf.ptrs, ready, (gat, gat_buf.ptrs, done, done_buf.ptrs)


def _run_rs(a, b, bias, group_name: str, plan: GemmCollectivePlan, out: torch.Tensor | None = None) -> torch.Tensor:
    from ...runtime.comm import resolve_group

    gather = plan.kind == "gemm_allreduce"
    if gather:
        plan = allreduce_stripes(plan)  # the reduce-scatter half; the reduce CTAs push the gather
    device = a.device
    capturing = torch.cuda.is_current_stream_capturing()
    if not capturing:
        check_errors(device, synchronize=False)
    pg = resolve_group(group_name)
    rank, w = pg.rank(), plan.world
    grid = stripe_grid(plan)
    T, bm, bn = grid.num_tiles, grid.block_m, grid.block_n
    cfg = _gemm_cfg(device, plan.m, plan.n, plan.k, a.dtype, plan)
    ctas = max(1, min(int(plan.config.get("comm_ctas", 8)), T))
    programs = max(1, min(_num_sms(device) - ctas, w * T))
    recv, recv_tbl, arrived, arrived_tbl, ready, gathered = _rs_buffers(group_name, plan, grid, a.dtype, device,
                                                                        gather)
    part = torch.empty(w * T, bm, bn, dtype=a.dtype, device=device)
    if out is None:
        out = torch.empty((w if gather else 1) * plan.result_rows, plan.n, dtype=a.dtype, device=device)
    # unused without the gather (GATHER=False)
    gat, gat_tbl, done, done_tbl = gathered or (part, recv_tbl, arrived, arrived_tbl)
    mine = out[rank * plan.chunk:(rank + 1) * plan.chunk] if gather else out
    err = _err_buf(device)
    tus, polls = _timeouts(plan)
    compute, comm = torch.cuda.current_stream(device), _comm_stream(device)
    comm.wait_stream(compute)
    sub_m = min(bm, 32 if bn <= 128 else 16)
    with torch.cuda.stream(comm):
        # Peers may write my receive buffer only after I finished reading it in the last call.
        barrier(group_name, device, w, rank, plan.timeout_ms)
        _launch_small("push", _push_kernel, (ctas,), part, ready, recv_tbl, arrived_tbl, arrived, err,
                      T, w, rank, tus, polls, BM=bm, BN=bn, SUB_M=sub_m, num_warps=4)
    stripes_contig = plan.outer == 1 or plan.chunk % bm == 0
    part_view = part.view(w * T * bm, bn)
    _launch_gemm(MODE_RS, a, b, bias, part, ready, grid.rows, plan.n, plan.k, T, w, rank, plan.chunk, programs,
                 cfg, stripes_contig, True, part_view, plan)
    with torch.cuda.stream(comm):
        scale = 1.0 / w if plan.reduce_op == "avg" else 1.0
        _launch_small("reduce", _reduce_kernel, (ctas,), part, ready, recv, arrived, mine, err,
                      gat_tbl, gat, done_tbl, done, grid.rows, plan.n, out.stride(0), T, w, rank, tus, polls, scale,
                      BM=bm, BN=bn, SUB_M=sub_m, GROUP_M=grid.group_m, GATHER=gather, num_warps=4)
        if gather:
            # queued behind the reduce CTAs, which finish with my own stripe, the GEMM's last: the
            # GEMM is done by then and the copy-out may take every SM
            gather_ctas = gather_grid(_num_sms(device), ctas, w, T)
            _launch_small("gather", _gather_kernel, (gather_ctas,), gat, done, out, err, grid.rows, plan.n, out.stride(0),
                          plan.chunk, T, w, rank, tus, polls, BM=bm, BN=bn, SUB_M=sub_m, GROUP_M=grid.group_m,
                          num_warps=4)
    compute.wait_stream(comm)  # the join (templates/base.py: no record_stream)
    _after_call(device, "gemm_allreduce" if gather else "gemm_reducescatter")
    return out


def run_allgather(shard: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None], group_name: str,
                  plan: AllGatherGemmPlan, outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """All-gather + GEMMs: returns [gathered, y_0, y_1, ...]; y_0's GEMM is fused with the gather."""
    from ...runtime.comm import resolve_group

    key = ("ag", shard.device.index, group_name, plan.to_json(), shard.dtype, tuple(b.stride() for b in bs))
    _first_call(key, resolve_group(group_name), shard.device,
                lambda: _run_ag(shard, bs, biases, group_name, plan))
    return _run_ag(shard, bs, biases, group_name, plan, outs)


def _run_ag(shard, bs, biases, group_name: str, plan: AllGatherGemmPlan,
            outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    from ...runtime.comm import resolve_group

    check_config(plan.config)
    device = shard.device
    if not torch.cuda.is_current_stream_capturing():
        check_errors(device, synchronize=False)
    pg = resolve_group(group_name)
    rank, w, st = pg.rank(), plan.world, plan.stripes
    shard = shard.contiguous()
    rows_local = st.stripe_rows
    c = plan.config
    bm, bn = c["block_m"], c["block_n"]
    # my shard where the peers pull it from: one buffer for every M (a barrier orders each call's
    # staging after the peers' pulls of the last one)
    staged = _grown(group_name, f"shard/k{plan.k}/w{w}", rows_local * plan.k, shard.dtype, device)
    mine = _symm_api().face(staged.local, (rows_local, plan.k))
    arrived = _zeros_cached(("ag", device.index, group_name), w, device)
    given = outs
    gathered = given[0] if given else torch.empty(plan.m, plan.k, dtype=shard.dtype, device=device)
    compute, comm = torch.cuda.current_stream(device), _comm_stream(device)
    comm.wait_stream(compute)
    with torch.cuda.stream(comm):
        barrier(group_name, device, w, rank, plan.timeout_ms)  # peers finished pulling my last shard
        mine.copy_(shard)
        barrier(group_name, device, w, rank, plan.timeout_ms)  # every shard is in its symmetric buffer
    # The ranks meet before the persistent GEMM starts (stream order): queued behind a GEMM that
    # holds every SM and spins on the chunks, the second barrier kernel found no SM slot, so no
    # pull began and the GEMM's wait timed out ("rank 1 ... read 0"). After this point the comm
    # stream holds only copies and flag writes, which need no SM (see ag_programs).
    compute.wait_stream(comm)
    with torch.cuda.stream(comm):
        for j in range(1, w):
            src = (rank + j) % w
            peer = _symm_api().face(staged.peer(src), (rows_local, plan.k))
            P.rank_copy_data(_stripe_pieces(gathered, st, src), _shard_pieces(peer, st), arrived, src, stream_notify)
    for piece, part in zip(_stripe_pieces(gathered, st, rank), _shard_pieces(shard, st)):
        piece.copy_(part)  # my rows: no wait
    outs = []
    n0 = plan.ns[0]
    y0 = given[1] if given else torch.empty(plan.m, n0, dtype=shard.dtype, device=device)
    grid = TileGrid(rows_local, n0, bm, bn, c.get("group_m", 8))
    cfg = _gemm_cfg(device, plan.m, n0, plan.k, shard.dtype, plan)
    programs = ag_programs(_num_sms(device), w, grid.num_tiles)
    contig = plan.outer == 1 or plan.chunk % bm == 0
    _launch_gemm(MODE_AG, gathered, bs[0], biases[0], y0, arrived, rows_local, n0, plan.k, grid.num_tiles, w, rank,
                 plan.chunk, programs, cfg, contig, plan.chunk % bm == 0, y0, plan)
    arrived.zero_()  # every tile that waited has read its flag (the GEMM is done): back to zero
    compute.wait_stream(comm)
    outs.append(y0)
    for i, (b, bias) in enumerate(zip(bs[1:], biases[1:]), start=2):
        y = given[i] if given else None
        outs.append(torch.addmm(bias, gathered, b, out=y) if bias is not None else torch.mm(gathered, b, out=y))
    _after_call(device, "allgather_gemm")
    return [gathered] + outs


AG_FREE_SMS = 1  # SMs the all-gather's persistent GEMM leaves free


def ag_programs(sms: int, world: int, tiles: int) -> int:
    """CTAs of the all-gather's persistent GEMM: one per tile, at most every SM but
    ``AG_FREE_SMS``. Its CTAs spin until the peers' chunks land; what lands them (a peer copy the
    driver may run as a kernel, the notify kernel where no stream memory operation is available)
    must find an SM, or the spin outlasts its bound."""
    return max(1, min(sms - AG_FREE_SMS, world * tiles))


def _stripe_pieces(x: torch.Tensor, st: Any, k: int) -> list[torch.Tensor]:
    """Stripe k of the row-major matrix x as contiguous pieces (one per outer block)."""
    v = x.view(st.outer, st.world, st.chunk, x.shape[-1])
    return [v[o, k] for o in range(st.outer)]


def _shard_pieces(x: torch.Tensor, st: Any) -> list[torch.Tensor]:
    v = x.reshape(st.outer, st.chunk, x.shape[-1])
    return [v[o] for o in range(st.outer)]
