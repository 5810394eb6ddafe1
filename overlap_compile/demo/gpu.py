"""The demo on 2+ GPUs: NCCL, bf16 Llama-3-8B-like block with TP+SP, measured step times.

Per setting ("auto" = the predictor's choices, or a template name to force) the block is compiled
once with the overlap backend (the Report comes from that same compile), checked against eager,
and its forward + backward step timed beside torch.compile's default backend.
"""
from __future__ import annotations

import functools
import json
import statistics

import torch
import torch.distributed as dist

from .common import max_err, setup_block

GPU_SIZES = {"hidden": 4096, "intermediate": 14336, "heads": 32, "batch": 1, "seq": 8192}


def _step_ms(fn, x, iters: int = 10) -> float:
    """Median ms of forward + backward (CUDA events, after warm-up); the slowest rank's."""
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        y = fn(x)
        y.to_local().float().sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    med = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def gpu_worker(settings: list[str], sizes: dict) -> dict:
    import overlap_compile as oc
    from torch._inductor import config as inductor_config

    from ..backend import overlap_backend

    inductor_config.fx_graph_cache = False  # every compile must run the pass, so the Report is complete
    ref, blk, xr, xc = setup_block(sizes, "cuda", torch.bfloat16)
    out = {"device": torch.cuda.get_device_name(), "world": dist.get_world_size(), "torch": torch.__version__,
           "sizes": sizes, "rows": []}
    eager_y = ref(xr)
    scale = max(eager_y.to_local().float().abs().max().item(), 1e-6)
    base_ms = _step_ms(torch.compile(ref), xr)
    out["rows"].append({"setting": "inductor", "ms": base_ms})
    for setting in settings:
        overrides = {} if setting == "auto" else {"force_template": setting}
        report = oc.Report()
        with oc.config.patch(**overrides):
            compiled = torch.compile(blk, backend=functools.partial(overlap_backend, report=report))
            y = compiled(xc)
            y.to_local().float().sum().backward()  # compiles backward (recorded in the same Report)
            err = max_err(y, eager_y) / scale
            ms = _step_ms(compiled, xc)
        out["rows"].append({"setting": setting, "ms": ms, "speedup": base_ms / ms, "rel_err": err,
                            "rewritten": sum(s.rewritten for s in report.sites), "sites": len(report.sites),
                            "report": str(report)})
    return out


def run_gpu_demo(world: int, settings: list[str], json_path: str | None) -> bool:
    from ..testing.multiprocess import run_distributed

    print(f"overlap_compile demo: {world} GPUs over NCCL, bf16 block {GPU_SIZES}, forward + backward.")
    res = run_distributed(gpu_worker, world_size=world, args=(settings, GPU_SIZES), backend="nccl", timeout_s=1800)[0]
    ok = True
    print(f"device {res['device']} x{res['world']}, torch {res['torch']}")
    for r in res["rows"]:
        if r["setting"] == "inductor":
            print(f"{'inductor':>16}: {r['ms']:.3f} ms/step (torch.compile default)")
            continue
        print(r["report"])
        good = r["rel_err"] < 2e-2
        ok &= good
        print(f"{r['setting']:>16}: {r['ms']:.3f} ms/step  {r['speedup']:.3f}x vs inductor  "
              f"({r['rewritten']}/{r['sites']} sites rewritten, output rel err {r['rel_err']:.1e} {'ok' if good else 'BAD'})")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
    return ok
