"""Where the overlap backend's extra GPU memory goes: e2e models (benchmarks/models) compiled as
benchmarks/e2e_run.py compiles them, torch.compile (inductor) beside the overlap variants, each
phase's peak per rank and what the templates hold.

    python benchmarks/diagnostics/memory_account.py --world 2 --out $OUT           # GPUs, self-spawning
    python benchmarks/diagnostics/memory_account.py --world 2 --models dtensor_gqa_8b --modes default
    torchrun --nproc-per-node 2 benchmarks/diagnostics/memory_account.py --out $OUT
    python benchmarks/diagnostics/memory_account.py --dry-run                      # CPU, gloo, world 2, tiny

Variants, in this order per (model, compile mode), each compiled afresh (torch._dynamo.reset())
after the previous one's template resources were released (runtime.teardown.release: symmetric
buffers, op graphs), the cuBLAS workspaces freed and passes/settle.py's measurements forgotten, so
that nothing carries into the next one's peak:

    inductor          torch.compile
    overlap           backend="overlap" as e2e runs it
    overlap_defer     the same with defer_compute on (OVERLAP_COMPILE_DEFER_COMPUTE=1), which turns
                      Inductor's reorder_for_peak_memory off
    overlap_reorder   defer_compute on with reorder_for_peak_memory forced back on (this run only)

Phases: ``train`` (forward + backward + AdamW, as e2e's train step) then ``prefill`` (forward under
no_grad) on the same model and optimizer state. Per phase and rank (GiB):

    peak      torch.cuda.max_memory_allocated over the phase (reset at its start); CPU: peak RSS
    first     the peak over the phase's first call (the compile, and the overlap pass timing the
              uncertain sites on random operands of their shapes, ``measured_sites``)
    steady    the peak over ``--steps`` calls after ``--warmup`` more (CUDA-graph trees recorded)
    reserved  torch.cuda.max_memory_reserved over the phase
    symm      bytes of the symmetric buffers alive (runtime.symm's cache; ``symm_buffers`` lists them)
    symm_pool bytes allocated in torch's symmetric-memory pool (the implicit pool of symm_mem.empty,
              part of ``peak``), from the allocator's snapshot
    op_graphs bytes reserved by runtime.op_graphs' graph pool (replays do not count in ``peak``)
    graphs    bytes reserved by the other private pools (CUDA-graph trees, measurement graphs)

``vs`` is peak / inductor's peak in the same (model, mode, phase) on that rank. Writes
memory_account-<device>-w<W>-torch<v>-<date>.json (benchmarks/results_io.py) and a .md beside it.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import os
import re
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root

from benchmarks.diagnostics.ranks import as_rank, under_torchrun  # noqa: E402

VARIANTS = ("inductor", "overlap", "overlap_defer", "overlap_reorder")
PHASES = ("train", "prefill")
# overlap_compile options a variant runs under (beside e2e's --force)
OPTIONS = {"overlap_defer": {"defer_compute": True}, "overlap_reorder": {"defer_compute": True}}
GIB = 2 ** 30
TABLE = ("peak", "first", "steady", "reserved", "symm", "symm_pool", "op_graphs", "graphs")


# ---- what is measured ----------------------------------------------------------------------------


@contextlib.contextmanager
def reorder_for_peak_memory_forced():
    """Compiles inside run under inductor_patches with ``reorder_for_peak_memory=True`` (this
    diagnostic's overlap_reorder variant only; the backend looks the function up at each compile)."""
    from overlap_compile import backend, inductor_hook

    original = inductor_hook.inductor_patches

    def forced(p):
        return {**original(p), "reorder_for_peak_memory": True}

    backend.inductor_patches = inductor_hook.inductor_patches = forced
    try:
        yield
    finally:
        backend.inductor_patches = inductor_hook.inductor_patches = original


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


class Meter:
    """Peak memory since ``reset()``: the caching allocator's counters on CUDA; on CPU (dry run)
    the process's resident set (VmHWM, reset through /proc/self/clear_refs)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.device = torch.device(device)

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass

    def now(self) -> float:
        return torch.cuda.memory_allocated(self.device) / GIB if self.cuda else _proc_kib("VmRSS") / 2 ** 20

    def peak(self) -> tuple[float, float]:
        """(peak allocated, peak reserved) since the last reset."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) / GIB,
                    torch.cuda.max_memory_reserved(self.device) / GIB)
        hwm = _proc_kib("VmHWM") / 2 ** 20
        return hwm, hwm


def symm_held() -> tuple[float, list[dict]]:
    """GiB of the symmetric buffers in runtime.symm's cache, and each one (key, shape, dtype, MiB)."""
    from overlap_compile.runtime import symm

    with symm._lock:
        items = list(symm._cache.items())
    bufs = [{"key": k[1], "shape": list(k[2]), "dtype": str(k[3]).replace("torch.", ""),
             "mib": b.local.numel() * b.local.element_size() / 2 ** 20} for k, b in items]
    return sum(b["mib"] for b in bufs) / 1024, bufs


def pools(device: str) -> dict[str, float]:
    """GiB per private pool of the allocator's snapshot: torch's symmetric-memory pool (allocated),
    op_graphs' pool (reserved), every other private pool (reserved). Zeros on CPU."""
    out = {"symm_pool": 0.0, "op_graphs": 0.0, "graphs": 0.0}
    if not device.startswith("cuda"):
        return out
    from overlap_compile.runtime import op_graphs

    index = torch.device(device).index
    ours = op_graphs._pools.get(index)
    symm_mem = sys.modules.get("torch.distributed._symmetric_memory")
    symm_ids = {tuple(p.id) for d, p in getattr(symm_mem, "_symm_mem_pools", {}).items()
                if torch.device(d).index in (index, None)}
    out["op_graphs"] = op_graphs.pool_bytes(index) / GIB
    for seg in torch.cuda.memory_snapshot():
        pid = tuple(seg.get("segment_pool_id", (0, 0)))
        if seg.get("device", index) != index or pid == (0, 0) or (ours is not None and pid == tuple(ours)):
            continue
        if pid in symm_ids:
            out["symm_pool"] += seg["allocated_size"] / GIB
        else:
            out["graphs"] += seg["total_size"] / GIB
    return out


def release(device: str) -> float:
    """Everything a variant left: compiled code and CUDA-graph trees, the template ops' buffers and
    graphs on the group (all ranks idle first), cuBLAS workspaces, cached blocks. Returns GiB still
    allocated (what the next variant starts from)."""
    from overlap_compile.runtime import teardown

    torch._dynamo.reset()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dist.barrier()
    teardown.release(dist.group.WORLD.group_name)
    settle = sys.modules.get("overlap_compile.passes.settle")
    if settle is not None:  # every variant measures its uncertain sites itself (the first call's peak)
        settle.clear_cache()
    gc.collect()
    if device.startswith("cuda"):
        from overlap_compile.runtime import cublas_workspaces, op_graphs

        cublas_workspaces.release()  # one per (cuBLAS handle, stream) that ran a GEMM, kept for the process
        # op_graphs' capture stream gets its cuBLAS workspace from a GEMM outside any capture
        # when it is made: a new one next time, not a capture allocating it
        op_graphs._side.clear()
        torch.cuda.empty_cache()
    return Meter(device).now()


# ---- what is live at the peak (--at-peak) ---------------------------------------------------------

# frames worth naming an allocation by, most telling first: the library, Inductor's generated code,
# the benchmark's models; else the innermost frame outside torch
TELLING = ("overlap_compile/", "torchinductor", "benchmarks/models/")


def allocation_site(frames: list[dict], depth: int = 2) -> str:
    """Where an allocation came from, as "file:line function" (frames innermost first), with up
    to ``depth`` telling frames from the innermost one outwards ("<" between caller and callee)."""
    def named(f: dict) -> str:
        return f"{os.path.basename(f.get('filename', ''))}:{f.get('line')} {f.get('name')}"

    telling = [f for f in frames if any(p in f.get("filename", "") for p in TELLING)]
    if telling:
        return " < ".join(named(f) for f in telling[:depth])
    outside = [f for f in frames if "/torch/" not in f.get("filename", "")]
    return named(outside[0]) if outside else "(no python frame)"


def live_at_peak(trace: list[dict], start: int = 0, end: int | None = None, top: int = 25) -> dict:
    """Replays an allocator trace (torch.cuda.memory._snapshot()["device_traces"][device]): the
    most bytes allocated at once between entries ``start`` and ``end``, counted from the trace's
    beginning, and what was live then (allocated anywhere before), grouped by allocation site
    (MiB, count), most bytes first. A free counts when requested (the allocator's allocated
    bytes drop then; a record_stream'd block's reuse waits)."""
    live: dict[int, tuple[int, str, bool]] = {}
    now = peak = 0
    at_peak: dict[int, tuple[int, str, bool]] = {}
    end = len(trace) if end is None else end
    for i, e in enumerate(trace[:end]):
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            live[addr] = (e["size"], allocation_site(e.get("frames") or []), i < start)
            now += e["size"]
            if i >= start and now > peak:
                peak, at_peak = now, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            now -= live.pop(addr)[0]
    groups: dict[str, list] = {}
    for size, site, before in at_peak.values():
        g = groups.setdefault(site, [0, 0, 0])
        g[0] += size
        g[1] += 1
        g[2] += before
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_mib": peak / 2 ** 20,
            "sites": [{"site": k, "mib": v[0] / 2 ** 20, "count": v[1], "before": v[2]} for k, v in ranked]}


class AllocatorTrace:
    """The caching allocator's history (python stacks) from ``start()`` to ``stop()``, with
    ``mark()`` giving the position reached so far; ``trace`` (this device's events) after stop.
    Off (or on CPU) it records nothing and marks 0."""

    def __init__(self, device: str, on: bool) -> None:
        self.device, self.on = device, on and device.startswith("cuda")
        self.trace: list[dict] = []

    def _events(self) -> list[dict]:
        return torch.cuda.memory._snapshot(self.device)["device_traces"][torch.device(self.device).index]

    def start(self) -> None:
        if self.on:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python", device=self.device)

    def mark(self) -> int:
        return len(self._events()) if self.on else 0

    def stop(self) -> None:
        if self.on:
            self.trace = self._events()
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)


# ---- one variant on this rank ----------------------------------------------------------------------


def run_variant(a, model_name: str, shape: dict, variant: str, mode: str, device: str, dtype) -> list[dict]:
    """This rank's rows, one per phase: the model built and compiled as e2e_run does it."""
    import overlap_compile as oc
    from overlap_compile.compile_caches import no_compile_caches

    from benchmarks.e2e_run import RecordsSince, compiled, framework_mode
    from benchmarks.models import build

    meter = Meter(device)
    base = meter.now()
    tracer = AllocatorTrace(device, a.at_peak)
    tracer.start()  # from before the model is built: everything the variant allocates has its site
    built = build(model_name, shape, device, dtype, seed=0)
    opt = torch.optim.AdamW(built.model.parameters(), lr=1e-4)
    report = oc.Report()
    records = RecordsSince(report)
    step_begin = torch.compiler.cudagraph_mark_step_begin if mode == "reduce-overhead" else (lambda: None)
    overlap = variant != "inductor"
    reorder = reorder_for_peak_memory_forced() if variant == "overlap_reorder" else contextlib.nullcontext()
    rows = []
    with no_compile_caches(), oc.config.patch(**OPTIONS.get(variant, {})), reorder, framework_mode(built, mode):
        fn, overrides = compiled(built.model, "overlap" if overlap else "default", mode,
                                 a.force if overlap else None, report, built.compile_with)

        def train() -> None:
            step_begin()
            with oc.config.patch(**overrides):
                built.to_local(fn(built.x)).float().pow(2).mean().backward()
            built.finalize_grads()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def prefill() -> None:
            step_begin()
            with torch.no_grad(), oc.config.patch(**overrides):
                fn(built.x)

        for phase in [p for p in PHASES if p in a.phases.split(",")]:
            call = train if phase == "train" else prefill
            row = {"phase": phase, "base": base, "start": meter.now()}
            if built.compile_with is not None:
                records.collect()
            before = len(report.records)
            peaks, windows = {}, {}
            for name, calls in (("first", 1), ("warmup", a.warmup), ("steady", a.steps)):
                meter.reset()
                mark = tracer.mark()
                for _ in range(calls):
                    call()
                peaks[name] = meter.peak()
                windows[name] = (mark, tracer.mark())
                if name != "warmup":
                    row[name] = peaks[name][0]
            # the live set at the phase's own peak, in whichever calls it came (under reduce-overhead
            # the CUDA-graph trees' warm-up and recording calls can hold more than the steady ones)
            row["peak_in"] = max(peaks, key=lambda n: peaks[n][0])
            row["_window"] = windows[row["peak_in"]]
            row["peak"] = peaks[row["peak_in"]][0]
            row["reserved"] = max(r for _, r in peaks.values())
            row["symm"], row["symm_buffers"] = symm_held()
            row.update(pools(device))
            if built.compile_with is not None:
                records.collect()
            # the sites of the graphs this phase compiled
            phase_sites = [s for rec in report.records[before:] for s in rec.sites]
            sites = [s for s in phase_sites if s.rewritten]
            row["rewritten"] = len(sites)
            row["measured_sites"] = sum(1 for s in phase_sites if s.measured)  # timed while compiling
            row["templates"] = dict(collections.Counter(s.template for s in sites))
            rows.append(row)
    tracer.stop()
    for row in rows:  # what was live at the phase's peak, wherever it was allocated
        start, end = row.pop("_window")
        if tracer.trace:
            row["at_peak"] = live_at_peak(tracer.trace, start, end)
    return rows


# ---- the sweep ------------------------------------------------------------------------------------


def model_shape(model: str, dry: bool) -> dict:
    from benchmarks.e2e import CPU_SHAPES, shape_table
    from benchmarks.models import PINNED_SHAPE

    if model in PINNED_SHAPE:
        _, key, dry_key = PINNED_SHAPE[model]
        return CPU_SHAPES[dry_key] if dry else shape_table(False)[key]
    return shape_table(dry)["tiny" if dry else "8b"]


def _go(start: float, budget: float) -> bool:
    """Rank 0's clock decides for every rank whether another variant starts."""
    flag = [budget <= 0 or time.time() - start < budget]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])


def worker(args: dict) -> list[dict]:
    """Every rank: each (model, mode, variant) in turn; every rank's rows come back on rank 0."""
    a = argparse.Namespace(**args)
    device = "cpu" if a.dry_run else f"cuda:{torch.cuda.current_device()}"
    dtype = torch.float32 if a.dry_run else torch.bfloat16
    rank, world = dist.get_rank(), dist.get_world_size()
    base = {"benchmark": "memory_account", "device": "cpu" if a.dry_run else torch.cuda.get_device_name(),
            "world_size": world, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "dtype": str(dtype).replace("torch.", ""), "rank": rank,
            "memory": "process peak RSS (dry run)" if a.dry_run else "cuda caching allocator"}
    rows: list[dict] = []
    release(device)
    for model in a.models.split(","):
        shape = model_shape(model, a.dry_run)
        for mode in a.modes.split(","):
            for variant in a.variants.split(","):
                cfg = {**base, "model": model, "kind": model, "shape": shape["name"], "compile_mode": mode,
                       "mode": "cuda_graph" if mode == "reduce-overhead" else "eager", "variant": variant,
                       "method": "inductor" if variant == "inductor" else "overlap",
                       "config": {**OPTIONS.get(variant, {}), **({"force_template": a.force} if a.force and
                                                                  variant != "inductor" else {}),
                                  **({"reorder_for_peak_memory": True} if variant == "overlap_reorder" else {})}
                       or None}
                if not _go(a.start_time, a.time_budget):
                    rows.append({**cfg, "skipped": "time budget"})
                    continue
                try:
                    rows += [{**cfg, **r} for r in run_variant(a, model, shape, variant, mode, device, dtype)]
                except Exception as e:  # recorded, the sweep goes on
                    rows.append({**cfg, "error": f"{type(e).__name__}: {e}"[:2000],
                                 "trace": traceback.format_exc()[-3000:]})
                release(device)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, rows)
    return add_ratios([r for per_rank in everyone for r in per_rank]) if rank == 0 else []


def add_ratios(rows: list[dict]) -> list[dict]:
    """``vs`` / ``vs_steady``: each row's peak / steady peak over inductor's in the same (model,
    mode, phase, rank)."""
    ref = {(r["model"], r["compile_mode"], r["phase"], r["rank"]): r
           for r in rows if r["variant"] == "inductor" and "peak" in r}
    for r in rows:
        base = ref.get((r["model"], r["compile_mode"], r.get("phase"), r["rank"]))
        if "peak" in r and base:
            r["vs"], r["vs_steady"] = r["peak"] / base["peak"], r["steady"] / base["steady"]
    return rows


def markdown(rows: list[dict]) -> str:
    head = (["model", "mode", "phase", "variant", "rank"] + [f"{c} GiB" for c in TABLE]
            + ["vs inductor", "steady vs", "sites rewritten (timed while compiling)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r["model"], r["compile_mode"], PHASES.index(r.get("phase", "train")),
                                         r["rank"], VARIANTS.index(r["variant"]))):
        if "peak" not in r:
            what = r.get("error", r.get("skipped", ""))[:120]
            lines.append(f"| {r['model']} | {r['compile_mode']} | - | {r['variant']} | {r['rank']} | {what} |")
            continue
        sites = ", ".join(f"{t} x{n}" for t, n in sorted(r["templates"].items())) or "-"
        sites += f" ({r['measured_sites']})" if r["measured_sites"] else ""
        cells = [r["model"], r["compile_mode"], r["phase"], r["variant"], str(r["rank"])]
        cells += [f"{r[c]:.3f}" for c in TABLE] + [f"{r[c]:.3f}" if c in r else "-" for c in ("vs", "vs_steady")]
        cells.append(sites)
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:  # what was live at the phase's peak, rank 0 (--at-peak)
        if r.get("at_peak") and r["rank"] == 0:
            calls = r.get("peak_in", "steady")
            lines += ["", f"**{r['model']}, {r['compile_mode']}, {r['phase']}, {r['variant']}**: "
                          f"{r['at_peak']['peak_mib']:.0f} MiB allocated at the phase's peak, in its {calls} calls, counted "
                          f"from the variant's start; live then, by allocation site:", "",
                      f"| site | MiB | blocks | of them allocated before the {calls} calls |", "|---|---|---|---|"]
            lines += [f"| `{x['site']}` | {x['mib']:.1f} | {x['count']} | {x['before']} |" for x in r["at_peak"]["sites"]]
    return "\n".join(lines)


def finish(rows: list[dict], a: argparse.Namespace) -> None:
    text = markdown(rows)
    print(text, flush=True)
    for r in rows:
        if "trace" in r and r["rank"] == 0:
            print(r["trace"], flush=True)
    if not a.out:
        return
    from benchmarks.results_io import result_stem, write_rows

    dev, world = rows[0]["device"], rows[0]["world_size"]
    path = write_rows(rows, a.out, "memory_account", dev, world)
    with open(result_stem(a.out, "memory_account", dev, world) + ".md", "w") as f:
        f.write(text + "\n")
    print("wrote", path)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="megatron_fused_8b,dtensor_gqa_8b",
                    help="comma list of e2e models (a zoo model runs its pinned shape, others the 8b one)")
    ap.add_argument("--modes", default=None,
                    help="comma list of default, reduce-overhead (default both; dry run: default)")
    ap.add_argument("--phases", default="train,prefill", help="comma list of train, prefill")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--force", default=None, help="overlap variants: TEMPLATE or TEMPLATE@{config json} "
                    "(dry run default: signal_reorder; on CPU the predictor keeps the baseline)")
    ap.add_argument("--steps", type=int, default=3, help="calls per phase whose peak is 'steady'")
    ap.add_argument("--warmup", type=int, default=2, help="calls between the first one and the steady ones")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds after which no further variant starts (default 270 on GPUs, none on a dry run)")
    ap.add_argument("--at-peak", action="store_true",
                    help="CUDA: record the allocator's history from each variant's start and list what was live at "
                         "its peak (in the first, warm-up or steady calls, whichever held most: row 'peak_in'), by "
                         "allocation site (row 'at_peak'; markdown beside the table)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, world 2, tiny shapes")
    ap.add_argument("--world", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args(argv)
    a.dry_run = a.dry_run or not torch.cuda.is_available()
    for opt, vals, allowed in (("--modes", a.modes or "default", ("default", "reduce-overhead")),
                               ("--phases", a.phases, PHASES), ("--variants", a.variants, VARIANTS)):
        bad = [v for v in vals.split(",") if v not in allowed]
        if bad:
            raise SystemExit(f"{opt}: {bad} not among {', '.join(allowed)}")
    if a.steps < 1 or a.warmup < 0:
        raise SystemExit(f"--steps ({a.steps}) must be >= 1 and --warmup ({a.warmup}) >= 0")
    if a.dry_run:
        a.modes = a.modes or "default"
        a.force = a.force or "signal_reorder"
        a.time_budget = a.time_budget or 0.0
    else:
        a.modes = a.modes or "default,reduce-overhead"
        a.time_budget = 270.0 if a.time_budget is None else a.time_budget
    a.start_time = time.time()
    return a


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse(argv)
    if under_torchrun():  # this process is one rank
        return as_rank(worker, lambda rows: finish(rows, a), vars(a), a.dry_run)
    from overlap_compile.testing.multiprocess import run_distributed

    rows = run_distributed("benchmarks.diagnostics.memory_account.worker", world_size=a.world, args=(vars(a),),
                           backend="gloo" if a.dry_run else "nccl",
                           timeout_s=(a.time_budget + 300) if a.time_budget else 1800)[0]
    finish(rows, a)
    return rows


if __name__ == "__main__":
    main()
