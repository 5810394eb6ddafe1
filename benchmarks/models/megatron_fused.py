"""A Llama block as Megatron-LM writes it: fused QKV and fused gate/up GEMMs, GQA, activations
``[seq, batch, hidden]`` sequence-sharded on dim 0, autograd functional collectives.

Per rank (W ranks)::

    h = x + RS0(attn(rope(split(AG0(rmsnorm(x)) @ Wqkv_shard.T))) @ Wo_shard.T)
    y = h + RS0(silu(g) * u @ W2_shard.T)   where g, u = split(AG0(rmsnorm(h)) @ Wgu_shard.T)

AG0 / RS0: all-gather / reduce-scatter along dim 0 (the sequence). Wqkv holds this rank's query
heads and its share of the key/value heads in one matrix; Wgu its gate and up columns. The
replicated norm weights' gradients are partial sums over the sequence shards: ``finalize_grads``
all-reduces them, as Megatron-LM's finalize_model_grads does for sequence-parallel weights.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .common import Built, all_reduce_grads, local
from .rope import apply_rope, rope_tables


def _shard(rows: int, cols: int, gen: torch.Generator, device, dtype, std: float = 0.02) -> nn.Parameter:
    return nn.Parameter((torch.randn(rows, cols, generator=gen) * std).to(device=device, dtype=dtype))


class MegatronFusedBlock(nn.Module):
    def __init__(self, sizes: dict, rank: int, world: int, group_name: str, device, dtype, seed: int) -> None:
        super().__init__()
        hidden, heads = sizes["hidden"], sizes["heads"]
        kv_heads = sizes.get("kv_heads", heads)
        if heads % world or kv_heads % world or sizes["intermediate"] % world:
            raise ValueError(f"megatron_fused: heads ({heads}), kv_heads ({kv_heads}) and intermediate "
                             f"({sizes['intermediate']}) must be multiples of the world size {world}")
        self.group_name = group_name
        self.head_dim = hidden // heads
        self.q_heads, self.kv_heads = heads // world, kv_heads // world
        self.ffn = sizes["intermediate"] // world
        gen = torch.Generator().manual_seed(seed * 1000 + rank)  # each rank draws its own shards
        qkv_rows = (self.q_heads + 2 * self.kv_heads) * self.head_dim
        self.wqkv = _shard(qkv_rows, hidden, gen, device, dtype)
        self.wo = _shard(hidden, self.q_heads * self.head_dim, gen, device, dtype)
        self.wgu = _shard(2 * self.ffn, hidden, gen, device, dtype)
        self.w2 = _shard(hidden, self.ffn, gen, device, dtype)
        self.attention_norm = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))
        self.ffn_norm = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))
        cos, sin = rope_tables(sizes["seq"], self.head_dim, device, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def finalize_grads(self) -> None:
        all_reduce_grads([self.attention_norm, self.ffn_norm], self.group_name)

    def _ag(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        return all_gather_tensor_autograd(t, gather_dim=0, group=self.group_name)

    def _rs(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import reduce_scatter_tensor_autograd

        return reduce_scatter_tensor_autograd(t, "sum", scatter_dim=0, group=self.group_name)

    def attention(self, full: torch.Tensor) -> torch.Tensor:
        s, b, _ = full.shape
        d = self.head_dim
        q, k, v = F.linear(full, self.wqkv).split([self.q_heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = apply_rope(q.reshape(s, b, self.q_heads, d).permute(1, 2, 0, 3), self.cos[:s], self.sin[:s])
        k = apply_rope(k.reshape(s, b, self.kv_heads, d).permute(1, 2, 0, 3), self.cos[:s], self.sin[:s])
        v = v.reshape(s, b, self.kv_heads, d).permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.q_heads)
        return F.linear(o.permute(2, 0, 1, 3).reshape(s, b, self.q_heads * d), self.wo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self._rs(self.attention(self._ag(F.rms_norm(x, (x.shape[-1],), self.attention_norm, 1e-5))))
        gate, up = F.linear(self._ag(F.rms_norm(h, (h.shape[-1],), self.ffn_norm, 1e-5)), self.wgu).chunk(2, dim=-1)
        return h + self._rs(F.linear(F.silu(gate) * up, self.w2))


def build_megatron_fused(sizes: dict, device: str, dtype, seed: int = 0) -> Built:
    rank, world = dist.get_rank(), dist.get_world_size()
    block = MegatronFusedBlock(sizes, rank, world, dist.group.WORLD.group_name, device, dtype, seed)
    gen = torch.Generator().manual_seed(seed * 1000 + 500 + rank)
    x = torch.randn(sizes["seq"] // world, sizes["batch"], sizes["hidden"], generator=gen).to(device=device, dtype=dtype)
    return Built(block, x, local, sizes["batch"] * sizes["seq"], block.finalize_grads)
