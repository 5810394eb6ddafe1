"""Host overhead of a template op, measured for the profile (``op_overhead_ms``).

A rewritten site runs one Python custom op (dispatch, plan decoding, stream and event work) where
the baseline ran a GEMM and a collective. Host-launched, that costs time the GPU may wait for;
replayed from a CUDA graph it costs nothing. Per GPU-implemented template, on a small
all-reduce site (so the GPU time is short and the host time shows)::

    overhead = (eager - graph)_template - (eager - graph)_sequential

per call, ranks synchronised before every call (as a step of a model is), the MAX over ranks.
The predictor adds it to every candidate of that template when kernels are host-launched.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

SITE = ("gemm_allreduce", 1024, 1024, 1024)  # kind, M, N, K: microseconds of GPU work


def _eager_and_graph_ms(fn: Callable[[], Any], bench: Any, group: Any, iters: int = 20) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    def per_call(call: Callable[[], Any]) -> float:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            dist.barrier(group=group)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            call()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)

    eager = per_call(fn)
    g = bench.capture(fn, 1)
    return eager, (per_call(g.replay) if g is not None else eager)


def measure_op_overhead(bench: Any, group: Any, device: str, dtype: Any, notes: list[str]) -> dict[str, Any]:
    """{"eager": max over templates, "cuda_graph": 0.0, "per_template": {name: ms}} (ms per op)."""
    import torch
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from .. import templates
    from ..config import current
    from ..passes.decide import Decision
    from ..passes.find import find
    from ..passes.rewrite import rewrite
    from ..testing.patterns import gemm_then_collective

    kind, m, n, k = SITE
    world, name = group.size(), group.group_name
    torch.manual_seed(7 + group.rank())
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    seq = gemm_then_collective(kind, name, world)
    seq_eager, seq_graph = _eager_and_graph_ms(lambda: seq(a, b), bench, group)
    per_template: dict[str, float] = {}
    for tname in templates.names():
        spec = templates.get_spec(tname)
        ok = 1.0
        try:
            gm = make_fx(seq, tracing_mode="fake")(a, b)
            (match,) = find(gm.graph)
            if not getattr(spec, "gpu_implemented", True) or spec.supports(match):
                ok = 0.0
            else:
                rewrite(gm.graph, [Decision(match, tname, spec.default_config(match), "profile", [])],
                        current().signal_timeout_ms)
                gm.recompile()
        except Exception as e:  # a template that cannot build here is simply not measured
            ok = 0.0
            notes.append(f"op_overhead: {tname} not measured ({type(e).__name__}: {e})")
        flag = torch.tensor([ok], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        if flag.item() == 0:
            continue
        eager, graph = _eager_and_graph_ms(lambda: gm(a, b), bench, group)
        t = torch.tensor([max(0.0, (eager - graph) - (seq_eager - seq_graph))], device=device,
                         dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        per_template[tname] = round(float(t.item()), 4)
    return {"eager": max(per_template.values(), default=0.0), "cuda_graph": 0.0, "per_template": per_template}
