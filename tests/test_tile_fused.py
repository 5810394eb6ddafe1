"""tile_fused on CPU: the reference (the GPU kernels' oracle) over gloo against torch.mm + the
collective, the rank-ordered tile maps checked with sympy against the reference's schedule, the
config checks and the latency model. The kernels themselves: test_tile_fused_interp.py."""
from __future__ import annotations

import pytest
import sympy
import torch
import torch.distributed as dist

from overlap_compile import templates
from overlap_compile.templates.plans import AllGatherGemmPlan, GemmCollectivePlan
from overlap_compile.testing.multiprocess import run_distributed
from overlap_compile.tiling import RankOrderedTiles, RowStripes

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel(got: torch.Tensor, exp: torch.Tensor) -> float:
    return float((got.double() - exp.double()).norm() / exp.double().norm().clamp_min(1e-30))


def check_ops(cases: list[dict]) -> list[tuple]:
    templates.load_all_ops()
    op_rs = torch.ops.overlap_compile.tile_fused_gemm_collective
    op_ag = torch.ops.overlap_compile.tile_fused_allgather_gemm
    group, world, rank = dist.group.WORLD.group_name, dist.get_world_size(), dist.get_rank()
    out = []
    for c in cases:
        dtype = getattr(torch, c["dtype"])
        torch.manual_seed(100 + rank)
        cfg = {"block_m": c["bm"], "block_n": c["bn"], "group_m": 2, "comm_ctas": 3}
        st = RowStripes(c["outer"], world, c["chunk"])
        if c["kind"] == "gemm_reducescatter":
            a, b = torch.randn(st.rows, c["k"], dtype=dtype), torch.randn(c["k"], c["n"], dtype=dtype)
            bias = torch.randn(c["n"], dtype=dtype) if c["bias"] else None
            plan = GemmCollectivePlan("tile_fused", "gemm_reducescatter", st.rows, c["n"], c["k"], world, c["op"],
                                      st.outer, st.chunk, bias is not None, cfg)
            got = op_rs(a, b, bias, group, plan.to_json())
            full = a.float() @ b.float() + (bias.float() if bias is not None else 0)
            full = full.to(dtype)
            # the collective, as the original graph runs it (stripe k of every rank to rank k)
            send = torch.cat([st.stripe(full, k) for k in range(world)]).contiguous()
            exp = torch.empty(st.stripe_rows, c["n"], dtype=dtype)
            dist.reduce_scatter_tensor(exp, send, op=dist.ReduceOp.SUM)
            if c["op"] == "avg":
                exp = exp / world
            out.append((c, _rel(got, exp)))
        elif c["kind"] == "gemm_allreduce":
            m = world * c["chunk"]
            a, b = torch.randn(m, c["k"], dtype=dtype), torch.randn(c["k"], c["n"], dtype=dtype)
            bias = torch.randn(c["n"], dtype=dtype) if c["bias"] else None
            plan = GemmCollectivePlan("tile_fused", "gemm_allreduce", m, c["n"], c["k"], world, c["op"], 1, m,
                                      bias is not None, cfg)
            got = op_rs(a, b, bias, group, plan.to_json())
            exp = (a.float() @ b.float() + (bias.float() if bias is not None else 0)).to(dtype)
            dist.all_reduce(exp, op=dist.ReduceOp.SUM)
            if c["op"] == "avg":
                exp = exp / world
            out.append((c, _rel(got, exp)))
        else:
            shard = torch.randn(st.stripe_rows, c["k"], dtype=dtype)
            bs = [torch.randn(c["k"], n, dtype=dtype) for n in c["ns"]]
            biases = [torch.randn(n, dtype=dtype) if c["bias"] else None for n in c["ns"]]
            plan = AllGatherGemmPlan("tile_fused", st.rows, c["k"], tuple(c["ns"]), world, st.outer, st.chunk,
                                     tuple(x is not None for x in biases), cfg)
            got = op_ag(shard, bs, biases, group, plan.to_json())
            parts = [torch.empty_like(shard) for _ in range(world)]
            dist.all_gather(parts, shard)
            gathered = torch.empty(st.rows, c["k"], dtype=dtype)
            for k, p in enumerate(parts):
                st.place(gathered, k, p)
            errs = [_rel(got[0], gathered)]
            for y, b, bias in zip(got[1:], bs, biases):
                exp = torch.mm(gathered, b) + (bias if bias is not None else 0)
                errs.append(_rel(y, exp))
            out.append((c, max(errs)))
    return out


def _cases(world: int) -> list[dict]:
    rs = dict(kind="gemm_reducescatter", bm=16, bn=16, bias=True, op="sum", dtype="float32")
    ag = dict(kind="allgather_gemm", bm=16, bn=16, bias=True, dtype="float32")
    return [
        dict(rs, outer=1, chunk=37, n=45, k=19),                  # odd everything, several tiles per stripe
        dict(rs, outer=3, chunk=5, n=17, k=7, op="avg", bias=False),  # dim > 0 scatter (strided stripes)
        dict(rs, outer=1, chunk=1, n=1, k=1),                      # the tiniest site
        dict(rs, outer=2, chunk=33, n=70, k=24, dtype="bfloat16", bm=32, bn=16),
        dict(rs, kind="gemm_allreduce", outer=1, chunk=29, n=41, k=11),     # all-reduce: W stripes of 29 rows
        dict(rs, kind="gemm_allreduce", outer=1, chunk=8, n=24, k=16, op="avg", bias=False, dtype="bfloat16"),
        dict(ag, outer=1, chunk=21, ns=[35, 9], k=13),
        dict(ag, outer=2, chunk=5, ns=[17], k=7, bias=False),
        dict(ag, outer=1, chunk=40, ns=[48], k=32, dtype="bfloat16"),
    ]


@pytest.mark.parametrize("world", [2, 4])
def test_reference_matches_mm_and_collective(world):
    results = run_distributed(check_ops, world_size=world, args=(_cases(world),), timeout_s=300)
    for rank_rows in results:
        for c, err in rank_rows:
            assert err <= TOL[getattr(torch, c["dtype"])], (world, c, err)


# ---- maps, with sympy ---------------------------------------------------------------------------

def _reference_schedule(world: int, rank: int, tiles: int, first: int) -> list[tuple[int, int]]:
    """The order reference.py walks: stripe by stripe from (rank + first) % W, tiles in order."""
    return [((rank + first + step) % world, t) for step in range(world) for t in range(tiles)]


def test_rank_ordered_maps_with_sympy():
    e, r, d, t = sympy.symbols("e r d t", integer=True, nonnegative=True)
    for world, tiles, channels in ((2, 5, 2), (3, 7, 4), (4, 3, 3), (8, 2, 16)):
        for first in (0, 1):
            sym = RankOrderedTiles(world, r, tiles, first, channels)
            stripe_e, local_e, chan_e = sym.stripe(e), sym.local(e), sym.channel(e)
            # closed forms: floor/mod-affine in e and r
            assert stripe_e == sympy.Mod(r + first + sympy.floor(e / tiles), world)
            assert local_e == sympy.Mod(e, tiles)
            inverse = sym.exec_id(d, t)
            for rank in range(world):
                ref = _reference_schedule(world, rank, tiles, first)
                for ei, (ds, ts) in enumerate(ref):
                    sub = {e: ei, r: rank}
                    assert (stripe_e.subs(sub), local_e.subs(sub)) == (ds, ts)
                    assert chan_e.subs(sub) == ei % channels
                    assert inverse.subs({d: ds, t: ts, r: rank}) == ei  # exec_id inverts the map
                # every tile of every stripe exactly once; GEMM+RS ends with the own stripe, AG starts with it
                assert sorted(ref) == [(s, x) for s in range(world) for x in range(tiles)]
                assert ref[-1][0] == rank if first == 1 else ref[0][0] == rank
            # slot is stripe-major and affine: slot(d, t) - (d * tiles + t) simplifies to 0
            assert sympy.simplify(sym.slot(d, t) - (d * tiles + t)) == 0


def test_rs_reference_pairs_push_and_receive():
    """At step s rank r pushes stripe (r+1+s) % W; its owner's receive from rank (owner-1-s) % W at the
    same step is that push (what reference.run relies on to pair messages)."""
    for world in (2, 3, 4, 8):
        for rank in range(world):
            for step in range(world - 1):
                dest = RankOrderedTiles(world, rank, 1, 1).stripe(step)
                assert (dest - 1 - step) % world == rank


# ---- config, spec, model --------------------------------------------------------------------------

def test_config_errors_name_the_key():
    from overlap_compile.templates.tile_fused.reference import check_config

    check_config({"block_m": 16, "block_n": 128, "group_m": 8, "comm_ctas": 8})
    for bad, key in (({"block_m": 24, "block_n": 16}, "block_m"), ({"block_m": 16, "block_n": 16, "comm_ctas": 0},
                                                                     "comm_ctas"),
                     ({"block_m": 16, "block_n": 16, "slices": 2}, "slices")):
        with pytest.raises(ValueError, match=key):
            check_config(bad)


def test_tiles_are_gemm_sized_wherever_a_stripe_reaches_one():
    """16x16 tiles only for problems smaller than a GEMM tile: a symbolic site's bucket runs its
    representative's config at every M of the bucket, and 16x16 tiles picked at a 256-row
    representative ran the 1024-token prefill's GEMM in them, priced as Hopper tiles and several
    times slower."""
    spec = templates.get_spec("tile_fused")
    assert spec.blocks(256, 3072) == (128, 256) and spec.blocks(128, 1024) == (128, 128)
    assert spec.blocks(4096, 14336) == (128, 256)
    assert spec.blocks(64, 3072) == (16, 16) and spec.blocks(256, 64) == (16, 16)  # CPU test shapes


def test_latency_model():
    from overlap_compile import predictor
    from overlap_compile.predictor.models import Ctx, Site
    from overlap_compile.templates.tile_fused.model import tile_fused

    p = predictor.load_profile("h200")
    rs = Site("gemm_reducescatter", ((8192, 8192, 4096),), 4, "bfloat16")
    ag = Site("allgather_gemm", ((8192, 8192, 4096),), 4, "bfloat16")
    for site in (rs, ag):
        for mode in ("eager", "cuda_graph"):
            s = tile_fused(site, {"block_m": 128, "block_n": 256, "group_m": 8, "comm_ctas": 8}, p, Ctx(mode))
            base = predictor.models.baseline(site, p, Ctx(mode))
            assert s is not None and s.total_ms > 0 and s.events
            assert s.total_ms >= max(ev.end for ev in s.events) - 1e-9
            # never better than the GEMM alone, never worse than everything in sequence plus launches
            assert s.total_ms >= predictor.models.gemm_ms(site, p) * 0.99
            assert s.total_ms < 2 * base.total_ms
    # more comm CTAs: faster pushes, slower GEMM; the model must see both
    few = tile_fused(rs, {"block_m": 128, "block_n": 256, "comm_ctas": 1}, p, Ctx("cuda_graph"))
    many = tile_fused(rs, {"block_m": 128, "block_n": 256, "comm_ctas": 16}, p, Ctx("cuda_graph"))
    assert few.total_ms != many.total_ms
    # all-reduce: the same site's reduce-scatter plus the reduced stripes' push and copy-out, which
    # nothing hides (at least the copy-out of (W-1)/W of the output through HBM); rows must split in W
    cfg = {"block_m": 128, "block_n": 256, "comm_ctas": 8}
    ar = tile_fused(Site("gemm_allreduce", ((8192, 8192, 4096),), 4, "bfloat16"), cfg, p, Ctx("cuda_graph"))
    rs_of_ar = tile_fused(rs, cfg, p, Ctx("cuda_graph"))
    out_bytes = 8192 * 8192 * 2
    assert ar.total_ms >= rs_of_ar.total_ms + predictor.models.hbm_ms(p, 2 * out_bytes * 3 / 4) - 1e-9
    assert ar.events[-1].lane == "comm" and ar.events[-1].end == pytest.approx(ar.total_ms)
    assert tile_fused(Site("gemm_allreduce", ((66, 64, 64),), 4, "float32"), cfg, p, Ctx()) is None


def test_first_call_warm_up_loads_kernels():
    """A plan's first call compiles its kernels (warmup) and must load them onto the GPU before
    any of them spins (CUDA lazy loading deadlocks a spinning kernel with one loaded at first
    launch: tests/gpu/test_kernel_loading.py). Checked on the launcher with a stand-in kernel."""
    pytest.importorskip("triton")
    from overlap_compile.templates.tile_fused import launch as L  # the launchers and their _warming flag

    loaded = []

    class Compiled:
        def _init_handles(self):
            loaded.append(True)

    class Kernel:
        def warmup(self, *args, **kwargs):
            return Compiled()

    L._warming = True
    try:
        L._launch_small("test-stand-in", Kernel(), (1,), 0, num_warps=1)
    finally:
        L._warming = False
        L._use_asm.pop("test-stand-in", None)
    assert loaded == [True]


def test_allreduce_gather_grid():
    """The all-reduce's gather kernel runs after the GEMM: one CTA per peer tile, up to every SM,
    never fewer than the reduce-scatter's comm CTAs."""
    from overlap_compile.templates.tile_fused.kernels import gather_grid

    assert gather_grid(132, 8, 2, 64) == 64
    assert gather_grid(132, 8, 4, 1000) == 132
    assert gather_grid(4, 8, 2, 100) == 8
    assert gather_grid(132, 8, 2, 1) == 1


def test_unproven_gpu_kinds_stay_as_written_under_gpu_profiles_even_when_forced():
    """Until their 2-GPU race loops pass, a GPU profile leaves tile_fused reduce-scatter and
    all-reduce sites as written (with the reason) also under force_template, while the all-gather,
    whose race loop passed, is taken; the CPU reference (cpu-gloo profile) rewrites all three."""
    from overlap_compile import config, predictor
    from overlap_compile.passes.decide import decide
    from overlap_compile.testing.fake_group import fake_process_group
    from overlap_compile.testing.patterns import traced_site

    with fake_process_group(2):
        rs = traced_site("gemm_reducescatter", 8192, 4096, 2048, 2)
        ar = traced_site("gemm_allreduce", 8192, 4096, 2048, 2)
        ag = traced_site("allgather_gemm", 8192, 4096, 2048, 2)
        with config.patch(force_template="tile_fused"):
            opts = config.current()
            gpu = decide([rs, ar, ag], opts, predictor.load_profile("h200"))
            cpu = decide([rs, ar, ag], opts, predictor.load_profile("cpu-gloo"))
        free = decide([rs, ar], config.current(), predictor.load_profile("h200"))
    assert [d.template for d in gpu] == ["baseline", "baseline", "tile_fused"]
    for d in gpu[:2]:
        assert "race loop" in d.reason and "force_template='tile_fused' cannot take this site" in d.reason, d.reason
    assert [d.template for d in cpu] == ["tile_fused"] * 3
    for d in free:  # not a candidate in the predictor's contest either, with the reason
        (tf,) = [c for c in d.candidates if c.template == "tile_fused"]
        assert tf.predicted_ms is None and "race loops" in tf.note


def test_allgather_refusal_is_one_flag(monkeypatch):
    """The all-gather's GPU refusal goes with ALLGATHER_RACE_LOOP_PASSED alone."""
    from overlap_compile.templates.tile_fused import spec
    from overlap_compile.testing.fake_group import fake_process_group
    from overlap_compile.testing.patterns import traced_site

    with fake_process_group(2):
        ag = traced_site("allgather_gemm", 8192, 4096, 2048, 2)
    monkeypatch.setattr(spec, "ALLGATHER_RACE_LOOP_PASSED", False)
    assert spec.SPEC.gpu_refusal(ag) == spec.ALLGATHER_REFUSAL
    monkeypatch.setattr(spec, "ALLGATHER_RACE_LOOP_PASSED", True)
    assert spec.SPEC.gpu_refusal(ag) is None


def test_allgather_gemm_leaves_an_sm_free():
    """The all-gather's persistent GEMM spins on chunks that copies and flag writes land; it never
    takes every SM, so whatever lands them finds one."""
    pytest.importorskip("triton")
    from overlap_compile.templates.tile_fused.kernels import AG_FREE_SMS, ag_programs

    assert AG_FREE_SMS >= 1
    assert ag_programs(132, 2, 256) == 132 - AG_FREE_SMS
    assert ag_programs(132, 2, 10) == 20
    assert ag_programs(1, 2, 10) == 1
