"""How many rows of each (destination, expert) slot group of a dispatch buffer must travel: 1 + the
index of its last non-zero row (routed.py); NaN counts as non-zero.

``_last_row_kernel``: one program per (chunk of CHUNK_ROWS rows, group), top chunks first; each
scans its chunk top-down, BLOCK_ROWS at a time, and stops at the first block with a non-zero entry
(atomic-max of 1 + its last non-zero row into the group's size) or once another program found a
routed row above it. So mostly the padding is read, by many SMs at once, a few dependent loads
each. ``sizes`` launches it on CUDA and uses torch ops elsewhere.
"""
from __future__ import annotations

import torch

from ..tile_fused.primitives import HAVE_TRITON, tl, triton

BLOCK_ROWS, CHUNK_ROWS, MAX_BLOCK_COLS = 32, 128, 1024

if HAVE_TRITON:

    @triton.jit
    def _last_row_kernel(x_ptr, sizes_ptr, rows, cols, stride_group, stride_row,
                         CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # axis 0, launched first: chunks counted from the top of the group
        chunk, group = tl.program_id(0), tl.program_id(1)
        base = x_ptr + group.to(tl.int64) * stride_group
        top = rows - chunk * CHUNK
        bottom = tl.maximum(top - CHUNK, 0)
        size = 0
        found = 0  # the group's size so far, as other programs left it
        while (top > bottom) & (size == 0) & (found < top):
            # rows under a routed row found above cannot change the size: not loaded
            found = tl.atomic_max(sizes_ptr + group, 0)
            r = top - BLOCK_R + tl.arange(0, BLOCK_R)
            live = (r >= bottom) & (r >= found)
            nonzero = tl.zeros([BLOCK_R], dtype=tl.int32)
            for c0 in range(0, cols, BLOCK_C):
                c = c0 + tl.arange(0, BLOCK_C)
                v = tl.load(base + r[:, None].to(tl.int64) * stride_row + c[None, :],
                            mask=live[:, None] & (c[None, :] < cols), other=0.0)
                nonzero = tl.maximum(nonzero, tl.max((v != 0).to(tl.int32), axis=1))
            size = tl.max(tl.where(nonzero > 0, r + 1, 0), axis=0)
            top -= BLOCK_R
        if size > found:
            tl.atomic_max(sizes_ptr + group, size)


def sizes_torch(slots: torch.Tensor) -> torch.Tensor:
    """The same with torch ops (reads every row)."""
    nonzero = slots.ne(0).any(-1)
    position = torch.arange(1, slots.shape[-2] + 1, device=slots.device, dtype=torch.int32)
    return (nonzero.to(torch.int32) * position).amax(-1)


def sizes_kernel(slots: torch.Tensor) -> torch.Tensor:
    """``_last_row_kernel`` over ``slots`` ``[..., C, H]`` (rows contiguous): int32 ``[...]``."""
    lead, (rows, cols) = slots.shape[:-2], slots.shape[-2:]
    groups = slots.reshape(-1, rows, cols)
    if groups.stride(2) != 1 or groups.stride(1) != cols:
        groups = groups.contiguous()
    out = torch.zeros(groups.shape[0], dtype=torch.int32, device=slots.device)
    if groups.shape[0] and rows:
        grid = (triton.cdiv(rows, CHUNK_ROWS), groups.shape[0])
        _last_row_kernel[grid](groups, out, rows, cols, groups.stride(0), groups.stride(1), CHUNK=CHUNK_ROWS,
                               BLOCK_R=BLOCK_ROWS, BLOCK_C=min(MAX_BLOCK_COLS, triton.next_power_of_2(cols)))
    return out.view(lead)


def sizes(slots: torch.Tensor) -> torch.Tensor:
    """``[..., C, H]`` -> int32 ``[...]``: 1 + the last row with a non-zero entry (0: all rows zero)."""
    if slots.is_cuda and HAVE_TRITON:
        return sizes_kernel(slots)
    return sizes_torch(slots)
