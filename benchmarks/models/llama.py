"""The Llama-style TP + SP block two ways: DTensor (torchtitan style) and Megatron style.

Megatron style, per rank (W ranks, sequence sharded on dim 1 between blocks)::

    h = x + RS(attn(AG(rmsnorm(x))) @ Wo_shard.T)        AG: all_gather along the sequence
    y = h + RS(swiglu(AG(rmsnorm(h))) @ W2_shard.T)      RS: reduce_scatter along the sequence

with Wq/Wk/Wv/W1/W3 sharded by output rows (heads / intermediate columns) and Wo/W2 by input
columns, exactly the shards DTensor's ColwiseParallel / RowwiseParallel take, so both models give
the same numbers for the same full weights. The collectives are the autograd-aware functional
ones, so the backward has the mirrored AG / RS pairs for the compiler to find too.

The RMSNorm weights are replicated while their inputs are sequence shards, so each rank's weight
gradient is a partial sum: ``finalize_grads`` all-reduces them before the optimizer step, as
Megatron-LM does for sequence-parallel weights (DTensor does the same reduction itself when the
optimizer touches its Partial gradients). Without it the ranks' norm weights drift apart.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from overlap_compile.demo.models import LlamaBlock, parallelize_tp_sp

from .common import Built, all_reduce_grads, local


def _full_block(sizes: dict, device: str, dtype, seed: int) -> LlamaBlock:
    torch.manual_seed(seed)
    return LlamaBlock(sizes["hidden"], sizes["intermediate"], sizes["heads"]).to(device=device, dtype=dtype)


def _input(sizes: dict, device: str, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["hidden"], generator=g)
    return x.to(device=device, dtype=dtype)


def build_llama_dtensor(sizes: dict, device: str, dtype, seed: int = 0) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.split(":")[0], (dist.get_world_size(),))
    block = parallelize_tp_sp(_full_block(sizes, device, dtype, seed), mesh)
    x = distribute_tensor(_input(sizes, device, dtype, seed), mesh, [Shard(1)])
    return Built(block, x, local, sizes["batch"] * sizes["seq"])


class MegatronLlamaBlock(nn.Module):
    def __init__(self, full: LlamaBlock, rank: int, world: int, group_name: str) -> None:
        super().__init__()
        hidden = full.attention.wq.weight.shape[1]
        if full.attention.heads % world or full.feed_forward.w1.weight.shape[0] % world:
            raise ValueError(f"heads ({full.attention.heads}) and intermediate ({full.feed_forward.w1.weight.shape[0]}) "
                             f"must be divisible by the world size {world}")
        self.group_name, self.world = group_name, world
        self.heads = full.attention.heads // world
        self.head_dim = hidden // full.attention.heads

        def rows(w):  # ColwiseParallel's shard: output features
            return nn.Parameter(w.detach().chunk(world, 0)[rank].clone())

        def cols(w):  # RowwiseParallel's shard: input features
            return nn.Parameter(w.detach().chunk(world, 1)[rank].clone())

        self.attention_norm = nn.Parameter(full.attention_norm.weight.detach().clone())
        self.ffn_norm = nn.Parameter(full.ffn_norm.weight.detach().clone())
        self.eps = full.attention_norm.eps
        a, f = full.attention, full.feed_forward
        self.wq, self.wk, self.wv, self.wo = rows(a.wq.weight), rows(a.wk.weight), rows(a.wv.weight), cols(a.wo.weight)
        self.w1, self.w3, self.w2 = rows(f.w1.weight), rows(f.w3.weight), cols(f.w2.weight)

    def finalize_grads(self) -> None:
        all_reduce_grads([self.attention_norm, self.ffn_norm], self.group_name)

    def _ag(self, t):
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        return all_gather_tensor_autograd(t, gather_dim=1, group=self.group_name)

    def _rs(self, t):
        from torch.distributed._functional_collectives import reduce_scatter_tensor_autograd

        return reduce_scatter_tensor_autograd(t, "sum", scatter_dim=1, group=self.group_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self._ag(F.rms_norm(x, (x.shape[-1],), self.attention_norm, self.eps))
        b, s, _ = full.shape
        q = F.linear(full, self.wq).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = F.linear(full, self.wk).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = F.linear(full, self.wv).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        h = x + self._rs(F.linear(o, self.wo))
        full = self._ag(F.rms_norm(h, (h.shape[-1],), self.ffn_norm, self.eps))
        return h + self._rs(F.linear(F.silu(F.linear(full, self.w1)) * F.linear(full, self.w3), self.w2))


def build_llama_megatron(sizes: dict, device: str, dtype, seed: int = 0) -> Built:
    rank, world = dist.get_rank(), dist.get_world_size()
    block = MegatronLlamaBlock(_full_block(sizes, device, dtype, seed), rank, world, dist.group.WORLD.group_name)
    x = _input(sizes, device, dtype, seed).chunk(world, 1)[rank].contiguous()
    return Built(block, x, local, sizes["batch"] * sizes["seq"], block.finalize_grads)
