"""What the library holds on a GPU is counted: a symmetric buffer's bytes appear either in the
caching allocator's statistics or in ``symm.bytes_outside_allocator`` (never neither, never
both), and the op graphs' pool is found once a host-launched template op was captured. e2e's
``peak_mem_gib`` adds the first to ``max_memory_allocated``; its ``op_graphs_gib`` is the second.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2+ CUDA GPUs, found {torch.cuda.device_count()}"),
]

MIB = 2**20


def account() -> dict:
    import torch.distributed as dist

    from overlap_compile.runtime import op_graphs, symm

    rank = dist.get_rank()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    group = dist.group.WORLD.group_name
    torch.cuda.synchronize()
    before_alloc, before_out = torch.cuda.memory_allocated(dev), symm.bytes_outside_allocator(dev)
    buf = symm.symm_buffer(group, "test/memory-accounting", (16 * MIB,), torch.uint8, dev)
    torch.cuda.synchronize()
    grew = torch.cuda.memory_allocated(dev) - before_alloc
    outside = symm.bytes_outside_allocator(dev) - before_out
    # a template op host-launched three times: captured on the second call, its pool alive after
    from overlap_compile.testing.patterns import gemm_then_collective
    import functools

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend

    fn = gemm_then_collective("gemm_reducescatter", group, dist.get_world_size())
    with oc.config.patch(force_template="p2p_ring"):
        compiled = torch.compile(fn, backend=functools.partial(overlap_backend, report=oc.Report()))
        a = torch.randn(2048, 1536, device=dev, dtype=torch.bfloat16)
        b = torch.randn(1536, 1024, device=dev, dtype=torch.bfloat16) / 40
        for _ in range(3):
            compiled(a, b)
    torch.cuda.synchronize()
    return {"rank": rank, "nbytes": buf.local.untyped_storage().nbytes(), "grew": grew, "outside": outside,
            "buffer_outside": buf.outside, "pool": op_graphs.pool_bytes(dev), "captured": op_graphs.stats["captured"]}


def test_symmetric_buffers_and_op_graph_pool_are_counted():
    from overlap_compile.testing.multiprocess import run_distributed

    for r in run_distributed(account, world_size=2, backend="nccl", timeout_s=600):
        print(r)
        assert r["nbytes"] >= 16 * MIB
        # counted once: by the allocator (a pool of it), or outside it
        assert r["outside"] == r["buffer_outside"]
        assert r["outside"] in (0, r["nbytes"]), r
        assert r["outside"] + min(r["grew"], r["nbytes"]) >= r["nbytes"], r
        assert r["captured"] >= 1 and r["pool"] > 0, r
