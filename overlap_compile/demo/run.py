"""``python -m overlap_compile demo``: the main job, on whatever the machine has.

* 2+ GPUs: one process per GPU (up to 4) over NCCL, a bf16 Llama-style block with TP+SP,
  compiled with the default inductor backend and with ``backend="overlap"``; prints the Report,
  the correctness check and the measured step times.
* otherwise: 2 CPU processes over gloo, a small block; prints the Report of the predictor's
  choices, then runs each template forced on every site it supports, and says whether outputs
  and gradients match eager; then plans the Llama-3-8B block at its real size as 2x H200 would
  compile it (``overlap_compile.plan``, meta tensors) and forecasts how much of its
  communication the pass hides.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from .common import max_err, setup_block


def check_against_eager(setting: str, sizes: dict, device: str = "cpu", dtype: str = "float32") -> dict:
    """Run on every rank: compile the block once with the overlap pass under ``setting`` ("auto" =
    the predictor, or a template name to force), run forward + backward, compare outputs and all
    gradients with eager; return the errors and what the pass did (from that same compile)."""
    import functools

    import overlap_compile as oc

    from ..backend import overlap_backend
    from ..compile_caches import no_compile_caches

    ref, blk, xr, xc = setup_block(sizes, device, getattr(torch, dtype))
    yr = ref(xr)
    yr.to_local().float().sum().backward()
    overrides = {} if setting == "auto" else {"force_template": setting}
    report = oc.Report()
    start = time.perf_counter()
    with oc.config.patch(**overrides), no_compile_caches():
        y = torch.compile(blk, backend=functools.partial(overlap_backend, report=report))(xc)
        y.to_local().float().sum().backward()
    seconds = time.perf_counter() - start
    grads = [max_err(xc.grad, xr.grad)] + [max_err(p.grad, q.grad) for p, q in zip(blk.parameters(), ref.parameters())]
    return {"setting": setting, "report": str(report), "out_err": max_err(y, yr), "grad_err": max(grads),
            "rewritten": sum(s.rewritten for s in report.sites), "n_sites": len(report.sites), "seconds": seconds,
            "sites": [(s.graph, s.kind, s.template, s.config) for s in report.sites],
            "after": {r.name: r.after for r in report.records}}


CPU_SIZES = {"hidden": 64, "intermediate": 128, "heads": 4, "batch": 2, "seq": 32}
MOE_SIZES = {"hidden": 32, "ffn": 48, "experts": 8, "top_k": 2, "tokens": 64}


def check_moe_inference(setting: str, sizes: dict) -> dict:
    """Run on every rank: the expert-parallel MoE layer (demo.moe) compiled for inference with the
    overlap pass under ``setting``, against eager (MoE sections are rewritten in inference only)."""
    import functools

    import overlap_compile as oc

    from ..backend import overlap_backend
    from ..compile_caches import no_compile_caches
    from .moe import ExpertParallelMoE

    torch.manual_seed(0)
    layer = ExpertParallelMoE(sizes["hidden"], sizes["ffn"], sizes["experts"], sizes["top_k"], 1.25,
                              dist.group.WORLD.group_name, dist.get_world_size(), dist.get_rank())
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(sizes["tokens"], sizes["hidden"])
    overrides = {} if setting == "auto" else {"force_template": setting}
    report = oc.Report()
    start = time.perf_counter()
    with torch.no_grad():
        want = layer(x)
        with oc.config.patch(**overrides), no_compile_caches():
            got = torch.compile(layer, backend=functools.partial(overlap_backend, report=report))(x)
    return {"setting": setting, "report": str(report), "out_err": max_err(got, want), "grad_err": 0.0,
            "rewritten": sum(s.rewritten for s in report.sites), "n_sites": len(report.sites),
            "seconds": time.perf_counter() - start}


# the Llama-3-8B TP+SP block of shapes.json's e2e set, planned at its real size on the CPU demo
PLAN_SIZES = {"hidden": 4096, "intermediate": 14336, "heads": 32, "batch": 1, "seq": 8192}


def plan_at_scale(world: int, profile: str, mode: str, sizes: dict = PLAN_SIZES) -> "object":
    """The Report of the demo's block at ``sizes`` over ``world`` ranks (training step), as a GPU
    compile with ``profile`` in ``mode`` would decide it: planned on the meta device over a fake
    process group (``overlap_compile.plan``), no GPU and no memory needed."""
    import overlap_compile as oc

    from ..testing.fake_group import fake_process_group
    from .common import meta_block

    with fake_process_group(world):
        block, x = meta_block(sizes, world)
        return oc.plan(block, x, backward=True, mode=mode, profile=profile)


def print_plan(world: int, profile: str = "h200") -> None:
    from ..report import forecast_line

    for mode in ("default", "reduce-overhead"):
        report = plan_at_scale(world, profile, mode)
        print(f"=== planned on this CPU: the Llama-3-8B block {PLAN_SIZES} on {world}x {profile.upper()}, "
              f"torch.compile mode={mode!r} (profile {profile!r}; sites inside the model error are measured "
              f"on GPUs) ===")
        print(report)
        print(forecast_line(report.forecast()["all"]) + "\n")


def run_cpu_demo(world: int, settings: list[str]) -> bool:
    from ..testing.multiprocess import run_distributed

    print(f"overlap_compile demo: no 2+ GPUs here; {world} CPU processes over gloo, "
          f"Llama-style block {CPU_SIZES} with TP+SP (DTensor), forward + backward.\n")
    from .. import templates

    ok = True
    for setting in settings:
        moe_only = setting != "auto" and templates.get_spec(setting).kinds == ("moe",)
        if moe_only:  # its sites live in MoE layers: show it on one (inference), not on the Llama block
            print(f"(force_template={setting!r}: on the expert-parallel MoE layer {MOE_SIZES}, inference)")
            results = run_distributed(check_moe_inference, world_size=world, args=(setting, MOE_SIZES), timeout_s=900)
        else:
            results = run_distributed(check_against_eager, world_size=world, args=(setting, CPU_SIZES), timeout_s=900)
        r0 = results[0]
        err = max(r["out_err"] for r in results)
        gerr = max(r["grad_err"] for r in results)
        good = err <= 1e-4 and gerr <= 1e-4
        ok &= good
        title = "predictor's choice" if setting == "auto" else f"force_template={setting!r}"
        print(f"=== {title}: {r0['rewritten']}/{r0['n_sites']} sites rewritten ===")
        print(r0["report"])
        grads = "inference: no gradients" if moe_only else f"max |grad - eager| = {gerr:.2e}"
        print(f"max |out - eager| = {err:.2e}, {grads} -> {'MATCH' if good else 'MISMATCH'}"
              f"  (compile + run {r0['seconds']:.1f}s)\n")
    print_plan(world)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m overlap_compile demo")
    ap.add_argument("--world", type=int, default=None, help="processes (default: GPUs up to 4, else 2 on CPU)")
    ap.add_argument("--settings", default=None,
                    help="comma list of 'auto' and template names to force (default: auto + every implemented template)")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    args = ap.parse_args(argv)
    from .. import templates

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # On GPUs each setting is a full compile of a large block: the predictor's choice by default.
    default = ["auto"] if gpus >= 2 else ["auto", *templates.names()]
    settings = args.settings.split(",") if args.settings else default
    if gpus >= 2:
        from .gpu import run_gpu_demo

        ok = run_gpu_demo(args.world or min(gpus, 4), settings, args.json)
    else:
        ok = run_cpu_demo(args.world or 2, settings)
    checked = "outputs" if gpus >= 2 else "outputs and gradients"
    print(f"demo: all {checked} match eager" if ok else "demo: MISMATCH against eager")
    return 0 if ok else 1
