"""moe_fused's payload-only pipeline (templates/moe_fused/routed.py) on CUDA over NCCL: against the
capacity pipeline (reference.py) with ragged zero tails (a peer that gets nothing, a full expert),
bf16 (torch._grouped_mm) and fp32 (one mm per expert, TF32 off), with and without the saved
intermediates, 10 calls back to back on new fills (the communication stream's buffers reused:
a missing stream dependency shows as a moving error); and the op under CUDA-graph capture,
where it must take the capacity pipeline (it cannot read sizes on the host) and still be right;
the backward's routed rounds (backward_reference.run_routed) against its capacity pipeline.

One GPU: the pipeline at W = 1 (sizes exchange, grouped experts, scatter). Two or more: the
pairwise pieces on the communication stream."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E_LOCAL, CAP, H, F_ = 3, 96, 256, 384
SAVES = ("tokens", "gate", "up", "act")


def _ragged(w: int, rank: int, dev, dtype, call: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(100 * call + rank)
    buf = torch.randn(w, E_LOCAL, CAP, H, generator=g).to(dev, dtype)
    fill = torch.randint(0, CAP + 1, (w, E_LOCAL), generator=g)
    if w > 1:
        fill[(rank + 1) % w] = 0  # one peer gets nothing from me
    fill[rank, 0] = CAP
    for d in range(w):
        for j in range(E_LOCAL):
            buf[d, j, int(fill[d, j]):] = 0
    return buf.view(-1, H)


def _routed_vs_capacity() -> list[str]:
    import torch.distributed as dist

    from overlap_compile.templates.moe_fused import reference, routed
    from overlap_compile.templates.moe_fused.packed import grouped_mm_runs
    from overlap_compile.templates.moe_fused.op import moe_fused  # noqa: F401  (registers the op)
    from overlap_compile.templates.plans import MoePlan

    rank, w = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    group, dev = dist.group.WORLD.group_name, torch.device("cuda", rank)
    fails = []
    link = routed.link_for(group, dev, w)
    if not isinstance(link, routed.StreamLink):
        return [f"rank {rank}: routed.link_for gave {type(link).__name__} on an NCCL group, not StreamLink"]
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        torch.manual_seed(0)
        ws = [(torch.randn(E_LOCAL, H, F_, device=dev) / 16).to(dtype), (torch.randn(E_LOCAL, H, F_, device=dev) / 16).to(dtype),
              (torch.randn(E_LOCAL, F_, H, device=dev) / 20).to(dtype)]
        x = torch.empty(1, H, device=dev, dtype=dtype)
        grouped = grouped_mm_runs(x, ws[0])
        if dtype == torch.bfloat16 and torch.cuda.get_device_capability(dev) >= (9, 0) and not grouped:
            fails.append(f"rank {rank}: torch._grouped_mm not taken for bf16 on sm90")
        for saves in ((), SAVES):
            plan = MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, {"split": "source", "payload": "routed"}, saves=saves)
            cap_plan = MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, {"split": "source"}, saves=saves)
            for call in range(10):
                buf = _ragged(w, rank, dev, dtype, call)
                want = reference.run(buf.float(), *[t.float() for t in ws], group, cap_plan)
                got = routed.run(buf, *ws, group, plan)
                want, got = (want, got) if saves else ([want], [got])
                for i, (g, r) in enumerate(zip(got, want)):
                    err = ((g.float() - r).norm() / r.norm().clamp_min(1e-12)).item()
                    if not err < tol:
                        fails.append(f"rank {rank} {dtype} saves={bool(saves)} call {call} output {i}: rel err {err:.3g}")
        # the op under capture: the capacity pipeline, right on replay with new inputs
        plan = MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, {"split": "source", "payload": "routed"}).to_json()
        buf = _ragged(w, rank, dev, dtype, 50)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.ops.overlap_compile.moe_fused(buf, *ws, group, plan)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            (captured,) = torch.ops.overlap_compile.moe_fused(buf, *ws, group, plan)
        buf.copy_(_ragged(w, rank, dev, dtype, 51))
        graph.replay()
        want = reference.run(buf.float(), *[t.float() for t in ws], group,
                             MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, {"split": "source"}))
        err = ((captured.float() - want).norm() / want.norm()).item()
        if not err < tol:
            fails.append(f"rank {rank} {dtype} CUDA graph: rel err {err:.3g}")
    fails += _routed_backward(rank, w, group, dev)
    torch.cuda.synchronize()
    return fails


def _routed_backward(rank: int, w: int, group: str, dev) -> list[str]:
    """moe_fused_backward's routed rounds against its capacity pipeline, bf16 and fp32, 5 calls."""
    from overlap_compile.templates.moe_fused import backward_reference as bref
    from overlap_compile.templates.plans import MoePlan

    fails = []
    e, c, h, f = E_LOCAL, CAP, H, F_
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        torch.manual_seed(0)
        wts = [(torch.randn(e, f, h, device=dev) / 16).to(dtype), (torch.randn(e, f, h, device=dev) / 16).to(dtype),
               (torch.randn(e, h, f, device=dev) / 20).to(dtype)]
        saved = [torch.randn(e, h, w * c, device=dev).to(dtype), torch.randn(e, w * c, f, device=dev).to(dtype),
                 torch.randn(e, w * c, f, device=dev).to(dtype), torch.randn(e, f, w * c, device=dev).to(dtype)]
        cap_plan = MoePlan("moe_fused", w, e, c, h, f, {"split": "source"}, direction="backward")
        plan = MoePlan("moe_fused", w, e, c, h, f, {"split": "source", "payload": "routed"}, direction="backward")
        for call in range(5):
            grad = _ragged(w, rank, dev, dtype, 200 + call)
            want = bref.run(grad.float(), *[t.float() for t in saved], *[t.float() for t in wts], group, cap_plan)
            got = bref.run_routed(grad, *saved, *wts, group, plan)
            for i, (g, r) in enumerate(zip(got, want)):
                err = ((g.float() - r).norm() / r.norm().clamp_min(1e-12)).item()
                if not err < tol:
                    fails.append(f"rank {rank} backward {dtype} call {call} output {i}: rel err {err:.3g}")
    return fails


@pytest.mark.parametrize("world", [1, 2])
def test_routed_pipeline_matches_the_capacity_pipeline(world):
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(_routed_vs_capacity, world)
