"""Sites with a symbolic row count on 2 GPUs (NCCL): the bucketed op (templates/bucketed.py) runs
each template's GPU path at the run's M, or the site as written, and gives the eager result.

* every symbolic graph case (tests/symbolic_cases.py: all-reduce, reduce-scatter dims 0 and 1, a
  sum of GEMMs, all-to-all, all-gather dims 0 and 1) x every template forced, bf16, at M of 1 row
  to a few thousand (odd, below W x tile, not tile multiples);
* torch.compile with the overlap backend and the predictor's own choice (the GPU's profile),
  mark_dynamic and automatic dynamic (two lengths, then a third: no third compile), forward and
  backward of a sequence-parallel MLP, against eager;
* the same under CUDA-graph trees (mode="reduce-overhead"): lengths alternating, each recorded size
  replaying its own choice;
* host-launched: decode-sized lengths that every rewritten site runs as written go to torch.compile's
  own compile of the graph (overlap_compile/row_dispatch.py), never to a bucketed op.
Each check returns its failures as text (testing.multiprocess.assert_no_gpu_failures).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2+ CUDA GPUs, found {torch.cuda.device_count()}"),
]

TEMPLATES = ("p2p_ring", "signal_reorder", "priority_stream", "tile_fused")
LENGTHS = (1, 3, 17, 130, 1031)  # the symbolic length: M is it or a multiple of it
TOL = 2e-2  # bf16, relative to the result's norm
# GEMM sizes per case: K and N not multiples of a tile
SIZES = {"sum_reducescatter": {"n": 392, "k1": 264, "k2": 136}, "allgather_dim0": {"k": 264, "ns": (392, 136)}}


def _device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", dist.get_rank()) if torch.cuda.is_available() else torch.device("cpu")


def graph_case_checks(template: str, dtype: str = "bfloat16") -> list[str]:
    """Every symbolic case with ``template`` forced, run at LENGTHS on this rank's device."""
    import torch.distributed as dist

    from overlap_compile.templates.bucketed import choices_made
    from tests import symbolic_cases as sc

    group, world, rank = dist.group.WORLD.group_name, dist.get_world_size(), dist.get_rank()
    dev, dt = _device(), getattr(torch, dtype)
    fails = []
    for name, case in sc.CASES.items():
        fn, shapes, dyn = case(group, world, **SIZES.get(name, {"n": 392, "k": 264}))
        example = [torch.randn(s, device=dev, dtype=dt) for s in shapes(5)]
        gm, record = sc.rewritten(fn, example, dyn, template)
        site = record.sites[0]
        for s in LENGTHS:
            g = torch.Generator(device=dev).manual_seed(100 * rank + s)
            inputs = [torch.randn(sh, device=dev, dtype=dt, generator=g) / 8 for sh in shapes(s)]
            want, got = fn(*inputs), gm(*inputs)
            want, got = (want if isinstance(want, tuple) else (want,)), (got if isinstance(got, tuple) else (got,))
            for w_, g_ in zip(want, got):
                err = ((g_.float() - w_.float()).norm() / (w_.float().norm() + 1e-6)).item()
                if g_.shape != w_.shape or not err < TOL:
                    fails.append(f"rank {rank} {name}/{template} s={s}: shape {tuple(g_.shape)} vs "
                                 f"{tuple(w_.shape)}, rel err {err:.3g} ({site.template}: {site.reason[:200]})")
        if site.template == "bucketed" and not any(t == template for _, t, _ in choices_made()):
            fails.append(f"rank {rank} {name}/{template}: the op never ran the template: {choices_made()}")
    return fails


@pytest.mark.parametrize("template", TEMPLATES)
def test_symbolic_graph_cases(template):
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(graph_case_checks, 2, args=(template,), timeout_s=300)


def _mlp(x, w1, w2, group):
    from torch.distributed._functional_collectives import (all_gather_tensor_autograd,
                                                           reduce_scatter_tensor_autograd)

    full = all_gather_tensor_autograd(x, gather_dim=0, group=group)
    return reduce_scatter_tensor_autograd(torch.relu(full @ w1) @ w2, "sum", scatter_dim=0, group=group)


def compile_checks(mode: str | None, dynamic: str, lengths: tuple[int, ...], rounds: int = 1,
                   options: dict | None = None, decode: bool = False) -> list[str]:
    """The sequence-parallel MLP compiled with the overlap backend (the predictor decides), under
    ``dynamic`` ("mark_dynamic" | "automatic") and Inductor ``mode``, called at ``lengths`` (rows
    per rank) ``rounds`` times over; forward and gradients against eager; Dynamo's compile count.
    ``options``: overlap_compile options for the compile and the calls. ``decode``: lengths of at
    most 256 tokens that the forward graph's every rewritten site runs as written never call a
    bucketed op (row_dispatch.py), and some such graph exists."""
    import functools

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend

    group, rank = dist.group.WORLD.group_name, dist.get_rank()
    dev, dt = _device(), torch.bfloat16
    torch._dynamo.reset()
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = (torch.randn(1024, 2048, device=dev, dtype=dt, generator=g) / 32).requires_grad_()
    w2 = (torch.randn(2048, 1024, device=dev, dtype=dt, generator=g) / 45).requires_grad_()
    report = oc.Report()
    fn = torch.compile(functools.partial(_mlp, group=group),
                       backend=functools.partial(overlap_backend, report=report, mode=mode))
    frames = counters["stats"]["unique_graphs"]
    fails = []
    from overlap_compile.templates.bucketed import choices_made, clear_choices

    patch, decode_calls = oc.config.patch(**(options or {})), []
    patch.__enter__()
    for r in range(rounds):
        for i, rows in enumerate(lengths):
            clear_choices()
            gx = torch.Generator(device=dev).manual_seed(10 * rank + rows)
            x = torch.randn(rows, 1024, device=dev, dtype=dt, generator=gx).requires_grad_()
            if dynamic == "mark_dynamic" and r == 0 and i == 0:
                torch._dynamo.mark_dynamic(x, 0)
            y = fn(x, w1, w2)
            y.float().sum().backward()
            got = [y.detach().clone(), x.grad, w1.grad.clone(), w2.grad.clone()]
            x2 = x.detach().clone().requires_grad_()
            w1.grad = w2.grad = None
            y2 = _mlp(x2, w1, w2, group)
            y2.float().sum().backward()
            for label, a, b in zip(("out", "dx", "dw1", "dw2"), got, (y2, x2.grad, w1.grad, w2.grad)):
                err = ((a.float() - b.float()).norm() / (b.float().norm() + 1e-6)).item()
                if not err < TOL:
                    fails.append(f"rank {rank} {dynamic}/{mode} rows={rows} round {r} {label}: rel err {err:.3g}")
            w1.grad = w2.grad = None
            if 2 * rows <= 256:
                decode_calls += [(rows, c) for c in choices_made()]
    patch.__exit__(None, None, None)
    if decode:
        # the predictor decides each graph's table: one whose first bucket rewrites is not dispatched
        limits = [lim for rec in report.records if rec.dispatched for _, lim in rec.as_written_up_to or []]
        if not limits:
            fails.append(f"rank {rank}: no graph's calls go to torch.compile's own compile at any M")
        wrong = [(rows, c) for rows, c in decode_calls if 2 * rows <= min(limits, default=0)]
        if wrong:
            fails.append(f"rank {rank}: calls every site runs as written ran the bucketed op: {wrong}")
    compiles = counters["stats"]["unique_graphs"] - frames
    if compiles > (1 if dynamic == "mark_dynamic" else 2):
        fails.append(f"rank {rank} {dynamic}/{mode}: {compiles} compiles")
    symbolic = [s for s in report.sites if s.buckets]
    if len(symbolic) < 4:  # AG and RS, forward and backward
        fails.append(f"rank {rank} {dynamic}/{mode}: symbolic sites {[(s.graph, s.kind, s.reason) for s in report.sites]}")
    if rank == 0:
        print(report, flush=True)
    return fails


@pytest.mark.parametrize("dynamic", ["mark_dynamic", "automatic"])
def test_compile_dynamic_lengths(dynamic):
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(compile_checks, 2, args=(None, dynamic, (1000, 4096, 24576)), timeout_s=400)


def test_compile_dynamic_lengths_under_cuda_graphs():
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(compile_checks, 2, args=("reduce-overhead", "mark_dynamic", (96, 4096, 24576), 3),
                           timeout_s=400)


def test_host_launched_decode_lengths_run_torch_compiles_own_graph():
    """Host-launched, decode-sized lengths that every rewritten site runs as written run
    torch.compile's own compile, larger ones the bucketed op; forward and backward equal eager's."""
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(compile_checks, 2, args=(None, "mark_dynamic", (1000, 8, 4096, 64), 1, None, True),
                           timeout_s=400)
