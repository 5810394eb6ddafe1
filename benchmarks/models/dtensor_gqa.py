"""A Llama block with grouped-query attention parallelized by a DTensor plan, the way
``torch.distributed.tensor.parallel`` users write it: separate wq / wk / wv (ColwiseParallel), wo
and w2 (RowwiseParallel to a sequence shard), SequenceParallel norms, activations ``[batch, seq,
hidden]`` sharded on dim 1 between the halves of the block (the demo block's plan and SwiGLU,
``overlap_compile.demo.models``, with grouped-query attention and RoPE of its own).

The modules compute on local shards (``-1`` heads in the views), so the same code runs at any
world size that divides the query and key/value heads; RoPE is applied to q and k before
attention. DTensor reduces the norm weights' partial gradients itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from overlap_compile.demo.models import FeedForward, parallelize_tp_sp

from .common import Built, local
from .rope import apply_rope, rope_tables


class GQAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, seq: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)
        cos, sin = rope_tables(seq, self.head_dim, "cpu", torch.float32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        q = apply_rope(self.wq(x).view(b, s, -1, d).transpose(1, 2), self.cos[:s], self.sin[:s])
        k = apply_rope(self.wk(x).view(b, s, -1, d).transpose(1, 2), self.cos[:s], self.sin[:s])
        v = self.wv(x).view(b, s, -1, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class GQABlock(nn.Module):
    def __init__(self, sizes: dict) -> None:
        super().__init__()
        hidden = sizes["hidden"]
        self.attention_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.attention = GQAttention(hidden, sizes["heads"], sizes.get("kv_heads", sizes["heads"]), sizes["seq"])
        self.ffn_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.feed_forward = FeedForward(hidden, sizes["intermediate"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def build_dtensor_gqa(sizes: dict, device: str, dtype, seed: int = 0) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    kv = sizes.get("kv_heads", sizes["heads"])
    if sizes["heads"] % world or kv % world:
        raise ValueError(f"dtensor_gqa: heads ({sizes['heads']}) and kv_heads ({kv}) must be multiples of the "
                         f"world size {world}")
    torch.manual_seed(seed)
    block = GQABlock(sizes).to(device=device, dtype=dtype)
    mesh = init_device_mesh(device.split(":")[0], (world,))
    block = parallelize_tp_sp(block, mesh)  # the demo block's plan: same module names
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["hidden"], generator=g).to(device=device, dtype=dtype)
    return Built(block, distribute_tensor(x, mesh, [Shard(1)]), local, sizes["batch"] * sizes["seq"])
