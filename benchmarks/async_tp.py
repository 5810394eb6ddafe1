"""PyTorch async-TP as the benchmarks run it (e2e.py's ``async_tp`` variant, ops.py's ``async_tp``
rows): Inductor's micro-pipeline TP pass (``_micro_pipeline_tp``), which rewrites all-gather ->
matmul and matmul -> reduce-scatter into ``symm_mem.fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``, and only does so for groups with symmetric memory enabled.

    with async_tp():                       # default group; CUDA only
        code = compiled_code(fn, *args)    # or torch.compile(model)(x)
    rewrote(code)                          # did the pass fuse anything?

It leaves all-reduce and all-to-all as they are: a model compiled with it still runs those
(what a user of async-TP gets), and ``rewrote`` says so.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterable, Iterator

FUSED_OPS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter", "fused_scaled_matmul_reduce_scatter")


@contextlib.contextmanager
def async_tp(group_name: str | None = None) -> Iterator[None]:
    import torch.distributed as dist
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        # torch 2.13 calls it deprecated, yet its micro-pipeline pass still fuses only for groups it
        # enabled (is_symm_mem_enabled_for_group); torch 2.11 needs it. Idempotent.
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(group_name or dist.group.WORLD.group_name)
    with inductor_config.patch({"_micro_pipeline_tp": True}):
        yield


def rewrote(code: Iterable[str]) -> bool:
    """Whether Inductor's generated code calls one of async-TP's fused ops."""
    return any(op in c for c in code for op in FUSED_OPS)
