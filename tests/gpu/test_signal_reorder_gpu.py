"""signal_reorder's GPU path (kernels.py) against torch.mm, reference.py and the collectives.

Everything here needs CUDA and skips with the reason on a machine without it. One GPU already
exercises the whole path: a 1-rank NCCL process group runs the counters, the bounded waits and
one NCCL call per wave group; striped layouts (reduce-scatter, all-to-all with W > 1) are
checked on one GPU by running only the GEMM + epilogue into the send buffer and comparing it
with reference.py's layout. With 2+ GPUs the same checks run on W ranks (multigpu).

Inputs are random (never zeros) and outputs are poisoned with NaN before a run, so a tile that
is not written fails. Errors are ||out - ref|| / ||ref|| against an fp32-accumulated oracle.
"""
from __future__ import annotations

import os

import pytest
import torch

from overlap_compile.templates.plans import GemmCollectivePlan
from overlap_compile.tiling import RowStripes, TileGrid, cdiv, even_wave_groups, untile

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _kernels():
    from overlap_compile.templates.signal_reorder import kernels

    if not kernels.available():
        pytest.skip("signal_reorder kernels unavailable here (needs Triton and an sm_80+ GPU)")
    return kernels


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def make_plan(kind, m, n, k, world, bm, bn, programs, groups, outer=1, has_bias=False, reduce_op="sum",
              group_m=8, timeout_ms=10000) -> GemmCollectivePlan:
    """A plan as spec.py would build it, with explicit tiles/programs/groups."""
    if kind == "gemm_allreduce":
        outer, chunk, stripes, rows = 1, m, 1, m
    else:
        assert m % (outer * world) == 0
        chunk, stripes, rows = m // (outer * world), world, m // world
    tiles = TileGrid(rows, n, bm, bn, group_m).num_tiles * stripes
    programs = max(stripes, min(programs, tiles) // stripes * stripes)
    waves = cdiv(tiles, programs)
    return GemmCollectivePlan(
        template="signal_reorder", kind=kind, m=m, n=n, k=k, world=world,
        reduce_op=None if kind == "gemm_alltoall" else reduce_op, outer=outer, chunk=chunk, has_bias=has_bias,
        config={"block_m": bm, "block_n": bn, "group_m": group_m, "programs": programs,
                "wave_groups": list(even_wave_groups(waves, groups))},
        timeout_ms=timeout_ms,
    )


def expected_send(a, b, bias, plan) -> torch.Tensor:
    """reference.py's send buffer, built from one fp32 product (tile by tile is the same math)."""
    from overlap_compile.templates.signal_reorder import reference

    grid, sched = reference.layout(plan)
    full = a.float() @ b.float()
    if bias is not None:
        full += bias.float()
    full = full.to(a.dtype)
    out = torch.zeros(sched.num_exec, grid.block_m, grid.block_n, dtype=a.dtype, device=a.device)
    stripes = plan.stripes if sched.stripes > 1 else RowStripes(1, 1, grid.rows)
    for e in range(sched.num_exec):
        local, k = divmod(e, sched.stripes)
        rs, cs = grid.row_col_ranges(local)
        rows = stripes.global_row(k, torch.arange(rs.start, rs.stop, device=a.device))
        out[sched.send_slot(e), : rs.stop - rs.start, : cs.stop - cs.start] = full[rows, cs]
    return out


# ---- the plain GEMM ----------------------------------------------------------------------------

GEMM_SHAPES = [
    (1000, 1000, 1000),   # nothing a multiple of the tile
    (4096, 4096, 2048),
    (777, 1004, 520),     # N*2 bytes not 16-aligned: pointer loads for B, pointer stores for C
    (300, 512, 4000),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
@pytest.mark.parametrize("bias,bt", [(False, False), (True, False), (False, True)])
def test_gemm_matches_mm(dtype, m, n, k, bias, bt):
    K = _kernels()
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    b = (torch.randn(n, k, device="cuda", dtype=dtype, generator=g).t() if bt
         else torch.randn(k, n, device="cuda", dtype=dtype, generator=g))
    bvec = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    c = K.gemm(a, b, bvec, out=out)
    ref = a.double() @ b.double() + (bvec.double() if bias else 0)
    mm = torch.mm(a, b) + (bvec if bias else 0)
    err, err_mm = rel_err(c, ref), rel_err(mm, ref)
    assert err < TOL[dtype], (err, err_mm)
    assert err < 2 * err_mm + 1e-4, (err, err_mm)


@pytest.mark.parametrize("ci", range(4))
def test_every_candidate_config_is_correct(ci):
    K = _kernels()
    cfgs = K.candidate_configs(torch.bfloat16)
    if ci >= len(cfgs):
        pytest.skip("fewer candidates")
    g = torch.Generator(device="cuda").manual_seed(ci)
    a = torch.randn(1500, 1100, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(1100, 1300, device="cuda", dtype=torch.bfloat16, generator=g)
    c = K.gemm(a, b, config=cfgs[ci])
    assert rel_err(c, a.double() @ b.double()) < 1e-2


# ---- the signalling epilogue: layout and counters (one GPU, any stripe count) -------------------

LAYOUT_CASES = [
    # kind, m, n, k, world, bm, bn, programs, groups, outer, bias
    ("gemm_allreduce", 1000, 1000, 700, 1, 128, 128, 16, 3, 1, True),
    ("gemm_allreduce", 2048, 2560, 1024, 4, 128, 256, 132, 4, 1, False),
    ("gemm_reducescatter", 2000, 1000, 512, 2, 128, 128, 20, 3, 1, True),   # chunk 1000: TMA + row offset
    ("gemm_reducescatter", 4096, 1024, 256, 4, 128, 256, 132, 2, 1, False),
    ("gemm_reducescatter", 2400, 768, 320, 4, 128, 128, 24, 2, 3, False),   # outer 3, chunk 200: row gather
    ("gemm_alltoall", 2048, 1000, 384, 4, 128, 128, 32, 3, 1, True),
]


@pytest.mark.parametrize("signal_at", ["group_end", "next_tile"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,m,n,k,world,bm,bn,programs,groups,outer,bias", LAYOUT_CASES)
def test_signal_layout(dtype, kind, m, n, k, world, bm, bn, programs, groups, outer, bias, signal_at):
    K = _kernels()
    from overlap_compile.templates.signal_reorder import reference

    plan = make_plan(kind, m, n, k, world, bm, bn, programs, groups, outer, bias)
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    a = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(k, n, device="cuda", dtype=dtype, generator=g)
    bvec = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    grid, sched = reference.layout(plan)
    send = torch.full((sched.num_exec, bm, bn), float("nan"), device="cuda", dtype=dtype)
    send, counters = K.gemm_signal_into(a, b, bvec, plan, send=send, signal_at=signal_at)
    want = expected_send(a, b, bvec, plan)
    assert rel_err(send, want) < TOL[dtype]
    pad = want == 0
    assert (send[pad] == 0).all(), "edge padding must be zero"
    assert counters.tolist() == [hi - lo for lo, hi in sched.exec_ranges()]


# ---- the bounded wait ------------------------------------------------------------------------------

def test_wait_times_out_with_a_clear_error():
    K = _kernels()
    counters = torch.zeros(3, dtype=torch.int32, device="cuda")
    counters[2] = 4
    K.wait_counter(counters, 2, 4, timeout_ms=1000, mode="spin")  # satisfied: consumed
    K.wait_counter(counters, 1, 5, timeout_ms=50, mode="spin")    # never satisfied: bounded
    with pytest.raises(K.SignalTimeoutError, match=r"signal_reorder.*wave group 1.*read 0, expected 5"):
        K.check_errors()
    assert counters.tolist() == [0, 0, 0]
    K.check_errors()  # the record was cleared


# ---- the whole op on a 1-rank NCCL group, and on W ranks -------------------------------------------

RUN_CASES = [
    # kind, reduce_op, dtype, m, n, k, bias, bm, bn, programs, groups
    ("gemm_allreduce", "sum", torch.bfloat16, 1000, 1000, 700, True, 128, 128, 24, 3),
    ("gemm_allreduce", "avg", torch.float16, 2048, 2560, 1024, False, 128, 256, 120, 4),
    ("gemm_reducescatter", "sum", torch.bfloat16, 2000, 1000, 512, True, 128, 128, 40, 3),
    ("gemm_reducescatter", "sum", torch.float16, 4096, 1024, 256, False, 128, 256, 128, 2),
    ("gemm_alltoall", None, torch.bfloat16, 2048, 1000, 384, True, 128, 128, 32, 3),
]


def _run_checks(wait_modes=("spin", "stream")) -> list[str]:
    """Runs on every rank of an initialised NCCL group; returns failures as text."""
    import torch.distributed as dist

    from overlap_compile.templates.signal_reorder import kernels as K
    from overlap_compile.templates.signal_reorder import reference

    pg = dist.group.WORLD
    gname, rank, world = pg.group_name, dist.get_rank(), dist.get_world_size()
    failures: list[str] = []

    def check(tag, out, ref, dtype, rows=None):
        e = rel_err(out, ref)
        if not e < TOL[dtype]:
            failures.append(f"rank {rank} {tag}: rel err {e:.3g}")

    modes = list(wait_modes)
    try:
        K._driver()
    except ImportError:
        modes = [m for m in modes if m != "stream"]
    for mode in modes:
        os.environ["OVERLAP_COMPILE_SIGNAL_WAIT"] = mode
        for kind, op, dtype, m, n, k, bias, bm, bn, programs, groups in RUN_CASES:
            m = m // world * world if kind == "gemm_allreduce" else m
            plan = make_plan(kind, m, n, k, world, bm, bn, programs, groups, 1, bias, op or "sum")
            tag = f"{mode} {kind} {op} {str(dtype)[6:]} {m}x{n}x{k} bias={bias}"
            g = torch.Generator(device="cuda").manual_seed(1000 * rank + m + n)
            a = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
            b = torch.randn(k, n, device="cuda", dtype=dtype, generator=g)
            bvec = torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
            out = K.run(a, b, bvec, gname, plan)
            ref = reference.run(a, b, bvec, gname, plan)
            check(f"{tag} eager vs reference", out, ref, dtype)
            grid, _ = reference.layout(plan)
            if kind == "gemm_allreduce":
                mm = torch.mm(a, b) + (bvec if bias else 0)
                dist.all_reduce(mm, op=K._reduce_op(op), group=pg)
                check(f"{tag} eager vs mm+all_reduce", untile(out, grid), mm, dtype)
            elif world == 1:
                mm = torch.mm(a, b) + (bvec if bias else 0)
                rows = untile(out if kind != "gemm_alltoall" else out[0], grid)
                check(f"{tag} eager vs mm", rows, mm, dtype)
            # CUDA graph: capture once, replay on fresh inputs several times (counters must reset)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    K.run(a, b, bvec, gname, plan)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                gout = K.run(a, b, bvec, gname, plan)
            for rep in range(3):
                a.copy_(torch.randn(m, k, device="cuda", dtype=dtype, generator=g))
                b.copy_(torch.randn(k, n, device="cuda", dtype=dtype, generator=g))
                gout.fill_(float("nan"))
                graph.replay()
                ref = reference.run(a, b, bvec, gname, plan)
                check(f"{tag} graph replay {rep}", gout, ref, dtype)
            torch.cuda.synchronize()
            try:
                K.check_errors()
            except K.SignalTimeoutError as e:
                failures.append(f"rank {rank} {tag}: {e}")
            del graph
    # through the registered op once (what a compiled graph calls)
    os.environ["OVERLAP_COMPILE_SIGNAL_WAIT"] = "spin"
    import overlap_compile.templates.signal_reorder.op  # noqa: F401 (registers the op)

    plan = make_plan("gemm_allreduce", 1024, 768, 512, world, 128, 128, 16, 2)
    a = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    out = torch.ops.overlap_compile.signal_reorder_gemm_collective(a, b, None, gname, plan.to_json())
    check("op eager", out, reference.run(a, b, None, gname, plan), torch.bfloat16)
    torch.cuda.synchronize()
    return failures


def world1_checks() -> list[str]:
    return _run_checks()


def test_run_on_one_rank_nccl_group():
    _kernels()
    from overlap_compile.testing.multiprocess import run_distributed

    (failures,) = run_distributed(world1_checks, world_size=1, backend="nccl", timeout_s=600)
    assert not failures, "\n".join(failures)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_run_on_several_gpus():
    _kernels()
    from overlap_compile.testing.multiprocess import run_distributed

    world = min(torch.cuda.device_count(), 4)
    results = run_distributed(world1_checks, world_size=world, backend="nccl", timeout_s=900)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures)
