"""A default process group of fake ranks: trace and decide sites as rank 0 of W, with no
processes and no communication (collectives return at once). Tests and CPU tools use it.

    with fake_process_group(4) as group_name:
        site = traced_site("gemm_allreduce", 8192, 8192, 4096, 4)
"""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def fake_process_group(world: int) -> Iterator[str]:
    """Yields the default group's name. A default group already set up is used as it is (and
    left in place); otherwise a fake one of ``world`` ranks is made and torn down after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        yield dist.group.WORLD.group_name
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
