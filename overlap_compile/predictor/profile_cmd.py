"""``python -m overlap_compile profile``: measure this machine's HardwareProfile and write the JSON.

    torchrun --nproc-per-node 4 -m overlap_compile profile --out h200.json --name h200

Under torchrun on GPUs (NCCL), in this order, with a progress bar on rank 0:

1. GEMM table: cuBLAS bf16 (``torch.mm``) for every GEMM of the operator shape sets (the
   ``gemm_*`` / ``allgather_gemm`` lists of shapes.json; ``--shapes`` reads another file) and
   their row splits M/2 ... M/16 (the pieces p2p_ring and priority_stream compute); the Triton
   kernels of signal_reorder (``kernels.gemm``) on the unsplit shapes, when they import.
2. Collective curves for every power-of-two world size 2 ... W (sub-groups of ranks 0..w-1):
   all_reduce, reduce_scatter, all_gather, all_to_all, p2p (ring send/recv) and copy_engine
   (peer copies through symmetric memory), at 64 KiB ... 512 MiB. Each point is the time per
   call of a CUDA graph of back-to-back calls (eager back-to-back when capture fails on any
   rank), the MAX over ranks.
3. Launch cost per call: eager back-to-back small all_reduces minus the graph-captured ones.
4. Contention: a GEMM alone vs beside a looping all_reduce (``gemm_slowdown``), the same with
   cuBLAS leaving NCCL's SMs free (``gemm_slowdown_reserved``, needs
   ``torch._C._set_sm_carveout_experimental``), the all_reduce alone vs beside GEMMs
   (``comm_slowdown``).
5. Rank 0 validates and writes the JSON (``--out``), then prints a summary.

``nccl_sms`` is not measurable from outside NCCL: it comes from NCCL_MAX_NCHANNELS when set,
else the defaults below (one SM per channel); the file's ``notes`` say which. It takes about a
minute on 4 H200 (budget: under 5 minutes).

``--smoke`` runs the same code on an already initialised process group of any backend with tiny
sizes on CPU (the tests use it with the fake backend); nothing it measures means anything.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable

from .profile import COLLECTIVES, FORMAT, KiB, MiB, profile_from_dict, sample_sizes, save_profile

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


# ---- pure parts (tested on CPU) ----------------------------------------------------------------


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
    from .profile import _FLOP_PER_CLK_SM

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
                  notes: list[str], command: str, op_overhead_ms: dict | None = None) -> dict:
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


class Progress:
    """tqdm when importable (rank 0 only), else a line per step."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled, self.total, self.n, self.t0 = enabled, total, 0, time.time()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, what: str) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(what[:40])
            self.bar.update(1)
        elif self.n == self.total or self.n % max(1, self.total // 40) == 0:
            print(f"[{self.n}/{self.total} {time.time() - self.t0:6.1f}s] {what}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- measuring ---------------------------------------------------------------------------------


class Bench:
    """Timing on the group's device: CUDA events and graphs on GPU, perf_counter on CPU."""

    def __init__(self, device: str, iters: int = 5, warmup: int = 2) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.cuda = device.startswith("cuda")
        self.iters, self.warmup = iters, warmup

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any], calls: int = 1) -> float:
        """Median ms per call of ``calls`` back-to-back calls of fn."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        out = []
        for _ in range(self.iters):
            if self.cuda:
                s, e = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(calls):
                    fn()
                e.record()
                e.synchronize()
                out.append(s.elapsed_time(e) / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                out.append((time.perf_counter() - t0) * 1e3 / calls)
        return statistics.median(out)

    def capture(self, fn: Callable[[], Any], calls: int) -> Any:
        """A CUDA graph of ``calls`` calls of fn (run once eagerly first), or None when capture fails.
        Collective callers must agree on success across ranks before replaying it."""
        if not self.cuda:
            return None
        torch = self.torch
        try:
            fn()
            self.sync()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls):
                    fn()
            return g
        except Exception:
            _clear_last_cuda_error()
            self.sync()
            return None


def _clear_last_cuda_error() -> None:
    """A failed capture leaves its error as the runtime's "last error"; the next eager launch would
    report it as its own (seen on 4x H200: a peer copy's capture failing, then the eager copy
    "failing" with the same cudaErrorInvalidValue). Reading it clears it."""
    try:
        from cuda.bindings import runtime as cudart

        cudart.cudaGetLastError()
    except ImportError:
        pass


def _warm_up(bench: "Bench", device: str, dtype: Any, seconds: float = 0.5) -> None:
    """GEMMs until ``seconds`` have passed: the first timings otherwise run at idle clocks (the
    2x H200 table of 2026-11-22 was 10-28% off the operator benchmark's on small shapes)."""
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


def _agree(values: list[float], group: Any, device: str, op: str = "max") -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
    return [float(v) for v in t.cpu()]


def _collective_fns(coll: str, nbytes: int, group: Any, device: str, dtype: Any) -> Callable[[], Any] | None:
    """A call of ``coll`` moving ``nbytes`` (curve convention) on ``group``; None if not possible."""
    import torch
    import torch.distributed as dist

    w, rank = group.size(), group.rank()
    item = torch.empty((), dtype=dtype).element_size()
    numel = max(w, nbytes // item // w * w)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if coll == "all_reduce":
        buf = torch.randn(numel, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if coll == "reduce_scatter":
        src, dst = torch.randn(numel, dtype=dtype, device=device), torch.empty(numel // w, dtype=dtype, device=device)
        return lambda: rs(dst, src, group=group)
    if coll == "all_gather":
        src, dst = torch.randn(numel // w, dtype=dtype, device=device), torch.empty(numel, dtype=dtype, device=device)
        return lambda: ag(dst, src, group=group)
    if coll == "all_to_all":
        src, dst = torch.randn(numel, dtype=dtype, device=device), torch.empty(numel, dtype=dtype, device=device)
        return lambda: dist.all_to_all_single(dst, src, group=group)
    if w < 2:
        return None  # point-to-point transports need a peer
    peers = dist.get_process_group_ranks(group)
    nxt, prv = peers[(rank + 1) % w], peers[(rank - 1) % w]
    n1 = max(1, nbytes // item)
    if coll == "p2p":
        src, dst = torch.randn(n1, dtype=dtype, device=device), torch.empty(n1, dtype=dtype, device=device)

        def p2p() -> None:
            ops = [dist.P2POp(dist.isend, src, nxt, group), dist.P2POp(dist.irecv, dst, prv, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return p2p
    if coll == "copy_engine":
        if not device.startswith("cuda"):
            return None
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(n1, dtype=dtype, device=device)
        hdl = symm_mem.rendezvous(buf, group.group_name)
        peer = hdl.get_buffer((rank + 1) % w, (n1,), dtype)
        src = torch.randn(n1, dtype=dtype, device=device)
        # Try it once here: a copy the driver refuses (seen: "invalid argument" on 4x H200) must
        # become "not measured" on every rank, not a crash of the whole profile run.
        peer.copy_(src)
        torch.cuda.synchronize(device)

        def copy(keep=(buf, hdl)) -> None:
            # ``keep`` holds the local buffer and its handle alive with the closure: once they are
            # collected the peers' mappings go too, and the copy fails with "invalid argument"
            # (what the 4x H200 profile runs hit after the probe above had succeeded).
            peer.copy_(src)

        return copy
    raise ValueError(coll)


_last_graph_ok = [True]


def _time_collective(bench: Bench, coll: str, size: int, group: Any, device: str, dtype: Any, use_graph: bool,
                     notes: list[str], w: int) -> float:
    """ms per call (MAX over the group's ranks), or -1 when the call cannot be built on some rank.
    Every rank of ``group`` takes the same branches (each decision is agreed first): no hang."""
    fn, err = None, None
    try:
        fn = _collective_fns(coll, size, group, device, dtype)
    except Exception as e:
        err = e
    if _agree([0.0 if fn is None else 1.0], group, device, op="min")[0] == 0:
        if coll == "copy_engine" and not any(n.startswith(f"copy_engine not measured at w={w}") for n in notes):
            notes.append(f"copy_engine not measured at w={w} ({type(err).__name__ if err else 'unsupported'}: {err})")
        return -1.0
    calls = 4 if size >= 64 * MiB else 16
    # Peer copies are timed eagerly: a copy-engine transfer has no kernel launch to amortise, and
    # keeping them out of capture means a refused capture can never turn later collectives eager.
    g = bench.capture(fn, calls) if use_graph and coll != "copy_engine" else None
    # always agreed (a rank that gave up on graphs earlier votes 0), so all ranks branch alike
    ok = _agree([0.0 if g is None else 1.0], group, device, op="min")[0] > 0
    # only a refused capture of a collective makes later collectives eager (copies never try)
    _last_graph_ok[0] = ok or not bench.cuda or coll == "copy_engine"
    t = bench.time(g.replay, 1) / calls if ok else bench.time(fn, calls)
    return _agree([t], group, device)[0]


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
    table is timed ``passes`` times and each row keeps its fastest pass: a single pass had rows
    4-7x off (1x H100, 2026-11-23: 71 TFLOP/s on a 2048x2048x1536 cuBLAS GEMM) from slow
    stretches lasting several samples. Local work only: one GPU is enough
    (benchmarks/gemm_profile.py), and a rank failing here cannot desynchronise the others."""
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


def measure(group: Any, device: str, *, sets: dict, sizes: list[int], worlds: list[int], dtype: Any,
            progress: Progress, iters: int = 5, kernels: list[dict] | None = None,
            gemm_limit: int | None = None) -> dict:
    """Everything the profile needs, measured on ``group`` (the world); the same on every rank."""
    import torch
    import torch.distributed as dist

    bench = Bench(device, iters=iters)
    rank, world = group.rank(), group.size()
    notes: list[str] = []

    # 1. GEMMs (this GPU alone; the Triton kernels only where every rank could run them)
    rows, k_rows, err = measure_gemms(bench, device, sets=sets, dtype=dtype, progress=progress, kernels=kernels,
                                      gemm_limit=gemm_limit, notes=notes)
    if k_rows or err is not None:
        everyone = _agree([0.0 if err is not None else 1.0], group, device, op="min")[0] > 0
        if everyone:
            rows += k_rows
            notes.append("Triton kernels measured with templates/signal_reorder/kernels.gemm at full occupancy")
        else:  # keep the cuBLAS table; say why
            why = f"{type(err).__name__}: {err}" if err is not None else "failed on another rank"
            notes.append(f"Triton kernels not measured ({why}); vs_cublas are estimates")
    # every rank timed its own GEMMs: keep the slowest
    agreed = _agree([r["ms"] for r in rows], group, device)
    for r, ms in zip(rows, agreed):
        r["ms"] = round(ms, 5)

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
                    ms = _time_collective(bench, coll, size, sub, device, dtype, graph_ok, notes, w)
                    if ms < 0 and coll not in ("copy_engine", "p2p"):
                        raise RuntimeError(f"profile: {coll} of {size} bytes at w={w} could not run")
                    if ms >= 0:
                        graph_ok = graph_ok and _last_graph_ok[0]
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
    small = _collective_fns("all_reduce", 4 * KiB, group, device, dtype)
    eager = bench.time(small, 64)
    g = bench.capture(small, 64)
    ok = _agree([0.0 if g is None else 1.0], group, device, op="min")[0] > 0
    graph = bench.time(g.replay, 1) / 64 if ok else eager
    eager, graph = _agree([eager, graph], group, device)
    launch = {"eager": max(0.0, eager - graph), "cuda_graph": 0.001 if ok else max(0.0, eager - graph)}
    if not ok:
        notes.append("launch_ms: CUDA-graph capture failed; cuda_graph = eager")
    progress.step("launch cost")

    # 4. contention
    contention = _contention(bench, group, device, dtype, notes)
    progress.step("contention")

    # 5. host overhead of each template's op (GPU only: the CPU smoke run has no graphs)
    op_overhead = {"eager": 0.0, "cuda_graph": 0.0, "per_template": {}}
    if bench.cuda:
        from .op_overhead import measure_op_overhead

        op_overhead = measure_op_overhead(bench, group, device, dtype, notes)
    progress.step("op overhead")
    return {"gemm_rows": rows, "curves": curves, "launch_ms": launch, "contention": contention, "notes": notes,
            "op_overhead_ms": op_overhead}


def _contention(bench: Bench, group: Any, device: str, dtype: Any, notes: list[str]) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    size = 2048 if device.startswith("cuda") else 64
    a = torch.randn(2 * size, size, device=device, dtype=dtype)
    b = torch.randn(size, 2 * size, device=device, dtype=dtype)
    buf = torch.zeros((128 * MiB if device.startswith("cuda") else 64 * KiB) // 2, dtype=dtype, device=device)
    reps = 8
    gemm_alone = bench.time(lambda: torch.mm(a, b), reps)
    ar_alone = bench.time(lambda: dist.all_reduce(buf, group=group), 1)

    def together(carveout: int | None) -> tuple[float, float]:
        side = torch.cuda.Stream(priority=-1) if bench.cuda else None
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if carveout is not None and setter is not None and bench.cuda:
            setter(carveout)
        try:
            g_times, c_times = [], []
            for _ in range(bench.iters):
                n_ar = max(1, int(math.ceil(gemm_alone * reps / max(ar_alone, 1e-6))))
                t0 = time.perf_counter()
                if bench.cuda:
                    bench.sync()
                    cs, ce = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    gs, ge = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with torch.cuda.stream(side):
                        cs.record(side)
                        works = [dist.all_reduce(buf, group=group, async_op=True) for _ in range(n_ar)]
                        for wk in works:
                            wk.wait()
                        ce.record(side)
                    gs.record()
                    for _ in range(reps):
                        torch.mm(a, b)
                    ge.record()
                    bench.sync()
                    g_times.append(gs.elapsed_time(ge) / reps)
                    c_times.append(cs.elapsed_time(ce) / n_ar)
                else:
                    works = [dist.all_reduce(buf, group=group, async_op=True) for _ in range(n_ar)]
                    for _ in range(reps):
                        torch.mm(a, b)
                    for wk in works:
                        wk.wait()
                    dt = (time.perf_counter() - t0) * 1e3
                    g_times.append(dt / reps)
                    c_times.append(dt / n_ar)
            return statistics.median(g_times), statistics.median(c_times)
        finally:
            if carveout is not None and setter is not None and bench.cuda:
                setter(0)

    g_full, c_full = together(None)
    gemm_slow = max(1.0, g_full / gemm_alone)
    comm_slow = max(1.0, c_full / ar_alone)
    reserved = None
    if bench.cuda and getattr(torch._C, "_set_sm_carveout_experimental", None) is not None:
        try:
            carve = DEFAULT_NCCL_SMS["all_reduce"]
            torch._C._set_sm_carveout_experimental(carve)
            alone_c = bench.time(lambda: torch.mm(a, b), reps)
            torch._C._set_sm_carveout_experimental(0)
            g_res, _ = together(carve)
            reserved = max(1.0, g_res / alone_c)
        except Exception as e:
            notes.append(f"gemm_slowdown_reserved not measured ({type(e).__name__}: {e})")
    if reserved is None:
        reserved = 1.0 + (gemm_slow - 1.0) * 0.3
        notes.append("gemm_slowdown_reserved estimated as 30% of gemm_slowdown's excess")
    vals = _agree([gemm_slow, reserved, comm_slow], group, device)
    return {"gemm_slowdown": vals[0], "gemm_slowdown_reserved": min(vals[1], vals[0]), "comm_slowdown": vals[2]}


def _nccl_sms(notes: list[str]) -> dict[str, int]:
    env = os.environ.get("NCCL_MAX_NCHANNELS") or os.environ.get("NCCL_MIN_NCHANNELS")
    if env and env.isdigit():
        notes.append(f"nccl_sms from NCCL_*_NCHANNELS={env} (one SM per channel)")
        return {c: (0 if c == "copy_engine" else min(int(env), v if c == "p2p" else int(env)))
                for c, v in DEFAULT_NCCL_SMS.items()}
    notes.append("nccl_sms: defaults (not measurable from outside NCCL)")
    return dict(DEFAULT_NCCL_SMS)


def _topology(world: int, device: str) -> dict:
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    peer = False
    if device.startswith("cuda") and torch.cuda.device_count() >= 2:
        try:
            peer = all(torch.cuda.can_device_access_peer(0, j) for j in range(1, min(local, torch.cuda.device_count())))
        except Exception:
            peer = False
    return {"gpus_per_node": local, "peer_access": peer, "inter_node_gbps": 50.0, "inter_node_latency_ms": 0.02}


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
            dist.destroy_process_group()
        return 2
    worlds = world_sizes(world) or [world]
    from .seed import GPU_KERNELS

    kernels = [] if args.smoke else [dict(k) for k in GPU_KERNELS]
    total = gemm_steps(sets, kernels) + len(worlds) * len(COLLECTIVES) * len(sizes) + 3
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
        nccl_sms={c: 0 for c in COLLECTIVES} if args.smoke else _nccl_sms(notes), launch_ms=res["launch_ms"],
        contention=res["contention"], op_overhead_ms=res["op_overhead_ms"],
        topology=_topology(world, device), notes=notes + [f"world size {world}, took {time.time() - started:.0f}s"],
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
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
