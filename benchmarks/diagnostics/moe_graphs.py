"""The post-grad graphs of demo.moe's expert-parallel layer's training step, as the overlap pass
sees them on this machine's device, with moe_fused forced: the finder's input and its verdict per
section. A GPU compile's graphs can differ from a CPU compile's (device-specific decompositions),
so a section the CPU tests find may be missed on GPUs; this shows why.

    python benchmarks/diagnostics/moe_graphs.py --out $OUT          # every GPU's rank (NCCL), else gloo
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def worker(out: str, eager_first: bool = False) -> None:
    import torch.distributed as dist

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend
    from overlap_compile.demo.moe import ExpertParallelMoE
    from overlap_compile.compile_caches import no_compile_caches

    rank, w = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    layer = ExpertParallelMoE(1024, 768, 8, 2, 1.25, dist.group.WORLD.group_name, w, rank).to(dev, dtype)
    x = torch.randn(1000, 1024, device=dev, dtype=dtype)

    def step(fn) -> None:
        layer.zero_grad()
        fn(x.clone().requires_grad_()).float().pow(2).mean().backward()

    if eager_first:  # as tests/gpu/test_moe_backward.py does: the eager layer's gradients first
        step(layer)
    report = oc.Report()
    with oc.config.patch(force_template="moe_fused", force_config={"split": "source"}), no_compile_caches():
        torch._dynamo.reset()
        step(torch.compile(layer, backend=functools.partial(overlap_backend, report=report)))
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        for name, record in report.graphs.items():
            with open(os.path.join(out, f"moe-{dev.type}-w{w}{'-eager-first' if eager_first else ''}-{name}.py"), "w") as f:
                f.write(record.before)
        for s in report.sites:
            print(s.graph, s.kind, "rewritten" if s.rewritten else "left", s.reason[:400])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--eager-first", action="store_true", help="run the eager layer's step first, as the GPU test does")
    a = ap.parse_args()
    from overlap_compile.testing.multiprocess import run_distributed

    cuda = torch.cuda.is_available()
    world = a.world or (torch.cuda.device_count() if cuda else 2)
    run_distributed(worker, world_size=world, backend="nccl" if cuda else "gloo", timeout_s=600, args=(a.out, a.eager_first))


if __name__ == "__main__":
    main()
