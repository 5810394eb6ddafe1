"""signal_reorder, step by step on any device (the oracle for the GPU kernel).

FlashOverlap (EuroSys '26): one GEMM walks its output tiles in a fixed order shared by every
rank (exec id e runs on program e % P in wave e // P). Each tile is stored at its *send slot*
(tiling.WaveSchedule.send_slot), making every wave group one contiguous slice laid out as the
collective needs; when a group is done the unchanged collective runs on it while the GEMM goes
on. tiling.untile un-reorders the receive buffer as graph glue.

    all-reduce       send = recv = [T, BM, BN], tile t at slot t; all_reduce per group slice
    reduce-scatter   exec e = (local tile e // W of stripe e % W); group slice = [W, n_g, BM, BN];
                     reduce_scatter per slice -> recv[l] = reduced local tile l of my stripe
    all-to-all       same send layout; all_to_all per slice -> recv[j, l] = tile l of source j
"""
from __future__ import annotations

import torch

from ...runtime import comm
from ...tiling import TileGrid, WaveSchedule, subtile_rows
from ..base import gemm_tile
from ..plans import GemmCollectivePlan


def is_subtile(plan: GemmCollectivePlan) -> bool:
    """Reduce-scatter in FlashOverlap's subtile form (tiling.subtile_rows): tiles in plain order over
    the whole matrix, each split into W row subtiles; only where the pass moved the row fix past a
    later all-gather (passes.find records that path)."""
    return plan.kind == "gemm_reducescatter" and plan.config.get("rs_layout", "stripes") == "subtile"


def layout(plan: GemmCollectivePlan) -> tuple[TileGrid, WaveSchedule]:
    """The tile grid (of the full matrix for all-reduce and subtile RS, of one stripe otherwise)
    and schedule."""
    c = plan.config
    stripes = 1 if plan.kind == "gemm_allreduce" or is_subtile(plan) else plan.world
    rows = plan.m if stripes == 1 else plan.outer * plan.chunk
    grid = TileGrid(rows, plan.n, c["block_m"], c["block_n"], c["group_m"])
    sched = WaveSchedule(grid.num_tiles * stripes, c["programs"], tuple(c["wave_groups"]), stripes)
    return grid, sched


def out_shape(plan: GemmCollectivePlan) -> tuple[int, ...]:
    grid, _ = layout(plan)
    if is_subtile(plan):
        sub = subtile_rows(grid, plan.world)
        return (grid.num_tiles, sub.block_m, sub.block_n)
    tiles = (grid.num_tiles, grid.block_m, grid.block_n)
    return (plan.world, *tiles) if plan.kind == "gemm_alltoall" else tiles


def compute_tile(a, b, bias, plan: GemmCollectivePlan, grid: TileGrid, sched: WaveSchedule, e: int) -> torch.Tensor:
    """Exec id e's output tile, zero-padded to [BM, BN]."""
    local, stripe = divmod(e, sched.stripes)
    rs, cs = grid.row_col_ranges(local)
    if sched.stripes > 1:
        # rows of stripe k as global row indices (tiling.RowStripes.global_row)
        rows = plan.stripes.global_row(stripe, torch.arange(rs.start, rs.stop))
    else:
        rows = rs
    tile = a.new_zeros(grid.block_m, grid.block_n)
    tile[: rs.stop - rs.start, : cs.stop - cs.start] = gemm_tile(a, b, bias, rows, cs)
    return tile


def run(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
        plan: GemmCollectivePlan) -> torch.Tensor:
    grid, sched = layout(plan)
    if is_subtile(plan):
        return _run_subtile(a, b, bias, group_name, plan, grid, sched)
    send = a.new_empty(sched.num_exec, grid.block_m, grid.block_n)
    pending = []
    for start, stop in sched.exec_ranges():
        for e in range(start, stop):
            send[sched.send_slot(e)] = compute_tile(a, b, bias, plan, grid, sched, e)
        group = send[start:stop]
        if plan.kind == "gemm_allreduce":
            pending.append(comm.start_all_reduce(group, plan.reduce_op, group_name))
        elif plan.kind == "gemm_reducescatter":
            pending.append(comm.start_reduce_scatter(group, plan.reduce_op, plan.world, group_name))
        else:
            pending.append(comm.start_all_to_all(group, plan.world, group_name))
    done = [comm.wait(t) for t in pending]
    if plan.kind != "gemm_alltoall":
        return torch.cat(done)
    per_source = [t.view(plan.world, -1, grid.block_m, grid.block_n) for t in done]
    return torch.cat(per_source, dim=1)


def _run_subtile(a, b, bias, group_name, plan, grid, sched) -> torch.Tensor:
    """Per wave group [s, e): the k-th row subtile of each tile goes to chunk k of the group's
    send slice ([W, e - s, BM/W, BN]); a reduce-scatter of that slice leaves rank k the summed
    k-th subtiles of the group's tiles, in tile order."""
    w, sub_m = plan.world, grid.block_m // plan.world
    send = a.new_empty(sched.num_exec * w, sub_m, grid.block_n)
    pending = []
    for start, stop in sched.exec_ranges():
        n = stop - start
        for e in range(start, stop):
            tile = compute_tile(a, b, bias, plan, grid, sched, e).view(w, sub_m, grid.block_n)
            for k in range(w):
                send[start * w + k * n + (e - start)] = tile[k]
        pending.append(comm.start_reduce_scatter(send[start * w:stop * w], plan.reduce_op, w, group_name))
    return torch.cat([comm.wait(t) for t in pending])
