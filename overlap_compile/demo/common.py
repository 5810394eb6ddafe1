"""What the CPU demo (run.py) and the GPU demo (gpu.py) share: the eager reference and the block
to compile, built alike, and the error between an output and the reference's."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .models import LlamaBlock, parallelize_tp_sp


def setup_block(sizes: dict, device: str, dtype: torch.dtype, seed: int = 0):
    """(reference block, block to compile, the reference's input, the compiled block's input): two
    Llama blocks with the same weights, both TP+SP over the world, and one input sharded by
    sequence for each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    torch.manual_seed(seed)
    ref = LlamaBlock(sizes["hidden"], sizes["intermediate"], sizes["heads"]).to(device=device, dtype=dtype)
    blk = LlamaBlock(sizes["hidden"], sizes["intermediate"], sizes["heads"]).to(device=device, dtype=dtype)
    blk.load_state_dict(ref.state_dict())
    parallelize_tp_sp(ref, mesh)
    parallelize_tp_sp(blk, mesh)
    x = torch.randn(sizes["batch"], sizes["seq"], sizes["hidden"], device=device, dtype=dtype)
    xr = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(1)])
    xc = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(1)])
    return ref, blk, xr, xc


def meta_block(sizes: dict, world: int) -> tuple:
    """(block, input) on the meta device, TP+SP over the current (fake) default group of
    ``world`` ranks, as rank 0 holds them: for planning a real-size block without memory
    (``overlap_compile.plan``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))  # the group's mesh; the tensors stay on meta
    block = LlamaBlock(sizes["hidden"], sizes["intermediate"], sizes["heads"]).to(device="meta", dtype=torch.bfloat16)
    local = torch.empty(sizes["batch"], sizes["seq"] // world, sizes["hidden"], device="meta", dtype=torch.bfloat16,
                        requires_grad=True)
    return parallelize_tp_sp(block, mesh), DTensor.from_local(local, mesh, [Shard(1)])


def max_err(a: Any, b: Any) -> float:
    """max |a - b| of this rank's shards (DTensors) or of plain tensors, in fp32."""
    a = a.to_local() if hasattr(a, "to_local") else a
    b = b.to_local() if hasattr(b, "to_local") else b
    return (a.float() - b.float()).abs().max().item()
