"""What the profile command measures (the GEMM shapes, the world sizes) and the profile dict its
measurements become, with the facts it takes from the GPU and the environment (SM count, peak,
the SMs NCCL takes, the topology). The pure parts are tested on CPU."""
from __future__ import annotations

import datetime
import json
import os
import statistics

from ..predictor.profile import FORMAT, KiB

# Operator shape sets (shapes.json, "gemm_*" and "allgather_gemm"): per-rank GEMM M x N x K.
DEFAULT_GEMM_SETS = {
    "gemm_allreduce": [[4096, 8192, 2048], [8192, 8192, 2048], [8192, 8192, 4096], [8192, 8192, 8192],
                       [16384, 8192, 4096], [16384, 16384, 2048], [8192, 16384, 8192], [2048, 8192, 8192]],
    "gemm_reducescatter": [[8192, 4096, 2752], [8192, 4096, 3584], [8192, 3584, 3584], [8192, 4608, 9216],
                           [8192, 8192, 7168], [8192, 8192, 7392], [16384, 8192, 4096], [4096, 8192, 2048]],
    "allgather_gemm": [[8192, 2752, 4096], [8192, 3584, 4096], [8192, 3584, 3584], [8192, 9216, 4608],
                       [8192, 7168, 8192], [8192, 7392, 8192], [16384, 4096, 8192], [4096, 2048, 8192]],
    "gemm_alltoall": [[8192, 4096, 2048], [8192, 2048, 1536], [16384, 4096, 4096], [4096, 8192, 4096]],
}
ROW_SPLITS = (1, 2, 4, 8, 16)
DEFAULT_NCCL_SMS = {"all_reduce": 24, "reduce_scatter": 16, "all_gather": 16, "all_to_all": 16, "p2p": 8,
                    "copy_engine": 0}
PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "B200": 2250.0}


def gemm_shapes(sets: dict | None = None, splits: tuple[int, ...] = ROW_SPLITS) -> list[tuple[int, int, int]]:
    """Unique (M, N, K) to time: every shape of the sets and its M / s row splits (M divisible)."""
    sets = sets if sets is not None else DEFAULT_GEMM_SETS
    out: list[tuple[int, int, int]] = []
    seen = set()
    for key in sorted(sets):
        if not (key.startswith("gemm_") or key == "allgather_gemm"):
            continue
        for shape in sets[key]:
            m, n, k = (int(x) for x in shape)
            for s in splits:
                if m % s == 0 and (m // s, n, k) not in seen:
                    seen.add((m // s, n, k))
                    out.append((m // s, n, k))
    return out


def world_sizes(world: int) -> list[int]:
    """Power-of-two world sizes 2 ... world (and world itself)."""
    out = [w for w in (2 ** i for i in range(1, 12)) if w <= world]
    if world >= 2 and world not in out:
        out.append(world)
    return out


def load_shape_sets(path: str | None) -> dict:
    if path is None:
        return DEFAULT_GEMM_SETS
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"profile: cannot read shapes file {path}: {e}")
    return {k: v for k, v in d.items() if k.startswith("gemm_") or k == "allgather_gemm"}


def peak_tflops(gpu: str, sm_count: int, major: int) -> float:
    for key, v in PEAK_TFLOPS_BF16.items():
        if key in gpu.upper():
            return v
    from ..predictor.profile import _FLOP_PER_CLK_SM

    return round(sm_count * _FLOP_PER_CLK_SM.get(major, 2048) * 1.6e9 / 1e12, 1)


def gpu_facts(device: str) -> dict:
    """What the profile takes from the device's properties (build_profile's keyword arguments):
    name, SMs, shared memory and registers per SM, peak TFLOP/s and HBM bandwidth (by GPU name)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    gpu, sms = props.name, props.multi_processor_count
    return {"gpu": gpu, "sm_count": sms,
            "smem_per_sm": int(getattr(props, "shared_memory_per_multiprocessor", 228 * KiB)),
            "regs_per_sm": int(getattr(props, "regs_per_multiprocessor", 65536)),
            "peak": peak_tflops(gpu, sms, props.major),
            "mem_gbps": 4800.0 if "H200" in gpu else 3350.0 if "H100" in gpu else 2000.0}


def build_profile(*, name: str, gpu: str, sm_count: int, smem_per_sm: int, regs_per_sm: int,
                  gemm_rows: list[dict], peak: float, mem_gbps: float, kernels: list[dict],
                  curves: dict[str, dict[int, list[tuple[int, float]]]], nccl_sms: dict[str, int],
                  launch_ms: dict[str, float], contention: dict[str, float], topology: dict,
                  notes: list[str], command: str, op_overhead_ms: dict | None = None,
                  copy_gbps: float | None = None) -> dict:
    """The profile dict from measurements (validated by the caller through save_profile)."""
    # default efficiency: median achieved fraction of peak over the large measured GEMMs
    effs = []
    for r in gemm_rows:
        if r["config"] is None and r["dtype"] == "bfloat16" and 2 * r["m"] * r["n"] * r["k"] >= 2 ** 36:
            effs.append(2 * r["m"] * r["n"] * r["k"] / (r["ms"] * 1e-3) / (peak * 1e12))
    eff = round(min(1.0, statistics.median(effs)), 3) if effs else 0.7
    return {
        "format": FORMAT,
        "name": name,
        "gpu": gpu,
        "source": f"measured by `{command}` on {datetime.date.today().isoformat()}",
        "provisional": False,
        "roofline_only": False,
        "notes": notes,
        "sm_count": sm_count,
        "smem_per_sm": smem_per_sm,
        "regs_per_sm": regs_per_sm,
        "max_blocks_per_sm": 32,
        "gemm": {
            "peak_tflops": {"bfloat16": peak, "float16": peak, "float32": round(peak / 16, 1)},
            "efficiency": {"bfloat16": eff, "float16": eff, "float32": 0.8},
            "mem_gbps": mem_gbps,
            **({"copy_gbps": copy_gbps} if copy_gbps else {}),
            "floor_ms": 0.005,
            "table": gemm_rows,
            "kernels": kernels,
        },
        "collectives": {c: {str(w): [[int(b), round(float(t), 6)] for b, t in pts] for w, pts in sorted(per.items())}
                        for c, per in curves.items()},
        "nccl_sms": nccl_sms,
        "launch_ms": {k: round(v, 5) for k, v in launch_ms.items()},
        "contention": {k: round(v, 4) for k, v in contention.items()},
        "topology": topology,
        "op_overhead_ms": op_overhead_ms or {"eager": 0.0, "cuda_graph": 0.0},
    }


def nccl_sms_from_env(notes: list[str]) -> dict[str, int]:
    env = os.environ.get("NCCL_MAX_NCHANNELS") or os.environ.get("NCCL_MIN_NCHANNELS")
    if env and env.isdigit():
        notes.append(f"nccl_sms from NCCL_*_NCHANNELS={env} (one SM per channel)")
        return {c: (0 if c == "copy_engine" else min(int(env), v if c == "p2p" else int(env)))
                for c, v in DEFAULT_NCCL_SMS.items()}
    notes.append("nccl_sms: defaults (not measurable from outside NCCL)")
    return dict(DEFAULT_NCCL_SMS)


def topology_of(world: int, device: str) -> dict:
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    peer = False
    if device.startswith("cuda") and torch.cuda.device_count() >= 2:
        try:
            peer = all(torch.cuda.can_device_access_peer(0, j) for j in range(1, min(local, torch.cuda.device_count())))
        except Exception:
            peer = False
    return {"gpus_per_node": local, "peer_access": peer, "inter_node_gbps": 50.0, "inter_node_latency_ms": 0.02}

