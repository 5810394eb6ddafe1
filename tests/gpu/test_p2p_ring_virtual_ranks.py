"""p2p_ring's copy-engine ops with 2 virtual ranks on ONE GPU (overlap_compile.testing.virtual_ranks),
called through torch.ops the way a compiled graph calls them, host-launched: each rank's calls are
captured into CUDA graphs and replayed by runtime.op_graphs while its peer runs (and captures) on
its own schedule. Every call's output is compared with the sum / gather over ranks, the inputs
changing from call to call. What it cannot show: ordering across an NVLink fabric (every "peer"
shares one L2, and both ranks share one context and launch queue);
tests/gpu/test_p2p_ring.py checks that on 2 GPUs.
"""
from __future__ import annotations

import pytest
import torch

from overlap_compile.testing.virtual_ranks import virtual_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VARIANTS = 3


def _expected(kind: str, a: list, b: list, r: int, world: int) -> list[torch.Tensor]:
    """What rank r's op returns, from every rank's inputs (double precision)."""
    if kind == "allgather_gemm":
        gathered = torch.cat([x.double() for x in a])
        return [gathered, gathered @ b[r].double()]
    full = [x.double() @ y.double() for x, y in zip(a, b)]
    rows = full[0].shape[0] // world
    if kind == "gemm_allreduce":
        return [sum(full)]
    if kind == "gemm_reducescatter":
        return [sum(full)[r * rows:(r + 1) * rows]]
    return [torch.cat([f[r * rows:(r + 1) * rows] for f in full])]  # all-to-all: block q from rank q


def load_kernels(kind: str, m: int, n: int, k: int, world: int) -> None:
    """A throwaway round (fresh buffers, 1 s bounds, its failures dropped) so that every kernel is
    loaded before the timed one. On one GPU both ranks share a CUDA context, and a kernel loaded at
    its first launch (CUDA lazy loading) can wait for the peer's spinning wait kernel to finish,
    which itself waits for that launch: a stall two GPUs (two contexts) do not have."""
    from overlap_compile.runtime import spin_wait
    from overlap_compile.runtime.peer_flags import PeerWaitTimeoutError

    try:
        race(kind, m, n, k, world, 2, True, timeout_ms=1000)
    except PeerWaitTimeoutError:
        pass
    # A failure raised mid-round leaves waits queued behind it, which time out after it was
    # raised: their records would be read as the timed round's first failure. Drop them.
    torch.cuda.synchronize()
    spin_wait.clear(torch.device("cuda", 0))


def loaded_race(kind: str, m: int, n: int, k: int, world: int, calls: int, op_graphs_on: bool) -> dict:
    load_kernels(kind, m, n, k, world)
    return race(kind, m, n, k, world, calls, op_graphs_on)


def race(kind: str, m: int, n: int, k: int, world: int, calls: int, op_graphs_on: bool,
         timeout_ms: int = 10000) -> dict:
    from overlap_compile import config
    from overlap_compile.runtime import op_graphs
    from overlap_compile.templates import base
    from overlap_compile.testing.patterns import site_plan

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    base.clear_routes()
    op_graphs.clear()
    plan = site_plan(kind, "p2p_ring", m, n, k, world).replace('"timeout_ms":10000', f'"timeout_ms":{timeout_ms}')
    rows_in = m // world if kind == "allgather_gemm" else m
    g = torch.Generator(device=dev).manual_seed(11)
    sets = [([torch.randn(rows_in, k, device=dev, dtype=torch.bfloat16, generator=g) / 4 for _ in range(world)],
             [torch.randn(k, n, device=dev, dtype=torch.bfloat16, generator=g) / 4 for _ in range(world)])
            for _ in range(VARIANTS)]
    expected = [[_expected(kind, a, b, r, world) for r in range(world)] for a, b in sets]
    # fixed input buffers per rank, rewritten in place each call: a model's steady state (op_graphs
    # replays read them where they were captured)
    a_in = [torch.empty(rows_in, k, device=dev, dtype=torch.bfloat16) for _ in range(world)]
    b_in = [torch.empty(k, n, device=dev, dtype=torch.bfloat16) for _ in range(world)]
    ops = torch.ops.overlap_compile
    with virtual_ranks(world, dev) as group:
        def calls_of(r: int) -> torch.Tensor:
            with config.patch(op_graphs=op_graphs_on):  # options are per thread
                return rank_calls(r)

        def rank_calls(r: int) -> torch.Tensor:
            errs = []
            for i in range(calls):
                a, b = sets[i % VARIANTS]
                a_in[r].copy_(a[r])
                b_in[r].copy_(b[r])
                if kind == "allgather_gemm":
                    got = list(ops.p2p_ring_allgather_gemm(a_in[r], [b_in[r]], [None], "virtual", plan))
                else:
                    got = [ops.p2p_ring_gemm_collective(a_in[r], b_in[r], None, "virtual", plan)]
                errs.append(torch.stack([(x.double() - e).norm() / e.norm()
                                         for x, e in zip(got, expected[i % VARIANTS][r])]).max())
                got = None  # freed before the next call: the allocator hands out the same addresses
                if not group.pace(i):
                    break
            return torch.stack(errs)

        errs = torch.stack(group.run(calls_of))
    from overlap_compile.templates.p2p_ring import kernels as K

    K.check_errors(dev)
    return {"calls": calls, "wrong": int(((errs > 2e-2) | errs.isnan()).sum()), "max_rel": float(errs.max()),
            "stats": dict(op_graphs.stats)}


@pytest.mark.parametrize("kind", ["gemm_reducescatter", "gemm_allreduce", "gemm_alltoall", "allgather_gemm"])
@pytest.mark.parametrize("op_graphs_on", [True, False])
def test_every_call_right_with_two_virtual_ranks(kind, op_graphs_on):
    from overlap_compile.testing.multiprocess import run_distributed

    # a process of its own: a fresh CUDA context (nothing loaded, no record of an earlier test's
    # failed wait, no memory kept by earlier tests' graphs)
    (r,) = run_distributed(loaded_race, world_size=1, args=(kind, 2048, 1536, 1024, 2, 200, op_graphs_on),
                           timeout_s=400)
    print(kind, "op_graphs" if op_graphs_on else "launched", r)
    assert r["wrong"] == 0, r
    if op_graphs_on:  # both ranks' calls replayed from their graphs once addresses settled
        assert r["stats"].get("replayed", 0) >= 2 * 200 - 12 and not r["stats"].get("failed"), r
    else:
        assert not r["stats"], r
