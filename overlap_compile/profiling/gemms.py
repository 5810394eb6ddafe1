"""The profile's GEMM table: cuBLAS (``torch.mm``) on every shape of the operator sets and their
row splits, and signal_reorder's Triton kernels on the unsplit shapes; and the section's copy
bandwidth (``measure_copy_gbps``), the models' price of a pass through memory."""
from __future__ import annotations

import math
import time
from typing import Any, Callable

from ..predictor.profile import MiB
from .bench import Bench, Progress
from .build import gemm_shapes


def _warm_up(bench: "Bench", device: str, dtype: Any, seconds: float = 0.5) -> None:
    """GEMMs until ``seconds`` have passed: the first timings otherwise run at idle clocks and
    come out well off the operator benchmark's on small shapes."""
    import torch

    if not bench.cuda:
        return
    a = torch.randn(4096, 4096, device=device, dtype=dtype)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            torch.mm(a, a)
        bench.sync()


def _time_gemm(bench: "Bench", fn: Callable[[], Any], sample_ms: float = 1.0, max_calls: int = 64) -> float:
    """ms per call, timing back-to-back calls in samples of >= ``sample_ms`` (a lone small GEMM
    is mostly event and launch overhead)."""
    est = bench.time(fn, 1)
    calls = max(1, min(max_calls, math.ceil(sample_ms / max(est, 1e-3))))
    return bench.time(fn, calls) if calls > 1 else est


GEMM_PASSES = 3  # the table is timed this many times over, the fastest pass kept per row


def gemm_steps(sets: dict, kernels: list[dict] | None, gemm_limit: int | None = None,
               passes: int = GEMM_PASSES) -> int:
    """Progress steps of measure_gemms."""
    return passes * (len(gemm_shapes(sets)[:gemm_limit]) + len(kernels or []) * len(gemm_shapes(sets, splits=(1,))))


def measure_gemms(bench: "Bench", device: str, *, sets: dict, dtype: Any, progress: "Progress",
                  kernels: list[dict] | None, gemm_limit: int | None, notes: list[str], passes: int = GEMM_PASSES
                  ) -> tuple[list[dict], list[dict], Exception | None]:
    """The GEMM table of this GPU: cuBLAS (torch.mm) rows for every shape of ``gemm_shapes(sets)``,
    and rows of each Triton kernel config of ``kernels`` (with the error that stopped them, if
    one did). Clocks are ramped up first; each sample is >= 1 ms of back-to-back calls. The whole
    table is timed ``passes`` times and each row keeps its fastest pass: in a single pass slow
    stretches lasting several samples left rows several times off. Local work only: one GPU is enough
    (benchmarks/fitting/gemm_profile.py), and a rank failing here cannot desynchronise the others."""
    import torch

    dname = str(dtype).replace("torch.", "")
    _warm_up(bench, device, dtype)
    notes.append(f"GEMMs: after a 0.5 s warm-up, median of samples of >= 1 ms of back-to-back calls; "
                 f"the fastest of {passes} passes over the table")
    jobs: list[tuple[str | None, tuple[int, int, int], Callable]] = []
    for m, n, k in gemm_shapes(sets)[:gemm_limit]:
        jobs.append((None, (m, n, k), torch.mm))
    err: Exception | None = None
    if device.startswith("cuda") and kernels:
        try:
            from ..templates.signal_reorder import kernels as srk

            if not srk.available():
                raise RuntimeError("signal_reorder kernels unavailable")
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            for kd in kernels:
                cfg = srk.GemmConfig.from_dict({"block_m": kd["block_m"], "block_n": kd["block_n"],
                                                "block_k": kd.get("block_k", 64), "num_stages": kd.get("stages", 3),
                                                "num_warps": kd.get("warps", 8)})
                run = (lambda cfg: lambda a, b: srk.gemm(a, b, config=cfg, programs=sms))(cfg)
                jobs += [(kd["name"], shape, run) for shape in gemm_shapes(sets, splits=(1,))]
        except Exception as e:
            err = e
    best: dict[tuple, float] = {}
    for _ in range(passes):
        for config, (m, n, k), gemm in jobs:
            if config is not None and err is not None:
                continue
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            try:
                ms = _time_gemm(bench, lambda: gemm(a, b))
            except Exception as e:
                if config is None:
                    raise
                err = e  # a Triton config this GPU cannot run: no Triton rows at all
                continue
            best[(config, m, n, k)] = min(ms, best.get((config, m, n, k), float("inf")))
            progress.step(f"{'GEMM' if config is None else 'Triton ' + config} {m}x{n}x{k}")
    rows = [{"m": m, "n": n, "k": k, "dtype": dname, "config": c, "ms": best[(c, m, n, k)]}
            for c, (m, n, k), _ in jobs if (c, m, n, k) in best]
    k_rows = [r for r in rows if r["config"] is not None] if err is None else []
    return [r for r in rows if r["config"] is None], k_rows, err


COPY_BYTES = 256 * MiB  # a copy past the L2 of any GPU the models price


def measure_copy_gbps(bench: Bench, device: str, dtype: Any) -> float:
    """GB/s (read + written) of a contiguous clone of COPY_BYTES, 8 calls per CUDA graph where one
    captures (kernel time); on CPU (the smoke run) 4 MiB, host-launched."""
    import torch

    nbytes = COPY_BYTES if bench.cuda else 4 * MiB
    x = torch.empty(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=device).normal_()
    g = bench.capture(x.clone, 8)
    ms = bench.time(g.replay, 1) / 8 if g is not None else bench.time(x.clone)
    return round(2 * nbytes / (ms * 1e-3) / 1e9, 1)
