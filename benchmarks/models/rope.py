"""Rotary position embedding as model code applies it to q and k (rotate-half form), for the zoo's
hand-written blocks: a few pointwise ops between the QKV GEMM and attention, which Inductor fuses
and which a block as users write it has there."""
from __future__ import annotations

import torch


def rope_tables(seq: int, head_dim: int, device, dtype, theta: float = 500000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq, head_dim] (the half-dim frequencies repeated twice)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., seq, head_dim] with cos / sin broadcast over the leading dims."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
