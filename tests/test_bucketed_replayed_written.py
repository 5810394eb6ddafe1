"""A symbolic site's "as written" bucket, with the table's ``replay_written`` on, runs as
priority_stream's one-chunk op (the op runtime.op_graphs replays on GPUs) and gives what the GEMM
then the collective give: every kind, interleaved row stripes and an M that is no multiple of a
tile. Off, the bucketed op launches the GEMM and the collective itself and calls no template op.
CPU, gloo, world 2 (the template's reference path)."""
from __future__ import annotations

from overlap_compile.testing.multiprocess import run_distributed

W, K, N = 2, 24, 40
# (kind, row stripes' outer factor, M): M = 2 x 19 rows is no multiple of a tile or of 4
CASES = [("gemm_reducescatter", 1, 38), ("gemm_reducescatter", 3, 42), ("gemm_allreduce", None, 38),
         ("gemm_alltoall", 1, 38), ("allgather_gemm", 1, 38), ("allgather_gemm", 3, 42)]


def _table(kind: str, outer: int | None, replay: bool):
    from overlap_compile.templates.bucketed import BucketTable

    buckets = ({"max_m": None, "template": "baseline", "config": None},)
    if kind == "allgather_gemm":
        return BucketTable(kind=kind, world=W, k=K, ns=(N, 8), has_bias=(True, False), outer=outer, buckets=buckets,
                           replay_written=replay)
    return BucketTable(kind=kind, world=W, k=K, n=N, reduce_op=None if kind == "gemm_alltoall" else "sum",
                       has_bias=False, outer=outer, buckets=buckets, replay_written=replay)


def _expected(kind: str, outer: int | None, m: int, a_all, b):
    """The site as written, computed from every rank's operands on one rank."""
    import torch

    rank = torch.distributed.get_rank()
    ys = [a @ b for a in a_all]
    if kind == "gemm_allreduce":
        return sum(ys)
    if kind == "gemm_alltoall":  # rank r receives every rank's r-th block of rows, in rank order
        return torch.cat([y.chunk(W)[rank] for y in ys])
    total = sum(ys)  # reduce-scatter: stripes of [outer, W, chunk] rows, rank r's in its slot
    return total.view(outer, W, m // (outer * W), N)[:, rank].reshape(m // W, N)


def _check(kind: str, outer: int | None, m: int, called: list[str]) -> dict:
    """Run on every rank: the bucketed op on the case with replay_written on and off; its error
    against the site as written and the template kernels it called (``called``, filled by the
    wrappers _check_all puts around them)."""
    import torch
    import torch.distributed as dist

    from overlap_compile.templates.bucketed import run_allgather_gemm, run_gemm_collective

    rank, group = dist.get_rank(), dist.group.WORLD.group_name
    out: dict = {}
    for replay in (True, False):  # every rank draws every rank's operands: the same on all
        gen = torch.Generator().manual_seed(100)
        if kind == "allgather_gemm":
            rows = m // W
            shards = [torch.randn(rows, K, generator=gen) for _ in range(W)]
            bs = [torch.randn(K, N, generator=gen), torch.randn(K, 8, generator=gen)]
            biases = [torch.randn(N, generator=gen), None]
            called.clear()
            got = run_allgather_gemm(shards[rank], bs, biases, group, _table(kind, outer, replay).to_json())
            full = torch.cat(shards).view(W, outer, rows // outer, K).transpose(0, 1).reshape(m, K)
            want = [full, full @ bs[0] + biases[0], full @ bs[1]]
            err = max((g - w).abs().max().item() for g, w in zip(got, want))
        else:
            a_all = [torch.randn(m, K, generator=gen) for _ in range(W)]
            b = torch.randn(K, N, generator=gen)
            called.clear()
            got = run_gemm_collective(a_all[rank], b, None, group, _table(kind, outer, replay).to_json())
            err = (got - _expected(kind, outer, m, a_all, b)).abs().max().item()
        out[replay] = {"err": err, "ops": list(called)}
    return out


def _check_all() -> dict:
    """Every case in one pair of processes (a spawn costs seconds), each template op's kernel
    wrapped once to record that the bucketed op called it (directly, not through the dispatcher)."""
    from overlap_compile import templates
    from overlap_compile.templates import base, bucketed

    templates.load_all_ops()
    called: list[str] = []
    for name, kernel in list(base.KERNELS.items()):
        base.KERNELS[name] = lambda *a, _k=kernel, _n=name: (called.append(_n), _k(*a))[1]
    bucketed._as_emitted.cache_clear()
    return {case: _check(*case, called) for case in CASES}


def test_as_written_bucket_runs_as_the_replayed_op():
    for results in run_distributed(_check_all, world_size=W, timeout_s=300):
        for (kind, outer, m), got in results.items():
            what = "allgather_gemm" if kind == "allgather_gemm" else "gemm_collective"
            case = f"{kind} outer={outer} M={m}"
            assert got[True]["ops"] == [f"priority_stream_{what}"], (case, got[True]["ops"])
            assert got[False]["ops"] == [], (case, got[False]["ops"])
            assert got[True]["err"] < 1e-4 and got[False]["err"] < 1e-4, (case, got)
