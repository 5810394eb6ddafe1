"""The SwiGLU experts' elementwise steps in one pass each, for moe_fused's ops (both directions):

    forward   act = silu(gate) * up                                  (silu_mul)
    backward  d_up = d_act * silu(gate)
              d_gate = silu_backward(d_act * up, gate)               (silu_mul_backward)

Each operand is read once and each result written once, in fp32 arithmetic (as torch ops these
were several passes each way). Operands are ``[B, R, F]`` (2-D taken as B = 1) with unit column
stride and any batch and row strides, so the saved layouts' column blocks are written in place.
Without Triton, or on CPU tensors, the same formulas run as torch ops.

    kernels (_silu_mul_kernel, _silu_mul_backward_kernel)  ->  launchers (silu_mul, silu_mul_backward)
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..tile_fused.primitives import HAVE_TRITON, tl, triton

BLOCK_R, BLOCK_F = 16, 256

if HAVE_TRITON:

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, rows, cols, g_sb, g_sr, u_sb, u_sr, o_sb, o_sr,
                         BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
        b = tl.program_id(2).to(tl.int64)
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        g = tl.load(g_ptr + b * g_sb + r[:, None] * g_sr + c[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + b * u_sb + r[:, None] * u_sr + c[None, :], mask=mask, other=0.0).to(tl.float32)
        act = g * tl.sigmoid(g) * u
        tl.store(o_ptr + b * o_sb + r[:, None] * o_sr + c[None, :], act.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_backward_kernel(d_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, idx_ptr, rows, cols, g_rows, d_sb, d_sr,
                                  g_sb, g_sr, u_sb, u_sr, dg_sb, dg_sr, du_sb, du_sr,
                                  GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
        b = tl.program_id(2).to(tl.int64)
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        if GATHER:  # gate and up row idx[r] of their [B', g_rows, F] layout, zeros for -1
            v = tl.load(idx_ptr + r, mask=r < rows, other=-1).to(tl.int64)
            g_row, u_row = (v // g_rows) * g_sb + (v % g_rows) * g_sr, (v // g_rows) * u_sb + (v % g_rows) * u_sr
            g_mask = mask & (v[:, None] >= 0)
        else:
            g_row, u_row, g_mask = b * g_sb + r * g_sr, b * u_sb + r * u_sr, mask
        d = tl.load(d_ptr + b * d_sb + r[:, None] * d_sr + c[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + g_row[:, None] + c[None, :], mask=g_mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + u_row[:, None] + c[None, :], mask=g_mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        d_up = d * g * s
        d_gate = d * u * s * (1.0 + g * (1.0 - s))
        tl.store(du_ptr + b * du_sb + r[:, None] * du_sr + c[None, :], d_up.to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(dg_ptr + b * dg_sb + r[:, None] * dg_sr + c[None, :], d_gate.to(dg_ptr.dtype.element_ty), mask=mask)


def _use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 2 else t


def _check(what: str, tensors: dict[str, torch.Tensor]) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) not in (2, 3):
        raise ValueError(f"moe_fused {what}: operands must share one [B, R, F] or [R, F] shape; got {shapes}")
    strided = [name for name, t in tensors.items() if t.shape[-1] > 1 and t.stride(-1) != 1]
    if strided:
        raise ValueError(f"moe_fused {what}: {strided} must have unit column stride (rows may be strided)")


def _grid(t: torch.Tensor) -> tuple[int, int, int]:
    b, rows, cols = t.shape
    return triton.cdiv(rows, BLOCK_R), triton.cdiv(cols, BLOCK_F), b


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[:] = silu(gate) * up`` (a new tensor when ``out`` is None); returns it."""
    out = torch.empty_like(gate) if out is None else out
    _check("silu_mul", {"gate": gate, "up": up, "out": out})
    if not _use_triton(out):
        return out.copy_(F.silu(gate.float()) * up.float())
    g, u, o = _as_3d(gate), _as_3d(up), _as_3d(out)
    if o.numel():
        _silu_mul_kernel[_grid(o)](g, u, o, o.shape[1], o.shape[2], g.stride(0), g.stride(1), u.stride(0),
                                   u.stride(1), o.stride(0), o.stride(1), BLOCK_R=BLOCK_R, BLOCK_F=BLOCK_F,
                                   num_warps=4)
    return out


def silu_mul_backward(d_act: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, d_gate: torch.Tensor,
                      d_up: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """The gradient of ``silu(gate) * up`` for ``d_act``, written into ``d_gate`` and ``d_up``.

    ``rows``: gate and up read through an index instead (packed.py's backward: the packed rows'
    gate and up where the forward saved them, no gathered copy): row ``k`` of ``d_act``, ``d_gate``
    and ``d_up`` (``[len(rows), F]``) pairs with row ``rows[k]`` of ``gate`` and ``up`` (any
    ``[R, F]`` / ``[B, R, F]`` shape, rows counted over the leading dims), zeros for -1."""
    if rows is not None:
        _check("silu_mul_backward", {"d_act": d_act, "d_gate": d_gate, "d_up": d_up})
        _check("silu_mul_backward", {"gate": gate, "up": up})
        if d_act.dim() != 2 or d_act.shape[0] != rows.numel() or gate.shape[-1] != d_act.shape[-1]:
            raise ValueError(f"moe_fused silu_mul_backward: with rows, d_act must be [len(rows) = {rows.numel()}, "
                             f"F = {gate.shape[-1]}]; got {tuple(d_act.shape)}")
    else:
        _check("silu_mul_backward", {"d_act": d_act, "gate": gate, "up": up, "d_gate": d_gate, "d_up": d_up})
    if not _use_triton(d_gate):
        if rows is not None:
            gate, up = _gathered(gate, rows), _gathered(up, rows)
        g = gate.float()
        d_up.copy_(d_act.float() * F.silu(g))
        d_gate.copy_(torch.ops.aten.silu_backward(d_act.float() * up.float(), g))
        return
    d, g, u, dg, du = (_as_3d(t) for t in (d_act, gate, up, d_gate, d_up))
    if dg.numel():
        _silu_mul_backward_kernel[_grid(dg)](d, g, u, dg, du, rows if rows is not None else dg, dg.shape[1],
                                             dg.shape[2], g.shape[1], d.stride(0), d.stride(1), g.stride(0),
                                             g.stride(1), u.stride(0), u.stride(1), dg.stride(0), dg.stride(1),
                                             du.stride(0), du.stride(1), GATHER=rows is not None,
                                             BLOCK_R=BLOCK_R, BLOCK_F=BLOCK_F, num_warps=4)


def _gathered(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``t`` (rows counted over its leading dims), zeros for -1: the torch path."""
    flat = t.reshape(-1, t.shape[-1])
    got = flat.index_select(0, rows.clamp(min=0).long())
    return torch.where((rows >= 0)[:, None], got, torch.zeros((), dtype=got.dtype))
