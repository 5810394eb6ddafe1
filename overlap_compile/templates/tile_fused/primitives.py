"""TileLink's tile-centric primitives (Zheng et al., "TileLink", MLSys '25, section 3) in stock Triton:
``@triton.jit`` helpers over plain pointers, so they work on local tensors and on peers' symmetric
buffers alike (pointers from ``runtime.symm``).

Signals (all int32 counters, one per tile / rank):

    producer_tile_notify(flag, n)         CTA barrier, then thread 0: flag += n, release, GPU scope
    consumer_tile_wait(flag, n, ...)      spin until flag >= n (bounded), acquire, GPU scope
    peer_tile_notify(flag, n)             as producer_tile_notify at system scope (flag on a peer)
    peer_tile_wait(flag, n, ...)          as consumer_tile_wait at system scope
    rank_notify(flag, n) / rank_wait      the same at rank granularity (barriers, chunk arrivals)
    consume(flag, n)                      CTA barrier, then thread 0: flag -= n (the wait's target)

Consuming (subtracting the target, not storing 0) returns counters to zero without a memset and
without erasing a peer's early signal for the next call. Data: ``tile_push_data`` /
``tile_pull_data`` move a [BM, BN] tile in row chunks; ``rank_copy_data`` (host) a rank chunk by
copy engine. Waits are bounded (``timeout_us`` or ``max_polls``): a timed-out wait writes
``[failed, code, index, seen, target]`` to ``err`` and every later wait returns at once.
``USE_ASM``: inline PTX (relaxed polls, one acquire) or ``tl.atomic_add`` (the interpreter).
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None
    tl = None
    HAVE_TRITON = False

# err[1] codes: what a failed wait was waiting on (kernels.check_errors names them).
WAIT_TILE, WAIT_PEER_TILE, WAIT_RANK = 1, 2, 3
WAIT_NAMES = {WAIT_TILE: "local tile", WAIT_PEER_TILE: "peer tile", WAIT_RANK: "rank"}
ERR_WORDS = 5  # [failed, code, index, seen, target]


if HAVE_TRITON:

    # ---- small PTX pieces -------------------------------------------------------------------

    from ...runtime.spin_wait import globaltimer as _globaltimer  # %globaltimer in ns, one definition

    @triton.jit
    def _red_add(ptr, value, SYS: tl.constexpr):
        # All threads meet at bar.sync 0 (so their earlier stores are ordered before), then thread 0
        # alone adds with release semantics: one signal per CTA however many threads run this.
        value = value + tl.program_id(0) * 0  # a tensor operand even when the caller passed a constant
        if SYS:
            return tl.inline_asm_elementwise(
                "{\n.reg .pred p;\n.reg .u32 t;\nbar.sync 0;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
                "@p red.release.sys.global.add.s32 [$1], $2;\nmov.u32 $0, 0;\n}",
                "=r,l,r", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)
        else:
            return tl.inline_asm_elementwise(
                "{\n.reg .pred p;\n.reg .u32 t;\nbar.sync 0;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
                "@p red.release.gpu.global.add.s32 [$1], $2;\nmov.u32 $0, 0;\n}",
                "=r,l,r", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _red_sub_relaxed(ptr, value):
        # Consume: after every thread of the CTA finished its wait (bar.sync), thread 0 subtracts.
        value = value + tl.program_id(0) * 0
        return tl.inline_asm_elementwise(
            "{\n.reg .pred p;\n.reg .u32 t;\n.reg .s32 v;\nbar.sync 0;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
            "neg.s32 v, $2;\n@p red.relaxed.sys.global.add.s32 [$1], v;\nmov.u32 $0, 0;\n}",
            "=r,l,r", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _ld_relaxed(ptr, SYS: tl.constexpr):
        if SYS:
            return tl.inline_asm_elementwise("ld.relaxed.sys.global.s32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                             is_pure=False, pack=1)
        else:
            return tl.inline_asm_elementwise("ld.relaxed.gpu.global.s32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                             is_pure=False, pack=1)

    @triton.jit
    def _ld_acquire(ptr, SYS: tl.constexpr):
        if SYS:
            return tl.inline_asm_elementwise("ld.acquire.sys.global.s32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                             is_pure=False, pack=1)
        else:
            return tl.inline_asm_elementwise("ld.acquire.gpu.global.s32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                             is_pure=False, pack=1)

    # ---- generic signal / wait ----------------------------------------------------------------

    @triton.jit
    def signal_add(flag_ptr, value, SYS: tl.constexpr, USE_ASM: tl.constexpr):
        """``*flag += value`` once per CTA with release semantics, after all the CTA's stores."""
        if USE_ASM:
            _red_add(flag_ptr, value, SYS)
        else:
            tl.debug_barrier()
            if SYS:
                tl.atomic_add(flag_ptr, value, sem="release", scope="sys")
            else:
                tl.atomic_add(flag_ptr, value, sem="release", scope="gpu")

    @triton.jit
    def wait_ge(flag_ptr, target, err_ptr, code, index, timeout_us, max_polls,
                SYS: tl.constexpr, USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr):
        """Spin until ``*flag >= target`` (bounded); acquire. Returns 1, or 0 after recording a
        timeout in ``err_ptr`` (or at once if an earlier wait on this device already failed)."""
        ok = tl.load(err_ptr, volatile=True) == 0
        # relaxed polls, one acquire after: an acquire per poll would invalidate L1 under the GEMM
        # sharing the SM
        if USE_ASM:
            seen = _ld_relaxed(flag_ptr, SYS)
        else:
            seen = tl.load(flag_ptr, volatile=True)
        polls = seen * 0
        expired = polls
        if USE_TIMER:
            start = _globaltimer(seen)
            timeout_ns = timeout_us.to(tl.int64) * 1000
        # (seen - target) < 0: wrap-safe seen < target.
        while ((seen - target) < 0) & (expired == 0) & ok:
            if USE_TIMER:
                expired = (_globaltimer(seen) - start > timeout_ns).to(tl.int32)
            else:
                polls += 1
                expired = (polls >= max_polls).to(tl.int32)
            if USE_ASM:
                seen = _ld_relaxed(flag_ptr, SYS)
            else:
                seen = tl.load(flag_ptr, volatile=True)
        if ok:
            # The acquire that pairs with the producer's release: its data is visible from here.
            if USE_ASM:
                seen = _ld_acquire(flag_ptr, SYS)
            else:
                if SYS:
                    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
                else:
                    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
            if (seen - target) < 0:
                tl.store(err_ptr + 1, code)
                tl.store(err_ptr + 2, index)
                tl.store(err_ptr + 3, seen)
                tl.store(err_ptr + 4, target)
                tl.store(err_ptr, 1)
        return (ok & ((seen - target) >= 0)).to(tl.int32)

    @triton.jit
    def consume(flag_ptr, value, USE_ASM: tl.constexpr):
        """Give back a wait's target: ``*flag -= value`` once per CTA, after every thread's wait."""
        if USE_ASM:
            _red_sub_relaxed(flag_ptr, value)
        else:
            tl.debug_barrier()
            tl.atomic_add(flag_ptr, -value, sem="relaxed", scope="sys")

    @triton.jit
    def fence_async_reads(dep, USE_ASM: tl.constexpr):
        """After a wait: order the TMA (async proxy) loads that follow after the acquire, so
        they see the data the signal published (``fence.proxy.async.global``). Returns ``dep``;
        nothing to do off the GPU."""
        if USE_ASM:
            return tl.inline_asm_elementwise("fence.proxy.async.global;\nmov.u32 $0, $1;", "=r,r", [dep],
                                             dtype=tl.int32, is_pure=False, pack=1)
        else:
            return dep

    # ---- TileLink's named primitives ----------------------------------------------------------

    @triton.jit
    def producer_tile_notify(flags_ptr, tile, USE_ASM: tl.constexpr):
        """A GEMM CTA finished tile ``tile`` (its stores are complete): flags[tile] += 1."""
        signal_add(flags_ptr + tile, 1, False, USE_ASM)

    @triton.jit
    def consumer_tile_wait(flags_ptr, tile, target, err_ptr, timeout_us, max_polls,
                           USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr):
        """Wait until flags[tile] >= target (a tile produced on this GPU)."""
        return wait_ge(flags_ptr + tile, target, err_ptr, 1, tile, timeout_us, max_polls, False, USE_ASM, USE_TIMER)

    @triton.jit
    def peer_tile_notify(peer_flags_ptr, tile, USE_ASM: tl.constexpr):
        """Tile ``tile`` landed in a peer's memory: the peer's flags[tile] += 1, system scope."""
        signal_add(peer_flags_ptr + tile, 1, True, USE_ASM)

    @triton.jit
    def peer_tile_wait(flags_ptr, tile, target, err_ptr, timeout_us, max_polls,
                       USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr):
        """Wait until flags[tile] >= target, where a peer GPU signals (system scope)."""
        return wait_ge(flags_ptr + tile, target, err_ptr, 2, tile, timeout_us, max_polls, True, USE_ASM, USE_TIMER)

    @triton.jit
    def rank_notify(peer_flags_ptr, rank, USE_ASM: tl.constexpr):
        """Rank-granularity signal (barrier arrival, a chunk ready): peer's flags[rank] += 1."""
        signal_add(peer_flags_ptr + rank, 1, True, USE_ASM)

    @triton.jit
    def rank_wait(flags_ptr, rank, target, err_ptr, timeout_us, max_polls,
                  USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr):
        """Wait until flags[rank] >= target (system scope)."""
        return wait_ge(flags_ptr + rank, target, err_ptr, 3, rank, timeout_us, max_polls, True, USE_ASM, USE_TIMER)

    @triton.jit
    def peer_ptr(ptr_table, peer, like_ptr):
        """Rank ``peer``'s copy of a symmetric tensor: its address from a device table of W int64
        addresses (runtime.symm), typed like ``like_ptr`` (the local copy)."""
        return tl.load(ptr_table + peer).to(like_ptr.dtype)

    @triton.jit
    def tile_push_data(src_ptr, dst_ptr, BM: tl.constexpr, BN: tl.constexpr, SUB_M: tl.constexpr):
        """Copy one contiguous [BM, BN] tile from ``src_ptr`` (local) to ``dst_ptr`` (a peer's
        buffer: remote stores over NVLink), SUB_M rows at a time."""
        offs = tl.arange(0, SUB_M)[:, None] * BN + tl.arange(0, BN)[None, :]
        for i in range(BM // SUB_M):
            tl.store(dst_ptr + i * SUB_M * BN + offs, tl.load(src_ptr + i * SUB_M * BN + offs))

    @triton.jit
    def tile_pull_data(src_ptr, dst_ptr, BM: tl.constexpr, BN: tl.constexpr, SUB_M: tl.constexpr):
        """Copy one [BM, BN] tile from a peer's buffer (remote loads) into local memory."""
        offs = tl.arange(0, SUB_M)[:, None] * BN + tl.arange(0, BN)[None, :]
        for i in range(BM // SUB_M):
            tl.store(dst_ptr + i * SUB_M * BN + offs, tl.load(src_ptr + i * SUB_M * BN + offs, volatile=True))


# ---- host side: rank_copy_data -------------------------------------------------------------------

def rank_copy_data(dst, src, flags, index: int, notify) -> None:
    """Copy a rank chunk ``src`` -> ``dst`` on the current stream with the copy engine (a
    contiguous device-to-device ``copy_`` of a peer's symmetric buffer is a cudaMemcpyAsync,
    which uses no SM), then signal its arrival: ``notify(flags, index)`` enqueues
    ``flags[index] += 1`` behind the copy in stream order (a stream memory operation, see
    kernels.stream_notify). The consumer waits with rank_wait / consumer_tile_wait.

    ``dst``/``src`` may be lists of equally many pieces (a strided chunk, one piece per
    contiguous run of rows)."""
    pairs = list(zip(dst, src)) if isinstance(dst, (list, tuple)) else [(dst, src)]
    for d, s in pairs:
        if not (d.is_contiguous() and s.is_contiguous()):
            raise ValueError("rank_copy_data: the copy engine path needs contiguous pieces "
                             f"(got strides {d.stride()} <- {s.stride()})")
        d.copy_(s, non_blocking=True)
    notify(flags, index)
