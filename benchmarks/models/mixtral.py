"""Mixtral-style block with expert parallelism: attention on each rank's own tokens, then the
expert-parallel MoE FFN (overlap_compile.demo.moe: all-to-all dispatch -> local experts ->
all-to-all combine). Non-expert weights are the same on every rank (same seed); experts are
split across ranks. Tokens per rank = batch * seq of the shape."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap_compile.demo.models import Attention
from overlap_compile.demo.moe import ExpertParallelMoE

from .common import Built, local


class MixtralBlock(nn.Module):
    def __init__(self, sizes: dict, group_name: str, world: int, rank: int) -> None:
        super().__init__()
        h = sizes["hidden"]
        self.attention_norm, self.ffn_norm = nn.RMSNorm(h), nn.RMSNorm(h)
        self.attention = Attention(h, sizes["heads"])
        self.moe = ExpertParallelMoE(h, sizes["intermediate"], sizes["E"], sizes["topk"], 1.25, group_name, world, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.moe(self.ffn_norm(h))


def build_mixtral_ep(sizes: dict, device: str, dtype, seed: int = 0) -> Built:
    if "E" not in sizes:
        raise ValueError(f"mixtral_ep needs an expert count 'E' in the shape, got {sorted(sizes)}")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    block = MixtralBlock(sizes, dist.group.WORLD.group_name, world, rank).to(device=device, dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(seed + 1 + rank)
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["hidden"], generator=g).to(device=device, dtype=dtype)
    return Built(block, x, local, world * sizes["batch"] * sizes["seq"])
