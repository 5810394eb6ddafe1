"""passes/defer_compute.py: compute that does not lead to a collective moves between its start
and its wait; the wait moves to its first reader; a collective takes work up to its budget and
leaves the rest to the next; impure ops stay; Inductor keeps the order (the backward's
generated code has weight-gradient GEMMs between a collective and its wait); results equal."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from overlap_compile.passes.defer_compute import comm_bytes, defer_independent_compute, gemm_flops

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _node(g: fx.Graph, op, args, shape):
    n = g.call_function(op, args)
    n.meta["val"] = torch.empty(shape, device="meta")
    return n


def _placeholder(g: fx.Graph, name: str, shape):
    n = g.placeholder(name)
    n.meta["val"] = torch.empty(shape, device="meta")
    return n


def _backward_like(flops_per_gemm_dim: int = 64):
    """Two weight gradients (dw1, dw2), a data gradient feeding a reduce-scatter, whose result
    feeds an all-gather (the chain of a TP block's backward); a seeded-random op and an in-place
    copy among the independent work."""
    d = flops_per_gemm_dim
    g = fx.Graph()
    x, dy, w, buf = (_placeholder(g, n, (d, d)) for n in ("x", "dy", "w", "buf"))
    dw1 = _node(g, aten.mm.default, (x, dy), (d, d))
    noise = _node(g, aten.rand_like.default, (x,), (d, d))
    dw2 = _node(g, aten.mm.default, (dy, x), (d, d))
    copied = _node(g, aten.copy_.default, (buf, dw2), (d, d))  # in place: stays, so dw2 stays
    rs, rs_w, ag, ag_w, out = _chain(g, d, dy, w)
    g.output((dw1, dw2, noise, out, copied))
    return g, {n.name: n for n in g.nodes}


def _chain(g: fx.Graph, d: int, dy: fx.Node, w: fx.Node):
    """The data gradient -> reduce-scatter -> (its result) -> all-gather -> GEMM chain of a TP
    block's backward: (rs, rs wait, ag, ag wait, the GEMM reading it)."""
    dx = _node(g, aten.mm.default, (dy, w), (d, d))
    rs = _node(g, c10d.reduce_scatter_tensor.default, (dx, "sum", 2, "0"), (d // 2, d))
    rs_w = _node(g, c10d.wait_tensor.default, (rs,), (d // 2, d))
    act = _node(g, aten.relu.default, (rs_w,), (d // 2, d))
    ag = _node(g, c10d.all_gather_into_tensor.default, (act, 2, "0"), (d, d))
    ag_w = _node(g, c10d.wait_tensor.default, (ag,), (d, d))
    return rs, rs_w, ag, ag_w, _node(g, aten.mm.default, (ag_w, w), (d, d))


def _names(g: fx.Graph) -> list[str]:
    return [n.name for n in g.nodes if n.op == "call_function"]


def test_independent_work_moves_under_the_collective_and_the_wait_to_its_reader():
    g, n = _backward_like()
    done = defer_independent_compute(g, flops_per_byte=float("inf"))
    order = _names(g)
    rs, rs_w, ag = order.index(n["reduce_scatter_tensor_default"].name), order.index("wait_tensor_default"), \
        order.index("all_gather_into_tensor_default")
    assert order.index("mm_default") > rs and order.index("mm_default") < rs_w  # dw1 under the reduce-scatter
    assert order.index("mm_default_2") < rs  # the data gradient still feeds it first
    assert order.index("rand_like_default") < rs  # seeded randomness keeps its place
    # dw2 is read by an in-place copy that stays, so dw2 stays too
    assert order.index("mm_default_1") < rs and order.index("copy__default") < rs
    assert ag > rs_w and done[0].collective == "reduce_scatter_tensor_default" and done[0].gemms == 1
    g.lint()


def test_a_collective_takes_work_up_to_its_budget_and_leaves_the_rest_to_the_next():
    """Budget: flops_per_byte x the bytes it moves. One GEMM of 2 * 64^3 FLOPs covers the
    reduce-scatter (32 x 64 x 4 bytes, half of it moved) at 512 FLOP/byte; the other GEMM goes
    past its wait, to the all-gather."""
    g = fx.Graph()
    d = 64
    x, dy, w = (_placeholder(g, s, (d, d)) for s in ("x", "dy", "w"))
    dw1 = _node(g, aten.mm.default, (x, dy), (d, d))
    dw2 = _node(g, aten.mm.default, (dy, x), (d, d))
    rs, rs_w, ag, ag_w, out = _chain(g, d, dy, w)
    g.output((dw1, dw2, out))
    assert comm_bytes(rs) == d * d * 4 / 2 and gemm_flops(dw1) == 2 * d ** 3
    done = defer_independent_compute(g, flops_per_byte=2 * d ** 3 / (d * d * 4 / 2))
    order = _names(g)
    pos = {name: order.index(name) for name in order}
    assert pos[rs.name] < pos[dw1.name] < pos[rs_w.name]
    assert pos[ag.name] < pos[dw2.name] < pos[ag_w.name]
    assert [(x.collective, x.moved) for x in done] == [(rs.name, [dw1.name]), (ag.name, [dw2.name])]


def _tp_mlp_backward_code(**options) -> dict:
    """A TP/SP MLP (all-gather -> two GEMMs -> reduce-scatter; 37 rows per rank), forward and
    backward compiled by the overlap backend with no template allowed (every site as written),
    defer_compute on and ``options``, against eager: the errors, the Report's lines, and the
    generated backward's collective starts, waits and GEMMs in order (tests/test_prioritize.py
    uses it too)."""
    import functools

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend
    from overlap_compile.compile_caches import no_compile_caches
    from torch._inductor.utils import run_and_get_code

    group, w = dist.group.WORLD.group_name, dist.get_world_size()
    c = torch.ops._c10d_functional

    def mlp(x, w1, w2):
        full = c.wait_tensor(c.all_gather_into_tensor(x, w, group))
        h = torch.relu(full @ w1)
        return c.wait_tensor(c.reduce_scatter_tensor(h @ w2, "sum", w, group))

    torch.manual_seed(0)
    w1, w2 = torch.randn(64, 96, requires_grad=True), torch.randn(96, 64, requires_grad=True)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(37, 64, requires_grad=True)
    eager = mlp(x, w1, w2)
    eager.square().sum().backward()
    want = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    report = oc.Report()
    with oc.config.patch(**{"templates": (), "defer_compute": True, **options}), no_compile_caches():
        torch._dynamo.reset()
        fn = torch.compile(mlp, backend=functools.partial(overlap_backend, report=report))

        def step():
            y = fn(x, w1, w2)
            y.square().sum().backward()
            return y

        got, codes = run_and_get_code(step)
    backward = next(code for code in codes if "tangents" in code)
    lines = [ln.strip() for ln in backward.splitlines()]
    starts = ("all_gather_into_tensor.default(", "reduce_scatter_tensor.default(", "prioritized_collective.default(")
    events = [("start" if any(k in ln for k in starts)
               else "wait" if "wait_tensor.default(" in ln or "prioritized_join.default(" in ln else "mm")
              for ln in lines if (("_c10d_functional." in ln or "overlap_compile.prioritized" in ln)
                                  and ".default(" in ln) or "extern_kernels.mm(" in ln]
    return {"out_err": float((got - eager).detach().abs().max()),
            "grad_errs": [float((t.grad - g).abs().max()) for t, g in zip((x, w1, w2), want)],
            "deferred": [f"{r.name}: {d}" for r in report.records for d in r.deferred],
            "prioritized": [f"{r.name}: {p}" for r in report.records for p in r.prioritized],
            "flags": [s.prioritized for s in report.sites], "events": events}


@pytest.mark.slow
def test_inductor_keeps_the_weight_gradients_under_the_collective():
    from overlap_compile.testing.multiprocess import run_distributed

    for r in run_distributed(_tp_mlp_backward_code, world_size=2, timeout_s=300):
        assert r["out_err"] < 1e-4 and max(r["grad_errs"]) < 1e-4, r
        assert any(d.startswith("backward") and "GEMMs" in d for d in r["deferred"]), r
        ev = r["events"]
        # some GEMM runs between a collective's start and its wait in the generated backward
        assert any(ev[i] == "start" and "mm" in ev[i + 1:ev.index("wait", i)] for i in range(len(ev))
                   if "wait" in ev[i:]), ev


def test_peak_memory_reordering_is_off_only_where_compute_may_move():
    """Inductor's peak-memory reordering put the Llama block's weight-gradient GEMMs back ahead
    of the all-gather (tiny CPU run of benchmarks/e2e.py): it is turned off where the pass may
    move compute, and left alone otherwise."""
    from overlap_compile import config
    from overlap_compile.inductor_hook import inductor_patches, make_pass

    with config.patch(defer_compute=True):
        assert inductor_patches(make_pass())["reorder_for_peak_memory"] is False
    for off in ({}, {"defer_compute": False}, {"defer_compute": True, "force_template": "baseline"},
                {"defer_compute": True, "enabled": False}):
        with config.patch(**off):
            assert "reorder_for_peak_memory" not in inductor_patches(make_pass()), off


def test_the_option_reads_from_the_environment(monkeypatch):
    """OVERLAP_COMPILE_DEFER_COMPUTE=1 is how the e2e run measures the overlap variant with the
    pass, off by default (run_multigpu.sh's E2E_DEFER_ARGS); a bad value names what is allowed."""
    from overlap_compile import config

    assert config.current().defer_compute is False
    monkeypatch.setenv("OVERLAP_COMPILE_DEFER_COMPUTE", "1")
    assert config.current().defer_compute is True
    monkeypatch.setenv("OVERLAP_COMPILE_DEFER_COMPUTE", "sometimes")
    with pytest.raises(ValueError, match="'defer_compute': got 'sometimes'; allowed: True or False"):
        config.current()
