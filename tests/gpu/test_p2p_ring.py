"""p2p_ring's GPU paths (kernels.py: copy-engine peer copies over symmetric memory; kernels_nccl.py:
cuBLAS + NCCL send/recv on a high-priority stream) against eager torch.mm + the NCCL collective.

Every kind (reduce-scatter, all-gather, all-to-all; all-reduce on the copy engine, whole and in a
pipeline of 3 row chunks; the all-gather also with its gathered output left unwritten), odd shapes (rows, K and N not multiples of
any tile), bf16, fp16 and fp32 (an fp32 partial must be copied out of its slot before the slot is
released), with and without bias; 20 calls back to back with fresh inputs and no
synchronisation between them (a race between calls shows as a wrong result), then CUDA-graph
replays with the output poisoned with NaN. After all that: no bounded wait failed, every
flag is back at 0, and every call but the all-reduce received into the group's one mailbox (grown
between cases, the earlier ones still under their captured graphs). World sizes 2 and 4 (each skipped without enough GPUs).
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tests.gpu.test_priority_stream_gpu import _eager_all_gather, _eager_gemm_collective, _graph_replays, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2+ CUDA GPUs, found {torch.cuda.device_count()}"),
]

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
SHAPES = [(125, 520, 392), (257, 136, 1000)]  # (rows per rank, K, N): odd, not multiples of a tile
TRANSPORTS = ("p2p", "nccl")
REPEATS = 20


def _plan(kind, w, chunk, k, n, bias, transport, extra=None):
    from overlap_compile.templates.plans import AllGatherGemmPlan, GemmCollectivePlan

    extra = dict(extra or {})
    gathered = extra.pop("gathered", True)  # a plan field, not a config key
    cfg = {"slices": 1, "bidirectional": False, "transport": transport, **extra}
    if kind == "allgather_gemm":
        return AllGatherGemmPlan(template="p2p_ring", m=w * chunk, k=k, ns=(n, 72), world=w, outer=1, chunk=chunk,
                                 has_bias=(bias, False), config=cfg, timeout_ms=5000, gathered=gathered)
    reduces = kind in ("gemm_reducescatter", "gemm_allreduce")
    return GemmCollectivePlan(template="p2p_ring", kind=kind, m=w * chunk, n=n, k=k, world=w,
                              reduce_op="sum" if reduces else None, outer=1,
                              chunk=w * chunk if kind == "gemm_allreduce" else chunk,  # AR: the plan's convention
                              has_bias=bias, config=cfg, timeout_ms=5000)


def checks() -> list[str]:
    import torch.distributed as dist

    from overlap_compile.runtime import symm
    from overlap_compile.templates.p2p_ring import kernels, op

    pg = dist.group.WORLD
    group, rank, w = pg.group_name, dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cuda").manual_seed(rank)
    fails = []
    why = symm.usable(group, dev)
    if why:
        return [f"rank {rank}: symmetric memory not usable on a single node with NVLink: {why}"]

    def rnd(*shape, dtype):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

    def check(tag, out, want, dtype):
        e = rel_err(out, want)
        if not e < TOL[dtype]:
            fails.append(f"rank {rank} W={w} {tag}: rel err {e:.3g}")

    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    cases = [(*c, {}) for c in itertools.product(TRANSPORTS, ("gemm_reducescatter", "gemm_alltoall", "allgather_gemm"),
                                                  dtypes, SHAPES)]
    cases += [(*c, {}) for c in itertools.product(("p2p",), ("gemm_allreduce",), dtypes, SHAPES)]  # copy engine only
    # the copy engine in 3 row slices per message (125 and 257 rows: uneven slices)
    cases += [(*c, {"slices": 3}) for c in itertools.product(("p2p",), ("gemm_reducescatter", "gemm_alltoall",
                                                                        "allgather_gemm", "gemm_allreduce"),
                                                             (torch.bfloat16,), SHAPES)]
    # the copy engine's all-gather where the graph reads only the GEMMs (the gathered output unwritten)
    cases += [(*c, {"gathered": False}) for c in itertools.product(("p2p",), ("allgather_gemm",),
                                                                   (torch.bfloat16,), SHAPES)]
    # the copy engine's all-reduce in a pipeline of 3 row chunks (uneven: 125 and 257 rows per stripe)
    cases += [(*c, {"chunks": 3}) for c in itertools.product(("p2p",), ("gemm_allreduce",),
                                                             (torch.bfloat16, torch.float32), SHAPES)]
    for transport, kind, dtype, (chunk, k, n), extra in cases:
        bias_on = (chunk, k, n) == SHAPES[0]
        plan = _plan(kind, w, chunk, k, n, bias_on, transport, extra)
        tag = f"{transport} {kind} {str(dtype)[6:]} rows={chunk} k={k} n={n} bias={bias_on} {extra}"
        where = op.path(group, dev, plan)
        if where != transport:
            fails.append(f"rank {rank} {tag}: op dispatches to {where!r}")
            continue
        b = rnd(k, n, dtype=dtype)
        bias = rnd(n, dtype=dtype) if bias_on else None
        if kind == "allgather_gemm":
            b1 = rnd(k, 72, dtype=dtype)
            bs, biases = [b, b1], [bias, None]
            call = torch.ops.overlap_compile.p2p_ring_allgather_gemm
            shards = [rnd(chunk, k, dtype=dtype) for _ in range(REPEATS)]
            results = [call(s, bs, biases, group, plan.to_json()) for s in shards]  # no sync in between
            for i, (s, res) in enumerate(zip(shards, results)):
                full = _eager_all_gather(s, 1, chunk, pg)
                if plan.gathered and not torch.equal(res[0], full):
                    fails.append(f"rank {rank} W={w} {tag} call {i}: gathered rows differ")
                check(f"{tag} call {i} y0", res[1], torch.mm(full, b) if bias is None else torch.addmm(bias, full, b),
                      dtype)
                check(f"{tag} call {i} y1", res[2], torch.mm(full, b1), dtype)
            s0 = shards[0]

            def refresh():
                s0.copy_(rnd(chunk, k, dtype=dtype))
                full = _eager_all_gather(s0, 1, chunk, pg)
                return torch.mm(full, b) if bias is None else torch.addmm(bias, full, b)

            replays = _graph_replays(lambda: call(s0, bs, biases, group, plan.to_json()), refresh, lambda o: o[1])
        else:
            call = torch.ops.overlap_compile.p2p_ring_gemm_collective
            inputs = [rnd(w * chunk, k, dtype=dtype) for _ in range(REPEATS)]
            results = [call(a, b, bias, group, plan.to_json()) for a in inputs]  # no sync in between
            for i, (a, res) in enumerate(zip(inputs, results)):
                check(f"{tag} call {i}", res, _eager_gemm_collective(kind, a, b, bias, 1, chunk, pg), dtype)
            a0 = inputs[0]

            def refresh():
                a0.copy_(rnd(w * chunk, k, dtype=dtype))
                return _eager_gemm_collective(kind, a0, b, bias, 1, chunk, pg)

            replays = _graph_replays(lambda: call(a0, b, bias, group, plan.to_json()), refresh, lambda t: t)
        for i, e in enumerate(replays):
            if not e < TOL[dtype]:
                fails.append(f"rank {rank} W={w} {tag} graph replay {i}: rel err {e:.3g}")
    torch.cuda.synchronize()
    try:
        kernels.check_errors(dev)
    except kernels.SignalTimeoutError as e:
        fails.append(f"rank {rank}: {e}")
    dist.barrier()
    torch.cuda.synchronize()
    # the all-gathers, reduce-scatters and all-to-alls received into the group's mailbox (one per
    # dtype and size it grew to), the all-reduces into buffers of their own
    own = sorted({ck[1] for ck in symm._cache if ck[1].startswith("p2p_ring/") and not ck[1].endswith("/flags")
                  and "mailbox" not in ck[1] and "allreduce" not in ck[1]})
    if own:
        fails.append(f"rank {rank}: standalone calls left buffers of their own beside the mailbox: {own}")
    if not any("p2p_ring/mailbox" in ck[1] for ck in symm._cache):
        fails.append(f"rank {rank}: no p2p_ring mailbox was allocated")
    for ck, buf in list(symm._cache.items()):
        if ck[1].endswith("/flags") and buf.local.view(torch.int32).abs().sum().item() != 0:
            fails.append(f"rank {rank}: flags {ck[1]} not back at 0: {buf.local.view(torch.int32).tolist()}")
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_gpu_paths_match_eager(world):
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(checks, world)


def timeout_checks() -> list[str]:
    """A wait that no peer ever satisfies ends after its bound and is reported, naming the
    template, the step and the value (rank 1 skips the call; rank 0's waits time out)."""
    import torch.distributed as dist

    from overlap_compile.templates.p2p_ring import kernels

    rank, w = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    dev = torch.device("cuda", torch.cuda.current_device())
    plan = _plan("gemm_alltoall", w, 64, 64, 64, False, "p2p")
    plan = dataclasses.replace(plan, timeout_ms=200)
    a, b = torch.randn(w * 64, 64, device=dev), torch.randn(64, 64, device=dev)
    kernels.run(a, b, None, group, plan)  # buffers exist on every rank (allocation is collective)
    torch.cuda.synchronize()
    dist.barrier()
    out = []
    if rank == 0:
        kernels.run(a, b, None, group, plan)
        try:
            kernels.check_errors(dev)
            out.append("rank 0: no error after a wait nobody satisfied")
        except kernels.SignalTimeoutError as e:
            if not ("p2p_ring" in str(e) and "ring step 1" in str(e) and "read 0, expected 1" in str(e)):
                out.append(f"rank 0: unexpected message: {e}")
    dist.barrier()
    return out


def test_wait_timeout_is_reported():
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(timeout_checks, 2, timeout_s=300)
