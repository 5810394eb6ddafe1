"""tile_fused, step by step on any device: the CPU oracle of kernels.py (runs over gloo), with
the GPU kernels' tile schedule (tiling.RankOrderedTiles) and point-to-point messages standing in
for the peer pushes and copy-engine pulls:

    GEMM + reduce-scatter   rank r computes its partial GEMM tile by tile, stripe (r+1) % W first and
                            its own stripe r last, each tile rounded to the output dtype; a finished
                            peer stripe d goes to rank d. Rank r's result = its own partial stripe +
                            the W-1 received ones, summed in fp32 and rounded once.
    all-gather + GEMM       own shard's tiles first; the shards of ranks r+1, r+2, ... arrive in
                            that order and their tiles are computed as they land.
    GEMM + all-reduce       the reduce-scatter above over W row stripes (m a multiple of W), then
                            the all-gather above of the reduced stripes, with no GEMM.

Returns what the op returns: ``[result_rows, n]``, ``[m, n]`` or ``[gathered, y_0, y_1, ...]``.
"""
from __future__ import annotations

import torch

from ...tiling import RankOrderedTiles, TileGrid, untile
from ..base import gemm_tile
from ..plans import AllGatherGemmPlan, GemmCollectivePlan, allreduce_gather, allreduce_stripes
from ..p2p_ring.reference import Ring

TEMPLATE = "tile_fused"
CONFIG_KEYS = ("block_m", "block_n", "group_m", "comm_ctas")
REDUCE_OPS = ("sum", "avg")
KINDS = ("gemm_reducescatter", "gemm_allreduce", "allgather_gemm")


def config_problem(config) -> str | None:
    """Why ``config`` is not a valid tile_fused configuration (None: valid)."""
    if not isinstance(config, dict):
        return f"config must be a dict with keys {list(CONFIG_KEYS)}, got {config!r}"
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        return f"unknown config keys {unknown}; allowed: {list(CONFIG_KEYS)}"
    for key in ("block_m", "block_n"):
        v = config.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            return f"config {key!r} must be a power of two >= 16 (a Triton block), got {v!r}"
    for key in ("group_m", "comm_ctas"):
        v = config.get(key, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"config {key!r} must be an integer >= 1, got {v!r}"
    return None


def check_config(config) -> None:
    problem = config_problem(config)
    if problem:
        raise ValueError(f"{TEMPLATE}: {problem}")


def check_plan(plan: GemmCollectivePlan) -> None:
    """A GEMM + collective plan this template can run (config, kind, reduce op), else ValueError."""
    check_config(plan.config)
    if plan.kind not in ("gemm_reducescatter", "gemm_allreduce"):
        raise ValueError(f"{TEMPLATE} does not implement {plan.kind} (it implements {', '.join(KINDS)})")
    if plan.reduce_op not in REDUCE_OPS:
        raise ValueError(f"{TEMPLATE}: reduce op {plan.reduce_op!r} not supported (supported: {list(REDUCE_OPS)})")


def stripe_grid(plan: GemmCollectivePlan | AllGatherGemmPlan) -> TileGrid:
    """The tile grid of one row stripe (``outer * chunk`` rows) of the GEMM output."""
    c = plan.config
    n = plan.n if isinstance(plan, GemmCollectivePlan) else max(plan.ns)
    return TileGrid(plan.outer * plan.chunk, n, c["block_m"], c["block_n"], c.get("group_m", 8))


def tile_rows(plan, grid: TileGrid, stripe: int, t: int) -> tuple[torch.Tensor, slice, int]:
    """Global rows (tensor), columns and number of valid rows of local tile ``t`` of ``stripe``."""
    rs, cs = grid.row_col_ranges(t)
    return plan.stripes.global_row(stripe, torch.arange(rs.start, rs.stop)), cs, rs.stop - rs.start


# ---- GEMM + reduce-scatter --------------------------------------------------------------------

def out_shape(plan: GemmCollectivePlan) -> tuple[int, int]:
    return (plan.result_rows, plan.n)


def run(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str,
        plan: GemmCollectivePlan) -> torch.Tensor:
    check_plan(plan)
    if plan.kind == "gemm_allreduce":
        mine = run(a, b, bias, group_name, allreduce_stripes(plan))
        return run_allgather(mine, [], [], group_name, allreduce_gather(plan))[0]
    ring = Ring(group_name, plan.world, plan.timeout_ms, template=TEMPLATE)
    r, w = ring.rank, plan.world
    grid = stripe_grid(plan)
    T, bm, bn = grid.num_tiles, grid.block_m, grid.block_n
    order = RankOrderedTiles(w, r, T, first=1, channels=plan.config.get("comm_ctas", 1))
    partial = a.new_zeros(w * T, bm, bn)  # the GPU's partial buffer: tile slot(d, t), rounded to dtype
    arrivals = []
    for step in range(w):
        d = order.stripe(step * T)
        for t in range(T):
            e = step * T + t
            assert order.stripe(e) == d and order.local(e) == t
            rows, cs, nr = tile_rows(plan, grid, d, t)
            partial[order.slot(d, t), :nr, : cs.stop - cs.start] = gemm_tile(a, b, bias, rows.to(a.device), cs)
        if d != r:  # this stripe is complete: to its owner; meanwhile receive ours from rank r-1-step
            src = (r - 1 - step) % w
            buf = torch.empty_like(partial[:T])
            handle = ring.exchange(step, send=(partial[d * T:(d + 1) * T], d), recv=(buf, src))
            arrivals.append((buf, handle))
    acc = partial[r * T:(r + 1) * T].float()
    for buf, handle in arrivals:
        ring.wait(handle)
        acc += buf.float()
    ring.finish()
    if plan.reduce_op == "avg":
        acc /= w
    return untile(acc.to(a.dtype), grid).contiguous()


# ---- all-gather + GEMM ------------------------------------------------------------------------

def run_allgather(shard: torch.Tensor, bs: list[torch.Tensor], biases: list[torch.Tensor | None], group_name: str,
                  plan: AllGatherGemmPlan) -> list[torch.Tensor]:
    check_config(plan.config)
    ring = Ring(group_name, plan.world, plan.timeout_ms, template=TEMPLATE)
    r, w, st = ring.rank, plan.world, plan.stripes
    shard = shard.contiguous()
    gathered = shard.new_empty(plan.m, plan.k)
    outs = [shard.new_empty(plan.m, n) for n in plan.ns]
    # Every shard starts travelling at once (the GPU's copy engine pulls them back to back, in
    # the order r+1, r+2, ...): at step j rank r pulls from r + j, so rank r - j pulls from me.
    inbox = {}
    for j in range(1, w):
        buf = torch.empty_like(shard)
        inbox[(r + j) % w] = (buf, ring.exchange(j, send=(shard, (r - j) % w), recv=(buf, (r + j) % w)))
    for step in range(w):
        src = (r + step) % w
        if src == r:
            rows_of_src = shard
        else:
            rows_of_src, handle = inbox[src]
            ring.wait(handle)  # the rank_wait of its tiles
        st.place(gathered, src, rows_of_src)
        for y, b, bias, n in zip(outs, bs, biases, plan.ns):
            c = plan.config
            grid = TileGrid(st.stripe_rows, n, c["block_m"], c["block_n"], c.get("group_m", 8))
            order = RankOrderedTiles(w, r, grid.num_tiles, first=0)
            for t in range(grid.num_tiles):
                assert order.stripe(order.exec_id(src, t)) == src
                rows, cs, _ = tile_rows(plan, grid, src, t)
                y[rows, cs] = gemm_tile(gathered, b, bias, rows, cs)
    ring.finish()
    return [gathered] + outs
