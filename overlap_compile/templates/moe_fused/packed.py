"""moe_fused with ``"experts": "packed"``: the expert GEMMs over the routed rows only, with the
rows' sizes found and kept on the device (no host round trip, so the call stays capturable).
A bias-free SwiGLU maps the zero padding rows to zero, so they need no GEMM. Per piece of
``[E, C, *]`` slots::

    n[e]        = 1 + the last non-zero row of expert e (routed_sizes.py, on the device)
    packed      = the routed rows expert after expert, in a buffer of the static size E * C
                  (the rows past the last group: zeros, in no group)
    GEMMs       torch._grouped_mm with the group ends cumsum(n) on the device
    unpacked    every slot row gets its packed row, or zeros

Backward (backward_reference.PackedPieces): per piece d_act, the elementwise step and d_h on
packed rows; after the last piece the weight gradients as grouped GEMMs splitting K at each
expert's rows. The row moves cost back part of the gain (model.packed_overhead_ms).

    kernels (_move_rows_kernel, _silu_mul_unpack_kernel, _piece_maps_kernel)
        ->  launchers (move_rows, silu_mul_unpack, slot_maps)  ->  experts, PackedPieces
"""
from __future__ import annotations

import os

import torch

from ..tile_fused.primitives import HAVE_TRITON, tl, triton
from .swiglu_kernels import silu_mul

BLOCK_R, BLOCK_C = 16, 256

if HAVE_TRITON:

    @triton.jit
    def _move_rows_kernel(src_ptr, out_ptr, index_ptr, n, cols, src_rows, s_sb, s_sr, out_rows, o_sb, o_sr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # out row k (of [B, out_rows, cols]) <- src row index[k] (of [B', src_rows, cols]), zeros for -1
        k = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        live = k < n
        v = tl.load(index_ptr + k, mask=live, other=-1).to(tl.int64)
        src = (v // src_rows) * s_sb + (v % src_rows) * s_sr
        dst = (k // out_rows) * o_sb + (k % out_rows) * o_sr
        cmask = c[None, :] < cols
        x = tl.load(src_ptr + src[:, None] + c[None, :], mask=live[:, None] & (v[:, None] >= 0) & cmask, other=0.0)
        tl.store(out_ptr + dst[:, None] + c[None, :], x, mask=live[:, None] & cmask)


    @triton.jit
    def _silu_mul_unpack_kernel(g_ptr, u_ptr, a_ptr, index_ptr, gs_ptr, us_ptr, as_ptr, n, cols, p_sr, s_rows,
                                s_sb, s_sr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # slot row k (of [B, s_rows, cols]) <- packed row index[k]: gate, up and silu(gate) * up, zeros
        # for -1; the product also into its packed row (the down projection's operand)
        k = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        live = k < n
        v = tl.load(index_ptr + k, mask=live, other=-1).to(tl.int64)
        cmask = c[None, :] < cols
        routed = live[:, None] & (v[:, None] >= 0) & cmask
        src = v[:, None] * p_sr + c[None, :]
        g = tl.load(g_ptr + src, mask=routed, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + src, mask=routed, other=0.0).to(tl.float32)
        act = g * tl.sigmoid(g) * u
        tl.store(a_ptr + src, act.to(a_ptr.dtype.element_ty), mask=routed)
        dst = ((k // s_rows) * s_sb + (k % s_rows) * s_sr)[:, None] + c[None, :]
        slot = live[:, None] & cmask
        tl.store(gs_ptr + dst, g.to(gs_ptr.dtype.element_ty), mask=slot)
        tl.store(us_ptr + dst, u.to(us_ptr.dtype.element_ty), mask=slot)
        tl.store(as_ptr + dst, act.to(as_ptr.dtype.element_ty), mask=slot)


    @triton.jit
    def _piece_maps_kernel(sizes_ptr, pack_ptr, unpack_ptr, offs_ptr, groups, capacity,
                           BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr):
        # program g: group g's begin (the sizes before it), its slots' packed rows (-1 past its
        # size), the packed rows' slots, its group end, and -1 at the packed rows of its slot
        # range [g C, (g + 1) C) past the total (those ranges cover every packed row)
        g = tl.program_id(0)
        j = tl.arange(0, BLOCK_G)
        every = tl.load(sizes_ptr + j, mask=j < groups, other=0).to(tl.int64)
        begin = tl.sum(tl.where(j < g, every, 0), axis=0)
        total = tl.sum(every, axis=0)
        n = tl.load(sizes_ptr + g).to(tl.int64)
        tl.store(offs_ptr + g, (begin + n).to(tl.int32))
        base = g.to(tl.int64) * capacity
        for c0 in range(0, capacity, BLOCK_C):
            i = c0 + tl.arange(0, BLOCK_C)
            inside = i < capacity
            routed = i < n
            tl.store(unpack_ptr + base + i, tl.where(routed, begin + i, -1), mask=inside)
            tl.store(pack_ptr + begin + i, base + i, mask=inside & routed)
            tl.store(pack_ptr + base + i, tl.full([BLOCK_C], -1, tl.int64), mask=inside & (base + i >= total))


def _use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """``[R, F]`` or ``[B, R, F]`` as 3-D; the columns must be contiguous."""
    t3 = t.unsqueeze(0) if t.dim() == 2 else t
    if t3.dim() != 3 or (t3.shape[2] > 1 and t3.stride(2) != 1):
        raise ValueError(f"moe_fused move_rows: operands are [R, F] or [B, R, F] with unit column stride; "
                         f"got shape {tuple(t.shape)}, strides {tuple(t.stride())}")
    return t3


def move_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out``'s rows (flattened over its leading dims) ``k`` <- ``src``'s row ``index[k]``
    (flattened the same way), zeros where ``index[k]`` is -1. ``out``: a new ``[len(index), F]``
    when None; either side may be a strided view (a column block of the saved layout)."""
    s3 = _rows_view(src)
    out = src.new_empty(index.numel(), src.shape[-1]) if out is None else out
    o3 = _rows_view(out)
    if o3.shape[0] * o3.shape[1] != index.numel() or o3.shape[2] != s3.shape[2]:
        raise ValueError(f"moe_fused move_rows: out {tuple(out.shape)} does not hold {index.numel()} rows of "
                         f"{s3.shape[2]} columns")
    if not _use_triton(out):
        flat = s3.reshape(-1, s3.shape[2])
        got = flat.index_select(0, index.clamp(min=0).long())
        o3.copy_(torch.where((index >= 0)[:, None], got, torch.zeros((), dtype=got.dtype)).view(o3.shape))
        return out
    if index.numel() and o3.shape[2]:
        grid = (triton.cdiv(index.numel(), BLOCK_R), triton.cdiv(o3.shape[2], BLOCK_C))
        _move_rows_kernel[grid](s3, o3, index, index.numel(), o3.shape[2], s3.shape[1], s3.stride(0), s3.stride(1),
                                o3.shape[1], o3.stride(0), o3.stride(1), BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    return out


def silu_mul_unpack(gate: torch.Tensor, up: torch.Tensor, index: torch.Tensor, gate_slots: torch.Tensor,
                    up_slots: torch.Tensor, act_slots: torch.Tensor) -> torch.Tensor:
    """The forward's elementwise step on packed rows with the unpack of what training saves, in one
    pass: ``act = silu(gate) * up`` on the packed ``gate``, ``up`` ``[P, F]``, returned packed (the
    rows no slot maps to are left unwritten), and gate, up and act into the slots' views
    (``[B, R, F]``, ``B * R == len(index)``, one layout for the three: the saved layout's column
    blocks), row ``k`` from packed row ``index[k]``, zeros for -1. Written as silu_mul and three
    move_rows it read each packed operand again: three fewer passes over ``[P, F]`` here."""
    slots = {"gate_slots": gate_slots, "up_slots": up_slots, "act_slots": act_slots}
    views = {name: _rows_view(t) for name, t in slots.items()}
    layouts = {name: (tuple(v.shape), v.stride()[:2]) for name, v in views.items()}
    g3 = views["gate_slots"]
    if (len(set(layouts.values())) != 1 or g3.shape[0] * g3.shape[1] != index.numel()
            or tuple(gate.shape) != tuple(up.shape) or gate.dim() != 2 or gate.shape[1] != g3.shape[2]):
        raise ValueError(f"moe_fused silu_mul_unpack: gate and up must be one [P, F] shape and the three slot views "
                         f"one [B, R, F] layout of B * R = len(index) = {index.numel()} rows; got gate "
                         f"{tuple(gate.shape)}, up {tuple(up.shape)}, slots {layouts}")
    if not _use_triton(gate) or gate.stride() != up.stride() or gate.stride(1) != 1:
        act = silu_mul(gate, up)
        for packed_rows, name in ((gate, "gate_slots"), (up, "up_slots"), (act, "act_slots")):
            move_rows(packed_rows, index, out=slots[name])
        return act
    act = torch.empty_like(gate)
    a3, u3 = views["act_slots"], views["up_slots"]
    if index.numel() and gate.shape[1]:
        grid = (triton.cdiv(index.numel(), BLOCK_R), triton.cdiv(gate.shape[1], BLOCK_C))
        _silu_mul_unpack_kernel[grid](gate, up, act, index, g3, u3, a3, index.numel(), gate.shape[1], gate.stride(0),
                                      g3.shape[1], g3.stride(0), g3.stride(1), BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
                                      num_warps=4)
    return act


def gather_index(sizes: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """Segments packed one after the other, on the device: segment g's ``sizes[g]`` rows begin at
    row ``starts[g]`` of the source; returns the source row of each of ``length`` packed rows
    (int64), -1 past the last segment. ``length`` is static (no host read of the sizes)."""
    sizes, starts = sizes.reshape(-1).long(), starts.reshape(-1).long()
    ends = torch.cumsum(sizes, 0)
    q = torch.arange(length, device=sizes.device)
    seg = torch.searchsorted(ends, q, right=True)  # the segment holding packed row q (empty ones skipped)
    last = max(sizes.numel() - 1, 0)
    at = seg.clamp(max=last)
    row = starts[at] + q - (ends[at] - sizes[at])
    return torch.where(seg < sizes.numel(), row, torch.full_like(row, -1))


def unpack_index(sizes: torch.Tensor, capacity: int) -> torch.Tensor:
    """For a piece of ``len(sizes)`` groups of ``capacity`` slot rows packed by gather_index:
    each slot row's packed row, -1 past its group's size (int64)."""
    sizes = sizes.reshape(-1).long()
    begins = torch.cumsum(sizes, 0) - sizes
    r = torch.arange(sizes.numel() * capacity, device=sizes.device)
    group, i = r // capacity, r % capacity
    return torch.where(i < sizes[group], begins[group] + i, torch.full_like(r, -1))


def group_ends(sizes: torch.Tensor) -> torch.Tensor:
    """The grouped GEMMs' ``offs``: cumulative row counts per group, int32 on the device."""
    return torch.cumsum(sizes.reshape(-1), 0, dtype=torch.int32)


def grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm takes these operands: CPU (any float dtype), or CUDA bf16 on sm90+; row
    strides of 16-byte multiples either way."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    aligned = all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, w))
    if x.device.type == "cpu":
        return aligned
    return (aligned and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm where it runs (CPU; CUDA bf16 on sm90+): ``a`` [rows, K] x ``b`` [G, K, N]
    (groups of rows) or ``a`` [M, K_total] x ``b`` [K_total, N] (groups of K, -> [G, M, N]).
    Elsewhere (fp32 / fp16 on CUDA) one mm per group, which reads the group ends on the host."""
    if grouped_mm_runs(a, b):
        return torch._grouped_mm(a, b, offs=offs)
    ends = [0] + offs.tolist()
    if b.dim() == 3:  # groups of rows
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g, (lo, hi) in enumerate(zip(ends, ends[1:])):
            if hi > lo:
                torch.mm(a[lo:hi], b[g], out=out[lo:hi])
        return out
    out = a.new_zeros(len(ends) - 1, a.shape[0], b.shape[1])  # groups of K
    for g, (lo, hi) in enumerate(zip(ends, ends[1:])):
        if hi > lo:
            torch.mm(a[:, lo:hi], b[lo:hi], out=out[g])
    return out


def piece_maps(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sizes [E] int32, pack index, unpack index, offs) of a piece ``x`` [E, C, *] of slots: on
    CUDA the sizes scan and one launch (slot_maps), where gather_index, unpack_index and
    group_ends take ~30 small kernels and as many host calls; the torch ops elsewhere."""
    from .routed_sizes import sizes as routed_sizes

    n = routed_sizes(x)
    return (n, *slot_maps(n, x.shape[1]))


def slot_maps(sizes: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pack index, unpack index, offs) of groups of ``capacity`` slots one after another, group g
    holding ``sizes[g]`` routed rows first: gather_index(sizes, g * capacity), unpack_index and
    group_ends, in one launch where Triton runs (_piece_maps_kernel)."""
    sizes = sizes.reshape(-1)
    groups = sizes.numel()
    if not (_use_triton(sizes) and groups and capacity):
        starts = torch.arange(groups, device=sizes.device) * capacity
        return gather_index(sizes, starts, groups * capacity), unpack_index(sizes, capacity), group_ends(sizes)
    pack = torch.empty(groups * capacity, dtype=torch.int64, device=sizes.device)
    unpack, offs = torch.empty_like(pack), torch.empty(groups, dtype=torch.int32, device=sizes.device)
    _piece_maps_kernel[(groups,)](sizes.contiguous(), pack, unpack, offs, groups, capacity,
                                  BLOCK_G=triton.next_power_of_2(groups), BLOCK_C=min(1024, triton.next_power_of_2(capacity)),
                                  num_warps=4)
    return pack, unpack, offs


def experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
            out: torch.Tensor | None = None, keep: dict | None = None) -> torch.Tensor:
    """reference.experts on the routed rows only: ``x`` [E, C, H] slots -> [E, C, H] (into ``out``
    when given), zeros in every padding row; ``keep``'s views (role -> [E, C, *], or a layout
    with the same rows) get the intermediates, zeros in the padding rows too."""
    e, c, h = x.shape
    _, pack, unpack, offs = piece_maps(x)
    xp = move_rows(x, pack)
    gate, up = grouped(xp, w1, offs), grouped(xp, w3, offs)
    keep = keep or {}
    if all(role in keep for role in ("gate", "up", "act")):  # a training graph's saves: one pass
        act = silu_mul_unpack(gate, up, unpack, *(keep[role].view(e, c, -1) for role in ("gate", "up", "act")))
    else:
        act = silu_mul(gate, up)
        for role in ("gate", "up", "act"):
            if role in keep:
                move_rows({"gate": gate, "up": up, "act": act}[role], unpack, out=keep[role].view(e, c, -1))
    y = grouped(act, w2, offs)
    if "tokens" in keep:
        keep["tokens"].copy_(x.view(keep["tokens"].shape))
    out = x.new_empty(e, c, h) if out is None else out
    move_rows(y, unpack, out=out.view(e, c, h))
    return out


def saved_rows(t_transposed: torch.Tensor) -> torch.Tensor:
    """A saved tensor handed over transposed (``tokens_t`` / ``act_t`` [E, K, W*C]) as its rows
    [E, W*C, K]: a view when it is the transpose of row-major rows, a copy otherwise."""
    rows = t_transposed.transpose(1, 2)
    return rows if rows.stride(2) == 1 else rows.contiguous()
