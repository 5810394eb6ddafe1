"""p2p_ring's copy-engine path (kernels.py: peer copies over symmetric memory, cuBLAS pieces)
against eager torch.mm + the NCCL collective: reduce-scatter and all-gather along rows, odd row
counts, bf16 / fp32, bias, 20 calls back to back with fresh inputs and no synchronisation between
them (a race between calls shows as a wrong result), and CUDA-graph replays with the output
poisoned with NaN. World sizes 2 and 4 (as many GPUs as there are, up to 4).
"""
from __future__ import annotations

import itertools

import pytest
import torch

from tests.gpu.test_priority_stream_gpu import (TOL, _eager_all_gather, _eager_gemm_collective, _graph_replays,
                                               rel_err)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2+ CUDA GPUs, found {torch.cuda.device_count()}"),
]

P2P = {"slices": 1, "bidirectional": False, "transport": "p2p"}
K, N = 520, 392
CHUNKS = [250, 1000]  # rows per rank: not multiples of any tile


def checks() -> list[str]:
    import torch.distributed as dist

    from overlap_compile.templates.p2p_ring import kernels
    from overlap_compile.templates.plans import AllGatherGemmPlan, GemmCollectivePlan

    pg = dist.group.WORLD
    group, rank, w = pg.group_name, dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cuda").manual_seed(rank)
    fails = []

    def check(tag, out, want, dtype):
        e = rel_err(out, want)
        if not e < TOL[dtype]:
            fails.append(f"rank {rank} W={w} {tag}: rel err {e:.3g}")

    for dtype, chunk, bias_on in itertools.product((torch.bfloat16, torch.float32), CHUNKS, (False, True)):
        rs = GemmCollectivePlan(template="p2p_ring", kind="gemm_reducescatter", m=w * chunk, n=N, k=K, world=w,
                                reduce_op="sum", outer=1, chunk=chunk, has_bias=bias_on, config=P2P)
        why = kernels.usable(group, dev, rs)
        if why:
            return [f"rank {rank}: copy-engine path not usable: {why}"]
        tag = f"RS {str(dtype)[6:]} chunk={chunk} bias={bias_on}"
        b = torch.randn(K, N, device=dev, dtype=dtype, generator=g)
        bias = torch.randn(N, device=dev, dtype=dtype, generator=g) if bias_on else None
        inputs = [torch.randn(w * chunk, K, device=dev, dtype=dtype, generator=g) for _ in range(20)]
        outs = [kernels.run_reducescatter(a, b, bias, group, rs) for a in inputs]  # back to back
        for i, (a, out) in enumerate(zip(inputs, outs)):
            check(f"{tag} call {i}", out, _eager_gemm_collective("gemm_reducescatter", a, b, bias, 1, chunk, pg), dtype)
        a = inputs[0]

        def refresh_rs():
            a.copy_(torch.randn(a.shape, device=dev, dtype=dtype, generator=g))
            return _eager_gemm_collective("gemm_reducescatter", a, b, bias, 1, chunk, pg)

        for i, e in enumerate(_graph_replays(lambda: kernels.run_reducescatter(a, b, bias, group, rs), refresh_rs,
                                             lambda t: t)):
            if not e < TOL[dtype]:
                fails.append(f"rank {rank} W={w} {tag} graph replay {i}: rel err {e:.3g}")

        ag = AllGatherGemmPlan(template="p2p_ring", m=w * chunk, k=K, ns=(N, 136), world=w, outer=1, chunk=chunk,
                               has_bias=(bias_on, False), config=P2P)
        tag = f"AG {str(dtype)[6:]} chunk={chunk} bias={bias_on}"
        bs = [b, torch.randn(K, 136, device=dev, dtype=dtype, generator=g)]
        biases = [bias, None]
        shards = [torch.randn(chunk, K, device=dev, dtype=dtype, generator=g) for _ in range(20)]
        results = [kernels.run_allgather(s, bs, biases, group, ag) for s in shards]
        for i, (s, res) in enumerate(zip(shards, results)):
            full = _eager_all_gather(s, 1, chunk, pg)
            if not torch.equal(res[0], full):
                fails.append(f"rank {rank} W={w} {tag} call {i}: gathered rows differ")
            y0 = torch.mm(full, b) if bias is None else torch.addmm(bias, full, b)
            check(f"{tag} call {i} y0", res[1], y0, dtype)
            check(f"{tag} call {i} y1", res[2], torch.mm(full, bs[1]), dtype)
        s0 = shards[0]

        def refresh_ag():
            s0.copy_(torch.randn(s0.shape, device=dev, dtype=dtype, generator=g))
            full = _eager_all_gather(s0, 1, chunk, pg)
            return torch.mm(full, b) if bias is None else torch.addmm(bias, full, b)

        for i, e in enumerate(_graph_replays(lambda: kernels.run_allgather(s0, bs, biases, group, ag), refresh_ag,
                                             lambda outs: outs[1])):
            if not e < TOL[dtype]:
                fails.append(f"rank {rank} W={w} {tag} graph replay {i}: rel err {e:.3g}")
    torch.cuda.synchronize()
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_path_matches_nccl(world):
    from overlap_compile.testing.multiprocess import run_distributed

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    fails = [f for per_rank in run_distributed(checks, world_size=world, backend="nccl", timeout_s=600) for f in per_rank]
    assert not fails, "\n".join(fails[:20])
