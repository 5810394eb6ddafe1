"""One rank of a diagnostic run under torchrun: join the group, run the worker, let rank 0 write
the results, then end the rank through the library's teardown (barrier, CUDA graphs and buffers
released, group destroyed), which a script's own ``destroy_process_group`` would not bound."""
from __future__ import annotations

import os
from typing import Any, Callable


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def as_rank(worker: Callable[[dict], list], write: Callable[[list], Any], args: dict, dry_run: bool) -> list:
    """``worker(args)`` on this rank (gloo on a dry run, else NCCL on LOCAL_RANK's GPU); rank 0
    calls ``write(rows)`` before the teardown, so the results survive a teardown that fails."""
    import torch
    import torch.distributed as dist

    from overlap_compile.runtime import teardown

    if not dry_run:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("gloo" if dry_run else "nccl")
    rows = worker(args)
    if dist.get_rank() == 0:
        write(rows)
    teardown.finish()
    return rows


def diagnostic_main(worker: Callable[[], list], write: Callable[[list], Any]) -> list:
    """A GPU diagnostic's entry under torchrun: NVLink multicast off (NVLS, symmetric memory)
    unless the environment says otherwise, then ``as_rank`` with ``worker()``'s rows."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if not under_torchrun():
        raise SystemExit("run it under torchrun (the script's docstring)")
    return as_rank(lambda _: worker(), write, {}, dry_run=False)
