"""Dispatch slots as a router leaves them, for the MoE GPU tests: each (destination, expert)'s
routed rows first, then zeros, with sizes new for every seed (0 and the capacity among them: a
size left from the last call, or read before its rows landed, then drops or keeps the wrong rows)."""
from __future__ import annotations

import torch


def zero_tails(slots: torch.Tensor, seed: int) -> torch.Tensor:
    """Zero the rows of ``slots`` [W, E, C, H] past sizes drawn from ``seed``; returns the sizes [W, E]."""
    w, e, cap = slots.shape[:3]
    sizes = torch.randint(0, cap + 1, (w, e), generator=torch.Generator().manual_seed(seed))
    sizes[0, 0], sizes[-1, -1] = 0, cap
    for d in range(w):
        for j in range(e):
            slots[d, j, int(sizes[d, j]):] = 0
    return sizes
