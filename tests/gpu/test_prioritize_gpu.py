"""Collectives left as written, run on the high-priority stream beside the GEMMs moved under them
(passes/prioritize.py), on 2 GPUs: a TP/SP MLP (all-gather -> GEMMs -> reduce-scatter) with
every site as written, compiled in default and reduce-overhead mode, forward and backward
against eager over several calls with new inputs (a reader that ran before the join would read
the collective's buffer before NCCL wrote it); the backward's reduce-scatter must be taken.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2+ CUDA GPUs, found {torch.cuda.device_count()}"),
]


def compile_and_compare() -> dict:
    import functools

    import torch.distributed as dist

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend

    rank, w = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    dev = torch.device("cuda", rank)
    c = torch.ops._c10d_functional

    def mlp(x, w1, w2):
        full = c.wait_tensor(c.all_gather_into_tensor(x, w, group))
        h = torch.nn.functional.silu(full @ w1)
        return c.wait_tensor(c.reduce_scatter_tensor(h @ w2, "sum", w, group))

    g = torch.Generator(device=dev).manual_seed(0)
    w1 = (torch.randn(4096, 7168, device=dev, dtype=torch.bfloat16, generator=g) / 64).requires_grad_()
    w2 = (torch.randn(7168, 4096, device=dev, dtype=torch.bfloat16, generator=g) / 84).requires_grad_()
    fails, prioritized = [], []
    for mode in (None, "reduce-overhead"):
        torch._dynamo.reset()
        report = oc.Report()
        with oc.config.patch(templates=(), defer_compute=True, prioritize_deferred=True):
            fn = torch.compile(mlp, backend=functools.partial(overlap_backend, report=report, mode=mode))
            gx = torch.Generator(device=dev).manual_seed(1 + rank)
            for call in range(6):
                x = torch.randn(4093 if call % 2 else 4096, 4096, device=dev, dtype=torch.bfloat16,
                                generator=gx).requires_grad_()
                want = mlp(x, w1, w2)
                want.float().square().sum().backward()
                want_grads = [t.grad.clone() for t in (x, w1, w2)]
                for t in (x, w1, w2):
                    t.grad = None
                got = fn(x, w1, w2)
                got.float().square().sum().backward()
                pairs = [("out", got.detach(), want.detach())] + [
                    (name, t.grad, ref) for name, t, ref in zip(("dx", "dw1", "dw2"), (x, w1, w2), want_grads)]
                for name, a, b in pairs:
                    err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                    if not err < 2e-2:
                        fails.append(f"{mode or 'default'} call {call} {name}: rel err {err:.3g}")
                for t in (x, w1, w2):
                    t.grad = None
        prioritized += [f"{mode or 'default'} {r.name}: {p}" for r in report.records for p in r.prioritized]
    torch.cuda.synchronize()
    return {"fails": fails, "prioritized": prioritized}


def test_prioritized_collectives_equal_eager_in_both_modes():
    from overlap_compile.testing.multiprocess import run_distributed

    for r in run_distributed(compile_and_compare, world_size=2, backend="nccl", timeout_s=600):
        assert not r["fails"], r["fails"]
        for mode in ("default", "reduce-overhead"):
            assert any(p.startswith(f"{mode} backward") and "on the high-priority stream" in p
                       for p in r["prioritized"]), r["prioritized"]
