"""passes/prioritize.py and templates/priority_stream/collective_op.py: a collective that
defer_compute gave GEMMs to becomes prioritized_collective + prioritized_join (the join where the
wait was, its readers after it); collectives with no GEMM under them, other kinds, other devices
and collectives read other than through one wait stay; the Report and the forecast say so; a
compiled TP MLP's forward and backward over gloo equal eager's with the ops in its code."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from overlap_compile.passes.defer_compute import defer_independent_compute
from overlap_compile.passes.prioritize import prioritize_deferred
from overlap_compile.templates.priority_stream import collective_op

from .test_defer_compute import _backward_like, _chain, _names, _node, _placeholder

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
ops = torch.ops.overlap_compile


def test_a_collective_with_gemms_under_it_runs_prioritized_and_its_readers_follow_the_join():
    g, n = _backward_like()
    done = defer_independent_compute(g, flops_per_byte=float("inf"))
    assert [(d.collective, d.gemms) for d in done] == [("reduce_scatter_tensor_default", 1)]
    got = prioritize_deferred(g, done)  # meta: what oc.plan plans, as on GPUs
    assert [(p.collective, p.done) for p in got] == [("reduce_scatter_tensor_default", True)]
    order = [x for x in g.nodes if x.op == "call_function"]
    start = next(x for x in order if x.target is ops.prioritized_collective.default)
    join = next(x for x in order if x.target is ops.prioritized_join.default)
    assert start.args[1:] == ("reduce_scatter_tensor", "sum", 2, "0")
    assert start.args[0].name == "mm_default_2"  # the data gradient still feeds it
    names = _names(g)
    # the weight gradient moved under it stays between the start and the join
    assert names.index(start.name) < names.index("mm_default") < names.index(join.name)
    # the reader of the old wait reads the op's result, after the join
    relu = next(x for x in order if x.target is aten.relu.default)
    assert relu.args[0] is start and names.index(join.name) < names.index(relu.name)
    assert not any(x.target in (c10d.reduce_scatter_tensor.default, c10d.wait_tensor.default)
                   and x.args[0] in (start,) for x in order)
    # the all-gather had no GEMM under it: left as written, with its own wait
    assert "all_gather_into_tensor_default" in names
    assert sum(x.target is c10d.wait_tensor.default for x in order) == 1
    assert join.op == "call_function" and join.is_impure()  # dead-code elimination keeps it
    g.lint()


def test_what_is_left_on_the_process_group_stream_says_why():
    g, _ = _backward_like()
    done = defer_independent_compute(g, flops_per_byte=float("inf"))
    (p,) = prioritize_deferred(g, done, devices=("cuda",))
    assert not p.done and "tensors on meta (only cuda)" in p.describe()
    assert not any(x.target is ops.prioritized_collective.default for x in g.nodes)

    g = fx.Graph()
    d = 64
    x, dy, w = (_placeholder(g, s, (d, d)) for s in ("x", "dy", "w"))
    dw = _node(g, aten.mm.default, (x, dy), (d, d))
    dx = _node(g, aten.mm.default, (dy, w), (d, d))
    a2a = _node(g, c10d.all_to_all_single.default, (dx, [32, 32], [32, 32], "0"), (d, d))
    a2a_w = _node(g, c10d.wait_tensor.default, (a2a,), (d, d))
    g.output((dw, a2a_w))
    done = defer_independent_compute(g, flops_per_byte=float("inf"))
    (p,) = prioritize_deferred(g, done, devices=("meta",))
    assert "all_to_all_single is not taken; allowed: all_gather_into_tensor, reduce_scatter_tensor, all_reduce" \
        in p.describe()

    g = fx.Graph()
    x, dy, w = (_placeholder(g, s, (d, d)) for s in ("x", "dy", "w"))
    dw = _node(g, aten.mm.default, (x, dy), (d, d))
    rs, rs_w, ag, ag_w, out = _chain(g, d, dy, w)
    peek = _node(g, aten.sum.default, (rs,), ())  # reads the collective's result without its wait
    g.output((dw, out, peek))
    done = defer_independent_compute(g, flops_per_byte=float("inf"))
    got = prioritize_deferred(g, done, devices=("meta",))
    assert [p.refusal for p in got] == ["its result is read other than through one wait"]


def test_out_shape_follows_the_functional_ops_and_bad_kinds_are_named():
    assert collective_op.out_shape((6, 4), "all_gather_into_tensor", 3) == [18, 4]
    assert collective_op.out_shape((6, 4), "reduce_scatter_tensor", 3) == [2, 4]
    assert collective_op.out_shape((6, 4), "all_reduce", 3) == [6, 4]
    with pytest.raises(ValueError, match="kind 'broadcast' is not supported; allowed"):
        collective_op.out_shape((6, 4), "broadcast", 2)


def test_it_is_off_unless_asked_for_and_never_without_defer_compute():
    from overlap_compile import config

    with config.patch():
        assert not config.current().prioritizes_deferred
    with config.patch(prioritize_deferred=True, defer_compute=True):
        assert config.current().prioritizes_deferred
    with config.patch(prioritize_deferred=True):  # defer_compute is off by default
        assert not config.current().prioritizes_deferred


def test_the_forecast_counts_a_prioritized_sites_credit_as_hidden():
    from overlap_compile.report import forecast

    site = {"graph": "backward", "kind": "gemm_reducescatter", "predicted_ms": {"baseline": 1.0},
            "chosen_ms": 1.0, "comm_ms": 0.3, "hidden_ms": 0.2, "template": "baseline"}
    left = forecast([site])["all"]
    assert left["hidden_ms"] == 0 and left["deferred_ms"] == pytest.approx(0.2)
    prio = forecast([site | {"prioritized": True}])["all"]
    assert prio["hidden_ms"] == pytest.approx(0.2) and prio["deferred_ms"] == 0


def _compiled_mlp_with_prioritized_collectives() -> dict:
    """test_defer_compute's TP MLP with collectives on CPU tensors taken by prioritize.py."""
    from overlap_compile.passes import prioritize

    from .test_defer_compute import _tp_mlp_backward_code

    prioritize.DEVICES = ("cpu", "cuda")
    return _tp_mlp_backward_code(prioritize_deferred=True)


@pytest.mark.slow
def test_compiled_tp_mlp_with_prioritized_collectives_equals_eager():
    """Forward and backward equal eager's; in the generated backward the prioritized collective
    starts, a GEMM runs, then its join (the ops keep Inductor's order); the Report says so."""
    from overlap_compile.testing.multiprocess import run_distributed

    for r in run_distributed(_compiled_mlp_with_prioritized_collectives, world_size=2, timeout_s=300):
        assert r["out_err"] < 1e-4 and max(r["grad_errs"]) < 1e-4, r
        assert any(p.startswith("backward") and "on the high-priority stream" in p for p in r["prioritized"]), r
        assert any(r["flags"]), r
        ev = r["events"]
        assert any(ev[i] == "start" and "mm" in ev[i + 1:ev.index("wait", i)] for i in range(len(ev))
                   if "wait" in ev[i:]), ev
