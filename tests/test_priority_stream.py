"""priority_stream (resource-aware overlap): chunked GEMM + per-chunk collectives against eager.

Every distributed check calls the template's op through torch.ops with a plan built by hand and
compares it with what the original graph computes on the same inputs and dtype: torch.mm (addmm
with bias) followed by the functional collective (``_c10d_functional.*`` + ``wait_tensor``). On
CPU the op runs reference.py over gloo. Spawning process groups costs seconds, so one spawn per
world size runs every shape x dtype x bias x chunk count; the worker functions live at module
level so the spawned ranks can import them.

Shapes are odd on purpose: K = 9, N = 7, stripes of 5 rows (outer = 1) and 2 x 3 rows
(outer = 2: a [2, W*3, N] view scattered along dim 1); chunk counts 1..4 (3 and 4 split 5 or 6
rows unevenly) and 16 (more chunks than rows: clamped to one row each).
"""
from __future__ import annotations

import itertools

import pytest
import torch

from overlap_compile.passes.matches import (
    AllGatherGemmMatch,
    GemmAllReduceMatch,
    GemmAllToAllMatch,
    GemmReduceScatterMatch,
)
from overlap_compile.templates.plans import AllGatherGemmPlan, GemmCollectivePlan
from overlap_compile.templates.priority_stream import reference
from overlap_compile.templates.priority_stream.spec import SPEC
from overlap_compile.tiling import RowStripes

c10d = torch.ops._c10d_functional

K, N = 9, 7
STRIPES = [(1, 5), (2, 3)]  # (outer, chunk) of one rank's stripe
CHUNKS = [1, 2, 3, 4, 16]
DTYPES = [torch.float32, torch.bfloat16]


# ---- helpers shared by the workers ---------------------------------------------------------

def _group():
    import torch.distributed as dist

    return dist.group.WORLD.group_name, dist.get_rank(), dist.get_world_size()


def _inputs(seed: int, rank: int, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Different inputs on every rank (so a reduction really adds different partial results)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _mm(a, b, bias):
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def _config(chunks: int) -> dict:
    return {"chunks": chunks, "block_m": None, "block_n": None, "stages": None}


def _assert_close(ours: torch.Tensor, eager: torch.Tensor, roundings: int, what: str) -> None:
    """fp32: equal up to summation order. bf16: within ``roundings + 1`` bf16 roundings of the
    largest value: the GEMM of a chunk may round differently from the whole GEMM (one rounding),
    and a W-way reduction over a different split may add in another order (one per addition)."""
    assert ours.dtype == eager.dtype and ours.shape == eager.shape, f"{what}: {ours.shape} vs {eager.shape}"
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5, msg=what)
        return
    unit = torch.finfo(ours.dtype).eps * (eager.abs().max().item() + 1e-3)
    diff = (ours.double() - eager.double()).abs().max().item()
    assert diff <= (roundings + 1) * unit, f"{what}: |ours - eager| = {diff / unit:.2f} eps > {roundings + 1}"


def _gemm_plan(kind: str, w: int, outer: int, chunk: int, bias: bool, config: dict,
               reduce_op: str | None = "sum") -> GemmCollectivePlan:
    m = outer * w * chunk
    if kind == "gemm_allreduce":
        outer, chunk = 1, m  # unused by all-reduce; what TemplateSpec.plan sets without stripes
    return GemmCollectivePlan(template="priority_stream", kind=kind, m=m, n=N, k=K, world=w,
                              reduce_op=reduce_op, outer=outer, chunk=chunk, has_bias=bias, config=config)


def _striped(y: torch.Tensor, outer: int, chunk: int, w: int) -> torch.Tensor:
    """What the graph hands a dim-1 collective: [outer, W*chunk, N] split along dim 1 and
    concatenated along dim 0, so stripe k is the k-th block of rows."""
    if outer == 1:
        return y
    return torch.cat(torch.split(y.view(outer, w * chunk, -1), chunk, dim=1), dim=0).reshape(y.shape)


def _eager_reduce_scatter(y, outer, chunk, w, group):
    out = c10d.wait_tensor(c10d.reduce_scatter_tensor(_striped(y, outer, chunk, w).contiguous(), "sum", w, group))
    return out.reshape(outer * chunk, -1)


def _eager_all_to_all(y, outer, chunk, w, group):
    split = [outer * chunk] * w
    return c10d.wait_tensor(c10d.all_to_all_single(_striped(y, outer, chunk, w).contiguous(), split, split, group))


def _eager_all_gather(shard, outer, chunk, w, group):
    full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard.view(outer, chunk, -1).contiguous(), w, group))
    if outer > 1:
        full = torch.cat(torch.split(full, outer, dim=0), dim=1)
    return full.reshape(outer * w * chunk, -1)


# ---- distributed workers -------------------------------------------------------------------

def check_gemm_collectives() -> int:
    """All-reduce, reduce-scatter, all-to-all: every dtype x stripe layout x bias x chunk count."""
    group, r, w = _group()
    op = torch.ops.overlap_compile.priority_stream_gemm_collective
    checks = 0
    cases = itertools.product(DTYPES, STRIPES, (False, True), CHUNKS)
    for seed, (dtype, (outer, chunk), has_bias, chunks) in enumerate(cases):
        m = outer * w * chunk
        a, b, bias = _inputs(seed, r, [(m, K), (K, N), (N,)], dtype)
        bias = bias if has_bias else None
        y = _mm(a, b, bias)  # each rank adds its own bias before the reduction, as mm -> RS does
        what = f"w={w} {dtype} stripes={(outer, chunk)} bias={has_bias} chunks={chunks}"

        plan = _gemm_plan("gemm_reducescatter", w, outer, chunk, has_bias, _config(chunks))
        ours = op(a, b, bias, group, plan.to_json())
        _assert_close(ours, _eager_reduce_scatter(y, outer, chunk, w, group), w, f"RS {what}")

        plan = _gemm_plan("gemm_alltoall", w, outer, chunk, has_bias, _config(chunks), None)
        ours = op(a, b, bias, group, plan.to_json())
        _assert_close(ours, _eager_all_to_all(y, outer, chunk, w, group), 0, f"A2A {what}")

        reduce_op = "max" if chunks == 3 else "sum"  # the plan's reduce op is the collective's
        plan = _gemm_plan("gemm_allreduce", w, outer, chunk, has_bias, _config(chunks), reduce_op)
        ours = op(a, b, bias, group, plan.to_json())
        eager = c10d.wait_tensor(c10d.all_reduce(y, reduce_op, group))
        _assert_close(ours, eager, w, f"AR {reduce_op} {what}")
        checks += 3
    return checks


def check_all_gather_gemm() -> int:
    """Every dtype x stripe layout x chunk count, two consumers (one with bias, one without)."""
    group, r, w = _group()
    op = torch.ops.overlap_compile.priority_stream_allgather_gemm
    ns = (N, 4)
    checks = 0
    for seed, (dtype, (outer, chunk), chunks) in enumerate(itertools.product(DTYPES, STRIPES, CHUNKS)):
        rows = outer * chunk
        shard, b0, bias0, b1 = _inputs(100 + seed, r, [(rows, K), (K, ns[0]), (ns[0],), (K, ns[1])], dtype)
        plan = AllGatherGemmPlan(template="priority_stream", m=rows * w, k=K, ns=ns, world=w, outer=outer,
                                 chunk=chunk, has_bias=(True, False), config=_config(chunks))
        gathered, y0, y1 = op(shard, [b0, b1], [bias0, None], group, plan.to_json())
        eager = _eager_all_gather(shard, outer, chunk, w, group)
        what = f"AG w={w} {dtype} stripes={(outer, chunk)} chunks={chunks}"
        assert torch.equal(gathered, eager), what  # a gather moves bits: exact
        _assert_close(y0, _mm(eager, b0, bias0), 0, f"{what} y0")
        _assert_close(y1, _mm(eager, b1, None), 0, f"{what} y1")
        checks += 1
    return checks


def check_transposed_operand() -> bool:
    """A non-contiguous A (a transposed buffer, as in backward graphs) gives the same rows."""
    group, r, w = _group()
    op = torch.ops.overlap_compile.priority_stream_gemm_collective
    a, b = _inputs(7, r, [(K, 2 * w * 3), (K, N)], torch.float32)
    a = a.t()  # [m, K] with strides (1, m)
    plan = _gemm_plan("gemm_reducescatter", w, 2, 3, False, _config(4))
    ours = op(a, b, None, group, plan.to_json())
    _assert_close(ours, _eager_reduce_scatter(torch.mm(a, b), 2, 3, w, group), w, "RS transposed A")
    return True


def check_bad_calls() -> list[str]:
    """Mistakes fail with a clear message on every rank, before anything is sent."""
    group, r, w = _group()
    op = torch.ops.overlap_compile.priority_stream_gemm_collective
    a, b = torch.randn(w * 5, K), torch.randn(K, N)
    rs = "gemm_reducescatter"
    bad = [
        (_gemm_plan(rs, w, 1, 5, False, _config(2)), a[:, :-1]),  # wrong K
        (_gemm_plan(rs, w, 1, 5, False, _config(0)), a),
        (_gemm_plan(rs, w, 1, 5, False, {"chunks": 2, "slices": 2}), a),
        (_gemm_plan(rs, w, 1, 5, False, {"chunks": 2, "block_m": 64}), a),
        (_gemm_plan("allgather_gemm", w, 1, 5, False, _config(2)), a),
    ]
    messages = []
    for plan, a_ in bad:
        with pytest.raises(ValueError) as info:
            op(a_, b, None, group, plan.to_json())
        messages.append(str(info.value))
    return messages


def check_compiled_block() -> dict:
    """The DTensor TP+SP Llama block compiled with backend="overlap", priority_stream forced (the demo's
    check: outputs, input and parameter gradients against eager)."""
    from overlap_compile.demo.run import CPU_SIZES, check_against_eager

    res = check_against_eager("priority_stream", CPU_SIZES)
    assert res["out_err"] < 1e-4 and res["grad_err"] < 1e-4, res
    return res


def suite(compiled: bool) -> dict:
    """One process group for all checks (spawns are the expensive part)."""
    out = {
        "gemm": check_gemm_collectives(),
        "ag": check_all_gather_gemm(),
        "transposed": check_transposed_operand(),
        "bad": check_bad_calls(),
    }
    if compiled:
        out["compiled"] = check_compiled_block()
    return out


# ---- the distributed tests -----------------------------------------------------------------

def _check_op_results(results: list[dict]) -> None:
    r = results[0]
    assert r["gemm"] == 3 * len(DTYPES) * len(STRIPES) * 2 * len(CHUNKS)
    assert r["ag"] == len(DTYPES) * len(STRIPES) * len(CHUNKS) and r["transposed"]
    assert all(res["bad"] == r["bad"] for res in results)
    bad = r["bad"]
    assert "do not match the plan" in bad[0]
    assert "'chunks' must be an integer >= 1" in bad[1]
    assert "unknown config keys ['slices']" in bad[2]
    assert "'block_m' and 'block_n'" in bad[3]
    assert "kind 'allgather_gemm'" in bad[4]


def test_w4_ops_match_eager():
    from overlap_compile.testing.multiprocess import run_distributed

    _check_op_results(run_distributed("tests.test_priority_stream.suite", world_size=4, args=(False,),
                                      timeout_s=240))


def test_w2_ops_and_compiled_llama_block():
    """W = 2: the op checks, then the DTensor TP/SP Llama block compiled with priority_stream
    forced: every all-gather and reduce-scatter site of both graphs uses it."""
    from overlap_compile.testing.multiprocess import run_distributed

    results = run_distributed("tests.test_priority_stream.suite", world_size=2, args=(True,), timeout_s=300)
    _check_op_results(results)
    out = results[0]["compiled"]
    sites = out["sites"]
    for graph in ("forward", "backward"):
        for kind in ("allgather_gemm", "gemm_reducescatter"):
            here = [s for s in sites if s[0] == graph and s[1] == kind]
            assert here, f"no {kind} site in the {graph} graph: {sites}"
            assert all(s[2] == "priority_stream" and s[3]["chunks"] >= 1 for s in here), here
    for graph, code in out["after"].items():
        assert "priority_stream" in code, graph
        assert "reduce_scatter_tensor" not in code and "all_gather_into_tensor" not in code, graph


# ---- spec, geometry and plumbing (no processes) ---------------------------------------------

def _rs_match(world=4, m=20, n=7, k=9, outer=1, cls=GemmReduceScatterMatch, stripes=True):
    chunk = m // world // outer
    return cls(
        group_name="0", world_size=world, dtype=torch.float32, graph="forward", unsupported=None, mm_node=None,
        a_node=None, b_node=None, bias_node=None, collective_node=None, wait_node=None, chain_nodes=[], m=m, n=n,
        k=k, view_shape=(m, n), stripes=RowStripes(outer, world, chunk) if stripes else None,
        reduce_op=None if cls is GemmAllToAllMatch else "sum",
    )


def _ag_match(world=4, m=16, k=9, outer=1):
    return AllGatherGemmMatch(
        group_name="0", world_size=world, dtype=torch.float32, graph="forward", unsupported=None, ag_node=None,
        wait_node=None, shard_node=None, chain_nodes=[], full_node=None, gathered_node=None, gathered_twins=[],
        gathered_shape=(m, k), gather_dim=0, consumers=[], m=m, k=k,
        stripes=RowStripes(outer, world, m // world // outer),
    )


def test_supports_gives_reasons():
    assert SPEC.supports(_rs_match()) is None
    assert SPEC.supports(_rs_match(m=40, outer=2, cls=GemmAllToAllMatch)) is None
    assert SPEC.supports(_rs_match(cls=GemmAllReduceMatch, stripes=False)) is None
    assert SPEC.supports(_ag_match(outer=2)) is None
    assert "row stripes" in SPEC.supports(_rs_match(stripes=False))

    class Moe:
        kind = "moe"

    assert "does not implement moe" in SPEC.supports(Moe())


def test_configs():
    rs = _rs_match(world=4, m=20)  # stripes of 5 rows
    assert SPEC.default_config(rs) == {"chunks": 4, "block_m": None, "block_n": None, "stages": None}
    assert [c["chunks"] for c in SPEC.candidates(rs, None)] == [1, 2, 4]
    tiny = _rs_match(world=4, m=8)  # 2 rows per stripe: at most 2 chunks
    assert SPEC.default_config(tiny)["chunks"] == 2
    assert [c["chunks"] for c in SPEC.candidates(tiny, None)] == [1, 2]
    ar = _rs_match(world=4, m=20, cls=GemmAllReduceMatch, stripes=False)  # AR chunks the whole 20 rows
    assert [c["chunks"] for c in SPEC.candidates(ar, None)] == [1, 2, 4, 8]
    assert SPEC.default_config(_ag_match(world=4, m=4))["chunks"] == 1
    for match in (rs, tiny, ar):
        for c in SPEC.candidates(match, None):
            assert reference.config_problem(c) is None


def test_plan_validates_config():
    rs = _rs_match()
    plan = SPEC.plan(rs, SPEC.default_config(rs), 1000)
    assert plan.template == "priority_stream" and plan.result_rows == 5
    assert GemmCollectivePlan.from_json(plan.to_json()) == plan
    for bad, words in [({"chunks": 0}, "chunks"), ({"chunks": True}, "chunks"), ({"chunks": 2, "x": 1}, "unknown"),
                       ({"chunks": 2, "stages": 0}, "stages"), ({"chunks": 2, "block_n": 64}, "together"),
                       ("4", "dict")]:
        with pytest.raises(ValueError, match=words):
            SPEC.plan(rs, bad, 1000)
    tiled = {"chunks": 2, "block_m": 128, "block_n": 256, "stages": 3}
    assert SPEC.plan(rs, tiled, 1000).config == tiled
    shaped = {"chunks": 2, "block_m": 128, "block_n": 128, "stages": 2, "programs": 96}
    assert SPEC.plan(rs, shaped, 1000).config == shaped
    for bad, words in [({"chunks": 2, "block_m": 128, "block_n": 128, "programs": 0}, "'programs'"),
                       ({"chunks": 2, "stages": 3}, "need a tile"), ({"chunks": 2, "programs": 64}, "need a tile")]:
        with pytest.raises(ValueError, match=words):
            SPEC.plan(rs, bad, 1000)


@pytest.mark.parametrize("outer,world,chunk,chunks", [(1, 1, 7, 2), (1, 3, 5, 2), (2, 3, 4, 3)])
def test_gemm_hook_computes_what_cublas_does(outer, world, chunk, chunks):
    """The GPU path's Triton GEMM enters through compute_chunk's ``mm`` hook: called with 2-D
    row-major operands only (once per stripe where a chunk's rows are not one range), it must
    give exactly what the mm/bmm path gives."""
    st = RowStripes(outer, world, chunk)
    lay = reference.Layout(st, tuple(reference.bounds(st.stripe_rows, chunks)))
    g = torch.Generator().manual_seed(outer * 100 + world * 10 + chunk)
    a, b, bias = torch.randn(st.rows, 6, generator=g), torch.randn(6, 5, generator=g), torch.randn(5, generator=g)
    calls = []

    def mm(x, w, bb, out):
        assert x.dim() == 2 and out.dim() == 2 and out.stride(1) == 1
        calls.append(tuple(x.shape))
        out.copy_(torch.addmm(bb, x, w))

    for c in range(len(lay.chunks)):
        rows = slice(*lay.buffer_rows(c))
        want = torch.full((st.rows, 5), float("nan"))[rows]
        got = torch.full((st.rows, 5), float("nan"))[rows]
        reference.compute_chunk(a, b, bias, lay, c, want)
        reference.compute_chunk(a, b, bias, lay, c, got, mm)
        torch.testing.assert_close(got, want)
    assert calls and all(r >= 1 for r, _ in calls)


def test_chunk_geometry():
    assert reference.bounds(5, 2) == [(0, 3), (3, 5)]  # uneven: the last chunk is the smaller
    assert reference.bounds(5, 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert reference.bounds(3, 16) == [(0, 1), (1, 2), (2, 3)]  # clamped: no empty collectives
    st = RowStripes(2, 3, 4)  # local rows of a stripe: block 0 rows 0-3, block 1 rows 0-3
    segs = reference.segments(st, 2, 7)
    assert segs == [reference.Segment(0, 2, 4, 0), reference.Segment(1, 0, 3, 2)]
    # segment views are exactly the rows RowStripes assigns to every stripe
    x = torch.arange(st.rows, dtype=torch.float32).unsqueeze(1)
    for seg in segs:
        block = reference.stripe_block(x, st, seg)
        for k in range(st.world):
            want = [st.global_row(k, r) for r in range(seg.o * st.chunk + seg.r0, seg.o * st.chunk + seg.r1)]
            assert block[k, :, 0].tolist() == want


@pytest.mark.parametrize("outer,chunk,world", [(1, 5, 2), (2, 3, 4), (3, 2, 2)])
def test_chunk_send_buffers_hold_every_stripe(outer, chunk, world):
    """Chunk c's send buffer is [W, q, n]: rows [lo, hi) of stripe 0, then of stripe 1, ..."""
    st = RowStripes(outer, world, chunk)
    a, b, bias = torch.randn(st.rows, K), torch.randn(K, N), torch.randn(N)
    full = torch.addmm(bias, a, b)
    for chunks in CHUNKS:
        lay = reference.Layout(st, tuple(reference.bounds(st.stripe_rows, chunks)))
        send = torch.empty(st.rows, N)
        for c in range(len(lay.chunks)):
            reference.compute_chunk(a, b, bias, lay, c, send[slice(*lay.buffer_rows(c))])
        want = torch.cat([st.stripe(full, k)[lo:hi] for lo, hi in lay.chunks for k in range(world)])
        torch.testing.assert_close(send, want)


def test_fake_impls_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import overlap_compile  # noqa: F401  (registers the ops)

    rs = _gemm_plan("gemm_reducescatter", 4, 2, 3, False, _config(2))
    ar = _gemm_plan("gemm_allreduce", 4, 2, 3, True, _config(2))
    ag = AllGatherGemmPlan(template="priority_stream", m=24, k=K, ns=(3, 5), world=4, outer=2, chunk=3,
                           has_bias=(False, False), config=_config(2))
    with FakeTensorMode():
        op = torch.ops.overlap_compile.priority_stream_gemm_collective
        assert op(torch.empty(24, K), torch.empty(K, N), None, "0", rs.to_json()).shape == (6, N)
        assert op(torch.empty(24, K), torch.empty(K, N), torch.empty(N), "0", ar.to_json()).shape == (24, N)
        outs = torch.ops.overlap_compile.priority_stream_allgather_gemm(
            torch.empty(6, K), [torch.empty(K, 3), torch.empty(K, 5)], [None, None], "0", ag.to_json())
        assert [tuple(o.shape) for o in outs] == [(24, K), (24, 3), (24, 5)]


def test_registered_and_cuda_path_inert_on_cpu():
    """The registry knows the template; kernels.py imports without touching CUDA and declines
    CPU tensors (the op then runs the reference)."""
    from overlap_compile import templates
    from overlap_compile.templates.priority_stream import kernels

    assert "priority_stream" in templates.names() and templates.get_spec("priority_stream") is SPEC
    assert not torch.cuda.is_initialized()
    assert "needs CUDA tensors" in kernels.usable("0", torch.device("cpu"))
    with pytest.raises(ValueError, match="reduce op"):
        kernels.reduce_op("premul")
