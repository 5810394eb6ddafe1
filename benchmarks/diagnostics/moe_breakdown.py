"""Where the MoE layer's time goes, kernel by kernel: the layer as written (overlap_compile.demo.moe,
torch.compile default mode, forward, no grad) on one GPU, profiled with torch.profiler.

    python benchmarks/diagnostics/moe_breakdown.py --out $OUT            # every moe shape
    python benchmarks/diagnostics/moe_breakdown.py --shapes MoE-3 --top 20

One GPU, a one-rank NCCL group: the all-to-alls are local copies, so what is left is the layer's
own compute, the part no overlap can hide. Each kernel is put in one role by its name:
``expert_gemm`` (every cuBLAS / CUTLASS GEMM: the router's is a small one), ``routing`` (softmax,
top-k, one-hot cumsum),
``dispatch`` (repeat_interleave, the zeroed buffer, index_add), ``combine`` (the gather of the
slots, weights, sum over choices), ``swiglu`` (silu * up), ``collective`` (NCCL) and ``other``.
Inductor names a fused kernel after the aten ops it holds (``triton_poi_fused_index_add_...``),
which is what the roles read. Prints per shape the share of each role and the top kernels, and
writes moe_breakdown-<device>-torch<v>-<date>.json under --out.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root

# role -> name fragments, first match wins (checked in this order)
ROLES = (
    ("collective", ("nccl", "all_to_all", "alltoall")),
    ("combine", ("index_mul", "mul_sum", "sum_view")),
    ("dispatch", ("index_add", "index_put", "indexfunc", "repeat_interleave", "scatter", "zeros")),
    ("routing", ("softmax", "topk", "one_hot", "cumsum", "sort", "_amax", "exp")),
    ("swiglu", ("silu",)),
    ("expert_gemm", ("gemm", "cutlass", "nvjet", "sm90_", "xmma", "cublas", "bmm")),
)


def one_gpu_group(tool: str, port: int) -> None:
    """A one-rank NCCL group on GPU 0 (the diagnostics that profile one GPU: the all-to-alls become
    local copies); exits naming ``tool`` where there is no GPU."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{tool} needs a GPU (it profiles CUDA kernels)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))


def launched_group(tool: str, port: int) -> None:
    """Under torchrun (WORLD_SIZE set): the launcher's NCCL group, this process on its LOCAL_RANK's
    GPU; otherwise one_gpu_group."""
    if "WORLD_SIZE" not in os.environ:
        return one_gpu_group(tool, port)
    if torch.cuda.device_count() < int(os.environ["WORLD_SIZE"]):
        raise SystemExit(f"{tool}: {os.environ['WORLD_SIZE']} ranks asked, {torch.cuda.device_count()} GPUs here")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)


def role_of(name: str) -> str:
    low = name.lower()
    for role, parts in ROLES:
        if any(p in low for p in parts):
            return role
    return "other"


def profile_case(case: dict, iters: int, device, dtype) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.moe import build_layer, routing_inputs

    group = dist.group.WORLD.group_name
    layer = build_layer(case, 1, 0, group, device, dtype)
    router, x = routing_inputs(layer.router, case, "uniform", 0)
    with torch.no_grad():
        layer.router.copy_(router.to(device=device, dtype=dtype))
    x = x.to(device=device, dtype=dtype)
    fn = torch.compile(layer)
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn(x)
        end.record()
        torch.cuda.synchronize()
        layer_ms = start.elapsed_time(end) / iters
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn(x)
            torch.cuda.synchronize()
    kernels: collections.Counter = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            kernels[ev.name] += ev.device_time / 1e3 / iters  # ms per layer call
    roles: collections.Counter = collections.Counter()
    for name, ms in kernels.items():
        roles[role_of(name)] += ms
    busy = sum(kernels.values())
    return {"shape": case["name"], "sizes": {k: case[k] for k in ("S", "H", "I", "E", "topk")}, "layer_ms": layer_ms,
            "kernel_ms": busy, "roles_ms": dict(roles.most_common()),
            "kernels_ms": [[n, ms, role_of(n)] for n, ms in kernels.most_common()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="all", help="comma list of moe shape names, or all")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--top", type=int, default=12, help="kernels printed per shape")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    one_gpu_group("moe_breakdown", 29531)
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    from benchmarks.shape_sets import shape_set

    shapes = shape_set("moe")
    wanted = None if a.shapes == "all" else set(a.shapes.split(","))
    rows = []
    for case in [s for s in shapes if wanted is None or s["name"] in wanted]:
        torch._dynamo.reset()
        row = profile_case(case, a.iters, device, dtype)
        rows.append(row)
        share = "  ".join(f"{r} {ms:.3f} ({ms / row['kernel_ms']:.0%})" for r, ms in row["roles_ms"].items())
        print(f"{row['shape']}: layer {row['layer_ms']:.3f} ms, kernels {row['kernel_ms']:.3f} ms: {share}", flush=True)
        for name, ms, role in row["kernels_ms"][:a.top]:
            print(f"    {ms:8.3f} ms  {role:12s} {name[:110]}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        tag = torch.cuda.get_device_name().replace(" ", "_")
        path = os.path.join(a.out, f"moe_breakdown-{tag}-torch{torch.__version__.split('+')[0]}-"
                                   f"{datetime.date.today().isoformat()}.json")
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
        print("wrote", path)
    from overlap_compile.runtime import teardown
    teardown.finish()  # barrier, release, destroy; every rank before the store's host leaves


if __name__ == "__main__":
    main()
