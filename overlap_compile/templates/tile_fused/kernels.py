"""tile_fused on NVIDIA GPUs: TileLink-style (MLSys '25) tile-fused GEMM + reduce-scatter and
all-gather + GEMM over torch symmetric memory, in stock Triton (primitives.py).

Kernels (one persistent GEMM for both directions, signal_reorder's tiling/config/TMA code)::

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
    _barrier_kernel    rank_notify every peer, rank_wait every peer (consuming): orders this call's
                       writes into peers' symmetric buffers after their previous call's reads.
    _notify_kernel     rank_notify of a local flag behind a copy-engine copy (when the driver's
                       cuStreamWriteValue32 is not available).

Streams. RS: comm stream (highest priority) = barrier, push, reduce; compute stream = GEMM; join.
AG: comm stream = barrier, copy my shard into my symmetric buffer, barrier, then per peer (r+1,
r+2, ...) a copy-engine pull of its shard into the gathered matrix + rank notify; compute stream =
copy of my shard into the gathered matrix, the fused GEMM of the first consumer (waits per tile),
then the flag reset; further consumers as plain GEMMs after the join.

Signals return to zero after every call with no host value that changes between calls (the
waits consume, the AG chunk flags are reset by a 4-byte-per-rank memset after the GEMM that
read them), so a call is capturable in a CUDA graph and a replay is a fresh call. Every wait is
bounded (plan.timeout_ms); a failed wait records [failed, code, index, seen, target] in a device
buffer and makes every later wait return at once; ``check_errors`` raises TileWaitTimeout naming
the template, the op, what was waited on, its index and the value seen. The op checks after each
eager call, without synchronising: the record is copied to pinned memory behind the call and
read at the next call (or by check_errors(), which synchronises).

Status (2x H200, torch 2.11, Triton 3.6, one run): everything compiled, but the first GEMM+RS
case failed with a barrier wait timing out ("the wait on rank 1 timed out: its flag read 0"), and
Triton 3.6 rejected the inline-asm variant of the barrier kernel (the tl.atomic fallback ran).
Likely cause of the timeout, fixed since but not re-run: kernels were compiled lazily *after* the
first bounded wait had started, and a rank compiling several variants kept its peers waiting past
the bound; the first call now compiles everything (Triton warmup) and meets the peers at a host
barrier before any wait. The asm operands are now always tensors (a constant operand is the
likely 3.6 rejection). 2026-11-23 on 2x H200: all-gather + GEMM passes its GPU tests (also under
CUDA-graph trees) and is a GPU candidate; GEMM + reduce-scatter still fails on some calls, so
spec.py offers it no configuration under GPU profiles. Likely cause, found on 1x H100 the same day
(tests/gpu/test_kernel_loading.py): the first call launched the push kernel, which spins on the
GEMM's tiles, before the GEMM's first launch, and CUDA's lazy loading held the GEMM's load until
the spin ran out its bound (3.0 s timeout vs 2.5 ms once preloaded); the flags left unconsumed by
that call then released later calls' waits early (wrong results). Warm-up now loads every kernel
(``_loaded``); the 2-GPU test has not run since.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from typing import Any

import torch

from ...tiling import TileGrid
from ..plans import AllGatherGemmPlan, GemmCollectivePlan, allreduce_stripes
from . import primitives as P
from .reference import check_config, check_plan, stripe_grid
from ...runtime.persistent import allocate, zeros_int32

TEMPLATE = "tile_fused"

try:
    import triton
    import triton.language as tl

    from ..signal_reorder import kernels as SR  # GEMM configs, TMA operand setup, jit tiling twins

    _HAVE_TRITON = P.HAVE_TRITON
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = tl = SR = None
    _HAVE_TRITON = False

MODE_RS, MODE_AG = 0, 1


class TileWaitTimeout(RuntimeError):
    """A bounded tile / rank wait of tile_fused ran past plan.timeout_ms."""


if _HAVE_TRITON:

    @triton.jit
    def rank_ordered_jit(e, rank, world, tiles, first):
        """Twin of tiling.RankOrderedTiles: exec id -> (stripe, local tile)."""
        step = e // tiles
        return (rank + first + step) % world, e - step * tiles

    @triton.jit
    def _tile_gemm_kernel(
        a_ptr, a_desc, b_ptr, b_desc, bias_ptr, c_ptr, c_desc, flags_ptr, err_ptr,
        rows, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
        tiles, world, rank, chunk, programs, timeout_ns, max_polls,
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
        k_tiles = (K + BLOCK_K - 1) // BLOCK_K
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        first = 1 - MODE  # RS: peers' stripes first; AG: own shard first
        for e in tl.range(pid, tiles * world, programs, flatten=FLATTEN):
            stripe, t = rank_ordered_jit(e, rank, world, tiles, first)
            tm, tn = SR.tile_coords_jit(t, tiles_m, tiles_n, GROUP_M)
            r0 = tm * BLOCK_M
            n0 = tn * BLOCK_N
            if MODE == 1:
                if stripe != rank:
                    P.rank_wait(flags_ptr, stripe, 1, err_ptr, timeout_ns, max_polls, USE_ASM, USE_TIMER)
            a_row0 = SR.global_row_jit(stripe, r0, world, chunk)
            loc_rows = r0 + offs_m
            g_rows = SR.global_row_jit(stripe, loc_rows, world, chunk).to(tl.int64)
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for kk in range(k_tiles):
                k0 = kk * BLOCK_K
                if A_TMA:
                    a = a_desc.load([a_row0, k0])
                else:
                    ks = k0 + offs_k
                    a = tl.load(a_ptr + g_rows[:, None] * stride_am + ks[None, :] * stride_ak,
                                mask=(loc_rows < rows)[:, None] & (ks < K)[None, :], other=0.0)
                if B_TMA:
                    if B_KMAJOR:
                        b = b_desc.load([n0, k0]).T
                    else:
                        b = b_desc.load([k0, n0])
                else:
                    ks = k0 + offs_k
                    cs = n0 + offs_n
                    b = tl.load(b_ptr + ks[:, None].to(tl.int64) * stride_bk + cs[None, :] * stride_bn,
                                mask=(ks < K)[:, None] & (cs < N)[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            cols = n0 + offs_n
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
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

    @triton.jit
    def _push_kernel(part_ptr, ready_ptr, recv_tbl, arrived_tbl, arrived_local, err_ptr,
                     tiles, world, rank, timeout_ns, max_polls,
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
                ok = P.consumer_tile_wait(ready_ptr, slot, 1, err_ptr, timeout_ns, max_polls, USE_ASM, USE_TIMER)
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

    @triton.jit
    def _reduce_kernel(part_ptr, ready_ptr, recv_ptr, arrived_ptr, out_ptr, err_ptr,
                       gat_tbl, gat_local, done_tbl, done_local,
                       rows, N, stride_om, tiles, world, rank, timeout_ns, max_polls, scale,
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
                ok = P.consumer_tile_wait(ready_ptr, slot, 1, err_ptr, timeout_ns, max_polls, USE_ASM, USE_TIMER)
                for q in range(world):
                    if (q != rank) & (ok != 0):
                        ok = P.peer_tile_wait(arrived_ptr, q * tiles + t, 1, err_ptr, timeout_ns, max_polls,
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

    @triton.jit
    def _gather_kernel(gat_ptr, done_ptr, out_ptr, err_ptr, rows, N, stride_om, chunk, tiles, world, rank,
                       timeout_ns, max_polls, BM: tl.constexpr, BN: tl.constexpr, SUB_M: tl.constexpr,
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
                ok = P.peer_tile_wait(done_ptr, q * tiles + t, 1, err_ptr, timeout_ns, max_polls, USE_ASM, USE_TIMER)
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

    @triton.jit
    def _barrier_kernel(flags_tbl, flags_local, err_ptr, world, rank, timeout_ns, max_polls,
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
                    ok = P.rank_wait(flags_local, q, 1, err_ptr, timeout_ns, max_polls, USE_ASM, USE_TIMER)
                    if ok != 0:
                        P.consume(flags_local + q, 1, USE_ASM)

    @triton.jit
    def _notify_kernel(flags_ptr, index, USE_ASM: tl.constexpr):
        P.rank_notify(flags_ptr, index, USE_ASM)

    @triton.jit
    def _wait_kernel(flags_ptr, index, target, err_ptr, timeout_ns, max_polls,
                     USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr):
        """One bounded rank_wait (tests: the timeout path)."""
        P.rank_wait(flags_ptr, index, target, err_ptr, timeout_ns, max_polls, USE_ASM, USE_TIMER)


# ------------------------------------------------------------------------------------------
# Availability, errors
# ------------------------------------------------------------------------------------------

def available() -> bool:
    return _HAVE_TRITON and SR is not None and SR.available()


def usable(group_name: str, device: torch.device) -> bool:
    """GPU path: Triton kernels available, an NCCL group, symmetric memory with peer access."""
    if not available() or device.type != "cuda":
        return False
    import torch.distributed as dist

    from ...runtime.comm import resolve_group

    pg = resolve_group(group_name)
    if dist.get_backend(pg) != "nccl":
        return False
    return _symm_ok(group_name, device)


_state_lock = threading.RLock()
_err: dict[int, torch.Tensor] = {}
_err_host: dict[int, tuple[torch.Tensor, Any, str]] = {}
_use_asm: dict[str, bool] = {}


def _err_buf(device: torch.device) -> torch.Tensor:
    with _state_lock:
        buf = _err.get(device.index)
        if buf is None:
            buf = _err[device.index] = zeros_int32(P.ERR_WORDS, device)
        return buf


def _format_error(vals: list[int], what: str) -> str:
    code, index, seen, target = vals[1:5]
    name = P.WAIT_NAMES.get(code, f"code {code}")
    return (f"{TEMPLATE} {what}: the wait on {name} {index} timed out: its flag read {seen}, expected >= {target}. "
            f"A producer or peer did not signal within signal_timeout_ms (a peer not running the same plan, or "
            f"a kernel that failed); the results of that call are invalid.")


def check_errors(device: torch.device | int | None = None, synchronize: bool = True) -> None:
    """Raise TileWaitTimeout if a bounded wait on ``device`` failed (after a synchronisation unless
    ``synchronize=False``, which only reads the copy the last eager call left in pinned memory)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    with _state_lock:
        pending = _err_host.pop(device.index, None)
        buf = _err.get(device.index)
    if synchronize and buf is not None:
        torch.cuda.synchronize(device)
        vals = buf.tolist()
        if vals[0]:
            buf.zero_()
            raise TileWaitTimeout(_format_error(vals, pending[2] if pending else "op"))
        return
    if pending is not None:
        host, event, what = pending
        if not event.query():
            with _state_lock:
                _err_host.setdefault(device.index, pending)
            return
        vals = host.tolist()
        if vals[0]:
            _err_buf(device).zero_()
            raise TileWaitTimeout(_format_error(vals, what))


def _after_call(device: torch.device, what: str) -> None:
    """Eager calls: copy the error record to pinned memory behind the call (read next time)."""
    if torch.cuda.is_current_stream_capturing():
        return
    with _state_lock:
        prev = _err_host.get(device.index)
        host = prev[0] if prev else torch.zeros(P.ERR_WORDS, dtype=torch.int32).pin_memory()
        host.copy_(_err_buf(device), non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        _err_host[device.index] = (host, ev, what)


def _timeouts(plan: Any) -> tuple[int, int]:
    """(timeout in ns for %globaltimer, max polls where no timer is used: ~1 us per poll)."""
    return int(plan.timeout_ms) * 1_000_000, max(1, int(plan.timeout_ms) * 1000)


# ------------------------------------------------------------------------------------------
# Symmetric memory (runtime.symm) and streams
# ------------------------------------------------------------------------------------------

def _symm_ok(group_name: str, device: torch.device) -> bool:
    """Symmetric memory can serve this group: every rank on this node with peer access."""
    try:
        return bool(_symm_api().available(group_name, device))
    except Exception as e:  # no peer access, no symmetric memory: the reference runs instead
        warnings.warn(f"{TEMPLATE}: symmetric memory unusable on group {group_name!r} ({e}); using the reference")
        return False


def _symm(group_name: str, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          zero: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(local symmetric tensor, int64 device table of every rank's address of it); cached per
    (group, key, shape, dtype); ``zero``: zeroed on every rank before any peer can signal into it."""
    return _symm_api().tensor_and_ptrs(group_name, f"{TEMPLATE}/{key}", shape, dtype, device, zero=zero)


def _symm_api() -> Any:
    from ...runtime import symm

    return symm


_streams: dict[int, torch.cuda.Stream] = {}
_local: dict[tuple, torch.Tensor] = {}


def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    with _state_lock:
        s = _streams.get(device.index)
        if s is None:
            s = _streams[device.index] = torch.cuda.Stream(device=device, priority=-1000)
        return s


def _zeros_cached(key: tuple, n: int, device: torch.device) -> torch.Tensor:
    """Local int32 flags, zeroed once; the protocol leaves them at zero after every call."""
    with _state_lock:
        t = _local.get(key)
        if t is None:
            t = _local[key] = zeros_int32(n, device)
        return t


# ------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------

_fallbacks: dict[tuple, tuple] = {}
# First call of a plan: every kernel is compiled (Triton ``warmup``: no launch) and the ranks meet
# at a host barrier before any bounded wait starts. Without it a rank still compiling (several
# seconds per variant, more when a variant is rejected) makes its peers' waits time out.
_warming = False
_warmed: set = set()


def _first_call(key: tuple, pg: Any, device: torch.device, body) -> None:
    global _warming
    if key in _warmed or torch.cuda.is_current_stream_capturing():
        return
    _warming = True
    try:
        body()
    finally:
        _warming = False
    torch.cuda.synchronize(device)
    import torch.distributed as dist

    # On the persistent worker: NCCL's barrier allocates a one-element tensor on the calling
    # thread and keeps it until its watchdog retires the work, so under CUDA-graph trees it was
    # the "1 tensor(s) in the cudagraph pool not tracked as outputs" of the first call.
    allocate(lambda: dist.barrier(group=pg))
    torch.cuda.synchronize(device)
    _warmed.add(key)


def _loaded(compiled: Any) -> Any:
    """Load a kernel Triton compiled (``warmup``) onto the GPU now, not at its first launch.

    Triton loads a compiled kernel's module at its first launch, and under CUDA's lazy loading
    (the default) loading can wait for the context to go idle. A first GEMM+RS call thus
    deadlocked until the bound ran out: the push kernel spun waiting for the GEMM's tiles while
    the GEMM, launched after it, waited to be loaded until the push kernel finished. NVIDIA's
    lazy-loading guide names this hazard and the cure: load every kernel before any of them spins.
    ``_init_handles`` loads the module and queries the function's attributes, which loads it."""
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()
    return compiled


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_gemm(mode: int, a, b, bias, c, flags, rows, n, k, tiles, world, rank, chunk, programs, cfg,
                 a_contig_rows: bool, c_tma_ok: bool, c_view, plan) -> None:
    """_tile_gemm_kernel with signal_reorder's operand setup; if this Triton rejects a variant
    (inline asm, loop flattening, TMA, stages), retry simpler ones, warn once, remember."""
    ops = SR._operands(a, b, cfg, a_contig_rows)
    c_desc = None
    if c_tma_ok and SR._tma_ok(c_view):
        c_desc = SR.TensorDescriptor.from_tensor(c_view, [cfg.block_m, cfg.block_n])
    err = _err_buf(a.device)
    tns, polls = _timeouts(plan)
    key = (mode, cfg, ops.a_desc is not None, ops.b_desc is not None, ops.b_kmajor, c_desc is not None, a.dtype,
           bias is not None)
    tries = [_fallbacks[key]] if key in _fallbacks else [
        (True, cfg.flatten, True, cfg.num_stages), (True, False, True, cfg.num_stages),
        (False, cfg.flatten, True, cfg.num_stages), (False, False, True, cfg.num_stages),
        (False, False, True, max(2, cfg.num_stages - 1)), (False, False, False, max(2, cfg.num_stages - 1))]
    errors = []
    for use_asm, flatten, tma, stages in tries:
        ad, bd, km, cd = (ops.a_desc, ops.b_desc, ops.b_kmajor, c_desc) if tma else (None, None, False, None)
        if mode == MODE_RS and not use_asm:
            cd = None  # no bulk-store wait without asm: plain stores, ordered by the CTA barrier
        try:
            _loaded((_tile_gemm_kernel.warmup if _warming else _tile_gemm_kernel[(programs,)])(
                ops.a, ad, ops.b, bd, bias if bias is not None else c, c, cd, flags, err,
                rows, n, k, ops.a.stride(0), ops.a.stride(1), ops.b.stride(0), ops.b.stride(1),
                c.stride(0) if mode == MODE_AG else 0,
                tiles, world, rank, chunk, programs, tns, polls,
                MODE=mode, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                A_TMA=ad is not None, B_TMA=bd is not None, B_KMAJOR=km, C_TMA=cd is not None,
                HAS_BIAS=bias is not None, FLATTEN=flatten, DOT_PRECISION=SR._dot_precision(a.dtype),
                USE_ASM=use_asm, USE_TIMER=use_asm, num_warps=cfg.num_warps, num_stages=stages,
                **({"grid": (programs,)} if _warming else {}),
            ))
        except Exception as e:
            if torch.cuda.is_current_stream_capturing():
                raise
            errors.append(f"{type(e).__name__}: {str(e)[:300]}")
            continue
        if key not in _fallbacks:
            _fallbacks[key] = (use_asm, flatten, tma, stages)
            if errors:
                warnings.warn(f"{TEMPLATE}: GEMM variant fell back to asm={use_asm} flatten={flatten} tma={tma} "
                              f"stages={stages} after: {errors}")
        return
    raise RuntimeError(f"{TEMPLATE}: no variant of the tile GEMM ran on Triton {triton.__version__}: {errors}")


def _launch_small(name: str, kernel, grid, *args, **meta) -> None:
    """Comm kernels: inline-asm signals, else (remembered, warned) tl.atomic_* signals."""
    use = _use_asm.get(name)
    for use_asm in ([use] if use is not None else [True, False]):
        try:
            extra = {"USE_TIMER": use_asm} if name not in ("notify",) else {}
            if _warming:
                _loaded(kernel.warmup(*args, **meta, USE_ASM=use_asm, **extra, grid=grid))
            else:
                kernel[grid](*args, **meta, USE_ASM=use_asm, **extra)
        except Exception as e:
            if use is not None or not use_asm or torch.cuda.is_current_stream_capturing():
                raise
            warnings.warn(f"{TEMPLATE}: {name} kernel without inline asm (tl.atomic signals) after: "
                          f"{type(e).__name__}: {str(e)[:300]}")
            continue
        _use_asm[name] = use_asm
        return


def barrier(group_name: str, device: torch.device, world: int, rank: int, timeout_ms: int) -> None:
    """Device-side barrier of the group on the current stream (bounded)."""
    flags, tbl = _symm(group_name, "barrier", (world,), torch.int32, device, zero=True)
    tns, polls = _timeouts(_T(timeout_ms))
    _launch_small("barrier", _barrier_kernel, (1,), tbl, flags, _err_buf(device), world, rank, tns, polls,
                  NOTIFY=True, WAIT=True, num_warps=1)


@dataclasses.dataclass(frozen=True)
class _T:
    timeout_ms: int


_driver_checked: list = []


def stream_notify(flags: torch.Tensor, index: int) -> None:
    """flags[index] += 1 behind the work already on the current stream: a stream memory operation
    (cuStreamWriteValue32 of 1, no SM; the flag is 0 before: one notify per flag per call), else a
    one-thread Triton kernel (rank_notify)."""
    if _warming:
        return
    drv = _stream_driver()
    if drv is not None:
        stream = drv.CUstream(torch.cuda.current_stream(flags.device).cuda_stream)
        addr = drv.CUdeviceptr(flags.data_ptr() + 4 * index)
        (err,) = drv.cuStreamWriteValue32(stream, addr, 1, drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
        if err == drv.CUresult.CUDA_SUCCESS:
            return
        raise RuntimeError(f"{TEMPLATE}: cuStreamWriteValue32 failed: {err}")
    _launch_small("notify", _notify_kernel, (1,), flags, index, num_warps=1)


def _stream_driver() -> Any:
    if os.environ.get("OVERLAP_COMPILE_TILE_FUSED_NOTIFY", "auto") == "kernel":
        return None
    if not _driver_checked:
        try:
            _driver_checked.append(SR._driver())
        except ImportError:
            _driver_checked.append(None)
    return _driver_checked[0]


def _gemm_cfg(device, m, n, k, dtype, plan) -> Any:
    c = plan.config
    cfg = SR.choose_config(device, m, n, k, dtype, c["block_m"], c["block_n"], c.get("group_m", 8))
    return dataclasses.replace(cfg, block_m=c["block_m"], block_n=c["block_n"], group_m=c.get("group_m", 8),
                               warp_specialize=False)


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
    ptag = f"{plan.m}x{plan.n}x{plan.k}/{bm}x{bn}/w{w}"
    recv, recv_tbl = _symm(group_name, f"recv/{ptag}", (w * T, bm, bn), a.dtype, device)
    arrived, arrived_tbl = _symm(group_name, f"arrived/{ptag}", (w * T,), torch.int32, device, zero=True)
    ready = _zeros_cached(("ready", device.index, group_name, ptag), w * T, device)
    part = torch.empty(w * T, bm, bn, dtype=a.dtype, device=device)
    if out is None:
        out = torch.empty((w if gather else 1) * plan.result_rows, plan.n, dtype=a.dtype, device=device)
    if gather:  # every rank's reduced tiles, pushed by its reduce CTAs, and one flag per tile
        gat, gat_tbl = _symm(group_name, f"gather/{ptag}", (w * T, bm, bn), a.dtype, device)
        done, done_tbl = _symm(group_name, f"done/{ptag}", (w * T,), torch.int32, device, zero=True)
    else:
        gat, gat_tbl, done, done_tbl = part, recv_tbl, arrived, arrived_tbl  # unused (GATHER=False)
    mine = out[rank * plan.chunk:(rank + 1) * plan.chunk] if gather else out
    err = _err_buf(device)
    tns, polls = _timeouts(plan)
    compute, comm = torch.cuda.current_stream(device), _comm_stream(device)
    comm.wait_stream(compute)
    sub_m = min(bm, 32 if bn <= 128 else 16)
    with torch.cuda.stream(comm):
        # Peers may write my receive buffer only after I finished reading it in the last call.
        barrier(group_name, device, w, rank, plan.timeout_ms)
        _launch_small("push", _push_kernel, (ctas,), part, ready, recv_tbl, arrived_tbl, arrived, err,
                      T, w, rank, tns, polls, BM=bm, BN=bn, SUB_M=sub_m, num_warps=4)
    stripes_contig = plan.outer == 1 or plan.chunk % bm == 0
    part_view = part.view(w * T * bm, bn)
    _launch_gemm(MODE_RS, a, b, bias, part, ready, grid.rows, plan.n, plan.k, T, w, rank, plan.chunk, programs,
                 cfg, stripes_contig, True, part_view, plan)
    with torch.cuda.stream(comm):
        scale = 1.0 / w if plan.reduce_op == "avg" else 1.0
        _launch_small("reduce", _reduce_kernel, (ctas,), part, ready, recv, arrived, mine, err,
                      gat_tbl, gat, done_tbl, done, grid.rows, plan.n, out.stride(0), T, w, rank, tns, polls, scale,
                      BM=bm, BN=bn, SUB_M=sub_m, GROUP_M=grid.group_m, GATHER=gather, num_warps=4)
        if gather:
            # queued behind the reduce CTAs, which finish with my own stripe, the GEMM's last: the
            # GEMM is done by then and the copy-out may take every SM
            gather_ctas = gather_grid(_num_sms(device), ctas, w, T)
            _launch_small("gather", _gather_kernel, (gather_ctas,), gat, done, out, err, grid.rows, plan.n, out.stride(0),
                          plan.chunk, T, w, rank, tns, polls, BM=bm, BN=bn, SUB_M=sub_m, GROUP_M=grid.group_m,
                          num_warps=4)
    compute.wait_stream(comm)
    part.record_stream(comm)
    out.record_stream(comm)
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
    ptag = f"{plan.m}x{plan.k}/w{w}"
    mine, mine_tbl = _symm(group_name, f"shard/{ptag}", (rows_local, plan.k), shard.dtype, device)
    arrived = _zeros_cached(("ag", device.index, group_name), w, device)
    given = outs
    gathered = given[0] if given else torch.empty(plan.m, plan.k, dtype=shard.dtype, device=device)
    compute, comm = torch.cuda.current_stream(device), _comm_stream(device)
    comm.wait_stream(compute)
    with torch.cuda.stream(comm):
        symm = _symm_api()
        barrier(group_name, device, w, rank, plan.timeout_ms)  # peers finished pulling my last shard
        mine.copy_(shard)
        barrier(group_name, device, w, rank, plan.timeout_ms)  # every shard is in its symmetric buffer
        for j in range(1, w):
            src = (rank + j) % w
            peer = symm.peer_view(group_name, mine, src)
            P.rank_copy_data(_stripe_pieces(gathered, st, src), _shard_pieces(peer, st), arrived, src, stream_notify)
    for piece, part in zip(_stripe_pieces(gathered, st, rank), _shard_pieces(shard, st)):
        piece.copy_(part)  # my rows: no wait
    outs = []
    n0 = plan.ns[0]
    y0 = given[1] if given else torch.empty(plan.m, n0, dtype=shard.dtype, device=device)
    grid = TileGrid(rows_local, n0, bm, bn, c.get("group_m", 8))
    cfg = _gemm_cfg(device, plan.m, n0, plan.k, shard.dtype, plan)
    programs = max(1, min(_num_sms(device), w * grid.num_tiles))
    contig = plan.outer == 1 or plan.chunk % bm == 0
    _launch_gemm(MODE_AG, gathered, bs[0], biases[0], y0, arrived, rows_local, n0, plan.k, grid.num_tiles, w, rank,
                 plan.chunk, programs, cfg, contig, plan.chunk % bm == 0, y0, plan)
    arrived.zero_()  # every tile that waited has read its flag (the GEMM is done): back to zero
    compute.wait_stream(comm)
    outs.append(y0)
    for i, (b, bias) in enumerate(zip(bs[1:], biases[1:]), start=2):
        y = given[i] if given else None
        outs.append(torch.addmm(bias, gathered, b, out=y) if bias is not None else torch.mm(gathered, b, out=y))
    gathered.record_stream(comm)
    _after_call(device, "allgather_gemm")
    return [gathered] + outs


def _stripe_pieces(x: torch.Tensor, st: Any, k: int) -> list[torch.Tensor]:
    """Stripe k of the row-major matrix x as contiguous pieces (one per outer block)."""
    v = x.view(st.outer, st.world, st.chunk, x.shape[-1])
    return [v[o, k] for o in range(st.outer)]


def _shard_pieces(x: torch.Tensor, st: Any) -> list[torch.Tensor]:
    v = x.reshape(st.outer, st.chunk, x.shape[-1])
    return [v[o] for o in range(st.outer)]
