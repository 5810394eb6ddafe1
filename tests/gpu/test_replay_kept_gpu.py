"""passes/replay_kept.py on 2 GPUs (NCCL): a host-launched inference compile of a
sequence-parallel MLP whose sites the decision keeps runs them as priority_stream's one-chunk op,
replayed from op graphs once the buffers settle, every call equal to eager's (bf16, sizes that are
no tile multiples, new contents each call); the training step's graphs keep Inductor's own calls.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2+ CUDA GPUs, found {torch.cuda.device_count()}"),
]

TOL = 2e-2  # bf16, relative to the result's norm


def _mlp_sequence_parallel(x, w1, w2, group):
    from torch.distributed._functional_collectives import (all_gather_tensor_autograd,
                                                           reduce_scatter_tensor_autograd)

    full = all_gather_tensor_autograd(x, gather_dim=0, group=group)
    return reduce_scatter_tensor_autograd(torch.relu(full @ w1) @ w2, "sum", scatter_dim=0, group=group)


def replay_checks() -> list[str]:
    import functools

    import torch.distributed as dist

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend
    from overlap_compile.runtime import op_graphs

    rank, group = dist.get_rank(), dist.group.WORLD.group_name
    dev = torch.device("cuda", rank)
    torch.manual_seed(0)
    w1 = torch.randn(264, 392, device=dev, dtype=torch.bfloat16) / 16
    w2 = torch.randn(392, 136, device=dev, dtype=torch.bfloat16) / 16
    fails = []
    for phase in ("inference", "train"):
        torch._dynamo.reset()
        op_graphs.clear()
        report = oc.Report()
        fn = torch.compile(functools.partial(_mlp_sequence_parallel, group=group),
                           backend=functools.partial(overlap_backend, report=report))
        x = torch.empty(517, 264, device=dev, dtype=torch.bfloat16, requires_grad=phase == "train")
        with oc.config.patch(min_speedup=1e6, measure_uncertain=False):
            for call in range(6):
                with torch.no_grad():
                    x.copy_(torch.randn(517, 264, device=dev, dtype=torch.bfloat16, generator=torch.Generator(
                        device=dev).manual_seed(10 * rank + call)))
                if phase == "inference":
                    with torch.no_grad():
                        got, want = fn(x, w1, w2), _mlp_sequence_parallel(x, w1, w2, group)
                else:
                    got, want = fn(x, w1, w2), _mlp_sequence_parallel(x, w1, w2, group)
                    got.float().sum().backward()
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                if not err < TOL:
                    fails.append(f"rank {rank} {phase} call {call}: rel err {err:.3g}")
        after = "\n".join(r.after for r in report.records)
        ops = "priority_stream" in after
        if phase == "inference" and not (ops and op_graphs.stats["replayed"] >= 4):
            fails.append(f"rank {rank} inference: priority_stream op in the graph {ops}, op graphs {dict(op_graphs.stats)}")
        if phase == "train" and ops:
            fails.append(f"rank {rank} train: a kept site was replaced in a training graph")
    return fails


def test_inference_compile_replays_kept_sites():
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(replay_checks, 2, timeout_s=300)
