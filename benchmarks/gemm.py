"""GEMM benchmark on one GPU: signal_reorder's Triton GEMM vs cuBLAS (torch.mm).

    python benchmarks/gemm.py --out $OUT            # every gemm_* shape of shapes.json, bf16
    python benchmarks/gemm.py --out $OUT --op       # + the whole op on a 1-rank NCCL group

Per unique (M, N, K) of the gemm_* sets:
  cublas         torch.mm
  triton         kernels.gemm with the best of kernels.candidate_configs (tuned here, cached)
  triton_signal  kernels.gemm_signal_into: the same tiles with the signalling epilogue (tile
                 stored at its send slot; per program and wave group one CTA barrier and
                 release atomic) on the plan the site would get (all-reduce: 1 stripe;
                 reduce-scatter / all-to-all: 4 stripes), 4 wave groups, programs = SM count
cuBLAS, Triton and Triton+signal are timed in ``--repeat`` interleaved rounds (median).
Times are triton.testing.do_bench medians (ms, CUDA events): "cuda_graph" rows time 10 calls
captured in one CUDA graph (kernel time, what the tuning and the table use); "eager" rows time
host-launched calls (Triton's Python launch cost shows on the smallest shapes). Each Triton
result is checked against torch.mm in the same run (``correct``).

Rows follow DESIGN.md's schema and go to <out>/gemm-<device>-w1-torch<v>-<date>.json
(benchmarks/results_io.py); the tuned configs
go to <out>/gemm-configs-<device>-<date>.json (kernels.py's JSON cache format; point
OVERLAP_COMPILE_GEMM_CACHE at it to reuse them). A table with the ratios is printed last.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root

from benchmarks.results_io import write_rows  # noqa: E402
from benchmarks.timing import graphed  # noqa: E402
from overlap_compile.templates.plans import GemmCollectivePlan  # noqa: E402
from overlap_compile.tiling import TileGrid, cdiv, even_wave_groups  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE_FILES = [os.path.join(HERE, "..", "..", "shared", "shapes.json"), os.path.join(HERE, "shapes.json")]
STRIPED = {"gemm_reducescatter": 4, "gemm_alltoall": 4}


def load_shapes(path: str | None) -> dict[tuple[int, int, int], list[str]]:
    """Unique (M, N, K) -> the gemm_* sets it appears in."""
    for p in [path] if path else SHAPE_FILES:
        if p and os.path.exists(p):
            with open(p) as f:
                data = json.load(f)
            break
    else:
        raise SystemExit(f"no shapes.json found (tried {path or SHAPE_FILES}); pass --shapes")
    shapes: dict[tuple[int, int, int], list[str]] = {}
    sets = [k for k in data if k.startswith("gemm_") or k == "allgather_gemm"]
    for s in sets:
        for m, n, k in data[s]:
            shapes.setdefault((m, n, k), []).append(s)
    return shapes


def signal_plan(kind: str, m: int, n: int, k: int, cfg, programs: int, flat: bool = False) -> GemmCollectivePlan:
    world = 1 if flat else STRIPED.get(kind, 1)
    if kind == "gemm_allreduce" or world == 1 or m % world:
        kind, world, outer, chunk, rows, stripes = "gemm_allreduce", 1, 1, m, m, 1
    else:
        outer, chunk, rows, stripes = 1, m // world, m // world, world
    tiles = TileGrid(rows, n, cfg.block_m, cfg.block_n, cfg.group_m).num_tiles * stripes
    programs = max(stripes, min(programs, tiles) // stripes * stripes)
    return GemmCollectivePlan(
        template="signal_reorder", kind=kind, m=m, n=n, k=k, world=world,
        reduce_op=None if kind == "gemm_alltoall" else "sum", outer=outer, chunk=chunk, has_bias=False,
        config={"block_m": cfg.block_m, "block_n": cfg.block_n, "group_m": cfg.group_m, "programs": programs,
                "wave_groups": list(even_wave_groups(cdiv(tiles, programs), 4))},
    )


def op_rows(args, shapes, rows, table_op, capture, bench, row, sms) -> None:
    """kernels.run (GEMM + bounded wait + NCCL per wave group) vs torch.mm + all_reduce on a
    1-rank NCCL group: on one GPU the collective is nearly free, so this shows what the
    signalling machinery itself costs (waits, per-group NCCL launches, stream joins)."""
    import torch.distributed as dist

    from overlap_compile.templates.signal_reorder import kernels as K
    from overlap_compile.templates.signal_reorder import reference
    from overlap_compile.testing.multiprocess import free_port
    from overlap_compile.tiling import untile

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    pg = dist.group.WORLD
    for (m, n, k), sets in shapes.items():
        if "gemm_allreduce" not in sets:
            continue
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        cfg = K.choose_config(a.device, m, n, k, a.dtype)
        plan = signal_plan("gemm_allreduce", m, n, k, cfg, sms)
        grid, _ = reference.layout(plan)

        def seq():
            torch.mm(a, b, out=y)
            dist.all_reduce(y, group=pg)

        res = {}
        for mode in ("spin", "stream"):
            os.environ["OVERLAP_COMPILE_SIGNAL_WAIT"] = mode
            out = K.run(a, b, None, pg.group_name, plan)
            seq()
            ok = rel_err(untile(out, grid), y) < 1e-2
            res[mode] = (capture(lambda: K.run(a, b, None, pg.group_name, plan), calls=5)(), ok)
            row("gemm_allreduce", (m, n, k), "signal_reorder", {**plan.config, "wait": mode}, res[mode][0], ok,
                world_note="1-rank NCCL group")
            row("gemm_allreduce", (m, n, k), "signal_reorder", {**plan.config, "wait": mode},
                bench(lambda: K.run(a, b, None, pg.group_name, plan)), ok, mode="eager", world_note="1-rank NCCL group")
            K.check_errors()
        os.environ["OVERLAP_COMPILE_SIGNAL_WAIT"] = "spin"
        t_seq = capture(seq, calls=5)()
        row("gemm_allreduce", (m, n, k), "sequential", None, t_seq, world_note="1-rank NCCL group")
        row("gemm_allreduce", (m, n, k), "sequential", None, bench(seq), mode="eager", world_note="1-rank NCCL group")
        table_op.append((m, n, k, t_seq, res["spin"][0], res["stream"][0], plan.config["wave_groups"]))
        print(f"op {m}x{n}x{k}: mm+AR {t_seq:.3f} signal_reorder spin {res['spin'][0]:.3f} "
              f"stream {res['stream'][0]:.3f} (correct {res['spin'][1]} {res['stream'][1]})", flush=True)
        del a, b, y


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help="shapes.json (default: ../shared/shapes.json, else benchmarks/)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    ap.add_argument("--limit", type=int, default=0, help="only the first N shapes (smoke runs)")
    ap.add_argument("--sets", default="", help="comma-separated shape sets to run (default: every gemm_* set)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds for cuBLAS / Triton / signal")
    ap.add_argument("--op", action="store_true",
                    help="also time the whole op (kernels.run) on a 1-rank NCCL group for the all-reduce shapes")
    ap.add_argument("--signal-at", default="group_end",
                    help="comma-separated signalling points to time (kernels.SIGNAL_AT: group_end, next_tile, "
                         "none); the first is the table's 'signal' column, the others get a table of their own")
    ap.add_argument("--flat", action="store_true",
                    help="lay every kind's signalling GEMM out as the all-reduce one (one stripe, no stripe "
                         "interleaving): with --signal-at none, what the striped tile order itself costs")
    args = ap.parse_args()
    signal_modes = args.signal_at.split(",")

    import triton
    from triton.testing import do_bench

    from overlap_compile.templates.signal_reorder import kernels as K

    assert torch.cuda.is_available() and K.available(), "needs a CUDA GPU with Triton"
    dev = torch.device("cuda", 0)
    device = torch.cuda.get_device_name(dev)
    tag = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-")
    date = datetime.date.today().isoformat()
    os.environ["OVERLAP_COMPILE_GEMM_CACHE"] = os.path.join(args.out, f"gemm-configs-{tag}-{date}.json")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    dtype = torch.bfloat16
    shapes = load_shapes(args.shapes)
    if args.sets:
        wanted = set(args.sets.split(","))
        shapes = {shape: sets for shape, sets in shapes.items() if wanted & set(sets)}
    items = list(shapes.items())[: args.limit or None]
    rows, table, variants = [], [], []

    def bench(fn) -> float:
        """Host-launched: one launch per call (Triton's Python launch cost included)."""
        return do_bench(fn, warmup=25, rep=args.rep, return_mode="median")

    def capture(fn, calls: int = 10):
        """``calls`` calls of fn captured in one CUDA graph (timing.graphed, 2 warm-up calls);
        returns a timer of one call (ms)."""
        replay = graphed(fn, calls=calls, warmup=2)
        torch.cuda.synchronize()
        return lambda: do_bench(replay, warmup=25, rep=args.rep, return_mode="median") / calls

    def bench_graph(fn) -> float:
        """Kernel time without launch gaps (graph replay)."""
        return capture(fn)()

    def interleaved(timers: dict) -> dict:
        """Median over ``--repeat`` rounds, the methods alternating within each round, so that
        clock and thermal drift hit every method alike (the same kernel timed twice in a row
        differed by up to 10% here)."""
        got = {name: [] for name in timers}
        for _ in range(args.repeat):
            for name, t in timers.items():
                got[name].append(t())
        return {name: statistics.median(v) for name, v in got.items()}

    def row(kind, shape, method, config, ms, correct=None, mode="cuda_graph", **extra):
        r = {"benchmark": "gemm", "device": device, "world_size": 1, "torch": torch.__version__,
             "triton": triton.__version__, "date": date, "kind": kind, "shape": list(shape), "method": method,
             "config": config, "mode": mode, "ms": ms, "dtype": "bfloat16", **extra}
        if correct is not None:
            r["correct"] = correct
        rows.append(r)

    for (m, n, k), sets in items:
        kind = sets[0]
        g = torch.Generator(device=dev).manual_seed(m + 3 * n + 7 * k)
        a = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
        b = torch.randn(k, n, device=dev, dtype=dtype, generator=g)
        ref = torch.mm(a, b)
        out = torch.empty_like(ref)
        cublas_timer = capture(lambda: torch.mm(a, b, out=out))
        row(kind, (m, n, k), "cublas", None, bench(lambda: torch.mm(a, b, out=out)), mode="eager", sets=sets)
        # tune: every candidate, checked and timed (graph mode: kernel time); the best is cached
        timings = []
        for cfg in K.candidate_configs(dtype):
            try:
                out.fill_(float("nan"))
                K.gemm(a, b, config=cfg, out=out)
                ok = rel_err(out, ref) < 1e-2
                ms = bench_graph(lambda: K.gemm(a, b, config=cfg, out=out)) if ok else None
            except Exception as e:  # a config this Triton cannot build: record and move on
                print(f"  {m}x{n}x{k} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                ok, ms = False, None
            timings.append((cfg, ms, ok))
            row(kind, (m, n, k), "triton_candidate", cfg.to_dict(), ms, ok, sets=sets)
        good = [(ms, cfg) for cfg, ms, ok in timings if ok and ms is not None]
        if not good:
            t_cublas = cublas_timer()
            row(kind, (m, n, k), "cublas", None, t_cublas, sets=sets)
            table.append((m, n, k, kind, t_cublas, None, None, None, None))
            continue
        _, best = min(good, key=lambda x: x[0])
        key = K._shape_key(dev, m, n, k, dtype)
        K._cache()[key] = {"best": best.to_dict(),
                           "timings": [[c.to_dict(), ms] for c, ms, ok in timings if ok and ms is not None]}
        timers = {"cublas": cublas_timer, "triton": capture(lambda: K.gemm(a, b, config=best, out=out))}
        row(kind, (m, n, k), "triton", best.to_dict(), bench(lambda: K.gemm(a, b, config=best, out=out)), True,
            mode="eager", sets=sets)
        # the signalling epilogue on the same tiles
        t_sig = t_same = None
        if kind != "allgather_gemm":
            from overlap_compile.templates.signal_reorder import reference
            from overlap_compile.tiling import untile

            plan = signal_plan(kind, m, n, k, best, sms, args.flat)
            grid, sched = reference.layout(plan)
            send, counters = K.gemm_signal_into(a, b, None, plan, config=best, signal_at=signal_modes[0])
            if sched.stripes == 1:
                ok = rel_err(untile(send, grid), ref) < 1e-2
            else:  # every stripe's rows, re-assembled (RowStripes.place), against the product
                rows_ = torch.empty_like(ref)
                per = sched.num_exec // sched.stripes
                # exec ranges per group are [W, n_g] blocks: gather each stripe's tiles in order
                parts = [[] for _ in range(sched.stripes)]
                for lo, hi in sched.exec_ranges():
                    blk = send[lo:hi].view(sched.stripes, (hi - lo) // sched.stripes, grid.block_m, grid.block_n)
                    for j in range(sched.stripes):
                        parts[j].append(blk[j])
                for j in range(sched.stripes):
                    plan.stripes.place(rows_, j, untile(torch.cat(parts[j]), grid))
                ok = rel_err(rows_, ref) < 1e-2 and per == grid.num_tiles
            want_counts = [0 if signal_modes[0] == "none" else hi - lo for lo, hi in sched.exec_ranges()]
            ok = ok and counters.tolist() == want_counts
            counts_ok = {}
            for mode in signal_modes[1:]:  # each other signalling point: one checked call, then timed
                counters.zero_()
                K.gemm_signal_into(a, b, None, plan, send=send, counters=counters, config=best, signal_at=mode)
                counts_ok[mode] = counters.tolist() == [0 if mode == "none" else hi - lo
                                                        for lo, hi in sched.exec_ranges()]
                timers[f"signal:{mode}"] = capture(
                    lambda mode=mode: K.gemm_signal_into(a, b, None, plan, send=send, counters=counters, config=best,
                                                         signal_at=mode))
            counters.zero_()
            timers["signal"] = capture(lambda: K.gemm_signal_into(a, b, None, plan, send=send, counters=counters,
                                                                  config=best, signal_at=signal_modes[0]))
            nows = dataclasses.replace(best, warp_specialize=False)
            if best.warp_specialize:  # the signalling kernel never uses it: compare like with like too
                timers["triton_nows"] = capture(lambda: K.gemm(a, b, config=nows, out=out))
            cfg_row = {**best.to_dict(), **plan.config, "stripes": sched.stripes, "signal_at": signal_modes[0]}
            row(plan.kind, (m, n, k), "triton_signal", cfg_row,
                bench(lambda: K.gemm_signal_into(a, b, None, plan, send=send, counters=counters, config=best,
                                                 signal_at=signal_modes[0])), ok,
                mode="eager", sets=sets)
        med = interleaved(timers)
        t_cublas, t_best = med["cublas"], med["triton"]
        row(kind, (m, n, k), "cublas", None, t_cublas, sets=sets, tflops=2 * m * n * k / t_cublas / 1e9)
        row(kind, (m, n, k), "triton", best.to_dict(), t_best, True, sets=sets, ratio_vs_cublas=t_cublas / t_best)
        if "signal" in med:
            t_sig = med["signal"]
            t_same = med.get("triton_nows", t_best)
            row(plan.kind, (m, n, k), "triton_signal", cfg_row, t_sig, ok, sets=sets,
                overhead_vs_triton=t_sig / t_best - 1, overhead_vs_same_config=t_sig / t_same - 1)
            for mode in signal_modes[1:]:
                t_mode = med[f"signal:{mode}"]
                row(plan.kind, (m, n, k), "triton_signal", {**cfg_row, "signal_at": mode}, t_mode, counts_ok[mode],
                    sets=sets, overhead_vs_triton=t_mode / t_best - 1, overhead_vs_same_config=t_mode / t_same - 1)
                variants.append((m, n, k, kind, mode, t_mode / t_same - 1, t_sig / t_same - 1, counts_ok[mode]))
        table.append((m, n, k, kind, t_cublas, t_best, t_sig, best, t_same))
        print(f"{m}x{n}x{k} {kind}: cublas {t_cublas:.3f} triton {t_best:.3f} "
              f"({t_cublas / t_best:.2f}x) signal {t_sig if t_sig is None else round(t_sig, 3)}", flush=True)
        del a, b, ref, out
        torch.cuda.empty_cache()

    table_op: list = []
    if args.op:
        op_rows(args, shapes, rows, table_op, capture, bench, row, sms)

    path = write_rows(rows, args.out, "gemm", device, 1, date=date, suffix="-flat" if args.flat else "")
    K._save_cache()
    print(f"\nwrote {path} and {K.cache_path()}")
    print(f"\n{'M x N x K':>20} {'set':>20} {'cuBLAS':>8} {'Triton':>8} {'cuB/Tri':>8} {'signal':>8} {'epi%':>6} "
          f"{'epi%same':>8}  config")
    ratios, epis = [], []
    for m, n, k, kind, tc, tt, ts, cfg, tsame in table:
        if tt is None:
            print(f"{f'{m}x{n}x{k}':>20} {kind:>20} {tc:8.3f} {'fail':>8}")
            continue
        ratios.append(tc / tt)
        epi = f"{100 * (ts / tt - 1):6.1f}" if ts else "     -"
        epi_same = f"{100 * (ts / tsame - 1):8.1f}" if ts and tsame else "       -"
        if ts:
            epis.append(ts / tt)
        sig = f"{ts:8.3f}" if ts else "       -"
        c = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps}" + (" ws" if cfg.warp_specialize else "")
        print(f"{f'{m}x{n}x{k}':>20} {kind:>20} {tc:8.3f} {tt:8.3f} {tc / tt:8.2f} {sig} {epi} {epi_same}  {c}")
    if variants:
        print(f"\nsignalling points vs the plain kernel with the same config (CUDA graph), "
              f"'{signal_modes[0]}' first:")
        for m, n, k, kind, mode, over, first, ok in variants:
            print(f"{f'{m}x{n}x{k}':>20} {kind:>20} {signal_modes[0]} {100 * first:+6.1f}%  {mode} {100 * over:+6.1f}%"
                  f"{'' if ok else '  COUNTERS WRONG'}")
        for mode in signal_modes[1:]:
            xs = [1 + over for *_, md, over, _, _ in variants if md == mode]
            ys = [1 + first for *_, md, _, first, _ in variants if md == mode]
            gx = statistics.geometric_mean(xs)
            gy = statistics.geometric_mean(ys)
            print(f"{mode}: geomean {100 * (gx - 1):+.1f}% (max {100 * (max(xs) - 1):+.1f}%) against "
                  f"{signal_modes[0]} {100 * (gy - 1):+.1f}% (max {100 * (max(ys) - 1):+.1f}%)")
    if table_op:
        print(f"\nthe whole op on a 1-rank NCCL group (GEMM + per-group wait + NCCL), CUDA graph, ms:")
        print(f"{'M x N x K':>20} {'mm+AR':>8} {'spin':>8} {'stream':>8}  groups")
        for m, n, k, t_seq, t_spin, t_stream, groups in table_op:
            print(f"{f'{m}x{n}x{k}':>20} {t_seq:8.3f} {t_spin:8.3f} {t_stream:8.3f}  {groups}")
    if ratios:
        import math

        gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"cuBLAS/Triton: geomean {gm:.3f}, min {min(ratios):.3f}, shapes >= 0.90: "
              f"{sum(r >= 0.9 for r in ratios)}/{len(ratios)}")
        if epis:
            ge = math.exp(sum(math.log(r) for r in epis) / len(epis))
            print(f"signalling epilogue / best plain Triton: geomean {100 * (ge - 1):+.1f}%, "
                  f"max {100 * (max(epis) - 1):+.1f}%")


if __name__ == "__main__":
    main()
