"""tile_fused's Triton kernels (TileLink, MLSys '25) on primitives.py's signals: device code only;
launch.py builds and launches them, kernels.py runs the ops with them::

    _tile_gemm_kernel  MODE_RS: exec id e -> stripe (r+1+e//T) % W, own stripe last (tiling.
                       RankOrderedTiles, first=1); tile stored at partial[slot(d, t)], then
                       producer_tile_notify(ready[slot]).
                       MODE_AG: exec id e -> stripe (r + e//T) % W, own shard first (first=0); a
                       peer stripe's tiles rank_wait(arrived[src]) before reading A; C stored at
                       the tile's global rows.
    _push_kernel       comm_ctas CTAs (channel c: exec ids c, c + C, ... of the peer stripes):
                       consumer_tile_wait(ready[slot]) -> tile_push_data into rank d's receive
                       buffer slot (r, t) -> peer_tile_notify(rank d's arrived[r*T + t]).
    _reduce_kernel     comm_ctas CTAs: own stripe tile t = own partial + W-1 received tiles (fp32,
                       rounded once) -> result rows, after consumer_tile_wait / peer_tile_waits.
    _gather_kernel     all-reduce: the peers' reduced tiles, as their peer_tile_notify lands,
                       copied from the gather buffer to their rows of the output.
    _barrier_kernel    rank_notify every peer, rank_wait every peer (consuming): orders this call's
                       writes into peers' symmetric buffers after their previous call's reads.
    _notify_kernel     rank_notify of a local flag behind a copy-engine copy (no cuStreamWriteValue32).
"""
from __future__ import annotations

from . import primitives as P

try:
    import triton
    import triton.language as tl

    from ..signal_reorder import kernels as SR  # GEMM configs, TMA operand setup, jit tiling twins

    _HAVE_TRITON = P.HAVE_TRITON
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = tl = SR = None
    _HAVE_TRITON = False

MODE_RS, MODE_AG = 0, 1


if _HAVE_TRITON:

    @triton.jit
    def rank_ordered_jit(e, rank, world, tiles, first):
        """Twin of tiling.RankOrderedTiles: exec id -> (stripe, local tile)."""
        step = e // tiles
        return (rank + first + step) % world, e - step * tiles

    @triton.jit(do_not_specialize=["timeout_us", "max_polls"])  # one variant for every bound
    def _tile_gemm_kernel(
        a_ptr, a_desc, b_ptr, b_desc, bias_ptr, c_ptr, c_desc, flags_ptr, err_ptr,
        rows, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
        tiles, world, rank, chunk, programs, timeout_us, max_polls,
        MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
        C_TMA: tl.constexpr, HAS_BIAS: tl.constexpr, FLATTEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
        USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr,
    ):
        """Persistent GEMM over ``world`` row stripes of ``rows`` rows (``tiles`` tiles each).

        MODE_RS: C is the partial buffer viewed as [W*T*BM, BN]; tile (d, t) goes to rows
        slot(d, t)*BM, then flags[slot] += 1 (release). MODE_AG: A is the gathered matrix being
        filled by the copy engine; flags[src] >= 1 (acquire) before a tile of a peer's rows reads
        A; C is [M, N] and the tile lands at its global rows. A rows: tiling.RowStripes.global_row.
        """
        pid = tl.program_id(0)
        tiles_m = (rows + BLOCK_M - 1) // BLOCK_M
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        first = 1 - MODE  # RS: peers' stripes first; AG: own shard first
        for e in tl.range(pid, tiles * world, programs, flatten=FLATTEN):
            stripe, t = rank_ordered_jit(e, rank, world, tiles, first)
            tm, tn = SR.tile_coords_jit(t, tiles_m, tiles_n, GROUP_M)
            r0 = tm * BLOCK_M
            n0 = tn * BLOCK_N
            if MODE == 1:
                if stripe != rank:
                    landed = P.rank_wait(flags_ptr, stripe, 1, err_ptr, timeout_us, max_polls, USE_ASM, USE_TIMER)
                    if A_TMA:
                        # TMA loads are async-proxy reads: ordered after the acquire only by this fence
                        P.fence_async_reads(landed, USE_ASM)
            a_row0 = SR.global_row_jit(stripe, r0, world, chunk)
            loc_rows = r0 + offs_m
            g_rows = SR.global_row_jit(stripe, loc_rows, world, chunk).to(tl.int64)
            acc = SR.tile_acc_jit(a_ptr, a_desc, b_ptr, b_desc, bias_ptr, a_row0, g_rows, loc_rows, rows, n0, N, K,
                                  stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, A_TMA, B_TMA,
                                  B_KMAJOR, HAS_BIAS, DOT_PRECISION)
            cols = n0 + offs_n
            valid = (loc_rows < rows)[:, None] & (cols < N)[None, :]
            if MODE == 0:
                slot = stripe * tiles + t
                out = tl.where(valid, acc, 0.0).to(c_ptr.dtype.element_ty)
                if C_TMA:
                    c_desc.store([slot * BLOCK_M, 0], out)
                    if USE_ASM:
                        # The TMA store must have landed (not only left shared memory) before the
                        # tile is announced; completion implies the async-proxy fence.
                        slot = SR._bulk_store_wait(slot)
                else:
                    dst = c_ptr + slot.to(tl.int64) * (BLOCK_M * BLOCK_N)
                    tl.store(dst + offs_m[:, None] * BLOCK_N + offs_n[None, :], out)
                P.producer_tile_notify(flags_ptr, slot, USE_ASM)
            else:
                out = acc.to(c_ptr.dtype.element_ty)
                if C_TMA:
                    c_desc.store([a_row0, n0], out)
                else:
                    tl.store(c_ptr + g_rows[:, None] * stride_cm + cols[None, :], out, mask=valid)

    @triton.jit(do_not_specialize=["timeout_us", "max_polls"])  # one variant for every bound
    def _push_kernel(part_ptr, ready_ptr, recv_tbl, arrived_tbl, arrived_local, err_ptr,
                     tiles, world, rank, timeout_us, max_polls,
                     BM: tl.constexpr, BN: tl.constexpr, SUB_M: tl.constexpr,
                     USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr):
        """Channel c = program id: exec ids c, c + C, ... of the W-1 peer stripes, in GEMM order."""
        c = tl.program_id(0)
        channels = tl.num_programs(0)
        ok = tl.full([], 1, tl.int32)  # a tensor (loop-carried); rank may arrive as a constexpr 1 (Triton specialises ints equal to 1)
        for e in range(c, (world - 1) * tiles, channels):
            if ok != 0:
                d, t = rank_ordered_jit(e, rank, world, tiles, 1)
                slot = d * tiles + t
                ok = P.consumer_tile_wait(ready_ptr, slot, 1, err_ptr, timeout_us, max_polls, USE_ASM, USE_TIMER)
                if ok != 0:
                    P.consume(ready_ptr + slot, 1, USE_ASM)
                    dst = P.peer_ptr(recv_tbl, d, part_ptr) + (rank * tiles + t).to(tl.int64) * (BM * BN)
                    P.tile_push_data(part_ptr + slot.to(tl.int64) * (BM * BN), dst, BM, BN, SUB_M)
                    P.peer_tile_notify(P.peer_ptr(arrived_tbl, d, arrived_local), rank * tiles + t, USE_ASM)

    @triton.jit
    def _sub_tile_layout(rows, N, BM: tl.constexpr, BN: tl.constexpr, SUB_M: tl.constexpr):
        """Tiles along M and N, and the offsets of a SUB_M-row chunk of a tile-contiguous [BM, BN]
        slot (the reduce and gather kernels move tiles SUB_M rows at a time)."""
        offs_i = tl.arange(0, SUB_M)
        offs_n = tl.arange(0, BN)
        return (rows + BM - 1) // BM, (N + BN - 1) // BN, offs_i, offs_n, offs_i[:, None] * BN + offs_n[None, :]

    @triton.jit(do_not_specialize=["timeout_us", "max_polls"])  # one variant for every bound
    def _reduce_kernel(part_ptr, ready_ptr, recv_ptr, arrived_ptr, out_ptr, err_ptr,
                       gat_tbl, gat_local, done_tbl, done_local,
                       rows, N, stride_om, tiles, world, rank, timeout_us, max_polls, scale,
                       BM: tl.constexpr, BN: tl.constexpr, SUB_M: tl.constexpr, GROUP_M: tl.constexpr,
                       GATHER: tl.constexpr, USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr):
        """Own stripe: tile t = partial[slot(r, t)] + sum of the W-1 received tiles, in fp32.
        GATHER (all-reduce): each reduced row chunk is also pushed to slot (r, t) of every peer's
        gather buffer, and the tile announced there (peer_tile_notify of done[r*T + t])."""
        c = tl.program_id(0)
        channels = tl.num_programs(0)
        tiles_m, tiles_n, offs_i, offs_n, tile_offs = _sub_tile_layout(rows, N, BM, BN, SUB_M)
        ok = tl.full([], 1, tl.int32)  # a tensor (loop-carried); rank may arrive as a constexpr 1 (Triton specialises ints equal to 1)
        for t in range(c, tiles, channels):
            if ok != 0:
                slot = rank * tiles + t
                ok = P.consumer_tile_wait(ready_ptr, slot, 1, err_ptr, timeout_us, max_polls, USE_ASM, USE_TIMER)
                for q in range(world):
                    if (q != rank) & (ok != 0):
                        ok = P.peer_tile_wait(arrived_ptr, q * tiles + t, 1, err_ptr, timeout_us, max_polls,
                                              USE_ASM, USE_TIMER)
                if ok != 0:
                    P.consume(ready_ptr + slot, 1, USE_ASM)
                    for q in range(world):
                        if q != rank:
                            P.consume(arrived_ptr + q * tiles + t, 1, USE_ASM)
                    tm, tn = SR.tile_coords_jit(t, tiles_m, tiles_n, GROUP_M)
                    cols = tn * BN + offs_n
                    for i in range(BM // SUB_M):
                        acc = tl.load(part_ptr + slot.to(tl.int64) * (BM * BN) + i * SUB_M * BN + tile_offs).to(
                            tl.float32)
                        for q in range(world):
                            if q != rank:
                                src = recv_ptr + (q * tiles + t).to(tl.int64) * (BM * BN) + i * SUB_M * BN
                                acc += tl.load(src + tile_offs).to(tl.float32)
                        r_out = tm * BM + i * SUB_M + offs_i
                        mask = (r_out < rows)[:, None] & (cols < N)[None, :]
                        val = (acc * scale).to(out_ptr.dtype.element_ty)
                        tl.store(out_ptr + r_out.to(tl.int64)[:, None] * stride_om + cols[None, :], val, mask=mask)
                        if GATHER:
                            for q in range(world):
                                if q != rank:
                                    dst = P.peer_ptr(gat_tbl, q, gat_local) + (rank * tiles + t).to(tl.int64) * (
                                        BM * BN) + i * SUB_M * BN
                                    tl.store(dst + tile_offs, val)
                    if GATHER:
                        for q in range(world):
                            if q != rank:
                                P.peer_tile_notify(P.peer_ptr(done_tbl, q, done_local), rank * tiles + t, USE_ASM)

    @triton.jit(do_not_specialize=["timeout_us", "max_polls"])  # one variant for every bound
    def _gather_kernel(gat_ptr, done_ptr, out_ptr, err_ptr, rows, N, stride_om, chunk, tiles, world, rank,
                       timeout_us, max_polls, BM: tl.constexpr, BN: tl.constexpr, SUB_M: tl.constexpr,
                       GROUP_M: tl.constexpr, USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr):
        """All-reduce: the peers' reduced tiles, as their done[q*T + t] notifies land, copied from
        the gather buffer to their rows of the output (stripe q = rows [q*chunk, (q+1)*chunk))."""
        c = tl.program_id(0)
        channels = tl.num_programs(0)
        tiles_m, tiles_n, offs_i, offs_n, tile_offs = _sub_tile_layout(rows, N, BM, BN, SUB_M)
        ok = tl.full([], 1, tl.int32)  # a tensor (loop-carried), as in the kernels above
        for e in range(c, (world - 1) * tiles, channels):
            if ok != 0:
                q, t = rank_ordered_jit(e, rank, world, tiles, 1)
                ok = P.peer_tile_wait(done_ptr, q * tiles + t, 1, err_ptr, timeout_us, max_polls, USE_ASM, USE_TIMER)
                if ok != 0:
                    P.consume(done_ptr + q * tiles + t, 1, USE_ASM)
                    tm, tn = SR.tile_coords_jit(t, tiles_m, tiles_n, GROUP_M)
                    cols = tn * BN + offs_n
                    for i in range(BM // SUB_M):
                        val = tl.load(gat_ptr + (q * tiles + t).to(tl.int64) * (BM * BN) + i * SUB_M * BN + tile_offs)
                        r_loc = tm * BM + i * SUB_M + offs_i
                        r_out = (q * chunk + r_loc).to(tl.int64)
                        mask = (r_loc < rows)[:, None] & (cols < N)[None, :]
                        tl.store(out_ptr + r_out[:, None] * stride_om + cols[None, :], val, mask=mask)

    @triton.jit(do_not_specialize=["timeout_us", "max_polls"])  # one variant for every bound
    def _barrier_kernel(flags_tbl, flags_local, err_ptr, world, rank, timeout_us, max_polls,
                        NOTIFY: tl.constexpr, WAIT: tl.constexpr, USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr):
        """All ranks of the group: rank_notify(peer q's flags[rank]) for every peer, then
        rank_wait(my flags[q]) and consume it. (NOTIFY / WAIT split it for the interpreter.)"""
        if NOTIFY:
            for q in range(world):
                if q != rank:
                    P.rank_notify(P.peer_ptr(flags_tbl, q, flags_local), rank, USE_ASM)
        if WAIT:
            ok = tl.full([], 1, tl.int32)  # a tensor (loop-carried); rank may arrive as a constexpr 1 (Triton specialises ints equal to 1)
            for q in range(world):
                if (q != rank) & (ok != 0):
                    ok = P.rank_wait(flags_local, q, 1, err_ptr, timeout_us, max_polls, USE_ASM, USE_TIMER)
                    if ok != 0:
                        P.consume(flags_local + q, 1, USE_ASM)

    @triton.jit
    def _notify_kernel(flags_ptr, index, USE_ASM: tl.constexpr):
        P.rank_notify(flags_ptr, index, USE_ASM)

    @triton.jit(do_not_specialize=["timeout_us", "max_polls"])  # one variant for every bound
    def _wait_kernel(flags_ptr, index, target, err_ptr, timeout_us, max_polls,
                     USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr):
        """One bounded rank_wait (tests: the timeout path)."""
        P.rank_wait(flags_ptr, index, target, err_ptr, timeout_us, max_polls, USE_ASM, USE_TIMER)
