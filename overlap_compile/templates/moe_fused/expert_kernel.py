"""The expert FFN of a moe_fused section as one persistent Triton kernel whose tiles start as
their tokens land (FlashDMoE's fused expert computation, in stock Triton).

    act[s, e] = silu(x[s, e] @ w1[e]) * (x[s, e] @ w3[e])     phase 1: gate and up in one tile
    y[s, e]   = act[s, e] @ w2[e]                               phase 2

    phase 1 (s, e, mb, fb)  waits for arrival[s, e], computes act[s, e] rows mb, columns fb,
                            adds 1 to act_done[s, e, mb]
    phase 2 (s, e, mb, hb)  waits until act_done[s, e, mb] counts every F block of those rows,
                            computes y rows mb, columns hb, adds 1 to y_done[s]

for source rank s and local expert e (x: ``[W, E, C, H]``). The tile table (``tile_order``) lists
sources in arrival order, unit i's phase-2 tiles after unit i+1's phase-1 tiles, the own second
half last; every tile waits only on earlier tiles, so with all programs resident nothing deadlocks.
Waits are bounded (records in ``err``, ``check_errors`` raises); counters are zeroed after each
call. Layers: ``_swiglu_experts_kernel`` -> ``launch`` -> ``swiglu_experts``.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..signal_reorder import kernels as SR  # its dot precision rule (fp32 follows torch's TF32 switch)
from ..tile_fused import primitives as prim
from ..tile_fused.primitives import HAVE_TRITON, tl, triton  # Triton is optional on CPU installs
from . import reference as ref
from ...runtime.spin_wait import bound_us

TEMPLATE = "moe_fused"
PHASE_ACT, PHASE_OUT = 1, 2
# err[1] codes of this kernel's waits (primitives.WAIT_* are 1..3; the kernel writes them as literals)
WAIT_ARRIVAL, WAIT_ACT = 4, 5
SCHEDULES = ("dynamic", "static")
WAIT_NAMES = {WAIT_ARRIVAL: "tokens of (source, expert) index", WAIT_ACT: "activation rows (source, expert, row block) index"}


@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    """Block sizes of the kernel: rows (capacity) per tile, act columns per phase-1 tile, output
    columns per phase-2 tile, K step."""

    block_m: int = 128
    block_f: int = 128
    block_h: int = 256  # 128 ran well below cuBLAS bmm (benchmarks/moe_experts.py compares them)
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    # read the weights (and x, when every source has arrived before the launch) through TMA
    # descriptors where the shapes allow it (launch: _tma_views); pointer loads otherwise
    tma: bool = True
    tma_waits: bool = True  # x through TMA also when tiles wait on arrivals (proxy fence after the wait)
    # how programs take tiles: "dynamic", the next tile of the table from a ticket counter as a
    # program comes free (tiles of unequal cost: skipped rows, Mixtral's long phase-2 K loop);
    # "static", program p takes p, p + P, ... (a slow tile delays every later tile of its program)
    schedule: str = "dynamic"
    # row blocks per group in the tile order: a group's tiles go column block by column block,
    # so the tiles running at once share a few weight column blocks in L2 instead of sweeping
    # all of them for one row block (Mixtral's F = 14336 is 112 column blocks of w1 and w3, 2 MB
    # each; one row block at a time reads them from HBM again for every row block)
    group_m: int = 8

    def __post_init__(self) -> None:
        for f in ("block_m", "block_f", "block_h", "block_k"):
            v = getattr(self, f)
            if v < 16 or v & (v - 1):
                raise ValueError(f"ExpertTiles.{f} must be a power of two >= 16, got {v}")
        if not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"ExpertTiles.group_m must be an int >= 1, got {self.group_m!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"ExpertTiles.schedule must be one of {SCHEDULES}, got {self.schedule!r}")


@functools.lru_cache(maxsize=64)
def tile_order(world: int, rank: int, e_local: int, capacity: int, ffn: int, hidden: int,
               block_m: int, block_f: int, block_h: int, group_m: int = 1) -> tuple[tuple[int, int, int, int, int], ...]:
    """(phase, source, expert, row block, column block) of every tile, in execution order; within
    a (phase, source, expert), groups of ``group_m`` row blocks, each group column by column."""
    mb = -(-capacity // block_m)
    fb, hb = -(-ffn // block_f), -(-hidden // block_h)
    every = (range(e_local), 0, mb)
    # the own tokens in two halves around the peers' (reference.own_parts over row blocks: by
    # experts, or by row blocks for one expert): the second half runs while the last peer's
    # result travels home
    own = [every] if world == 1 else [(range(e_local)[ex], rows.start, rows.stop)
                                      for ex, rows in ref.own_parts(e_local, mb)]
    units = [(rank, own[0])] + [(ref.round_peers(rank, world, k)[1], every) for k in range(1, world)]

    def phase(p: int, unit, blocks: int) -> list[tuple[int, int, int, int, int]]:
        s, (experts, lo, hi) = unit
        return [(p, s, e, m, n) for e in experts for g in range(lo, hi, group_m) for n in range(blocks)
                for m in range(g, min(g + group_m, hi))]

    order = phase(PHASE_ACT, units[0], fb)
    for prev, unit in zip(units, units[1:]):
        order += phase(PHASE_ACT, unit, fb) + phase(PHASE_OUT, prev, hb)
    order += phase(PHASE_OUT, units[-1], hb)
    for part in own[1:]:  # after the last peer's outputs are done, all of it behind their push
        order += phase(PHASE_ACT, (rank, part), fb) + phase(PHASE_OUT, (rank, part), hb)
    return tuple(order)


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["timeout_us", "max_polls"])  # one variant for every bound
    def _swiglu_experts_kernel(
        x_ptr, w1_ptr, w3_ptr, w2_ptr, act_ptr, y_ptr, gate_ptr, up_ptr, tiles_ptr, n_tiles,
        x_desc, w1_desc, w3_desc, w2_desc, act_desc,
        arrival_ptr, act_done_ptr, y_done_ptr, err_ptr, timeout_us, max_polls, sizes_ptr, ticket_ptr,
        E, C, H, F,
        sx_s, sx_e, sx_c, sa_s, sa_e, sa_c, sy_s, sy_e, sy_c,
        BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
        WAIT_ARRIVAL: tl.constexpr, USE_ASM: tl.constexpr, USE_TIMER: tl.constexpr, DOT_PRECISION: tl.constexpr,
        X_TMA: tl.constexpr, W_TMA: tl.constexpr, A_TMA: tl.constexpr, USE_SIZES: tl.constexpr,
        DYNAMIC: tl.constexpr, SAVE_GATE: tl.constexpr, SAVE_UP: tl.constexpr, WHOLE_ACT: tl.constexpr,
    ):
        """Weights are contiguous: w1, w3 ``[E, H, F]``, w2 ``[E, F, H]``; x, act, y have a unit
        last stride; x and act may be any layout whose (source, expert) slots are row blocks of one
        dense array (TMA rows are found from the strides). See the module doc for the tiles.

        W_TMA / X_TMA / A_TMA: weights, x, act through 2-D descriptors (rows past a slot only feed
        rows never stored; a proxy fence orders TMA reads after each acquire). SAVE_GATE / SAVE_UP:
        phase 1 also stores the gate / up results (a training section saves them); WHOLE_ACT: tiles
        past the routed rows store zeros, so saved intermediates are whole. DYNAMIC: tiles taken in
        table order from ``*ticket_ptr`` (else program p takes p, p + P, ...); either way a tile is
        taken only after every earlier one, so no wait depends on a tile nobody runs. USE_SIZES:
        ``sizes[s * E + e]`` rows are routed, the rest zero: tiles wholly past them compute nothing."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        m_blocks = (C + BLOCK_M - 1) // BLOCK_M
        f_blocks = (F + BLOCK_F - 1) // BLOCK_F
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        if DYNAMIC:
            t = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
        else:
            t = pid
        while t < n_tiles:
            phase = tl.load(tiles_ptr + 5 * t)
            s = tl.load(tiles_ptr + 5 * t + 1)
            e = tl.load(tiles_ptr + 5 * t + 2)
            mb = tl.load(tiles_ptr + 5 * t + 3)
            nb = tl.load(tiles_ptr + 5 * t + 4)
            rows = mb * BLOCK_M + offs_m
            rmask = rows < C
            se = s * E + e
            if phase == 1:
                if WAIT_ARRIVAL:
                    landed = prim.wait_ge(arrival_ptr + se, 1, err_ptr, 4, se, timeout_us, max_polls, True, USE_ASM,
                                          USE_TIMER)
                    if X_TMA:  # the copy engine's data, read by TMA after the acquire
                        prim.fence_async_reads(landed, USE_ASM)
            elif USE_SIZES and WAIT_ARRIVAL:  # the sizes land with the chunk: acquire it before reading them
                prim.wait_ge(arrival_ptr + se, 1, err_ptr, 4, se, timeout_us, max_polls, True, USE_ASM, USE_TIMER)
            live = True
            if USE_SIZES:
                live = mb * BLOCK_M < tl.load(sizes_ptr + se)
            if (phase == 1) & live:
                f_cols = nb * BLOCK_F + tl.arange(0, BLOCK_F)
                f_mask = f_cols < F
                x_rows = x_ptr + s.to(tl.int64) * sx_s + e.to(tl.int64) * sx_e + rows[:, None].to(tl.int64) * sx_c
                w_base = e.to(tl.int64) * H * F
                gate = tl.zeros((BLOCK_M, BLOCK_F), tl.float32)
                up = tl.zeros((BLOCK_M, BLOCK_F), tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    ks = k0 + offs_k
                    kmask = ks < H
                    if X_TMA:
                        xa = x_desc.load([((s.to(tl.int64) * sx_s + e.to(tl.int64) * sx_e) // sx_c
                                           + mb * BLOCK_M).to(tl.int32), k0])
                    else:
                        xa = tl.load(x_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                    if W_TMA:
                        w1t = w1_desc.load([(e * H + k0).to(tl.int32), nb * BLOCK_F])
                        w3t = w3_desc.load([(e * H + k0).to(tl.int32), nb * BLOCK_F])
                    else:
                        woff = w_base + ks[:, None].to(tl.int64) * F + f_cols[None, :]
                        wmask = kmask[:, None] & f_mask[None, :]
                        w1t = tl.load(w1_ptr + woff, mask=wmask, other=0.0)
                        w3t = tl.load(w3_ptr + woff, mask=wmask, other=0.0)
                    gate = tl.dot(xa, w1t, gate, input_precision=DOT_PRECISION)
                    up = tl.dot(xa, w3t, up, input_precision=DOT_PRECISION)
                # SiLU of the gate GEMM's result rounded as the layer rounds it (bmm output in
                # the activation dtype), the product likewise
                g = gate.to(act_ptr.dtype.element_ty).to(tl.float32)
                u = up.to(act_ptr.dtype.element_ty).to(tl.float32)
                silu = (g / (1.0 + tl.exp(-g))).to(act_ptr.dtype.element_ty).to(tl.float32)
                act = (silu * u).to(act_ptr.dtype.element_ty)
                offs = s.to(tl.int64) * sa_s + e.to(tl.int64) * sa_e + rows[:, None].to(tl.int64) * sa_c + f_cols[None, :]
                amask = rmask[:, None] & f_mask[None, :]
                tl.store(act_ptr + offs, act, mask=amask)
                if SAVE_GATE:
                    tl.store(gate_ptr + offs, g.to(act_ptr.dtype.element_ty), mask=amask)
                if SAVE_UP:
                    tl.store(up_ptr + offs, u.to(act_ptr.dtype.element_ty), mask=amask)
            elif (phase == 1) & WHOLE_ACT:  # rows past the routed ones: the saved values are zeros
                f_cols = nb * BLOCK_F + tl.arange(0, BLOCK_F)
                offs = s.to(tl.int64) * sa_s + e.to(tl.int64) * sa_e + rows[:, None].to(tl.int64) * sa_c + f_cols[None, :]
                amask = rmask[:, None] & (f_cols < F)[None, :]
                zero = tl.zeros((BLOCK_M, BLOCK_F), act_ptr.dtype.element_ty)
                tl.store(act_ptr + offs, zero, mask=amask)
                if SAVE_GATE:
                    tl.store(gate_ptr + offs, zero, mask=amask)
                if SAVE_UP:
                    tl.store(up_ptr + offs, zero, mask=amask)
            if phase == 1:
                # every thread's stores, then one release add for the CTA (GPU scope: the
                # readers are this kernel's phase-2 tiles); a tile past the routed rows too
                prim.signal_add(act_done_ptr + se * m_blocks + mb, 1, False, USE_ASM)
            elif live == 0:  # rows past the routed ones: zero outputs, nothing to compute or wait for
                h_cols = nb * BLOCK_H + tl.arange(0, BLOCK_H)
                dst = y_ptr + s.to(tl.int64) * sy_s + e.to(tl.int64) * sy_e + rows[:, None].to(tl.int64) * sy_c
                tl.store(dst + h_cols[None, :], tl.zeros((BLOCK_M, BLOCK_H), y_ptr.dtype.element_ty),
                         mask=rmask[:, None] & (h_cols < H)[None, :])
                prim.signal_add(y_done_ptr + s, 1, False, USE_ASM)
            else:
                done = prim.wait_ge(act_done_ptr + se * m_blocks + mb, f_blocks, err_ptr, 5, se * m_blocks + mb,
                                    timeout_us, max_polls, False, USE_ASM, USE_TIMER)
                if A_TMA:  # rows other programs stored, read by TMA after the acquire
                    prim.fence_async_reads(done, USE_ASM)
                h_cols = nb * BLOCK_H + tl.arange(0, BLOCK_H)
                h_mask = h_cols < H
                a_rows = act_ptr + s.to(tl.int64) * sa_s + e.to(tl.int64) * sa_e + rows[:, None].to(tl.int64) * sa_c
                w_base = e.to(tl.int64) * F * H
                acc = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)
                for k0 in range(0, F, BLOCK_K):
                    ks = k0 + offs_k
                    kmask = ks < F
                    if A_TMA:
                        a = act_desc.load([((s.to(tl.int64) * sa_s + e.to(tl.int64) * sa_e) // sa_c
                                             + mb * BLOCK_M).to(tl.int32), k0])
                    else:
                        a = tl.load(a_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                    if W_TMA:
                        w = w2_desc.load([(e * F + k0).to(tl.int32), nb * BLOCK_H])
                    else:
                        w = tl.load(w2_ptr + w_base + ks[:, None].to(tl.int64) * H + h_cols[None, :],
                                    mask=kmask[:, None] & h_mask[None, :], other=0.0)
                    acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
                dst = y_ptr + s.to(tl.int64) * sy_s + e.to(tl.int64) * sy_e + rows[:, None].to(tl.int64) * sy_c
                tl.store(dst + h_cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & h_mask[None, :])
                prim.signal_add(y_done_ptr + s, 1, False, USE_ASM)
            if DYNAMIC:
                t = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
            else:
                t += programs


def _on_gpu(t: torch.Tensor) -> bool:
    import os

    return t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def _tma_views(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, act: torch.Tensor,
               cfg: ExpertTiles, wait_arrival: bool) -> tuple:
    """(x, w1, w3, w2, act) descriptors for the kernel's X_TMA / W_TMA / A_TMA paths, None where a
    path does not apply: weights only when H and F are multiples of block_k (a K step never
    crosses into the next expert's rows) and each 2-D view is one TMA accepts; x when its slots
    are row blocks of one dense array (``dense_rows``; and ``cfg.tma_waits`` or no tile waits on
    an arrival); act likewise (its K steps run along F, whose end TMA pads with zeros)."""
    if not cfg.tma or SR.TensorDescriptor is None:
        return None, None, None, None, None
    e, h, f = w1.shape
    views = ((w1.view(e * h, f), cfg.block_f), (w3.view(e * h, f), cfg.block_f), (w2.view(e * f, h), cfg.block_h))
    w_ok = h % cfg.block_k == 0 and f % cfg.block_k == 0 and all(SR._tma_ok(v) for v, _ in views)
    w_descs = tuple(SR.TensorDescriptor.from_tensor(v, [cfg.block_k, cols]) if w_ok else None for v, cols in views)
    x_rows, act_rows = dense_rows(x), dense_rows(act)
    x_desc = None
    if (cfg.tma_waits or not wait_arrival) and x_rows is not None and SR._tma_ok(x_rows):
        x_desc = SR.TensorDescriptor.from_tensor(x_rows, [cfg.block_m, cfg.block_k])
    act_desc = None
    if act_rows is not None and SR._tma_ok(act_rows):
        act_desc = SR.TensorDescriptor.from_tensor(act_rows, [cfg.block_m, cfg.block_k])
    return (x_desc, *w_descs, act_desc)


def dense_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` ``[W, E, C, D]`` as the dense ``[W * E * C, D]`` array holding it, starting where ``t``
    does, when its (source, expert) slots are row blocks of one (``[W, E]`` in either order: the
    dispatch layout, or the saved intermediates' expert-major one); None otherwise. The kernel
    finds a slot's first row as (s * stride_s + e * stride_e) / stride_c."""
    if t.dim() != 4 or t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
        return None
    lead = sorted((0, 1), key=lambda d: -t.stride(d))
    dense = t.permute(*lead, 2, 3)
    return dense.reshape(-1, t.shape[-1]) if dense.is_contiguous() else None


def launch(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, act: torch.Tensor, y: torch.Tensor,
           tiles: torch.Tensor, arrival: torch.Tensor, act_done: torch.Tensor, y_done: torch.Tensor,
           err: torch.Tensor, programs: int, cfg: ExpertTiles, wait_arrival: bool, timeout_ms: int,
           max_polls: int = 1 << 20, sizes: torch.Tensor | None = None, ticket: torch.Tensor | None = None,
           gate: torch.Tensor | None = None, up: torch.Tensor | None = None, whole_act: bool = False) -> None:
    """One launch of the kernel over the tile table ``tiles`` ([T, 5] int32 on the device);
    ``sizes``: int32 [W * E], the routed rows of each (source, expert) (the rest zero): tiles past
    them are skipped (kernel doc, USE_SIZES); ``ticket``: int32 [1], zero at the launch, the
    dynamic schedule's tile counter (``cfg.schedule == "dynamic"`` needs it; the caller zeroes it
    after the kernel). ``gate`` / ``up``: where to save those GEMM results too (act's shape and
    strides); ``whole_act``: act is saved, so skipped tiles store its zeros (kernel doc)."""
    w, e, c, h = x.shape
    f = w1.shape[2]
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2)):
        if not t.is_contiguous():
            raise ValueError(f"{TEMPLATE} expert kernel: {name} must be contiguous, got strides {t.stride()}")
    for name, t in (("x", x), ("act", act), ("y", y), ("gate", gate), ("up", up)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{TEMPLATE} expert kernel: {name} needs a unit last stride, got {t.stride()}")
    for name, t in (("gate", gate), ("up", up)):
        if t is not None and (t.shape != act.shape or t.stride() != act.stride()):
            raise ValueError(f"{TEMPLATE} expert kernel: {name} must have act's shape and strides "
                             f"{tuple(act.shape)} {act.stride()}, got {tuple(t.shape)} {t.stride()}")
    dynamic = cfg.schedule == "dynamic"
    if dynamic and ticket is None:
        raise ValueError(f"{TEMPLATE} expert kernel: the dynamic schedule needs a ticket counter (Counters.ticket)")
    gpu = _on_gpu(x)
    x_desc, w1_desc, w3_desc, w2_desc, act_desc = _tma_views(x, w1, w3, w2, act, cfg, wait_arrival)
    _swiglu_experts_kernel[(programs,)](
        x, w1, w3, w2, act, y, act if gate is None else gate, act if up is None else up, tiles, tiles.shape[0],
        x_desc, w1_desc, w3_desc, w2_desc, act_desc,
        arrival, act_done, y_done, err, bound_us(timeout_ms), max_polls,
        sizes if sizes is not None else arrival, ticket if ticket is not None else arrival, e, c, h, f,
        x.stride(0), x.stride(1), x.stride(2), act.stride(0), act.stride(1), act.stride(2),
        y.stride(0), y.stride(1), y.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_F=cfg.block_f, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k,
        WAIT_ARRIVAL=wait_arrival, USE_ASM=gpu, USE_TIMER=gpu, DOT_PRECISION=SR._dot_precision(x.dtype),
        X_TMA=x_desc is not None, W_TMA=w1_desc is not None, A_TMA=act_desc is not None,
        USE_SIZES=sizes is not None, DYNAMIC=dynamic, SAVE_GATE=gate is not None, SAVE_UP=up is not None,
        WHOLE_ACT=sizes is not None and (whole_act or gate is not None or up is not None),
        **({"num_warps": cfg.num_warps, "num_stages": cfg.num_stages} if gpu else {}),
    )


@dataclasses.dataclass
class Counters:
    """The kernel's signals for one (world, E, C) and device: arrival [W * E] (uint32, so stream
    memory operations can write it; the kernel reads it as int32), act_done [W * E * row
    blocks], y_done [W], err [5], ticket [1] (the dynamic schedule's next tile). All zero
    between calls."""

    arrival: torch.Tensor
    act_done: torch.Tensor
    y_done: torch.Tensor
    err: torch.Tensor
    ticket: torch.Tensor

    @staticmethod
    def make(world: int, e_local: int, capacity: int, block_m: int, device: torch.device,
             pinned_err: bool = False) -> "Counters":
        """``pinned_err``: keep the error record in pinned host memory (on CUDA), so the host
        can read it at the next call without a synchronisation (kernels.py does)."""
        mb = -(-capacity // block_m)
        err = (torch.zeros(prim.ERR_WORDS, dtype=torch.int32).pin_memory() if pinned_err and torch.device(device).type == "cuda"
               else torch.zeros(prim.ERR_WORDS, dtype=torch.int32, device=device))
        return Counters(torch.zeros(world * e_local, dtype=torch.uint32, device=device),
                        torch.zeros(world * e_local * mb, dtype=torch.int32, device=device),
                        torch.zeros(world, dtype=torch.int32, device=device), err,
                        torch.zeros(1, dtype=torch.int32, device=device))

    def reset(self, y_done: bool = True) -> None:
        """After the kernel, in stream order (the error record stays for check_errors).
        ``y_done=False``: leave y_done to the caller (kernels.py's waits consume it)."""
        self.arrival.view(torch.int32).zero_()
        self.act_done.zero_()
        self.ticket.zero_()
        if y_done:
            self.y_done.zero_()


def check_errors(err: torch.Tensor) -> None:
    """Raise if a wait of the kernel recorded a failure (reads the record: synchronises)."""
    failed, code, index, seen, target = err.tolist()
    if failed:
        err.zero_()
        what = WAIT_NAMES.get(code, prim.WAIT_NAMES.get(code, f"code {code}"))
        raise RuntimeError(f"{TEMPLATE} expert kernel: the wait for {what} {index} read {seen}, expected "
                           f">= {target} within signal_timeout_ms; the results of that call are invalid.")


_tables: dict[tuple, torch.Tensor] = {}


def tile_table(order: tuple, device: torch.device) -> torch.Tensor:
    """``order`` as a [T, 5] int32 device tensor, made once per (order, device): a call does no
    host-to-device copy (and can be captured in a CUDA graph)."""
    key = (order, str(device))
    table = _tables.get(key)
    if table is None:
        from ...runtime.persistent import allocate

        table = _tables[key] = allocate(lambda: torch.tensor(order, dtype=torch.int32, device=device))
    return table


def swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, rank: int,
                   cfg: ExpertTiles | None = None, programs: int | None = None, counters: Counters | None = None,
                   arrived: bool = True, timeout_ms: int = 10000, max_polls: int = 1 << 20,
                   sizes: torch.Tensor | None = None, keep: dict | None = None) -> torch.Tensor:
    """``y [W, E, C, H]`` = the SwiGLU experts of every source's slots ``x [W, E, C, H]``, rank
    ``rank``'s tile order. ``arrived``: every source's tokens are in place already (no arrival
    waits); otherwise the caller's copy stream sets ``counters.arrival[s * E + e]`` to 1 as
    they land. ``sizes`` (int32 [W * E] or [W, E]): rows past ``sizes[s, e]`` of x[s, e] are zero,
    and their tiles are skipped (routed.routed_sizes gives them; in place before the arrival).
    ``keep``: "act", "gate", "up" -> ``[W, E, C, F]`` tensors (any layout ``dense_rows`` takes,
    all three alike) the kernel fills with those intermediates, as reference.experts keeps them."""
    cfg = cfg or ExpertTiles()
    w, e, c, h = x.shape
    f = w1.shape[2]
    counters = counters or Counters.make(w, e, c, cfg.block_m, x.device)
    order = tile_order(w, rank, e, c, f, h, cfg.block_m, cfg.block_f, cfg.block_h, cfg.group_m)
    tiles = tile_table(order, x.device)
    if programs is None:
        programs = max(1, torch.cuda.get_device_properties(x.device).multi_processor_count - 2) if x.is_cuda else 1
    keep = keep or {}
    act = keep["act"] if "act" in keep else x.new_empty(w, e, c, f)
    y = x.new_empty(w, e, c, h)
    launch(x, w1, w3, w2, act, y, tiles, counters.arrival.view(torch.int32), counters.act_done, counters.y_done,
           counters.err, min(programs, len(order)), cfg, not arrived, timeout_ms, max_polls,
           None if sizes is None else sizes.reshape(-1).to(torch.int32), counters.ticket,
           keep.get("gate"), keep.get("up"), "act" in keep)
    counters.reset()
    return y
