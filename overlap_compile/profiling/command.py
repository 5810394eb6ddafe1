"""``python -m overlap_compile profile``: measure this machine's HardwareProfile and write the JSON.

    torchrun --nproc-per-node 4 -m overlap_compile profile --out h200.json --name h200

Runs, in order: gemms.py's GEMM table (cuBLAS over shapes.json's operator sets and row splits, and
signal_reorder's Triton kernels); collectives.py's curves for each power-of-two world size up to W
(per call of a CUDA graph, max over ranks), launch cost and GEMM/collective contention;
op_overhead.py's host overhead per template op. build.py makes the profile dict (``nccl_sms`` from
NCCL_MAX_NCHANNELS or defaults) and rank 0 validates and writes it. ``--smoke``: the same code with
tiny sizes on any backend (the tests use the fake one); its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

from ..predictor.profile import COLLECTIVES, KiB, MiB, profile_from_dict, sample_sizes, save_profile
from . import collectives
from .bench import Bench, Progress, agree
from .build import (build_profile, gpu_facts, load_shape_sets, nccl_sms_from_env, peak_tflops, topology_of,
                    world_sizes)
from .collectives import collective_fns, measure_contention, time_collective
from .gemms import gemm_steps, measure_copy_gbps, measure_gemms


def measure(group: Any, device: str, *, sets: dict, sizes: list[int], worlds: list[int], dtype: Any,
            progress: Progress, iters: int = 5, kernels: list[dict] | None = None,
            gemm_limit: int | None = None) -> dict:
    """Everything the profile needs, measured on ``group`` (the world); the same on every rank."""
    import torch.distributed as dist

    bench = Bench(device, iters=iters)
    rank, world = group.rank(), group.size()
    notes: list[str] = []

    # 1. GEMMs (this GPU alone; the Triton kernels only where every rank could run them)
    rows, k_rows, err = measure_gemms(bench, device, sets=sets, dtype=dtype, progress=progress, kernels=kernels,
                                      gemm_limit=gemm_limit, notes=notes)
    if k_rows or err is not None:
        everyone = agree([0.0 if err is not None else 1.0], group, device, op="min")[0] > 0
        if everyone:
            rows += k_rows
            notes.append("Triton kernels measured with templates/signal_reorder/kernels.gemm at full occupancy")
        else:  # keep the cuBLAS table; say why
            why = f"{type(err).__name__}: {err}" if err is not None else "failed on another rank"
            notes.append(f"Triton kernels not measured ({why}); vs_cublas are estimates")
    # every rank timed its own GEMMs: keep the slowest
    agreed = agree([r["ms"] for r in rows], group, device)
    for r, ms in zip(rows, agreed):
        r["ms"] = round(ms, 5)

    # 1b. a copy kernel's bandwidth (the models' price of a pass through memory: predictor.models.hbm_ms)
    copy_gbps = agree([measure_copy_gbps(bench, device, dtype)], group, device, op="min")[0]
    progress.step("copy bandwidth")

    # 2. collectives per world size (sub-groups of the first w ranks)
    curves: dict[str, dict[int, list[tuple[int, float]]]] = {c: {} for c in COLLECTIVES}
    graph_ok = True
    for w in worlds:
        sub = group if w == world else dist.new_group(list(dist.get_process_group_ranks(group))[:w])
        member = rank < w
        for coll in COLLECTIVES:
            pts = []
            for size in sizes:
                ms = -1.0
                # Peer copies are measured between ranks 0 and 1 only: a copy uses one link whatever
                # the world size, and on 4x H200 the symmetric-memory rendezvous over the whole
                # world hung right here (torch 2.11); larger worlds reuse the w=2 curve (noted below).
                if member and not (coll == "copy_engine" and w != min(worlds)):
                    ms = time_collective(bench, coll, size, sub, device, dtype, graph_ok, notes, w)
                    if ms < 0 and coll not in ("copy_engine", "p2p"):
                        raise RuntimeError(f"profile: {coll} of {size} bytes at w={w} could not run")
                    if ms >= 0:
                        graph_ok = graph_ok and collectives.last_graph_ok[0]
                pts.append((size, ms))
                progress.step(f"{coll} w={w} {size // KiB} KiB")
            if member and all(t > 0 for _, t in pts):
                curves[coll][w] = pts
        dist.barrier(group=group)
    if not graph_ok:
        notes.append("CUDA-graph capture of collectives failed: curves are eager back-to-back timings")
    w0 = min(worlds)
    for w in worlds:
        if w != w0 and w0 in curves["copy_engine"]:
            curves["copy_engine"][w] = curves["copy_engine"][w0]
            notes.append(f"copy_engine at w={w}: the w={w0} curve (one peer copy per rank, one link each)")
        elif w not in curves["copy_engine"] and w in curves["p2p"]:
            curves["copy_engine"][w] = curves["p2p"][w]
            notes.append(f"copy_engine at w={w}: the p2p curve (peer copies could not be measured)")

    # 3. launch cost: eager back-to-back small calls vs the same calls in a CUDA graph
    small = collective_fns("all_reduce", 4 * KiB, group, device, dtype)
    eager = bench.time(small, 64)
    g = bench.capture(small, 64)
    ok = agree([0.0 if g is None else 1.0], group, device, op="min")[0] > 0
    graph = bench.time(g.replay, 1) / 64 if ok else eager
    eager, graph = agree([eager, graph], group, device)
    launch = {"eager": max(0.0, eager - graph), "cuda_graph": 0.001 if ok else max(0.0, eager - graph)}
    if not ok:
        notes.append("launch_ms: CUDA-graph capture failed; cuda_graph = eager")
    progress.step("launch cost")

    # 4. contention
    contention = measure_contention(bench, group, device, dtype, notes)
    progress.step("contention")

    # 5. host overhead of each template's op (GPU only: the CPU smoke run has no graphs)
    op_overhead = {"eager": 0.0, "cuda_graph": 0.0, "per_template": {}}
    if bench.cuda:
        from .op_overhead import measure_op_overhead

        op_overhead = measure_op_overhead(bench, group, device, dtype, notes)
    progress.step("op overhead")
    return {"gemm_rows": rows, "curves": curves, "launch_ms": launch, "contention": contention, "notes": notes,
            "op_overhead_ms": op_overhead, "copy_gbps": copy_gbps}


# ---- entry point -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m overlap_compile profile",
                                 description="Measure this machine's hardware profile (run under torchrun on GPUs).")
    ap.add_argument("--out", default=None, help="JSON file to write (default: profile-<gpu>-w<world>.json)")
    ap.add_argument("--name", default=None, help="profile name recorded in reports (default: from the GPU name)")
    ap.add_argument("--shapes", default=None, help="a shapes.json whose gemm_* / allgather_gemm sets to time")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--max-size", type=int, default=512 * MiB, help="largest message in bytes (default 512 MiB)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes on CPU with the already initialised process group (tests)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    started = time.time()
    own_group = False
    if args.smoke:
        if not dist.is_initialized():
            print("profile --smoke: needs an initialised process group", file=sys.stderr)
            return 2
        device, dtype = "cpu", torch.float32
        sets = {"gemm_allreduce": [[64, 32, 16]]}
        sizes = sample_sizes(64 * KiB, 256 * KiB)
    else:
        if not torch.cuda.is_available():
            print("python -m overlap_compile profile: needs CUDA GPUs; run it under torchrun, e.g.\n"
                  "  torchrun --nproc-per-node 4 -m overlap_compile profile --out h200.json", file=sys.stderr)
            return 2
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device, dtype = f"cuda:{local}", getattr(torch, args.dtype)
        if not dist.is_initialized():
            if "RANK" not in os.environ:
                os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
            dist.init_process_group("nccl", device_id=torch.device(device))
            own_group = True
        sets = load_shape_sets(args.shapes)
        sizes = sample_sizes(64 * KiB, args.max_size)
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2 and not args.smoke:
        print("python -m overlap_compile profile: a profile describes a group of 2+ GPUs (collective and "
              "peer-to-peer curves); run it under torchrun with --nproc-per-node 2 or more", file=sys.stderr)
        if own_group:
            from ..runtime import teardown
            teardown.finish()  # barrier, release, destroy; every rank before the store's host leaves
        return 2
    worlds = world_sizes(world) or [world]
    from ..predictor.seed import GPU_KERNELS

    kernels = [] if args.smoke else [dict(k) for k in GPU_KERNELS]
    total = gemm_steps(sets, kernels) + len(worlds) * len(COLLECTIVES) * len(sizes) + 4
    progress = Progress(total, enabled=rank == 0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            res = measure(group, device, sets=sets, sizes=sizes, worlds=worlds, dtype=dtype, progress=progress,
                          iters=args.iters, kernels=kernels)
    finally:
        progress.close()
    notes = res["notes"]
    if args.smoke:
        facts = {"gpu": "smoke test (CPU)", "sm_count": 8, "smem_per_sm": 1024 * KiB, "regs_per_sm": 65536,
                 "peak": peak_tflops("smoke test (CPU)", 8, 8), "mem_gbps": 20.0}
    else:
        facts = gpu_facts(device)
    gpu = facts["gpu"]
    name = args.name or gpu.lower().replace("nvidia ", "").split()[0]
    command = "python -m overlap_compile profile " + " ".join(argv if argv is not None else sys.argv[1:])
    d = build_profile(
        name=name, **facts, gemm_rows=res["gemm_rows"], kernels=kernels, curves=res["curves"],
        nccl_sms={c: 0 for c in COLLECTIVES} if args.smoke else nccl_sms_from_env(notes), launch_ms=res["launch_ms"],
        contention=res["contention"], op_overhead_ms=res["op_overhead_ms"], copy_gbps=res["copy_gbps"],
        topology=topology_of(world, device), notes=notes + [f"world size {world}, took {time.time() - started:.0f}s"],
        command=command.strip(),
    )
    out = args.out or f"profile-{name}-w{world}.json"
    if rank == 0:
        save_profile(d, out)
        p = profile_from_dict(d, source=out)
        print(f"wrote {out}: {p.gpu}, {len(d['gemm']['table'])} GEMMs, collectives at world sizes "
              f"{sorted(p.curves['all_reduce'])}, launch {d['launch_ms']}, contention {d['contention']} "
              f"({time.time() - started:.0f}s)")
    if own_group:
        from ..runtime import teardown
        teardown.finish()  # barrier, release, destroy; every rank before the store's host leaves
    return 0


if __name__ == "__main__":
    sys.exit(main())
