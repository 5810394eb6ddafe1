"""The last step of p2p_ring's reduce-scatter in one pass: ``out = (acc + own + arrived) * scale``.

Summing the partials with torch ops took four passes over the stripe (copy the arrived bf16
partial to fp32, add it, add my own partial, cast back): at W=2 on an 8192 x 4096 output that is
~350 MiB of memory traffic and four launches after the last GEMM, the op's exposed tail, which
ate most of the ring's gain. This kernel reads each input once, sums in fp32 and writes the
result in its dtype: ~96 MiB, one launch.

    kernel (_sum_kernel)  ->  launcher (sum_into; the compiled kernel reused: runtime/triton_launch.py)

``acc`` is the fp32 running sum of the earlier arrivals (None at W=2). All tensors contiguous
and of one shape. Without Triton, or on CPU tensors, the same sum runs as torch ops.
"""
from __future__ import annotations

import os

import torch

from ...runtime.triton_launch import FastLaunch, aligned, int_kind

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the installation
    triton = tl = None
    HAVE_TRITON = False

BLOCK = 2048

if HAVE_TRITON:

    @triton.jit
    def _sum_kernel(out_ptr, own_ptr, arrived_ptr, acc_ptr, numel, scale,
                    HAS_ACC: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        s = tl.load(own_ptr + offs, mask=mask).to(tl.float32) + tl.load(arrived_ptr + offs, mask=mask).to(tl.float32)
        if HAS_ACC:
            s += tl.load(acc_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, (s * scale).to(out_ptr.dtype.element_ty), mask=mask)


_launch = FastLaunch(_sum_kernel) if HAVE_TRITON else None  # the compiled kernel reused


def _use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def sum_into(out: torch.Tensor, own: torch.Tensor, arrived: torch.Tensor, acc: torch.Tensor | None = None,
             scale: float = 1.0) -> torch.Tensor:
    """``out[:] = (acc + own + arrived) * scale`` summed in fp32; returns ``out``."""
    parts = [out, own, arrived] + ([acc] if acc is not None else [])
    if any(p.shape != out.shape for p in parts):
        raise ValueError(f"p2p_ring sum: shapes differ: {[tuple(p.shape) for p in parts]}")
    if any(not p.is_contiguous() for p in parts):
        raise ValueError("p2p_ring sum: every tensor must be contiguous")
    if acc is not None and acc.dtype != torch.float32:
        raise ValueError(f"p2p_ring sum: acc must be float32, got {acc.dtype}")
    if not _use_triton(out):
        s = own.float() + arrived.float()
        if acc is not None:
            s += acc
        return out.copy_(s * scale if scale != 1.0 else s)
    numel = out.numel()
    parts[3:] = parts[3:] or [out]  # acc's pointer when there is none (never read)
    # what the JIT specialises on: dtypes, pointer alignment, the size (== 1, multiple of 16, width)
    key = (out.device.index, acc is not None, numel == 1, numel % 16 == 0, int_kind(numel),
           *((p.dtype, aligned(p)) for p in parts))
    _launch(key, (triton.cdiv(numel, BLOCK),), (*parts, numel, float(scale)),
                dict(HAS_ACC=acc is not None, BLOCK=BLOCK), num_warps=8)
    return out

