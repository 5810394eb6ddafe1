"""Process-group access for the op implementations: resolve a group by name and start
collectives asynchronously through the same functional ops the original graph used, so a
decomposed template keeps exactly the original reduce-op semantics and backend support."""
from __future__ import annotations

import torch
import torch.distributed as dist

c10d = torch.ops._c10d_functional


def resolve_group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name)
    except Exception as e:  # the message names the group; the cause is kept
        raise RuntimeError(f"overlap_compile: process group {group_name!r} is not initialised in this process") from e


def rank_and_size(group_name: str) -> tuple[int, int]:
    pg = resolve_group(group_name)
    return pg.rank(), pg.size()


def start_all_reduce(t: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    return c10d.all_reduce.default(t, reduce_op, group_name)


def start_reduce_scatter(t: torch.Tensor, reduce_op: str, world: int, group_name: str) -> torch.Tensor:
    return c10d.reduce_scatter_tensor.default(t, reduce_op, world, group_name)


def start_all_gather(t: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    return c10d.all_gather_into_tensor.default(t, world, group_name)


def start_all_to_all(t: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    rows = t.shape[0] // world
    return c10d.all_to_all_single.default(t, [rows] * world, [rows] * world, group_name)


def wait(t: torch.Tensor) -> torch.Tensor:
    return c10d.wait_tensor.default(t)
