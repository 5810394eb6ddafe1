"""A hardware profile from one GPU: this GPU's measured GEMM table, the rest borrowed.

    python benchmarks/fitting/gemm_profile.py --base h200 --name h100 --out h100.json

``python -m overlap_compile profile`` needs 2+ GPUs (collective and peer-copy curves). Where
only one GPU of a kind can be had, this measures what one GPU can: the cuBLAS and Triton GEMM
table (``profile_cmd.measure_gemms``, the same code and shapes), SM count, shared memory and
registers per SM and the roofline numbers. It takes every group measurement from ``--base``:
collective curves, launch cost, contention, NCCL SMs, op host overheads and model error. The
notes name each borrowed section and its source. The result stays ``provisional``: re-measure
on 2+ GPUs of the kind when they can be had.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository root

BORROWED = ("collectives", "nccl_sms", "launch_ms", "contention", "topology", "op_overhead_ms", "model_error",
            "peer_sync_ms")


def one_gpu_profile(base: dict, measured: dict, command: str, date: str) -> dict:
    """``measured`` (build_profile's dict of this GPU, without group measurements) with the
    sections of BORROWED taken from ``base``, and notes saying so."""
    out = copy.deepcopy(measured)
    borrowed = [k for k in BORROWED if k in base]
    for key in borrowed:
        out[key] = copy.deepcopy(base[key])
    out["provisional"] = True
    out["source"] = f"GEMM table measured by `{command}` on {date}; group measurements from {base['name']!r}"
    out["notes"] = list(measured.get("notes", [])) + [
        f"{', '.join(borrowed)}: from the {base['name']!r} profile ({base.get('gpu', '?')}; "
        f"{base.get('source', '?')}), not measured on this GPU: this machine had one GPU",
        "re-measure with `torchrun --nproc-per-node 2 -m overlap_compile profile` on 2+ GPUs of this kind",
    ]
    return out


def main() -> None:
    import datetime

    import torch

    from overlap_compile import predictor
    from overlap_compile.predictor.profile import save_profile
    from overlap_compile.predictor.seed import GPU_KERNELS
    from overlap_compile.profiling.bench import Bench, Progress
    from overlap_compile.profiling.build import build_profile, gpu_facts, load_shape_sets
    from overlap_compile.profiling.gemms import gemm_steps, measure_gemms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="h200", help="profile (name or path) whose group measurements are borrowed")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_profile measures a GPU: none visible")
    started = time.time()
    device, dtype = "cuda:0", torch.bfloat16
    sets = load_shape_sets(args.shapes)
    kernels = [dict(k) for k in GPU_KERNELS]
    notes: list[str] = []
    progress = Progress(gemm_steps(sets, kernels), enabled=True)
    try:
        rows, k_rows, err = measure_gemms(Bench(device), device, sets=sets, dtype=dtype, progress=progress,
                                          kernels=kernels, gemm_limit=None, notes=notes)
    finally:
        progress.close()
    if err is None:
        rows += k_rows
        notes.append("Triton kernels measured with templates/signal_reorder/kernels.gemm at full occupancy")
    else:
        notes.append(f"Triton kernels not measured ({type(err).__name__}: {err}); vs_cublas are estimates")
    for r in rows:
        r["ms"] = round(r["ms"], 5)
    facts = gpu_facts(device)
    gpu = facts["gpu"]
    name = args.name or gpu.lower().replace("nvidia ", "").split()[0]
    command = "python benchmarks/fitting/gemm_profile.py " + " ".join(sys.argv[1:])
    base = predictor.load_profile(args.base).raw
    measured = build_profile(
        name=name, **facts, gemm_rows=rows, kernels=kernels, curves={},
        nccl_sms={}, launch_ms={}, contention={}, topology={}, command=command,
        notes=notes + [f"one GPU, took {time.time() - started:.0f}s"])
    d = one_gpu_profile(base, measured, command, datetime.date.today().isoformat())
    save_profile(d, args.out)  # validates: a malformed result is an error naming the problem
    print(f"wrote {args.out}: {gpu}, {len(rows)} GEMM rows ({len(k_rows)} Triton), group measurements from "
          f"{base['name']!r} ({time.time() - started:.0f}s)")


if __name__ == "__main__":
    main()
