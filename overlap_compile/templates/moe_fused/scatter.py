"""The MoE dispatch buffer, filled without an atomic add per element where a slot has one writer.

``zeros(rows, H).index_add(0, slot, src)`` runs as ATen's index kernel, one atomic add per
element, yet nearly every slot has exactly one writer. Here the same sum takes three launches::

    _count_kernel    counts[r] = number of choices whose index is r      (int32 atomics, one per choice)
    _clear_kernel    zero every row whose count is not 1                 (rows with one writer are not written twice)
    _scatter_kernel  a choice whose row has one writer stores its row;   (plain, vectorised stores)
                     the others add their nonzero elements atomically

Exact: one writer gives src; a shared row is the atomic sum of its writers' nonzero elements
(except -0.0 + 0.0 stays -0.0), in nondeterministic order as in ATen. Negative indices count from
the end; an index outside [-rows, rows) writes nothing (ATen would assert). Without Triton or on
CPU tensors (unless TRITON_INTERPRET=1) the op runs the ATen sum.

    kernels -> launcher (scatter_add_rows) -> op (torch.ops.overlap_compile.moe_scatter_rows)
"""
from __future__ import annotations

import os

import torch

from ..base import LIB

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the installation
    triton = tl = None
    HAVE_TRITON = False

BLOCK_CHOICES = 1024  # choices per program of the count kernel
BLOCK_ROWS = 8  # rows per program of the clear / scatter kernels
BLOCK_W = 256  # columns per program of the clear / scatter kernels

if HAVE_TRITON:

    @triton.jit
    def _row_of(idx_ptr, i, n, rows):
        """The row choice ``i`` adds into, in index_put's meaning (negative indices count from the
        end); -1 past the last choice or for an index out of range."""
        idx = tl.load(idx_ptr + i, mask=i < n, other=0).to(tl.int64)
        idx = tl.where(idx < 0, idx + rows, idx)
        return tl.where((i < n) & (idx >= 0) & (idx < rows), idx, -1)

    @triton.jit
    def _count_kernel(idx_ptr, counts_ptr, n, rows, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        idx = _row_of(idx_ptr, offs, n, rows)
        tl.atomic_add(counts_ptr + idx, 1, mask=idx >= 0, sem="relaxed")

    @triton.jit
    def _clear_kernel(out_ptr, counts_ptr, rows, width, BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr):
        r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        count = tl.load(counts_ptr + r, mask=r < rows, other=1)
        keep = ((r < rows) & (count != 1))[:, None] & (c < width)[None, :]
        zero = tl.zeros((BLOCK_ROWS, BLOCK_W), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * width + c[None, :], zero, mask=keep)

    @triton.jit
    def _scatter_kernel(out_ptr, src_ptr, idx_ptr, counts_ptr, n, rows, width, src_stride,
                        BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr):
        i = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        idx = _row_of(idx_ptr, i, n, rows)
        valid = idx >= 0
        sole = tl.load(counts_ptr + idx, mask=valid, other=0) == 1
        cols = (c < width)[None, :]
        row = tl.load(src_ptr + i.to(tl.int64)[:, None] * src_stride + c[None, :], mask=valid[:, None] & cols)
        dest = out_ptr + idx[:, None] * width + c[None, :]
        tl.store(dest, row, mask=(valid & sole)[:, None] & cols)
        # zeros add nothing: the choices dropped past the capacity (zero rows, all clamped onto
        # one kept slot of the expert) would otherwise all add into that one row at once
        tl.atomic_add(dest, row, mask=(valid & ~sole)[:, None] & cols & (row != 0), sem="relaxed")


def _use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def check_operands(index: torch.Tensor, src: torch.Tensor, rows: int) -> None:
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"moe_scatter_rows: index must be 1-D int64 or int32, got {tuple(index.shape)} {index.dtype}")
    if src.dim() != 2 or src.shape[0] != index.shape[0]:
        raise ValueError(f"moe_scatter_rows: src must be [len(index), width] = [{index.shape[0]}, *], "
                         f"got {tuple(src.shape)}")
    if rows < 1:
        raise ValueError(f"moe_scatter_rows: rows must be >= 1, got {rows}")


def reference(index: torch.Tensor, src: torch.Tensor, rows: int) -> torch.Tensor:
    """``zeros(rows, width).index_put_([index], src, accumulate=True)`` (the graph's own op)."""
    return src.new_zeros(rows, src.shape[1]).index_put_((index,), src, accumulate=True)


def scatter_add_rows(index: torch.Tensor, src: torch.Tensor, rows: int) -> torch.Tensor:
    """``zeros(rows, width)`` with row ``index[i]`` += ``src[i]`` for every i (module doc)."""
    check_operands(index, src, rows)
    if not _use_triton(src):
        return reference(index, src, rows)
    n, width = src.shape
    if src.stride(1) != 1:
        src = src.contiguous()
    index = index.contiguous()
    out = src.new_empty(rows, width)
    counts = torch.zeros(rows, dtype=torch.int32, device=src.device)
    if n:
        _count_kernel[(triton.cdiv(n, BLOCK_CHOICES),)](index, counts, n, rows, BLOCK=BLOCK_CHOICES)
    cols = triton.cdiv(width, BLOCK_W)
    _clear_kernel[(triton.cdiv(rows, BLOCK_ROWS), cols)](out, counts, rows, width, BLOCK_ROWS=BLOCK_ROWS,
                                                         BLOCK_W=BLOCK_W)
    if n:
        _scatter_kernel[(triton.cdiv(n, BLOCK_ROWS), cols)](out, src, index, counts, n, rows, width, src.stride(0),
                                                            BLOCK_ROWS=BLOCK_ROWS, BLOCK_W=BLOCK_W)
    return out


@torch.library.custom_op(f"{LIB}::moe_scatter_rows", mutates_args=())
def moe_scatter_rows(index: torch.Tensor, src: torch.Tensor, rows: int) -> torch.Tensor:
    """The MoE dispatch buffer: ``zeros(rows, src.shape[1])`` with ``src[i]`` added into row
    ``index[i]`` (module doc)."""
    return scatter_add_rows(index, src, rows)


@moe_scatter_rows.register_fake
def _(index, src, rows):
    check_operands(index, src, rows)
    return src.new_empty(rows, src.shape[1])
