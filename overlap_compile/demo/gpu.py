"""The demo on 2+ GPUs: NCCL, bf16 Llama-3-8B-like block with TP+SP, measured step times."""
from __future__ import annotations

import json
import statistics

import torch
import torch.distributed as dist

from .run import _max_err, _setup

GPU_SIZES = {"hidden": 4096, "intermediate": 14336, "heads": 32, "batch": 1, "seq": 8192}


def _step_ms(fn, x, iters: int = 10) -> float:
    """Median ms of forward + backward, CUDA events, after warm-up."""
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
    return statistics.median(times)


def gpu_worker(settings: list[str], sizes: dict) -> dict:
    import overlap_compile as oc

    ref, blk, xr, xc = _setup(sizes, "cuda", torch.bfloat16)
    out = {"device": torch.cuda.get_device_name(), "world": dist.get_world_size(), "torch": torch.__version__, "rows": []}
    eager_y = ref(xr)
    inductor = torch.compile(ref)
    base_ms = _step_ms(inductor, xr)
    out["rows"].append({"setting": "inductor", "ms": base_ms})
    for setting in settings:
        overrides = {} if setting == "auto" else {"force_template": setting}
        report = oc.explain(blk, xc, backward=True, **overrides)
        with oc.config.patch(**overrides):
            compiled = torch.compile(blk, backend="overlap")
            y = compiled(xc)
            err = _max_err(y, eager_y) / max(eager_y.to_local().float().abs().max().item(), 1e-6)
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
        if r["setting"] != "inductor":
            print(r["report"])
            good = r["rel_err"] < 2e-2
            ok &= good
            print(f"{r['setting']:>16}: {r['ms']:.3f} ms/step  {r['speedup']:.3f}x vs inductor  "
                  f"({r['rewritten']}/{r['sites']} sites rewritten, rel err {r['rel_err']:.1e} {'ok' if good else 'BAD'})")
        else:
            print(f"{'inductor':>16}: {r['ms']:.3f} ms/step")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
    return ok
