"""Mixtral-style block with expert parallelism: attention on each rank's own tokens, then the
expert-parallel MoE FFN (overlap_compile.demo.moe: all-to-all dispatch -> local experts ->
all-to-all combine). Tokens per rank = batch * seq of the shape.

The non-expert weights (norms, attention, router) are replicated: the same seed on every rank,
and ``finalize_grads`` sums their gradients over the group before the optimizer step (the
data-parallel reduction an EP trainer does), so they stay equal across ranks. Summing, not
averaging, keeps them consistent with the expert gradients, which the all-to-all backward
already sums over every rank's tokens: the objective is the sum of the ranks' losses.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap_compile.demo.models import Attention
from overlap_compile.demo.moe import ExpertParallelMoE

from .common import Built, all_reduce_grads, local

# Switch/GShard's usual training value; a shape may set its own ("capacity_factor"), as e2e.py's
# nocomm_nopad bound does with 1.0 (slots for the mean load only: the expert GEMMs on no padding)
CAPACITY_FACTOR = 1.25


class MixtralBlock(nn.Module):
    def __init__(self, sizes: dict, group_name: str) -> None:
        super().__init__()
        h = sizes["hidden"]
        self.group_name = group_name
        self.attention_norm, self.ffn_norm = nn.RMSNorm(h), nn.RMSNorm(h)
        self.attention = Attention(h, sizes["heads"])
        self.moe = ExpertParallelMoE(h, sizes["intermediate"], sizes["E"], sizes["topk"],
                                     sizes.get("capacity_factor", CAPACITY_FACTOR), group_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.moe(self.ffn_norm(h))

    def replicated_parameters(self) -> list[nn.Parameter]:
        experts = {id(self.moe.w1), id(self.moe.w3), id(self.moe.w2)}
        return [p for p in self.parameters() if id(p) not in experts]

    def finalize_grads(self) -> None:
        all_reduce_grads(self.replicated_parameters(), self.group_name)


def build_mixtral_ep(sizes: dict, device: str, dtype, seed: int = 0) -> Built:
    if sizes["E"] % dist.get_world_size():
        raise ValueError(f"mixtral_ep: experts E={sizes['E']} must be a multiple of the world size {dist.get_world_size()}")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    block = MixtralBlock(sizes, dist.group.WORLD.group_name).to(device=device, dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(seed + 1 + rank)
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["hidden"], generator=g).to(device=device, dtype=dtype)
    return Built(block, x, local, world * sizes["batch"] * sizes["seq"], block.finalize_grads)
