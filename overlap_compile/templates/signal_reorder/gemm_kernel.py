"""signal_reorder's persistent Triton GEMM and its launchers (FlashOverlap, EuroSys '26), alone
(``gemm``) or with the signalling epilogue into a send buffer (``gemm_signal_into``)::

    _gemm_kernel          persistent GEMM (TMA loads, software pipelining, grouped tile order);
                          epilogue = plain store into C, or (SIGNAL) store the tile at its send
                          slot and, at a program's last tile of a wave group, CTA barrier + one
                          release atomic adding that program's tile count to the group counter
    gemm()                launcher: C = a @ b (+ bias), tile config per shape (cached, JSON)
    gemm_signal_into()    launcher: the GEMM + signalling epilogue into a send buffer, no waits

Layout contract (reference.py is the oracle): exec id ``e`` runs on program ``e % programs`` in
wave ``e // programs``; it is local tile ``e // stripes`` (tiling.tile_coords) of stripe
``e % stripes``, stored at ``WaveSchedule.send_slot(e)`` with the edge padding zeroed.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from ...tiling import TileGrid, WaveSchedule, cdiv
from ..plans import GemmCollectivePlan
from ...runtime.persistent import allocate
from .gemm_configs import GemmConfig, choose_config

try:  # Triton is optional on CPU-only installs; available() then says False.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the installation
    triton = None
    tl = None
    _HAVE_TRITON = False

try:  # host-side TMA descriptors: Triton >= 3.3 (3.6 on the GPU machines, 3.9 in CI)
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover
    TensorDescriptor = None

TEMPLATE = "signal_reorder"


# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------

if _HAVE_TRITON:

    @triton.jit
    def tile_coords_jit(t, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        """Twin of tiling.tile_coords (same formula): tile id -> (tile row, tile col)."""
        width = GROUP_M * tiles_n
        group = t // width
        first_m = group * GROUP_M
        size = tl.minimum(tiles_m - first_m, GROUP_M)
        local = t % width
        return first_m + local % size, local // size

    @triton.jit
    def global_row_jit(stripe, r, stripes, chunk):
        """Twin of tiling.RowStripes.global_row (local row r of stripe -> row of the matrix)."""
        return (r // chunk) * (stripes * chunk) + stripe * chunk + r % chunk

    @triton.jit
    def send_slot_jit(e, programs, stripes, wave_tbl):
        """(wave group, send slot, the group's exec range [lo, hi)) of exec id ``e``:
        WaveSchedule.group_of / send_slot / exec_ranges()[group].

        ``wave_tbl[3w : 3w+3]`` = (group, first exec id of the group, tiles per stripe in the
        group) of wave ``w``; the group's first exec id is a multiple of ``stripes``."""
        w = e // programs
        g = tl.load(wave_tbl + 3 * w)
        lo = tl.load(wave_tbl + 3 * w + 1)
        per = tl.load(wave_tbl + 3 * w + 2)
        local = e // stripes
        k = e - local * stripes
        return g, lo + k * per + (local - lo // stripes), lo, lo + per * stripes

    @triton.jit
    def tile_acc_jit(a_ptr, a_desc, b_ptr, b_desc, bias_ptr, a_row0, a_rows, loc_rows, rows, n0, N, K,
                     stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
                     HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """One output tile's fp32 accumulator, bias added: A's rows ``a_rows`` (int64; ``a_row0``
        the first, for TMA), whose tile-local rows ``loc_rows`` past ``rows`` read as zeros, times
        B's columns n0.. (past N: zeros). A by TMA or pointers; B by TMA as [K, N] or, for a
        transposed weight, [N, K] (B_KMAJOR), or pointers. The GEMM main loop of every persistent
        GEMM here (this file's, tile_fused's); inlined into the caller, so its loop is pipelined
        (and flattened) with the caller's."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        k_tiles = (K + BLOCK_K - 1) // BLOCK_K
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for kk in range(k_tiles):
            k0 = kk * BLOCK_K
            if A_TMA:
                a = a_desc.load([a_row0, k0])
            else:
                ks = k0 + offs_k
                a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
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
        return acc

    @triton.jit
    def _bulk_store_wait(dep):
        # Wait until this thread's TMA (bulk async) stores have completed, not only read their
        # shared memory: the writes must be in global memory before the tile counts as signalled.
        # Completion of a bulk async copy implies a generic-async proxy fence, so the CTA barrier
        # and release that follow publish them like ordinary stores.
        return tl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\nmov.u32 $0, $1;", "=r,r", [dep],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _cta_barrier(dep):
        # bar.sync 0 for all threads of the CTA (no warp specialization in the signalling kernel);
        # ``dep`` threads a value through so the barrier stays between the stores and the atomic.
        return tl.inline_asm_elementwise("bar.sync 0;\nmov.u32 $0, $1;", "=r,r", [dep], dtype=tl.int32,
                                         is_pure=False, pack=1)

    @triton.jit
    def _signal_group(counter_ptr, g, count, C_TMA: tl.constexpr, HW_BARRIER: tl.constexpr,
                      SIGNAL_SCOPE: tl.constexpr):
        """Add this program's ``count`` tiles to group ``g``'s counter once its stores landed.

        CTA barrier: every thread's stores happen before the one release atomic of this CTA; the
        waiter's acquire then makes the tiles visible to the collective. On the GPU a plain
        bar.sync in inline asm: tl.debug_barrier() inside the flattened persistent loop stops
        Triton from multi-buffering the operand loads (sm_90 build: 49 KB of shared memory
        instead of 180 KB)."""
        if HW_BARRIER:
            if C_TMA:
                g = _bulk_store_wait(g)
            g = _cta_barrier(g)
        else:
            tl.debug_barrier()
        tl.atomic_add(counter_ptr + g, count, sem="release", scope=SIGNAL_SCOPE)

    @triton.jit
    def _gemm_kernel(
        a_ptr, a_desc, b_ptr, b_desc, bias_ptr, c_ptr, c_desc, counter_ptr, wave_tbl,
        rows, N, K,                       # rows: rows of the tile grid (one stripe's rows when striped)
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
        num_exec, programs, stripes, chunk,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_KMAJOR: tl.constexpr, C_TMA: tl.constexpr,
        SIGNAL: tl.constexpr, HAS_BIAS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr,
        DOT_PRECISION: tl.constexpr, HW_BARRIER: tl.constexpr, SIGNAL_SCOPE: tl.constexpr,
        SIGNAL_AT: tl.constexpr = 1,
    ):
        """Persistent GEMM: program p computes exec ids p, p + programs, ... (one wave per step).

        A is read by TMA when the rows of a tile are contiguous in A (all-reduce; striped with
        outer == 1; or chunk % BLOCK_M == 0), else row by row through pointers (A_TMA=False).
        B is read by TMA as [K, N] row-major or, for a transposed weight, as [N, K] (B_KMAJOR).
        Out-of-range rows/cols read as zeros (TMA zero padding / masks), so edge tiles are right.

        SIGNAL_AT (with SIGNAL): when a program counts its tiles of a wave group (SIGNAL_AT in
        the launcher): 1 = right after its last tile of the group is stored (waits for that
        store); 2 = in the epilogue of its next tile, before that tile's store (the earlier store
        had a whole K loop to land: no wait, but the group is counted one tile later); the
        program's final group is counted after the loop. 0 = never (prices the rest).
        """
        pid = tl.program_id(0)
        # (not tl.cdiv: only core builtins, so the interpreter runs this whatever order
        # triton.language and TRITON_INTERPRET were set up in)
        tiles_m = (rows + BLOCK_M - 1) // BLOCK_M
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        # The flattened loop lets Triton pipeline the next tile's loads under this tile's epilogue.
        for e in tl.range(pid, num_exec, programs, flatten=FLATTEN, warp_specialize=WARP_SPEC):
            local = e // stripes
            stripe = e - local * stripes
            tm, tn = tile_coords_jit(local, tiles_m, tiles_n, GROUP_M)
            r0 = tm * BLOCK_M
            n0 = tn * BLOCK_N
            if SIGNAL:
                # Read the wave table before the K loop: its latency hides under the MMAs instead
                # of stalling the epilogue.
                g, slot, group_lo, group_hi = send_slot_jit(e, programs, stripes, wave_tbl)
                if SIGNAL_AT == 2:
                    prev_wave = tl.maximum(e // programs - 1, 0)
                    g_prev = tl.load(wave_tbl + 3 * prev_wave)
                    prev_lo = tl.load(wave_tbl + 3 * prev_wave + 1)
            a_row0 = global_row_jit(stripe, r0, stripes, chunk)
            loc_rows = r0 + offs_m
            a_rows = global_row_jit(stripe, loc_rows, stripes, chunk).to(tl.int64)
            acc = tile_acc_jit(a_ptr, a_desc, b_ptr, b_desc, bias_ptr, a_row0, a_rows, loc_rows, rows, n0, N, K,
                               stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, A_TMA, B_TMA,
                               B_KMAJOR, HAS_BIAS, DOT_PRECISION)
            cols = n0 + offs_n
            valid = (loc_rows < rows)[:, None] & (cols < N)[None, :]
            if SIGNAL:
                # Padding rows/cols must be zero (bias, or a neighbouring stripe's rows read by TMA).
                out = tl.where(valid, acc, 0.0).to(c_ptr.dtype.element_ty)
                if SIGNAL_AT == 2:
                    # This tile opens a new group for this program: count the previous one now,
                    # its stores have had this tile's whole K loop to land.
                    if (e >= programs) & (g_prev != g):
                        _signal_group(counter_ptr, g_prev, prev_wave - prev_lo // programs + 1, C_TMA,
                                      HW_BARRIER, SIGNAL_SCOPE)
                if C_TMA:
                    # c_desc views the send buffer as [num_exec * BM, BN]: slot s = rows s*BM...
                    c_desc.store([slot * BLOCK_M, 0], out)
                else:
                    dst = c_ptr + slot.to(tl.int64) * (BLOCK_M * BLOCK_N)
                    tl.store(dst + offs_m[:, None] * BLOCK_N + offs_n[None, :], out)
                # Signal once per program and wave group, at this program's last tile of the
                # group, counting all its tiles of the group (one per wave; group_lo is a wave
                # start): a group completes only when its last tiles are counted, so counting
                # earlier ones early buys nothing, while it would make every tile wait for its
                # own store to land. No loop-carried counter: Triton 3.6's loop flattening
                # rejects extra loop-carried values (its FuseNestedLoops pass fails).
                if SIGNAL_AT == 1:
                    if e + programs >= group_hi:
                        _signal_group(counter_ptr, g, e // programs - group_lo // programs + 1, C_TMA, HW_BARRIER,
                                      SIGNAL_SCOPE)
            else:
                out = acc.to(c_ptr.dtype.element_ty)
                if C_TMA:
                    c_desc.store([r0, n0], out)
                else:
                    tl.store(c_ptr + loc_rows.to(tl.int64)[:, None] * stride_cm + cols[None, :], out, mask=valid)
        if SIGNAL:
            if SIGNAL_AT == 2:
                if pid < num_exec:  # this program's final group: counted once its last store landed
                    last_wave = (pid + (num_exec - 1 - pid) // programs * programs) // programs
                    g_last = tl.load(wave_tbl + 3 * last_wave)
                    lo_last = tl.load(wave_tbl + 3 * last_wave + 1)
                    _signal_group(counter_ptr, g_last, last_wave - lo_last // programs + 1, C_TMA, HW_BARRIER,
                                  SIGNAL_SCOPE)


# ------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------

def available() -> bool:
    """True where the GPU path can run: Triton importable and a CUDA device of sm_80 or newer
    (TMA is used only on sm_90+, pointer loads elsewhere)."""
    if not (_HAVE_TRITON and torch.cuda.is_available()):
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability()[0] >= 8


def _tma_ok(t: torch.Tensor) -> bool:
    """A 2-D view TMA can read: unit last stride, 16-byte aligned base and row stride."""
    if TensorDescriptor is None or t.dim() != 2 or t.stride(1) != 1:
        return False
    if t.device.type == "cuda" and torch.cuda.get_device_capability(t.device)[0] < 9:
        return False
    item = t.element_size()
    return t.data_ptr() % 16 == 0 and (t.stride(0) * item) % 16 == 0


@dataclasses.dataclass
class _Operands:
    """How _gemm_kernel reads A and B (TMA descriptors or pointers + strides)."""

    a: torch.Tensor
    b: torch.Tensor
    a_desc: Any
    b_desc: Any
    b_kmajor: bool


def _operands(a: torch.Tensor, b: torch.Tensor, cfg: GemmConfig, a_rows_contiguous: bool) -> _Operands:
    if a.stride(-1) != 1 and a.stride(0) != 1:
        a = a.contiguous()
    a_desc = None
    if a_rows_contiguous and _tma_ok(a):
        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    b_desc, kmajor = None, False
    if _tma_ok(b):
        b_desc = TensorDescriptor.from_tensor(b, [cfg.block_k, cfg.block_n])
    elif b.dim() == 2 and _tma_ok(b.t()):
        # A transposed weight (nn.Linear's W.t()): read W [N, K] K-major and transpose in smem.
        b_desc, kmajor = TensorDescriptor.from_tensor(b.t(), [cfg.block_n, cfg.block_k]), True
    return _Operands(a, b, a_desc, b_desc, kmajor)


def _dot_precision(dtype: torch.dtype) -> str | None:
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


_compile_fallbacks: dict[tuple, tuple[GemmConfig, bool]] = {}

# When a program counts its tiles of a wave group (_gemm_kernel's SIGNAL_AT): "group_end" after
# storing its last tile of the group (waits for that store), "next_tile" in its next tile's
# epilogue (no wait, one tile later), "none" never (benchmarks price the rest of the epilogue).
SIGNAL_AT = {"none": 0, "group_end": 1, "next_tile": 2}


def _launch(ops: _Operands, bias: torch.Tensor | None, c: torch.Tensor, c_desc: Any, counters: torch.Tensor | None,
            wave_tbl: torch.Tensor | None, rows: int, n: int, k: int, num_exec: int, programs: int, stripes: int,
            chunk: int, cfg: GemmConfig, signal: bool, scope: str = "gpu", signal_at: str = "group_end") -> GemmConfig:
    """Launch _gemm_kernel; if this Triton cannot build the config (warp specialization or loop
    flattening unsupported, shared memory exceeded, a TMA box it rejects), retry with the next
    simpler variant (last: no TMA at all), warn once, and remember the variant that ran.
    Returns the config that ran."""
    if signal and cfg.warp_specialize:
        # The epilogue's CTA barrier needs every warp of the CTA; specialised producer warps
        # never reach it.
        cfg = dataclasses.replace(cfg, warp_specialize=False)
    uses_tma = ops.a_desc is not None or ops.b_desc is not None or c_desc is not None
    if signal_at not in SIGNAL_AT:
        raise ValueError(f"{TEMPLATE}: signal_at must be one of {sorted(SIGNAL_AT)}, got {signal_at!r}")
    key = (cfg, signal, scope, signal_at, ops.a_desc is not None, ops.b_desc is not None, ops.b_kmajor, c_desc is not None,
           ops.a.dtype, bias is not None)
    if key in _compile_fallbacks:
        tries = [_compile_fallbacks[key]]
    else:
        tries = [(cfg, True)]
        if cfg.warp_specialize:
            tries.append((dataclasses.replace(cfg, warp_specialize=False), True))
        if cfg.flatten:
            tries.append((dataclasses.replace(cfg, warp_specialize=False, flatten=False), True))
        if cfg.num_stages > 2:
            tries.append((dataclasses.replace(cfg, warp_specialize=False, flatten=False,
                                              num_stages=cfg.num_stages - 1), True))
        if uses_tma:
            tries.append((dataclasses.replace(cfg, warp_specialize=False, flatten=False), False))
    dummy = counters if counters is not None else c
    errors: list[str] = []
    for attempt, tma in tries:
        a_desc, b_desc, kmajor, cd = (ops.a_desc, ops.b_desc, ops.b_kmajor, c_desc) if tma else (None, None, False, None)
        try:
            _gemm_kernel[(programs,)](
                ops.a, a_desc, ops.b, b_desc, bias if bias is not None else c, c, cd,
                counters if counters is not None else dummy, wave_tbl if wave_tbl is not None else dummy,
                rows, n, k,
                ops.a.stride(0), ops.a.stride(1), ops.b.stride(0), ops.b.stride(1), c.stride(0) if not signal else 0,
                num_exec, programs, stripes, chunk,
                BLOCK_M=attempt.block_m, BLOCK_N=attempt.block_n, BLOCK_K=attempt.block_k, GROUP_M=attempt.group_m,
                A_TMA=a_desc is not None, B_TMA=b_desc is not None, B_KMAJOR=kmajor,
                C_TMA=cd is not None, SIGNAL=signal, HAS_BIAS=bias is not None, FLATTEN=attempt.flatten,
                WARP_SPEC=attempt.warp_specialize, DOT_PRECISION=_dot_precision(ops.a.dtype),
                HW_BARRIER=c.is_cuda, SIGNAL_SCOPE=scope, SIGNAL_AT=SIGNAL_AT[signal_at], num_warps=attempt.num_warps, num_stages=attempt.num_stages,
            )
        except Exception as e:  # compile failures surface as several exception types across versions
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise  # never retry inside a capture; the warm-up run should have compiled it
            errors.append(f"{type(e).__name__}: {str(e)[:300]}")
            continue
        if key not in _compile_fallbacks:
            _compile_fallbacks[key] = (attempt, tma)
            if errors:
                import warnings

                warnings.warn(f"{TEMPLATE}: GEMM config {cfg} fell back to {attempt} (tma={tma and uses_tma}) "
                              f"after: {errors}")
        return attempt
    raise RuntimeError(f"{TEMPLATE}: no variant of GEMM config {cfg} ran on Triton {triton.__version__}: {errors}")


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, config: GemmConfig | None = None,
         programs: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` with the persistent TMA GEMM (fp32 accumulation, output in a's dtype).
    ``out``: a contiguous [m, n] tensor to write into (tests poison it first)."""
    m, k = a.shape
    n = b.shape[1]
    cfg = config or choose_config(a.device, m, n, k, a.dtype)
    c = out if out is not None else torch.empty(m, n, dtype=a.dtype, device=a.device)
    if tuple(c.shape) != (m, n) or c.stride(1) != 1:
        raise ValueError(f"gemm: out must be a row-major [{m}, {n}] tensor, got {tuple(c.shape)} {c.stride()}")
    ops = _operands(a, b, cfg, a_rows_contiguous=True)
    c_desc = TensorDescriptor.from_tensor(c, [cfg.block_m, cfg.block_n]) if _tma_ok(c) else None
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if programs is None:
        programs = _num_sms(a.device) if a.is_cuda else 4
    programs = max(1, min(programs, tiles))
    _launch(ops, bias, c, c_desc, None, None, m, n, k, tiles, programs, 1, max(m, 1), cfg, signal=False)
    return c


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def layout(plan: GemmCollectivePlan) -> tuple[TileGrid, WaveSchedule]:
    from .reference import layout as ref_layout

    return ref_layout(plan)


def wave_table(sched: WaveSchedule) -> list[int]:
    """Per wave: (group, first exec id of its group, tiles per stripe in the group), flattened."""
    ranges = sched.exec_ranges()
    out: list[int] = []
    for g in sched.wave_to_group():
        lo, hi = ranges[g]
        out += [g, lo, (hi - lo) // sched.stripes]
    return out


def _a_rows_contiguous(plan: GemmCollectivePlan, stripes: int, block_m: int) -> bool:
    """Whether each tile's rows are one contiguous run of A's rows (so TMA can read them)."""
    return stripes == 1 or plan.outer == 1 or plan.chunk % block_m == 0


@dataclasses.dataclass
class _Layout:
    """Per (device, plan): tile grid, schedule, the wave table on the device and the resolved
    kernel config per dtype; built once so a call does no host->device copies or lookups."""

    grid: TileGrid
    sched: WaveSchedule
    wave_tbl: torch.Tensor
    configs: dict


_layouts: dict[tuple[int, str], _Layout] = {}


def _layout(device: torch.device, plan: GemmCollectivePlan) -> _Layout:
    key = (device.index if device.type == "cuda" else -1, plan.to_json())
    lay = _layouts.get(key)
    if lay is None:
        grid, sched = layout(plan)
        table = allocate(lambda: torch.tensor(wave_table(sched), dtype=torch.int32, device=device))
        lay = _layouts[key] = _Layout(grid, sched, table, {})
    return lay


def gemm_signal_into(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, plan: GemmCollectivePlan,
                     send: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                     config: GemmConfig | None = None, scope: str = "gpu", signal_at: str = "group_end",
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the GEMM and its signalling epilogue: every exec id's tile at its send slot of
    ``send`` ([num_exec, BM, BN]) and one count per tile on ``counters[group]``; no waits, no
    collective. Returns (send, counters). Counters are not reset here.

    ``scope``: memory scope of the per-tile release atomic. "gpu" when the waiter is a kernel on
    this GPU (the spin waiter; NCCL then runs after it in stream order); "sys" when the
    waiter is the stream front end (cuStreamWaitValue32), as measured in DESIGN.md.
    ``signal_at``: see SIGNAL_AT."""
    lay = _layout(a.device, plan)
    grid, sched = lay.grid, lay.sched
    c = plan.config
    if config is None:
        config = lay.configs.get(a.dtype)
        if config is None:
            config = lay.configs[a.dtype] = choose_config(a.device, grid.rows * sched.stripes, plan.n, plan.k,
                                                          a.dtype, c["block_m"], c["block_n"], c["group_m"])
    cfg = dataclasses.replace(config, block_m=c["block_m"], block_n=c["block_n"], group_m=c["group_m"])
    if send is None:
        send = torch.empty(sched.num_exec, grid.block_m, grid.block_n, dtype=a.dtype, device=a.device)
    if counters is None:
        counters = torch.zeros(len(sched.wave_groups), dtype=torch.int32, device=a.device)
    stripes = sched.stripes
    chunk = plan.chunk if stripes > 1 else grid.rows
    ops = _operands(a, b, cfg, _a_rows_contiguous(plan, stripes, cfg.block_m))
    flat = send.view(-1, grid.block_n)  # slot s = rows [s*BM, (s+1)*BM) of this view
    send_desc = TensorDescriptor.from_tensor(flat, [grid.block_m, grid.block_n]) if _tma_ok(flat) else None
    _launch(ops, bias, send, send_desc, counters, lay.wave_tbl, grid.rows, plan.n, plan.k, sched.num_exec,
            sched.programs, stripes, chunk, cfg, signal=True, scope=scope, signal_at=signal_at)
    return send, counters
