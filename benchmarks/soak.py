"""Soak: random sites for a given number of minutes on W GPUs, every template forced and the
predictor's choice, host-launched and under CUDA graphs, each compared with eager on every call.

    python benchmarks/soak.py --minutes 10 --world 2 --out $OUT
    python benchmarks/soak.py --dry-run --minutes 0.1      # CPU, gloo, the reference implementations

Each round draws one site for every rank alike (a shared seed): a kind, M (small, 16-1024 as in
decoding, or large; odd, not a multiple of any tile, and for all-reduce not of W either), N, K,
a dtype (bf16 / fp16 / fp32), a template ("auto" = the predictor's choice, or one forced where it
takes the kind) and a launch mode. On GPUs the site is compiled with the overlap backend
(``mode="reduce-overhead"`` for "cuda_graph") and run ``--calls`` times with new inputs; the dry
run rewrites the traced site with the pass (benchmarks/ops.py's ``rewritten``) and runs the
reference ops. Counted per (template, kind, dtype, mode): calls, wrong results, wait timeouts,
hangs (a watchdog: no call finished for signal_timeout_ms + 30 s; the run then stops), recompiles,
peak memory. "auto" rows count what the predictor chose; forced rows only sites the template
rewrote on the profile in effect (a GPU profile refuses what it does not offer). Rows
(DESIGN.md's schema, benchmark "soak") go to <out>/soak-<device>-w<W>-...json; the ranks end with
a barrier and destroy_process_group (runtime.teardown.finish), and the run prints nothing after
its table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # the repository root

from benchmarks.results_io import write_rows  # noqa: E402

KINDS = ("gemm_allreduce", "gemm_reducescatter", "allgather_gemm", "gemm_alltoall")
DTYPES = ("bfloat16", "float16", "float32")
TOL = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 1e-2}
HANG_MARGIN_S = 30.0


def draw_site(rng: random.Random, world: int, small_dims: bool) -> dict:
    """One random site: kind, M (small or large, odd), N, K (multiples of 8: TMA rows of 16 bytes)."""
    kind = rng.choice(KINDS)
    if small_dims:
        m, n, k = rng.randint(3, 70), 8 * rng.randint(1, 12), 8 * rng.randint(1, 12)
    else:
        m = rng.randint(16, 1024) if rng.random() < 0.5 else rng.randint(1025, 8192)
        n, k = 8 * rng.randint(16, 1024), 8 * rng.randint(16, 1024)
    m |= 1  # odd: a multiple of no tile
    if kind == "allgather_gemm":
        rows = max(1, m // world) | 1  # the shard's rows; M = W * rows
        m = rows * world
    elif kind in ("gemm_reducescatter", "gemm_alltoall"):
        m = world * (max(1, m // world) | 1)  # the collective splits dim 0 in W: W times an odd count
    return {"kind": kind, "m": m, "n": n, "k": k, "dtype": rng.choice(DTYPES)}


def templates_for(kind: str) -> list[str]:
    from overlap_compile import templates

    return ["auto"] + [t for t in templates.names()
                       if t not in ("baseline",) and kind in templates.get_spec(t).kinds]


class Watchdog:
    """Notes each finished call; if none finishes for ``limit_s``, records a hang for what is
    running, saves the counts and ends the process (exit code 4): a hang is counted, not waited out."""

    def __init__(self, limit_s: float, on_hang) -> None:
        self.limit_s, self.on_hang = limit_s, on_hang
        self.last = time.monotonic()
        self.what: tuple | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="soak-watchdog", daemon=True).start()

    def beat(self, what: tuple | None = None) -> None:
        self.last = time.monotonic()
        if what is not None:
            self.what = what

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            if time.monotonic() - self.last > self.limit_s:
                self.on_hang(self.what)
                os._exit(4)


def _peak_gib(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _site_fn(site: dict, template: str, mode: str, group: str, world: int, dry_run: bool, a, b, counters: dict):
    """(fn(a, b), rewritten by ``template``?) for this site; fn runs the compiled / rewritten site."""
    from overlap_compile import config
    from overlap_compile.testing.patterns import gemm_then_collective

    if dry_run:
        from torch.fx.experimental.proxy_tensor import make_fx

        from overlap_compile.passes.pipeline import run_on_graph

        gm = make_fx(gemm_then_collective(site["kind"], group, world), tracing_mode="fake")(a, b)
        forced = {} if template == "auto" else {"force_template": template}
        with config.patch(**forced):
            record = run_on_graph(gm.graph, config.current())
        gm.recompile()
        s = record.sites[0]
        return gm, (s.rewritten and (template == "auto" or s.template == template)), s.template
    import functools

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend

    torch._dynamo.reset()
    report = oc.Report()

    def backend(gm, example_inputs):
        counters["compiles"] += 1
        return functools.partial(overlap_backend, report=report,
                                 mode="reduce-overhead" if mode == "cuda_graph" else None)(gm, example_inputs)

    forced = {} if template == "auto" else {"force_template": template}
    with config.patch(**forced):
        fn = torch.compile(gemm_then_collective(site["kind"], group, world), backend=backend, dynamic=False)
        fn(a, b)  # compiled here, under the options
    sites = report.sites
    chosen = sites[0].template if sites else "baseline"
    ok = bool(sites) and sites[0].rewritten and (template == "auto" or chosen == template)
    return fn, ok, chosen


def soak_worker(minutes: float, calls: int, dry_run: bool, seed: int, state_dir: str) -> dict:
    from overlap_compile import config, templates
    from overlap_compile.testing.patterns import gemm_then_collective

    templates.load_all_ops()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    dev = torch.device("cuda", torch.cuda.current_device()) if not dry_run else torch.device("cpu")
    rng = random.Random(seed)  # the same draws on every rank
    rows: dict[str, dict] = {}
    state_path = os.path.join(state_dir, f"rank{rank}.json")

    def save() -> None:
        with open(state_path + ".tmp", "w") as f:
            json.dump(list(rows.values()), f)
        os.replace(state_path + ".tmp", state_path)

    def on_hang(what) -> None:
        if what is not None:
            row(*what)["hangs"] += 1
        save()

    def row(template, kind, dtype, mode) -> dict:
        key = f"{template}|{kind}|{dtype}|{mode}"
        if key not in rows:
            rows[key] = {"template": template, "kind": kind, "dtype": dtype, "mode": mode, "calls": 0, "wrong": 0,
                         "timeouts": 0, "hangs": 0, "recompiles": 0, "errors": 0, "sites": 0, "chosen": {},
                         "peak_mem_gib": 0.0}
        return rows[key]

    dog = Watchdog(config.current().signal_timeout_ms / 1000 + HANG_MARGIN_S, on_hang)
    deadline = time.monotonic() + minutes * 60
    modes = ("eager",) if dry_run else ("eager", "cuda_graph")
    step = 0
    while True:
        # every rank stops after the same round: rank 0's clock decides
        flag = torch.tensor([1 if (time.monotonic() < deadline or step == 0) else 0], device=dev)
        dist.broadcast(flag, 0)
        if not int(flag):
            break
        site = draw_site(rng, world, small_dims=dry_run)
        template = rng.choice(templates_for(site["kind"]))
        mode = rng.choice(modes)
        dtype = getattr(torch, site["dtype"])
        r = row(template, site["kind"], site["dtype"], mode)
        dog.beat((template, site["kind"], site["dtype"], mode))
        g = torch.Generator(device=dev).manual_seed(seed * 1000 + step * 10 + rank)
        rows_in = site["m"] // world if site["kind"] == "allgather_gemm" else site["m"]

        def fresh():
            return (torch.randn(rows_in, site["k"], device=dev, dtype=dtype, generator=g) / 4,
                    torch.randn(site["k"], site["n"], device=dev, dtype=dtype, generator=g) / 4)

        counters = {"compiles": 0}
        step += 1
        try:
            a, b = fresh()
            fn, took, chosen = _site_fn(site, template, mode, group, world, dry_run, a, b, counters)
            r["sites"] += 1
            r["chosen"][chosen] = r["chosen"].get(chosen, 0) + 1
            if not took and template != "auto":
                continue  # the template does not take this site here: nothing of it to count
            eager = gemm_then_collective(site["kind"], group, world)
            for _ in range(calls):
                a, b = fresh()
                got, want = fn(a, b), eager(a, b)
                err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
                r["calls"] += 1
                r["wrong"] += int(not err <= TOL[site["dtype"]])
                dog.beat()
            r["recompiles"] += max(0, counters["compiles"] - 1)
        except Exception as e:  # a failed call is counted; the ranks stay in step (same draws)
            name = type(e).__name__
            r["timeouts" if "Timeout" in name else "errors"] += 1
            r.setdefault("last_error", f"{name}: {str(e)[:300]}")
        r["peak_mem_gib"] = max(r["peak_mem_gib"], _peak_gib(dev))
        save()
    dog.stop()
    save()
    return {"rank": rank, "rounds": step}


def merge(state_dir: str, world: int) -> list[dict]:
    """The ranks' counts summed per (template, kind, dtype, mode); peak memory the largest."""
    merged: dict[tuple, dict] = {}
    for rank in range(world):
        path = os.path.join(state_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for r in json.load(f):
                key = (r["template"], r["kind"], r["dtype"], r["mode"])
                m = merged.setdefault(key, {**r, "calls": 0, "wrong": 0, "timeouts": 0, "hangs": 0, "errors": 0,
                                            "recompiles": 0, "peak_mem_gib": 0.0})
                for f_ in ("wrong", "timeouts", "hangs", "errors"):
                    m[f_] += r[f_]
                m["calls"] = max(m["calls"], r["calls"])  # the same calls on every rank
                m["recompiles"] = max(m["recompiles"], r["recompiles"])
                m["peak_mem_gib"] = max(m["peak_mem_gib"], r["peak_mem_gib"])
    return [merged[k] for k in sorted(merged)]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--world", type=int, default=None, help="processes (default: the GPUs, 2 for --dry-run)")
    ap.add_argument("--calls", type=int, default=4, help="calls per site, each with new inputs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, the reference implementations")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    from overlap_compile.testing.multiprocess import DistributedFailure, run_distributed

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.dry_run and gpus < 2:
        raise SystemExit("benchmarks/soak.py needs 2+ GPUs (or --dry-run)")
    world = args.world or (2 if args.dry_run else gpus)
    device = "cpu-gloo" if args.dry_run else torch.cuda.get_device_name(0)
    env = {"OVERLAP_COMPILE_PROFILE": "cpu-gloo"} if args.dry_run else {}
    hung = None
    with tempfile.TemporaryDirectory(prefix="soak-") as state:
        try:
            run_distributed(soak_worker, world_size=world, args=(args.minutes, args.calls, args.dry_run, args.seed, state),
                            backend="gloo" if args.dry_run else "nccl", timeout_s=args.minutes * 60 + 900, env=env)
        except DistributedFailure as e:  # a rank the watchdog ended: its counts are saved
            hung = str(e).splitlines()[0]
        rows = merge(state, world)
    date = datetime.datetime.now().isoformat(timespec="seconds")
    out = [{"benchmark": "soak", **r, "device": device, "world_size": world, "minutes": args.minutes,
            "torch": torch.__version__, "date": date, **({"stopped": hung} if hung else {})} for r in rows]
    path = write_rows(out, args.out, "soak", device, world)
    for r in out:
        print(f"{r['template']:>16} {r['kind']:>20} {r['dtype']:>9} {r['mode']:>10}: {r['calls']:5d} calls, "
              f"wrong {r['wrong']}, timeouts {r['timeouts']}, hangs {r['hangs']}, errors {r['errors']}, "
              f"recompiles {r['recompiles']}, peak {r['peak_mem_gib']:.2f} GiB")
    print(f"soak: {sum(r['calls'] for r in out)} calls in {args.minutes} min on {world}x {device}"
          + (f"; stopped: {hung}" if hung else "") + f"; wrote {path}")
    return out


if __name__ == "__main__":
    rows = main()
    sys.exit(1 if any(r["wrong"] or r["timeouts"] or r["hangs"] or r["errors"] for r in rows) else 0)
