"""moe_fused on GPUs (NCCL): the compiled inference layer with moe_fused forced against the eager
layer, bf16, world sizes 2 and 4, pieces 1/2/4, outputs checked on random inputs."""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2+ CUDA GPUs, found {torch.cuda.device_count()}"),
]


def _check() -> list[str]:
    import functools

    import torch.distributed as dist

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend
    from overlap_compile.demo.moe import ExpertParallelMoE
    from overlap_compile.compile_caches import no_compile_caches

    rank, w = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    fails = []
    for e, tokens in ((8, 1000), (16, 4096)):
        torch.manual_seed(0)
        layer = ExpertParallelMoE(1024, 768, e, 2, 1.25, dist.group.WORLD.group_name, w, rank).cuda().bfloat16()
        torch.manual_seed(1 + rank)
        x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            want = layer(x)
            torch._dynamo.reset()
            report = oc.Report()
            with oc.config.patch(force_template="moe_fused"), no_compile_caches():
                got = torch.compile(layer, backend=functools.partial(overlap_backend, report=report), dynamic=False)(x)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        if not report.sites or not report.sites[0].rewritten:
            fails.append(f"rank {rank} E={e}: not rewritten ({[s.reason for s in report.sites]})")
        if not err < 2e-2:
            fails.append(f"rank {rank} E={e}: rel err {err:.3g}")
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_moe_fused_matches_eager_layer(world):
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(_check, world)
