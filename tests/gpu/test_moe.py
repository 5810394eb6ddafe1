"""moe_fused's CUDA paths against its reference: kernels_nccl.py (NCCL, both ways of cutting the
pieces) and kernels.py (copy engine over symmetric memory, by source; experts by bmm and by the
persistent expert kernel, odd tile counts: C = 96 rows in blocks of 32, H = 256, F = 384; and the
kernel skipping the tiles past the routed rows, zero tails of new lengths each call), fp32 (TF32 off), world 2
and 4, eager (the copy-engine path 20 calls back to back on new inputs: a flag protocol race
shows as a moving error) and captured in a CUDA graph (replayed on new inputs)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2+ CUDA GPUs, found {torch.cuda.device_count()}"),
]

E_LOCAL, CAP, H, F_ = 2, 96, 256, 384


def _kernels_vs_reference() -> list[str]:
    import torch.distributed as dist

    from overlap_compile.templates.moe_fused import kernels, kernels_nccl, reference
    from overlap_compile.templates.plans import MoePlan
    from tests.gpu.moe_slots import zero_tails

    rank, w = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    group = dist.group.WORLD.group_name
    dev = torch.device("cuda", rank)
    fails = []
    why = kernels_nccl.usable(group, dev)
    if why is not None:
        return [f"rank {rank}: the NCCL path cannot run on an NCCL group: {why}"]
    p2p = {"split": "source", "transport": "p2p"}
    why = kernels.usable(group, dev, MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, p2p))
    if why is not None:
        return [f"rank {rank}: the copy-engine path cannot run here: {why}"]
    torch.manual_seed(rank)
    ws = [torch.randn(E_LOCAL, H, F_, device=dev) / 16, torch.randn(E_LOCAL, H, F_, device=dev) / 16,
          torch.randn(E_LOCAL, F_, H, device=dev) / 20]
    fused = {**p2p, "experts": "fused", "tiles": {"block_m": 32, "block_f": 32, "block_h": 64, "block_k": 32}}
    skipping = {**fused, "skip_padding": True}
    for config in ({"split": "source"}, {"pieces": 1}, {"pieces": 3}, p2p, fused, skipping):
        impl = kernels if config.get("transport") == "p2p" else kernels_nccl
        plan = MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, config)
        one_shot = MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, {"pieces": 1})
        for call in range(20 if impl is kernels else 1):
            buf = torch.randn(w * E_LOCAL * CAP, H, device=dev)
            if config is skipping:  # routed rows then zeros, new sizes every call (a stale size skips live tiles)
                zero_tails(buf.view(w, E_LOCAL, CAP, H), call * 8 + rank)
            want = reference.run(buf, *ws, group, one_shot)
            got = impl.run(buf, *ws, group, plan)
            err = ((got - want).norm() / want.norm()).item()
            if not err < 1e-5:
                fails.append(f"rank {rank} {config} eager call {call}: rel err {err:.3g}")
        if impl is kernels:
            kernels.check_errors(dev)
        # CUDA graph: warm up on a side stream, capture, replay on new inputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            impl.run(buf, *ws, group, plan)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = impl.run(buf, *ws, group, plan)
        buf.copy_(torch.randn_like(buf))
        graph.replay()
        want = reference.run(buf, *ws, group, one_shot)
        err = ((captured - want).norm() / want.norm()).item()
        if not err < 1e-5:
            fails.append(f"rank {rank} {config} CUDA graph: rel err {err:.3g}")
    torch.cuda.synchronize()
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_moe_fused_kernels_match_reference(world):
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(_kernels_vs_reference, world)
