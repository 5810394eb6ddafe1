"""p2p_ring (CommFuse): ring reduce-scatter / all-gather / all-to-all against eager.

Every distributed check compares the template's op, called through torch.ops with a plan, with
what the original graph computes: torch.mm (addmm with bias) and the functional collective
(``_c10d_functional.*`` + ``wait_tensor``) on the same inputs and dtype. Each spawn of a process
group runs many shapes and configs (spawning costs seconds); the worker functions live at module
level so the spawned ranks can import them.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from overlap_compile.passes.matches import (
    AllGatherGemmMatch,
    GemmAllReduceMatch,
    GemmAllToAllMatch,
    GemmReduceScatterMatch,
)
from overlap_compile.templates.p2p_ring import reference
from overlap_compile.templates.p2p_ring.spec import SPEC
from overlap_compile.templates.plans import AllGatherGemmPlan, GemmCollectivePlan
from overlap_compile.tiling import RowStripes

c10d = torch.ops._c10d_functional

# Configs each distributed check runs: plain ring, pipelined slices (dividing and not dividing
# the rows, and more slices than rows, which clamps), and both ring directions.
CONFIGS = [
    {"slices": 1, "bidirectional": False, "transport": "nccl"},
    {"slices": 2, "bidirectional": False, "transport": "nccl"},
    {"slices": 3, "bidirectional": True, "transport": "nccl"},
    {"slices": 16, "bidirectional": True, "transport": "nccl"},
]
# (outer, chunk): rows of one rank's stripe come as `outer` blocks of `chunk` rows
# (outer > 1: a [outer, W*chunk, N] view scattered/gathered along dim 1).
STRIPES = [(1, 5), (2, 3)]
K, N = 9, 7


# ---- helpers shared by the workers ---------------------------------------------------------

def _group():
    import torch.distributed as dist

    return dist.group.WORLD.group_name, dist.get_rank(), dist.get_world_size()


def _all_ranks(seed: int, w: int, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """The inputs of every rank (same generator everywhere), so each rank can compute the exact
    answer in float64 without communicating."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(w)]


def _mm(a, b, bias):
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def _assert_matches(ours: torch.Tensor, eager: torch.Tensor, truth: torch.Tensor, hops: int, what: str) -> None:
    """fp32: equal to eager up to summation order. bf16: apart by at most the rounding of ``hops``
    bf16 additions (in units of eps * max|value|: measured <= 1.1 for W = 4), and no further from
    the float64 answer than half of that plus one rounding (measured <= 0.9)."""
    assert ours.dtype == eager.dtype and ours.shape == eager.shape, what
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5, msg=what)
        return
    unit = torch.finfo(ours.dtype).eps * (truth.abs().max().item() + 1e-3)
    diff = (ours.double() - eager.double()).abs().max().item()
    assert diff <= (hops + 1) * unit, f"{what}: |ours - eager| = {diff / unit:.2f} eps > {hops + 1}"
    err = (ours.double() - truth).abs().max().item()
    assert err <= (hops / 2 + 1) * unit, f"{what}: |ours - float64| = {err / unit:.2f} eps > {hops / 2 + 1}"


def _gemm_plan(kind: str, w: int, outer: int, chunk: int, bias: bool, config: dict,
               reduce_op: str | None = "sum") -> GemmCollectivePlan:
    return GemmCollectivePlan(template="p2p_ring", kind=kind, m=outer * w * chunk, n=N, k=K, world=w,
                              reduce_op=reduce_op, outer=outer, chunk=chunk, has_bias=bias, config=config)


def _eager_reduce_scatter(y: torch.Tensor, outer: int, chunk: int, w: int, op: str, group: str) -> torch.Tensor:
    """What the graph does: view [outer, W*chunk, N], split/cat along dim 1 when outer > 1."""
    if outer > 1:
        y = torch.cat(torch.split(y.view(outer, w * chunk, N), chunk, dim=1), dim=0)
    out = c10d.wait_tensor(c10d.reduce_scatter_tensor(y.contiguous(), op, w, group))
    return out.reshape(outer * chunk, N)


def _eager_all_gather(shard: torch.Tensor, outer: int, chunk: int, w: int, group: str) -> torch.Tensor:
    full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard.view(outer, chunk, -1).contiguous(), w, group))
    if outer > 1:
        full = torch.cat(torch.split(full, outer, dim=0), dim=1)
    return full.reshape(outer * w * chunk, -1)


# ---- distributed workers -------------------------------------------------------------------

def check_reduce_scatter_and_all_to_all() -> int:
    """Every dtype x stripe layout x bias x config: RS (sum; avg once) and A2A (outer == 1)."""
    group, r, w = _group()
    op = torch.ops.overlap_compile.p2p_ring_gemm_collective
    checks = 0
    cases = itertools.product((torch.float32, torch.bfloat16), STRIPES, (False, True), CONFIGS)
    for seed, (dtype, (outer, chunk), has_bias, config) in enumerate(cases):
        m = outer * w * chunk
        ranks = _all_ranks(seed, w, [(m, K), (K, N), (N,)], dtype)
        a, b, bias = ranks[r][0], ranks[r][1], ranks[r][2] if has_bias else None
        ys = [_mm(x[0].double(), x[1].double(), x[2].double() if has_bias else None) for x in ranks]
        st = RowStripes(outer, w, chunk)
        what = f"w={w} {dtype} stripes={(outer, chunk)} bias={has_bias} {config}"

        reduce_ops = ("sum", "avg") if config["slices"] == 2 else ("sum",)
        for reduce_op in reduce_ops:
            plan = _gemm_plan("gemm_reducescatter", w, outer, chunk, has_bias, config, reduce_op)
            ours = op(a, b, bias, group, plan.to_json())
            # gloo has no "avg" reduce-scatter: eager avg is the sum divided by W.
            eager = _eager_reduce_scatter(_mm(a, b, bias), outer, chunk, w, "sum", group)
            truth = st.stripe(sum(ys), r)
            if reduce_op == "avg":
                eager, truth = eager / w, truth / w
            _assert_matches(ours, eager, truth, hops=w, what=f"RS {reduce_op} {what}")
            checks += 1

        if outer == 1:  # all-reduce: the RS over W row stripes of the output, then their gather,
            # whole or in row chunks (3: of uneven sizes on these shapes)
            eager = c10d.wait_tensor(c10d.all_reduce(_mm(a, b, bias), "sum", group))
            for chunks in (1, 3):
                plan = dataclasses.replace(_gemm_plan("gemm_allreduce", w, 1, m, has_bias,
                                                      {**config, "chunks": chunks}), m=m)
                ours = op(a, b, bias, group, plan.to_json())
                _assert_matches(ours, eager, sum(ys), hops=w, what=f"AR chunks={chunks} {what}")
                checks += 1

        if outer == 1 and not config["bidirectional"]:
            plan = _gemm_plan("gemm_alltoall", w, outer, chunk, has_bias, config, None)
            ours = op(a, b, bias, group, plan.to_json())
            split = [chunk] * w
            eager = c10d.wait_tensor(c10d.all_to_all_single(_mm(a, b, bias), split, split, group))
            truth = torch.cat([st.stripe(y, r) for y in ys])
            _assert_matches(ours, eager, truth, hops=0, what=f"A2A {what}")
            checks += 1
    return checks


def check_all_gather_gemm() -> int:
    """Every dtype x stripe layout x config, two consumers (one with bias, one without)."""
    group, r, w = _group()
    op = torch.ops.overlap_compile.p2p_ring_allgather_gemm
    ns = (N, 4)
    checks = 0
    cases = itertools.product((torch.float32, torch.bfloat16), STRIPES, CONFIGS)
    for seed, (dtype, (outer, chunk), config) in enumerate(cases):
        rows = outer * chunk
        ranks = _all_ranks(100 + seed, w, [(rows, K), (K, ns[0]), (ns[0],), (K, ns[1])], dtype)
        shard = ranks[r][0]
        # the weights are replicated (column-parallel linears): rank 0's everywhere
        bs, biases = [ranks[0][1], ranks[0][3]], [ranks[0][2], None]
        plan = AllGatherGemmPlan(template="p2p_ring", m=rows * w, k=K, ns=ns, world=w, outer=outer, chunk=chunk,
                                 has_bias=(True, False), config=config)
        gathered, *ys = op(shard, bs, biases, group, plan.to_json())
        eager = _eager_all_gather(shard, outer, chunk, w, group)
        what = f"AG w={w} {dtype} stripes={(outer, chunk)} {config}"
        assert torch.equal(gathered, eager), what  # a gather moves bits: exact
        truth = eager.double()
        for i, (y, b, bias) in enumerate(zip(ys, bs, biases)):
            exact = _mm(truth, b.double(), bias.double() if bias is not None else None)
            _assert_matches(y, _mm(eager, b, bias), exact, hops=1, what=f"{what} y{i}")
        checks += 1
    return checks


def check_bad_calls() -> list[str]:
    """Mistakes fail with a clear message on every rank (no rank hangs: nothing is sent)."""
    group, r, w = _group()
    op = torch.ops.overlap_compile.p2p_ring_gemm_collective
    config = CONFIGS[0]
    a, b = torch.randn(w * 5, K), torch.randn(K, N)
    messages = []
    bad = [
        (_gemm_plan("gemm_reducescatter", w, 1, 5, False, config), a[:, :-1], b, None),  # wrong K
        (_gemm_plan("gemm_reducescatter", w, 1, 5, True, config), a, b, None),  # bias missing
        (_gemm_plan("gemm_reducescatter", w, 1, 5, False, config, "max"), a, b, None),
        (_gemm_plan("gemm_reducescatter", w, 1, 5, False, {"slices": 0}), a, b, None),
    ]
    ar = dataclasses.replace(_gemm_plan("gemm_allreduce", w, 1, 5, False, config), m=w * 5 + 1)
    bad.append((ar, torch.randn(w * 5 + 1, K), b, None))  # all-reduce rows not a multiple of W
    bad.append((_gemm_plan("gemm_reducescatter", w, 1, 5, False, {**config, "chunks": 2}), a, b, None))
    ar_chunks = dataclasses.replace(_gemm_plan("gemm_allreduce", w, 1, 5, False, {**config, "chunks": 0}), m=w * 5)
    bad.append((ar_chunks, a, b, None))
    for plan, a_, b_, bias in bad:
        with pytest.raises(ValueError) as info:
            op(a_, b_, bias, group, plan.to_json())
        messages.append(str(info.value))
    return messages


def check_compiled_block() -> dict:
    """The DTensor TP+SP Llama block compiled with backend="overlap", p2p_ring forced (the demo's
    check: outputs, input and parameter gradients against eager)."""
    from overlap_compile.demo.run import CPU_SIZES, check_against_eager

    res = check_against_eager("p2p_ring", CPU_SIZES)
    assert res["out_err"] < 1e-4 and res["grad_err"] < 1e-4, res
    return res


# ---- the tests -----------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_ops_match_eager(world):
    from overlap_compile.testing.multiprocess import run_distributed

    results = run_distributed(_op_suite, world_size=world, timeout_s=120)
    assert all(res == results[0] for res in results)
    rs, ag, bad = results[0]
    assert rs >= 30 and ag == 16
    assert "do not match the plan" in bad[0] and "has_bias" in bad[1]
    assert "'max'" in bad[2] and "slices" in bad[3] and "multiple of the world size" in bad[4]
    assert "'chunks'" in bad[5] and "no meaning for gemm_reducescatter" in bad[5] and "'chunks'" in bad[6]


def _op_suite():
    """One process group for all op checks (spawns are the expensive part)."""
    return check_reduce_scatter_and_all_to_all(), check_all_gather_gemm(), check_bad_calls()


@pytest.mark.slow
def test_compiled_llama_block_uses_p2p_ring():
    from overlap_compile.testing.multiprocess import run_distributed

    out = run_distributed(check_compiled_block, world_size=2, timeout_s=240)[0]
    sites = out["sites"]
    for graph in ("forward", "backward"):
        for kind in ("allgather_gemm", "gemm_reducescatter"):
            here = [s for s in sites if s[0] == graph and s[1] == kind]
            assert here, f"no {kind} site in the {graph} graph: {sites}"
            assert all(s[2] == "p2p_ring" for s in here), here
    for graph, code in out["after"].items():
        assert "p2p_ring" in code, graph
        assert "reduce_scatter_tensor" not in code, graph


# ---- spec and plumbing (no processes) ------------------------------------------------------

def _rs_match(world=4, m=20, n=7, k=9, outer=1, reduce_op="sum", cls=GemmReduceScatterMatch):
    chunk = m // world // outer
    return cls(
        group_name="0", world_size=world, dtype=torch.float32, graph="forward", unsupported=None, mm_node=None,
        a_node=None, b_node=None, bias_node=None, collective_node=None, wait_node=None, chain_nodes=[], m=m, n=n,
        k=k, view_shape=(m, n), stripes=RowStripes(outer, world, chunk) if cls is not GemmAllReduceMatch else None,
        reduce_op=reduce_op,
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
    assert SPEC.supports(_rs_match(reduce_op="avg")) is None
    assert "'max'" in SPEC.supports(_rs_match(reduce_op="max"))
    assert SPEC.supports(_ag_match()) is None
    assert SPEC.supports(_rs_match(cls=GemmAllReduceMatch)) is None
    assert "not a multiple of the world size" in SPEC.supports(_rs_match(m=22, cls=GemmAllReduceMatch))
    assert SPEC.supports(_rs_match(cls=GemmAllToAllMatch, reduce_op=None)) is None
    a2a_outer = _rs_match(m=40, outer=2, cls=GemmAllToAllMatch, reduce_op=None)
    assert "leading dimension" in SPEC.supports(a2a_outer)


def test_configs():
    rs = _rs_match(world=4, m=16)  # stripes of 4 rows
    assert SPEC.default_config(rs) == {"slices": 1, "bidirectional": False, "transport": "nccl"}
    got = {(c["slices"], c["bidirectional"]) for c in SPEC.candidates(rs, None)}
    assert got == {(s, bd) for s in (1, 2, 4) for bd in (False, True)}
    odd = {(c["slices"], c["bidirectional"]) for c in SPEC.candidates(_rs_match(world=2, m=10), None)}
    assert odd == {(1, False)}  # 5-row stripes, W = 2: one ring direction is all there is
    ag = {(c["slices"], c["bidirectional"]) for c in SPEC.candidates(_ag_match(world=4, m=16), None)}
    assert ag == {(1, False), (2, False), (4, False), (1, True), (2, True)}  # halves of 2 rows
    a2a = _rs_match(world=4, m=16, cls=GemmAllToAllMatch, reduce_op=None)
    assert all(not c["bidirectional"] for c in SPEC.candidates(a2a, None))
    for match in (rs, a2a):
        for c in SPEC.candidates(match, None):
            assert reference.config_problem(match.kind, c) is None
    # the copy-engine transport: offered for row stripes (every kind), not for outer > 1
    p2p = {"slices": 1, "bidirectional": False, "transport": "p2p"}
    assert p2p in SPEC.candidates(rs, None) and p2p in SPEC.candidates(_ag_match(world=4, m=16), None)
    assert p2p in SPEC.candidates(a2a, None)
    assert p2p not in SPEC.candidates(_rs_match(m=40, outer=2), None)


def test_plan_rejects_bad_configs():
    rs = _rs_match()
    plan = SPEC.plan(rs, SPEC.default_config(rs), 1000)
    assert plan.template == "p2p_ring" and plan.result_rows == 5
    assert GemmCollectivePlan.from_json(plan.to_json()) == plan
    for bad, words in [({"slices": 0}, "slices"), ({"slices": True}, "slices"), ({"bidirectional": 1}, "bidirectional"),
                       ({"transport": "gloo"}, "transport"), ({"waves": 2}, "unknown config keys"),
                           ({"chunks": 2}, "'chunks'.*no meaning for gemm_reducescatter")]:
        with pytest.raises(ValueError, match=words):
            SPEC.plan(rs, bad, 1000)
    assert SPEC.plan(rs, {"slices": 2, "transport": "nccl"}, 1000).config["transport"] == "nccl"
    # the copy engine takes row slices too (each copied / pushed on its own), one direction only
    assert SPEC.plan(rs, {"slices": 2, "transport": "p2p"}, 1000).config["slices"] == 2
    with pytest.raises(ValueError, match="transport 'p2p'.*bidirectional=False"):
        SPEC.plan(rs, {"slices": 2, "bidirectional": True, "transport": "p2p"}, 1000)
    a2a = _rs_match(cls=GemmAllToAllMatch, reduce_op=None)
    with pytest.raises(ValueError, match="all-to-all"):
        SPEC.plan(a2a, {"bidirectional": True}, 1000)


def test_ring_geometry():
    assert reference.bounds(5, 2) == [(0, 2), (2, 5)]
    assert reference.bounds(3, 16) == [(0, 1), (1, 2), (2, 3)]  # clamped: no empty messages
    assert reference.lanes(7, False) == [reference.Lane(1, (0, 7))]
    assert reference.lanes(7, True) == [reference.Lane(1, (0, 3)), reference.Lane(-1, (3, 7))]
    assert reference.lanes(1, True) == [reference.Lane(-1, (0, 1))]
    st = RowStripes(2, 3, 2)  # 12 rows; stripe 1 = rows 2, 3, 8, 9
    out = torch.zeros(12, 1)
    reference.put_rows(out, st, 1, 1, 3, torch.tensor([[1.0], [2.0]]))
    assert out.flatten().nonzero().flatten().tolist() == [3, 8]


def test_fake_impls_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import overlap_compile  # noqa: F401  (registers the ops)

    rs = _gemm_plan("gemm_reducescatter", 4, 2, 3, False, CONFIGS[0])
    a2a = _gemm_plan("gemm_alltoall", 4, 1, 5, False, CONFIGS[0], None)
    ag = AllGatherGemmPlan(template="p2p_ring", m=24, k=K, ns=(3, 5), world=4, outer=2, chunk=3,
                           has_bias=(False, False), config=CONFIGS[0])
    with FakeTensorMode():
        op = torch.ops.overlap_compile.p2p_ring_gemm_collective
        assert op(torch.empty(24, K), torch.empty(K, N), None, "0", rs.to_json()).shape == (6, N)
        assert op(torch.empty(20, K), torch.empty(K, N), None, "0", a2a.to_json()).shape == (20, N)
        outs = torch.ops.overlap_compile.p2p_ring_allgather_gemm(
            torch.empty(6, K), [torch.empty(K, 3), torch.empty(K, 5)], [None, None], "0", ag.to_json())
        assert [tuple(o.shape) for o in outs] == [(24, K), (24, 3), (24, 5)]
