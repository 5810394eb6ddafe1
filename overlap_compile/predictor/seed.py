"""The PROVISIONAL built-in profiles, written from the numbers measured so far.

    python -m overlap_compile.predictor.seed        # rewrites predictor/profiles/{h200,h100,cpu-gloo}.json

``h200``: 4x H200 (NVLink NV18), from ANCHORS.md and DESIGN.md, estimates marked in ``notes``;
``h100``: the same interconnect, GEMMs 6% slower (an estimate); ``cpu-gloo``: plausible numbers for
CPU processes over gloo. The built-in ``h200.json`` is this seed *plus* measurements folded in by
``benchmarks/fitting/calibrate_profile.py``: re-seeding overwrites them, so re-run the calibration.
"""
from __future__ import annotations

import json
import math
import os

from .curves import traffic_factor
from .profile import BUILTIN_DIR, FORMAT, KiB, MiB, sample_sizes, save_profile

SEED_SOURCE = "seeded from ANCHORS.md, to be replaced by `python -m overlap_compile profile`"

# Knots (bytes, ms) at world size 4 on H200. Large sizes: ANCHORS.md / DESIGN.md (medians,
# host-launched); small sizes: estimated NVLink latencies (marked in notes).
H200_W4_KNOTS = {
    # AR: 64 MiB 0.402-0.418, 128 MiB 0.721-0.744, 512 MiB: algbw 214 GB/s -> 2.51 ms
    "all_reduce": [(64 * KiB, 0.025), (1 * MiB, 0.035), (8 * MiB, 0.075), (32 * MiB, 0.23), (64 * MiB, 0.41),
                   (128 * MiB, 0.73), (512 * MiB, 2.51)],
    # RS: 64 MiB 0.241-0.257, 128 MiB 0.430-0.412, 512 MiB: algbw ~376 GB/s -> 1.43 ms
    "reduce_scatter": [(64 * KiB, 0.022), (1 * MiB, 0.030), (8 * MiB, 0.055), (32 * MiB, 0.15), (64 * MiB, 0.25),
                       (128 * MiB, 0.42), (512 * MiB, 1.43)],
    # AG (output bytes): algbw ~376 GB/s like RS (DESIGN.md)
    "all_gather": [(64 * KiB, 0.022), (1 * MiB, 0.030), (8 * MiB, 0.055), (32 * MiB, 0.15), (64 * MiB, 0.25),
                   (128 * MiB, 0.42), (512 * MiB, 1.43)],
    # A2A: not measured; RS's traffic (3/4 of the buffer leaves each rank) plus 10%
    "all_to_all": [(64 * KiB, 0.024), (1 * MiB, 0.033), (8 * MiB, 0.060), (32 * MiB, 0.165), (64 * MiB, 0.275),
                   (128 * MiB, 0.46), (512 * MiB, 1.57)],
    # P2P (NCCL send/recv, every rank to its ring neighbour at once): not measured, ~345 GB/s
    "p2p": [(64 * KiB, 0.018), (1 * MiB, 0.022), (8 * MiB, 0.045), (64 * MiB, 0.21), (512 * MiB, 1.55)],
    # copy engine peer copy: not measured, ~375 GB/s, lower fixed cost
    "copy_engine": [(64 * KiB, 0.010), (1 * MiB, 0.014), (8 * MiB, 0.035), (64 * MiB, 0.19), (512 * MiB, 1.42)],
}

# cuBLAS bf16, H200 (ANCHORS.md; medians of the repeated measurements of one shape)
H200_GEMMS = [
    ((8192, 4096, 2752), 0.276),  # 0.281, 0.276, 0.272
    ((8192, 8192, 7168), 1.324),
    ((8192, 8192, 4096), 0.76),  # 0.70-0.75 (DESIGN), 0.752 (graph), 0.821
    ((4096, 8192, 2048), 0.213),  # 0.215, 0.211
]

GPU_KERNELS = [
    # The configs templates/signal_reorder/kernels.py times on Hopper. DESIGN.md: TMA, 128x256x64,
    # 3 stages, 8 warps reached 0.89-1.06x of cuBLAS (1 block/SM); the others are estimates.
    {"name": "128x256", "block_m": 128, "block_n": 256, "block_k": 64, "stages": 3, "warps": 8,
     "regs_per_thread": 232, "vs_cublas": 0.95},
    {"name": "256x128", "block_m": 256, "block_n": 128, "block_k": 64, "stages": 3, "warps": 8,
     "regs_per_thread": 232, "vs_cublas": 0.93},
    {"name": "128x128", "block_m": 128, "block_n": 128, "block_k": 64, "stages": 4, "warps": 8,
     "regs_per_thread": 168, "vs_cublas": 0.85},
]


def _interp(knots: list[tuple[int, float]], size: int) -> float:
    if size <= knots[0][0]:
        return knots[0][1]
    for (b0, t0), (b1, t1) in zip(knots, knots[1:]):
        if size <= b1:
            f = (math.log(size) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
    return knots[-1][1] * size / knots[-1][0]


def _curves(knots_w4: dict, worlds=(2, 4)) -> dict:
    out = {}
    for coll, knots in knots_w4.items():
        per = {}
        for w in worlds:
            scale = traffic_factor(coll, w) / traffic_factor(coll, 4)
            floor = knots[0][1]
            per[str(w)] = [[s, round(floor + (_interp(knots, s) - floor) * scale, 5)] for s in sample_sizes()]
        out[coll] = per
    return out


def gpu_profile(name: str, gpu: str, gemm_scale: float) -> dict:
    table = [{"m": m, "n": n, "k": k, "dtype": "bfloat16", "config": None, "ms": round(t * gemm_scale, 4)}
             for (m, n, k), t in H200_GEMMS]
    return {
        "format": FORMAT,
        "name": name,
        "gpu": gpu,
        "source": SEED_SOURCE,
        "provisional": True,
        "roofline_only": False,
        "notes": [
            "GEMM table: cuBLAS bf16 medians from ANCHORS.md (H200)" + ("" if gemm_scale == 1 else
                                                                      f", times x{gemm_scale} for H100 (estimate)"),
            "collectives at world size 4: all_reduce/reduce_scatter from ANCHORS.md (64 and 128 MiB) and DESIGN.md "
            "(512 MiB algbw); all_gather = reduce_scatter's algbw (DESIGN.md); sizes <= 8 MiB, all_to_all, p2p and "
            "copy_engine are estimates",
            "world size 2: the world-size-4 curves with the bandwidth part scaled by the ring traffic factor",
            "nccl_sms, launch_ms, contention: estimates (ANCHORS.md: a normal-priority comm stream was starved)",
            "kernels: 128x256 from DESIGN.md (0.89-1.06x cuBLAS), 256x128 and 128x128 estimates",
        ],
        "sm_count": 132,
        "smem_per_sm": 228 * KiB,
        "regs_per_sm": 65536,
        "max_blocks_per_sm": 32,
        "gemm": {
            "peak_tflops": {"bfloat16": 989.0, "float16": 989.0, "float32": 60.0},
            # 2*8192*8192*4096 / 0.76 ms = 723 TFLOP/s = 0.73 of peak
            "efficiency": {"bfloat16": round(0.72 / gemm_scale, 3), "float16": round(0.72 / gemm_scale, 3),
                           "float32": 0.8},
            "mem_gbps": 4800.0 if "H200" in gpu else 3350.0,
            "floor_ms": 0.006,
            "table": table,
            "kernels": GPU_KERNELS,
        },
        "collectives": _curves(H200_W4_KNOTS),
        "nccl_sms": {"all_reduce": 24, "reduce_scatter": 16, "all_gather": 16, "all_to_all": 16, "p2p": 8,
                     "copy_engine": 0},
        "launch_ms": {"eager": 0.015, "cuda_graph": 0.002},
        "contention": {"gemm_slowdown": 1.12, "gemm_slowdown_reserved": 1.03, "comm_slowdown": 1.08},
        "topology": {"gpus_per_node": 4, "peer_access": True, "inter_node_gbps": 50.0, "inter_node_latency_ms": 0.02},
    }


def cpu_gloo_profile() -> dict:
    """CPU processes over gloo on one host: ~1.5 GB/s loopback, 80 us per call; numpy-class GEMMs.
    Tile kernels are the reference decompositions (Python loops over tiles): slow."""
    curves = {}
    for coll in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p", "copy_engine"):
        per = {}
        for w in (2, 4, 8):
            lat = 0.08 * (1 + 0.25 * math.log2(w))
            per[str(w)] = [[s, round(lat + traffic_factor(coll, w) * s / 1.5e9 * 1e3, 5)] for s in sample_sizes()]
        curves[coll] = per
    return {
        "format": FORMAT,
        "name": "cpu-gloo",
        "gpu": "CPU (gloo)",
        "source": "estimates for CPU processes over gloo (tests and the CPU demo)",
        "provisional": True,
        "roofline_only": False,
        "notes": ["'SMs' are the reference implementation's programs; peer access: the reference "
                  "implementations emulate peer transports over gloo"],
        "sm_count": 8,
        "smem_per_sm": 1024 * KiB,
        "regs_per_sm": 1 << 20,
        "max_blocks_per_sm": 1,
        "gemm": {
            "peak_tflops": {"float32": 0.4, "bfloat16": 0.1, "float16": 0.1},
            "efficiency": {"float32": 0.5, "bfloat16": 0.5, "float16": 0.5},
            "mem_gbps": 20.0,
            "floor_ms": 0.005,
            "table": [],
            "kernels": [
                {"name": "16x16", "block_m": 16, "block_n": 16, "block_k": 16, "stages": 1, "warps": 1,
                 "regs_per_thread": 32, "vs_cublas": 0.2},
                {"name": "32x32", "block_m": 32, "block_n": 32, "block_k": 32, "stages": 1, "warps": 1,
                 "regs_per_thread": 32, "vs_cublas": 0.3},
            ],
        },
        "collectives": curves,
        "nccl_sms": {c: 0 for c in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p", "copy_engine")},
        "launch_ms": {"eager": 0.01, "cuda_graph": 0.01},
        "contention": {"gemm_slowdown": 1.5, "gemm_slowdown_reserved": 1.5, "comm_slowdown": 1.3},
        "topology": {"gpus_per_node": 64, "peer_access": True, "inter_node_gbps": 1.0, "inter_node_latency_ms": 0.1},
    }


def write_all(directory: str = BUILTIN_DIR) -> list[str]:
    """Write the seeds, except over a built-in that holds measurements (h200: the profile
    command on 2x H200; h100: its GEMM table measured on 1x H100)."""
    paths = []
    for d in (gpu_profile("h200", "NVIDIA H200", 1.0), gpu_profile("h100", "NVIDIA H100 80GB HBM3", 1.06),
              cpu_gloo_profile()):
        path = os.path.join(directory, f"{d['name']}.json")
        if d["name"] != "cpu-gloo" and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                if "to be replaced by" not in json.load(f).get("source", "to be replaced by"):
                    continue
        save_profile(d, path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write_all():
        print("wrote", p)
