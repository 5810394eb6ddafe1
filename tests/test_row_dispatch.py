"""Host-launched dynamic compiles: calls at row counts every rewritten site runs as written go to
torch.compile's own compile of the graph (overlap_compile/row_dispatch.py,
passes/as_written_rows.py).

* the limits a graph's decisions give, and the pick at a call's sizes (no processes);
* torch.compile end to end (2 processes, gloo): the sequence-parallel MLP with its table "as
  written" up to M = 16, forward and backward against eager on both sides of 16, with
  mark_dynamic and with automatic dynamic; the bucketed op is never called at M <= 16, and is at
  M > 16; with the option off the op is called at every M; a warm FX graph cache does not skip the
  dispatch; a second compile that fails leaves the rewritten one running every call.
"""
from __future__ import annotations

import contextlib
import dataclasses

import sympy
import torch
import torch.distributed as dist

from overlap_compile.passes.as_written_rows import leading_as_written
from overlap_compile.row_dispatch import RowDispatch, dispatching, symbol_sources
from overlap_compile.templates.bucketed import BucketTable
from overlap_compile.testing.multiprocess import run_distributed
from tests.test_dynamic_shapes import _compiled, _mlp_sequence_parallel, _step_error


def _table(*entries):
    return BucketTable(kind="gemm_reducescatter", world=2, k=8, n=8, reduce_op="sum", outer=1,
                       buckets=tuple({"max_m": m, "template": t, "config": None} for m, t in entries))


def test_leading_as_written_is_the_first_run_of_as_written_buckets():
    assert leading_as_written(_table((16, "baseline"), (64, "baseline"), (None, "p2p_ring"))) == 64
    assert leading_as_written(_table((16, "p2p_ring"), (None, "baseline"))) == 0
    assert leading_as_written(_table((16, "baseline"), (256, "tile_fused"), (None, "baseline"))) == 16
    assert leading_as_written(_table((None, "baseline"),)) == 0  # nothing rewritten: nothing to avoid


def test_the_pick_binds_symbols_from_int_inputs_then_tensor_dims():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env) as mode:
        x = mode.from_tensor(torch.empty(6, 4), symbolic_context=None)
    sym = sympy.Symbol("s0", integer=True, positive=True)
    sources = {sym: (1, 0)}
    d = RowDispatch([(2 * sym, 16), (sym, 10)], sources)
    assert d.pick([None, torch.empty(8, 3)]) is True     # 2 x 8 = 16 <= 16, 8 <= 10
    assert d.pick([None, torch.empty(9, 3)]) is False    # 18 > 16
    assert d.pick([None, torch.empty(8, 3)]) is True     # remembered
    assert d.calls == {"plain": 2, "overlap": 1}
    assert symbol_sources([3, x]) == {}  # a static fake tensor and an int carry no symbol
    try:
        RowDispatch([(sym, 4)], {})
    except ValueError as e:
        assert "s0" in str(e)
    else:
        raise AssertionError("a symbol no input carries must be refused")


def test_dispatching_calls_the_picked_compile_positionally():
    sym = sympy.Symbol("s0", integer=True, positive=True)
    run = dispatching(lambda *a: ("overlap", a), lambda *a: ("plain", a), RowDispatch([(sym, 4)], {sym: (0, None)}))
    assert run(3, "x") == ("plain", (3, "x")) and run(5, "x") == ("overlap", (5, "x"))
    assert run.row_dispatch.calls == {"plain": 1, "overlap": 1}


@contextlib.contextmanager
def as_written_up_to_16():
    """The decisions' tables edited to "as written" up to M = 16 and p2p_ring (forced) above it."""
    from overlap_compile.passes import symbolic_rewrite

    real = symbolic_rewrite.table_of

    def edited(d, timeout_ms, *rest):
        t = real(d, timeout_ms, *rest)
        ring = next(dict(b, max_m=None) for b in t.buckets if b["template"] == "p2p_ring")
        return dataclasses.replace(t, buckets=({"max_m": 16, "template": "baseline", "config": None}, ring))

    symbolic_rewrite.table_of = edited
    try:
        yield
    finally:
        symbolic_rewrite.table_of = real


def _dispatch_checks(option: bool, dynamic: str) -> dict:
    """Run on every rank: the sequence-parallel MLP compiled host-launched, p2p_ring forced with
    its tables edited to "as written" up to M = 16; lengths on both sides of it, forward and
    backward against eager; which M called the bucketed op and what the Report says."""
    import overlap_compile as oc
    from overlap_compile.compile_caches import no_compile_caches
    from overlap_compile.templates.bucketed import choices_made, clear_choices

    group, rank = dist.group.WORLD.group_name, dist.get_rank()
    out = {"errs": [], "ran": {}}
    # mark_dynamic: one compile at 12; automatic: static at 28, symbolic from 20, then 12, 8, 22
    lengths = (6, 14, 4, 10, 11) if dynamic == "mark_dynamic" else (14, 10, 6, 4, 11)
    with as_written_up_to_16():
        fn, w1, w2, report = _compiled(_mlp_sequence_parallel, group)
        with oc.config.patch(force_template="p2p_ring", whole_graph_as_written=option), no_compile_caches():
            for i, rows in enumerate(lengths):  # M = 2 x rows
                torch.manual_seed(10 * rank + rows)
                x = torch.randn(rows, 16, requires_grad=True)
                if i == 0 and dynamic == "mark_dynamic":
                    torch._dynamo.mark_dynamic(x, 0)
                clear_choices()
                out["errs"].append(_step_error(fn, _mlp_sequence_parallel, x, w1, w2, group))
                out["ran"][2 * rows] = sorted({t for _, t, _ in choices_made()})
        out["report"] = report.table()
    return out


def test_decode_sized_calls_run_torch_compiles_own_graph():
    """With the option on, M <= 16 never calls the bucketed op (forward or backward): those calls
    run torch.compile's own compile; M > 16 runs p2p_ring. Results equal eager's at every M."""
    for dynamic in ("mark_dynamic", "automatic"):
        for r in run_distributed(_dispatch_checks, world_size=2, args=(True, dynamic), timeout_s=600):
            assert max(r["errs"]) < 1e-4, (dynamic, r["errs"])
            assert r["ran"][12] == r["ran"][8] == [], (dynamic, r["ran"])
            assert r["ran"][20] == r["ran"][22] == ["p2p_ring"], (dynamic, r["ran"])
            assert "torch.compile's own compile" in r["report"] and "<= 16" in r["report"], r["report"]


def _warm_cache_checks() -> list:
    """Run on every rank: the same model compiled twice (Dynamo reset between) with Inductor's FX
    graph cache on: what each compile's Report says, and which M called the bucketed op."""
    import functools

    from torch._inductor import config as inductor_config

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend
    from overlap_compile.report import global_report

    from overlap_compile.templates.bucketed import choices_made, clear_choices

    group, rank = dist.group.WORLD.group_name, dist.get_rank()
    out = []
    with as_written_up_to_16():
        for _ in range(2):
            # no Report of its own (that path skips the caches anyway): the process-wide one
            fn, w1, w2, _ = _compiled(_mlp_sequence_parallel, group)
            fn = torch.compile(functools.partial(_mlp_sequence_parallel, group=group), backend=overlap_backend)
            report = global_report()
            report.records.clear()
            ran = {}
            with oc.config.patch(force_template="p2p_ring"), inductor_config.patch(fx_graph_cache=True):
                for i, rows in enumerate((10, 4)):
                    x = torch.randn(rows, 16, requires_grad=True)
                    if i == 0:
                        torch._dynamo.mark_dynamic(x, 0)
                    clear_choices()
                    y = fn(x, w1, w2)
                    y.backward(torch.ones_like(y))
                    ran[2 * rows] = sorted({t for _, t, _ in choices_made()})
            out.append((report.table(), ran))
    return out


def test_a_warm_fx_graph_cache_does_not_skip_the_dispatch():
    """A host-launched dynamic compile skips Inductor's FX graph cache: a hit would skip the pass
    whose record decides the dispatch, and decode-sized calls would run the ops again."""
    for r in run_distributed(_warm_cache_checks, world_size=2, timeout_s=600):
        for table, ran in r:
            assert "torch.compile's own compile" in table, table
            assert ran[8] == [] and ran[20] == ["p2p_ring"], ran


@contextlib.contextmanager
def no_second_compile():
    """Inductor's compile_fx raising where the backend calls it without the pass."""
    from torch._inductor import compile_fx as cfx

    real = cfx.compile_fx

    def only_with_the_pass(gm, inputs, *args, config_patches=None, **kw):
        # the backend's calls carry patches (compile_fx calls itself again without them)
        if config_patches is not None and "post_grad_custom_post_pass" not in config_patches:
            raise RuntimeError("no second compile here")
        return real(gm, inputs, *args, config_patches=config_patches, **kw)

    cfx.compile_fx = only_with_the_pass
    try:
        yield
    finally:
        cfx.compile_fx = real


def _failed_second_compile() -> tuple:
    """Run on every rank: the second compile (the one without the pass) raises; the rewritten
    compile still runs every call, equal to eager, and the Report says why nothing dispatches."""
    import functools

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend

    group = dist.group.WORLD.group_name
    with no_second_compile(), as_written_up_to_16():
        _, w1, w2, report = _compiled(_mlp_sequence_parallel, group)
        fn = torch.compile(functools.partial(_mlp_sequence_parallel, group=group),
                           backend=functools.partial(overlap_backend, report=report))
        errs = []
        with oc.config.patch(force_template="p2p_ring"):
            for i, rows in enumerate((10, 4)):
                x = torch.randn(rows, 16, requires_grad=True)
                if i == 0:
                    torch._dynamo.mark_dynamic(x, 0)
                errs.append(_step_error(fn, _mlp_sequence_parallel, x, w1, w2, group))
    return max(errs), report.table()


def test_a_failed_second_compile_leaves_the_rewritten_one():
    for err, table in run_distributed(_failed_second_compile, world_size=2, timeout_s=600):
        assert err < 1e-4
        assert "torch.compile's own compile failed: RuntimeError: no second compile here" in table, table


def test_without_the_option_the_op_runs_every_call():
    for r in run_distributed(_dispatch_checks, world_size=2, args=(False, "mark_dynamic"), timeout_s=600):
        assert max(r["errs"]) < 1e-4, r["errs"]
        assert r["ran"][12] == r["ran"][8] == ["baseline"], r["ran"]
        assert "torch.compile's own compile" not in r["report"], r["report"]
