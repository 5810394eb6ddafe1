"""Sites whose row count is symbolic (dynamic shapes) are found, decided per M bucket and rewritten
into the bucketed op, which gives the site's result at any M over gloo.

* the bucket table and the choice at run time (no processes);
* graphs traced with only M symbolic, every kind and template forced, run at many M (odd, below
  W x tile, not multiples of W where the kind allows it) against the graph as written;
* torch.compile end to end (2 processes, gloo): mark_dynamic and automatic dynamic (two lengths,
  then a third without a recompile), forward and backward, plain functional collectives, their
  autograd forms and the DTensor TP+SP block; every graph's sites rewritten, results equal eager;
* a golden graph of one symbolic site; oc.plan of a model with a symbolic input;
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlap_compile.predictor.buckets import Bucket, buckets, choose
from overlap_compile.testing.multiprocess import run_distributed

LENGTHS = (1, 2, 3, 7, 8, 17, 40)  # the symbolic length s; M is s or a multiple of it


def test_buckets_cover_every_valid_m_once():
    for hint, lo, hi, step in [(64, 8, None, 4), (20, 2, None, 1), (1000, 4, 4096, 2), (3, 2, 5, 1)]:
        bs = buckets(hint, lo, hi, step)
        assert bs[0].lo == -(-lo // step) * step and (bs[-1].hi is None) == (hi is None), bs
        for prev, nxt in zip(bs, bs[1:]):
            assert nxt.lo == prev.hi // step * step + step, bs
        for b in bs:
            assert b.at % step == 0 and b.lo <= b.at and (b.hi is None or b.at <= b.hi), b
        assert len(bs) <= 11


def test_choose_picks_the_bucket_of_m():
    table = [{"max_m": 256, "template": "baseline", "config": None},
             {"max_m": 4096, "template": "p2p_ring", "config": {}},
             {"max_m": None, "template": "signal_reorder", "config": {}}]
    assert [choose(table, m)["template"] for m in (1, 256, 257, 4096, 10 ** 6)] == [
        "baseline", "baseline", "p2p_ring", "p2p_ring", "signal_reorder"]
    assert Bucket(5, None, 7).label() == "M>4"


def _graph_cases(templates_: list[str]) -> list[dict]:
    """Run on every rank: each symbolic case x template, traced at s=5, run at LENGTHS."""
    from overlap_compile.templates.bucketed import choices_made
    from tests import symbolic_cases as sc

    group, world, rank = dist.group.WORLD.group_name, dist.get_world_size(), dist.get_rank()
    rows = []
    for name, case in sc.CASES.items():
        fn, shapes, dyn = case(group, world)
        example = [torch.randn(s) for s in shapes(5)]
        for template in templates_:
            gm, record = sc.rewritten(fn, example, dyn, template)
            site = record.sites[0]
            errs = []
            for s in LENGTHS:
                torch.manual_seed(100 * rank + s)
                inputs = [torch.randn(sh) for sh in shapes(s)]
                exp, got = fn(*inputs), gm(*inputs)
                exp, got = (exp if isinstance(exp, tuple) else (exp,)), (got if isinstance(got, tuple) else (got,))
                assert all(g.shape == e.shape for g, e in zip(got, exp)), (name, template, s)
                errs.append(max(((g - e).abs().max() / (e.abs().max() + 1e-6)).item() for g, e in zip(got, exp)))
            ran = {template for _, template, _ in choices_made()}
            rows.append({"case": name, "template": template, "kind": site.kind, "chosen": site.template,
                         "reason": site.reason, "err": max(errs), "ran": sorted(ran),
                         "in_graph": "bucketed" in record.after, "buckets": site.buckets})
    return rows


def test_every_kind_every_template_at_any_m():
    from overlap_compile import templates
    from tests import symbolic_cases as sc

    names = ["p2p_ring", "signal_reorder", "priority_stream", "tile_fused"]
    for rows in run_distributed(_graph_cases, world_size=2, args=(names,), timeout_s=600):
        for r in rows:
            label = f"{r['case']}/{r['template']}"
            assert r["kind"] == sc.KIND[r["case"]], label
            assert r["err"] < 1e-4, f"{label}: relative error {r['err']:.2e}"
            if r["kind"] in templates.get_spec(r["template"]).kinds:
                assert r["chosen"] == "bucketed" and r["in_graph"], f"{label}: {r['reason']}"
                assert r["template"] in r["ran"], f"{label}: ran {r['ran']}"
                assert r["buckets"] and all(b["template"] == r["template"] for b in r["buckets"]), label
                if (r["case"], r["template"]) == ("allreduce_2d", "p2p_ring"):  # odd M: W stripes cannot be cut
                    assert "baseline" in r["ran"], r["ran"]
            else:
                assert r["chosen"] == "baseline" and not r["in_graph"], label


def _mlp_allreduce(x, w1, w2, group):
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(torch.relu(x @ w1) @ w2, "sum", group))


def _mlp_sequence_parallel(x, w1, w2, group):
    from torch.distributed._functional_collectives import (all_gather_tensor_autograd,
                                                           reduce_scatter_tensor_autograd)

    full = all_gather_tensor_autograd(x, gather_dim=0, group=group)
    return reduce_scatter_tensor_autograd(torch.relu(full @ w1) @ w2, "sum", scatter_dim=0, group=group)


def _alltoall(x, w1, w2, group):
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(torch.relu(x @ w1) @ w2, None, None, group)


def _step_error(fn, model, x, w1, w2, group) -> float:
    """Forward and backward of the compiled ``fn`` and of eager ``model`` on the same inputs: the
    largest difference of the output and the three gradients (the weights' grads reset after)."""
    y = fn(x, w1, w2)
    y.backward(torch.ones_like(y))  # a contiguous gradient: torch 2.11's eager collectives need one
    gx, g1, g2 = x.grad, w1.grad, w2.grad
    x2 = x.detach().clone().requires_grad_()
    w1.grad = w2.grad = None
    y_ref = model(x2, w1, w2, group)
    y_ref.backward(torch.ones_like(y_ref))
    err = max((a - b).abs().max().item() for a, b in ((y, y_ref), (gx, x2.grad), (g1, w1.grad), (g2, w2.grad)))
    w1.grad = w2.grad = None
    return err


def _compiled(model, group: str):
    """``model`` compiled with the overlap backend after a Dynamo reset, its weights (seeded) and
    the Report the compile fills: (compiled fn, w1, w2, report)."""
    import functools

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend

    torch._dynamo.reset()
    torch.manual_seed(0)
    w1, w2 = torch.randn(16, 24, requires_grad=True), torch.randn(24, 8, requires_grad=True)
    report = oc.Report()
    fn = torch.compile(functools.partial(model, group=group), backend=functools.partial(overlap_backend, report=report))
    return fn, w1, w2, report


def _compile_checks(template: str | None) -> dict:
    """Run on every rank: each model compiled with the overlap backend, with ``mark_dynamic`` (one
    compile, then lengths it was not compiled for) and with automatic dynamic (two lengths, then
    a third); forward and backward against eager; what the pass did and how often Dynamo compiled."""
    import overlap_compile as oc
    from overlap_compile.compile_caches import no_compile_caches
    from torch._dynamo.utils import counters

    group, rank = dist.group.WORLD.group_name, dist.get_rank()
    overrides = {"force_template": template} if template else {}
    out = {}
    for name, model in (("allreduce", _mlp_allreduce), ("sequence_parallel", _mlp_sequence_parallel),
                        ("alltoall", _alltoall)):
        for mode in ("mark_dynamic", "automatic"):
            fn, w1, w2, report = _compiled(model, group)
            frames = counters["stats"]["unique_graphs"]
            errs = []
            lengths = (6, 10, 14) if mode == "mark_dynamic" else (6, 10, 22)  # rows per rank: even (A2A)
            with oc.config.patch(**overrides), no_compile_caches():
                for i, rows in enumerate(lengths):
                    torch.manual_seed(10 * rank + rows)
                    x = torch.randn(rows, 16, requires_grad=True)
                    if mode == "mark_dynamic" and i == 0:
                        torch._dynamo.mark_dynamic(x, 0)
                    errs.append(_step_error(fn, model, x, w1, w2, group))
            out[(name, mode)] = {"err": max(errs), "compiles": counters["stats"]["unique_graphs"] - frames,
                                 "sites": [(s.graph, s.kind, s.template, s.reason) for s in report.sites]}
    return out


@pytest.mark.slow
def test_compile_dynamic_forward_and_backward():
    """p2p_ring forced: every site of every graph (the symbolic ones included) rewritten."""
    for r in run_distributed(_compile_checks, world_size=2, args=("p2p_ring",), timeout_s=900):
        for (name, mode), got in r.items():
            label = f"{name}/{mode}"
            assert got["err"] < 1e-4, (label, got)
            symbolic = [s for s in got["sites"] if "symbolic M" in s[3]]
            assert symbolic, (label, got["sites"])
            graphs = {s[0].split("_")[0] for s in symbolic}
            # the backward's collectives of the all-reduce and all-to-all models read no GEMM output
            assert graphs == ({"forward", "backward"} if name == "sequence_parallel" else {"forward"}), \
                (label, got["sites"])
            assert all(s[2] == "bucketed" for s in symbolic), (label, got["sites"])
            # mark_dynamic: one compile; automatic: static first, one recompile with M symbolic, no third
            assert got["compiles"] == (1 if mode == "mark_dynamic" else 2), (label, got["compiles"])


def _dtensor_block_checks(template: str | None) -> dict:
    """Run on every rank: the DTensor TP+SP Llama block (demo), compiled with the overlap backend
    under mark_dynamic on the sequence dim (automatic dynamic is the functional models' test, to
    keep CPU time down), at three sequence lengths; output and every gradient against eager."""
    import functools

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend
    from overlap_compile.demo.common import max_err, setup_block
    from overlap_compile.demo.run import CPU_SIZES
    from overlap_compile.compile_caches import no_compile_caches
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import Shard, distribute_tensor

    overrides = {"force_template": template} if template else {}
    out = {}
    for mode in ("mark_dynamic",):
        torch._dynamo.reset()
        ref, blk, _, _ = setup_block(CPU_SIZES, "cpu", torch.float32)
        mesh = next(iter(blk.parameters())).device_mesh
        report = oc.Report()
        compiled = torch.compile(blk, backend=functools.partial(overlap_backend, report=report))
        frames = counters["stats"]["unique_graphs"]
        errs = []
        with oc.config.patch(**overrides), no_compile_caches():
            for i, seq in enumerate((12, 20, 36)):  # local rows 6, 10, 18: no tile multiple
                torch.manual_seed(seq)
                x = torch.randn(CPU_SIZES["batch"], seq, CPU_SIZES["hidden"])
                xr = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(1)])
                xc = distribute_tensor(x.clone().requires_grad_(), mesh, [Shard(1)])
                if mode == "mark_dynamic" and i == 0:
                    torch._dynamo.mark_dynamic(xc, 1)
                yr, yc = ref(xr), compiled(xc)
                yr.to_local().sum().backward()
                yc.to_local().sum().backward()
                errs.append(max([max_err(yc, yr), max_err(xc.grad, xr.grad)]
                                + [max_err(p.grad, q.grad) for p, q in zip(blk.parameters(), ref.parameters())]))
                for p in (*blk.parameters(), *ref.parameters()):
                    p.grad = None
        out[mode] = {"err": max(errs), "compiles": counters["stats"]["unique_graphs"] - frames,
                     "sites": [(s.graph, s.kind, s.template, s.reason) for s in report.sites]}
    return out


@pytest.mark.slow
def test_compile_dynamic_dtensor_block():
    for r in run_distributed(_dtensor_block_checks, world_size=2, args=("p2p_ring",), timeout_s=900):
        for mode, got in r.items():
            assert got["err"] < 1e-4, (mode, got)
            symbolic = [s for s in got["sites"] if "symbolic M" in s[3]]
            kinds = {(s[0].split("_")[0], s[1]) for s in symbolic}
            assert kinds == {("forward", "allgather_gemm"), ("forward", "gemm_reducescatter"),
                             ("backward", "allgather_gemm"), ("backward", "gemm_reducescatter")}, (mode, got["sites"])
            assert all(s[2] == "bucketed" for s in symbolic), (mode, got["sites"])
            assert got["compiles"] == (1 if mode == "mark_dynamic" else 2), (mode, got["compiles"])


class GoldenSymbolicSite(__import__("expecttest").TestCase):
    """The graph of one symbolic site after the rewrite (EXPECTTEST_ACCEPT=1 regenerates it): the
    DTensor Shard(1) reduce-scatter becomes one bucketed op and a view whose symbolic size is the
    graph's own node."""

    def setUp(self):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        self.group = dist.group.WORLD.group_name

    def tearDown(self):
        dist.destroy_process_group()

    def test_reducescatter_dim1_p2p_ring(self):
        from overlap_compile import config
        from overlap_compile.passes.pipeline import run_on_graph
        from tests import symbolic_cases as sc

        fn, shapes, dyn = sc.reducescatter_dim1(self.group, 2)
        gm = sc.trace(fn, [torch.randn(s) for s in shapes(5)], dyn)
        with config.patch(force_template="p2p_ring"):
            record = run_on_graph(gm.graph, config.current())
        self.assertEqual([b["template"] for b in record.sites[0].buckets], ["p2p_ring"] * len(record.sites[0].buckets))
        self.assertExpectedInline(record.after.strip().replace(f"'{self.group}'", "'G'"), """\
def forward(self, x_1, b_1):
    mul = torch.ops.aten.mul.Tensor(x_1, 1)
    mul_1 = torch.ops.aten.mul.Tensor(x_1, 2)
    cat = torch.ops.aten.cat.default([mul, mul_1], 1);  mul = mul_1 = None
    sym_size_int = torch.ops.aten.sym_size.int(x_1, 1);  x_1 = None
    mul_2 = 2 * sym_size_int
    mul_3 = mul_2 * 2;  mul_2 = None
    view = torch.ops.aten.view.default(cat, [mul_3, 12]);  cat = mul_3 = None
    bucketed_gemm_collective_default = torch.ops.overlap_compile.bucketed_gemm_collective.default(view, b_1, None, 'G', '{"buckets":[{"config":{"bidirectional":false,"slices":1,"transport":"nccl"},"max_m":32768,"template":"p2p_ring"},{"config":{"bidirectional":false,"slices":2,"transport":"nccl"},"max_m":null,"template":"p2p_ring"}],"chunk":null,"gathered":true,"has_bias":false,"k":12,"kind":"gemm_reducescatter","n":20,"ns":[],"outer":2,"reduce_op":"sum","replay_written":true,"timeout_ms":10000,"world":2}');  view = b_1 = None
    mul_4 = sym_size_int * 2;  mul_4 = None
    view_default = torch.ops.aten.view.default(bucketed_gemm_collective_default, [2, sym_size_int, 20]);  bucketed_gemm_collective_default = sym_size_int = None
    add = torch.ops.aten.add.Tensor(view_default, 1);  view_default = None
    return add""")


def test_plan_of_a_symbolic_input_shows_buckets():
    """oc.plan on the meta device with mark_dynamic: every site of both graphs is symbolic, decided
    per bucket under the h200 profile (decode-sized M as written, long sequences rewritten), and
    the Report's reason and ``buckets`` show each bucket's choice."""
    import overlap_compile as oc
    from overlap_compile.testing.fake_group import fake_process_group
    from tests.test_plan import _TPMLP

    with fake_process_group(4) as group:
        mlp = _TPMLP(group, 4, 4096, 16384).to("meta", torch.bfloat16)
        x = torch.empty(2048, 4096, device="meta", dtype=torch.bfloat16, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        report = oc.plan(mlp, x, backward=True, mode="reduce-overhead", profile="h200")
    assert {s.graph.split("_")[0] for s in report.sites} == {"forward", "backward"}, report
    for s in report.sites:
        assert s.buckets and "symbolic M" in s.reason, s
        assert s.buckets[0]["template"] == "baseline", s.buckets[0]  # M of a few rows: nothing to hide
        assert s.predicted_ms.get("baseline") is not None, s
    assert any(b["template"] != "baseline" for s in report.sites for b in s.buckets), report
    assert any(s.rewritten for s in report.sites) and "bucketed" in str(report), report


def test_gathered_size_reads_do_not_keep_the_gathered_matrix():
    """A dynamic graph reads the gathered tensor's size (sym_size) to view the GEMM's output back:
    the rewrite computes that size from the inputs instead, so only the GEMM reads the gathered
    rows and the op's table says they need not be written out (as the static rewrite's plan does)."""
    import json

    from overlap_compile.testing.fake_group import fake_process_group
    from tests import symbolic_cases as sc

    with fake_process_group(2):
        group = dist.group.WORLD.group_name
        fn, shapes, dyn = sc.allgather_size_read(group, 2)
        before = sc.trace(fn, [torch.randn(s) for s in shapes(5)], dyn)
        assert any(n.target is torch.ops.aten.sym_size.int for n in before.graph.nodes)
        gm, record = sc.rewritten(fn, [torch.randn(s) for s in shapes(5)], dyn, "p2p_ring")
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.overlap_compile.bucketed_allgather_gemm.default]
    assert json.loads(op.args[-1])["gathered"] is False, record.sites[0].reason
    assert [u.args[1] for u in op.users] == [1]  # only the GEMM's output is read
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten.sym_size.int:
            assert n.args[0].op == "placeholder", n.format_node()


def _calls_without_building_the_match() -> float:
    """Rank's max error of p2p_ring's bucketed all-gather + GEMM called again at an M it has
    chosen for, with building a match refused: the op is called directly."""
    from overlap_compile.templates import bucketed as B

    group, world = dist.group.WORLD.group_name, dist.get_world_size()
    cfg = {"bidirectional": False, "slices": 1, "transport": "p2p"}
    table = B.BucketTable(kind="allgather_gemm", world=world, k=16, ns=(8,), has_bias=(False,), outer=1,
                          buckets=({"max_m": None, "template": "p2p_ring", "config": cfg},), gathered=False).to_json()
    torch.manual_seed(dist.get_rank())
    shard, w = torch.randn(3, 16), torch.randn(16, 8)
    op = torch.ops.overlap_compile.bucketed_allgather_gemm.default
    B.clear_choices()
    op(shard, [w], [None], group, table)  # the choice at M = 3 W
    real, B.concrete_match = B.concrete_match, None
    try:
        got = op(shard, [w], [None], group, table)[1]
    finally:
        B.concrete_match = real
    assert [t for _, t, _ in B.choices_made()] == ["p2p_ring"]
    full = torch.empty(3 * world, 16)
    dist.all_gather_into_tensor(full, shard)
    return ((got - full @ w).abs().max() / (full @ w).abs().max()).item()


def test_bucketed_op_calls_a_template_op_directly():
    """Where a template's op is what its spec emits for the site, the bucketed op calls it on the
    operands and the plan text, without building the site's match per call (host time)."""
    for err in run_distributed(_calls_without_building_the_match, world_size=2, timeout_s=300):
        assert err < 1e-5
