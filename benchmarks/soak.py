"""Soak: random sites for a given number of minutes on W GPUs, every template forced and the
predictor's choice, host-launched and under CUDA graphs, each compared with eager on every call.

    python benchmarks/soak.py --minutes 10 --world 2 --out $OUT
    python benchmarks/soak.py --dry-run --minutes 0.1      # CPU, gloo, the reference implementations

Each round takes the next case (template, kind, dtype, launch mode: templates in turn, "auto" being
the predictor's choice, and each template's cases once per pass in a shuffled order; ``Cases``)
and draws one site for every rank alike (a shared seed): M small (16-1024, as in decoding) or large,
a multiple of no tile (odd, or W times an odd count where the collective splits rows in W), N, K. On GPUs the site is compiled with the overlap backend
(``mode="reduce-overhead"`` for "cuda_graph") and called for ``--slice`` seconds on 4 input sets in
turn, each output compared with eager's on the device (no host sync per call); then the compiled
code and the ops' buffers are released, as a recompile would. The dry run rewrites the traced site
with the pass and runs the reference ops. Counted per (template, kind, dtype, mode): calls, wrong results, wait timeouts,
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
RACE_SETS = 4  # input sets per site, used in turn: consecutive calls never see the same inputs
MAX_CALLS = 50_000  # per site


def draw_site(rng: random.Random, world: int, small_dims: bool, kind: str | None = None,
              dtype: str | None = None) -> dict:
    """One random site (``kind`` / ``dtype`` drawn unless given): M small (16-1024, as in decoding)
    or large, odd, a multiple of no tile; N, K multiples of 8 (TMA rows of 16 bytes)."""
    kind = kind or rng.choice(KINDS)
    if small_dims:
        m, n, k = rng.randint(3, 70), 8 * rng.randint(1, 12), 8 * rng.randint(1, 12)
    else:
        m = rng.randint(16, 1024) if rng.random() < 0.5 else rng.randint(1025, 8192)
        n, k = 8 * rng.randint(16, 768), 8 * rng.randint(16, 768)
    m |= 1  # odd: a multiple of no tile
    if kind == "allgather_gemm":
        rows = max(1, m // world) | 1  # the shard's rows; M = W * rows
        m = rows * world
    elif kind in ("gemm_reducescatter", "gemm_alltoall") or rng.random() < 0.5:
        # the collective splits dim 0 in W (all-reduce: half the time, for templates that cut the
        # output in W row stripes): W times an odd count
        m = world * (max(1, m // world) | 1)
    return {"kind": kind, "m": m, "n": n, "k": k, "dtype": dtype or rng.choice(DTYPES)}


def templates_for(kind: str) -> list[str]:
    from overlap_compile import templates

    return ["auto"] + [t for t in templates.names()
                       if t not in ("baseline",) and kind in templates.get_spec(t).kinds]


class Cases:
    """The (template, kind, dtype, mode) cases in turn: templates round-robin (each gets as many
    sites), and within a template its (kind, dtype, mode) cases, every one once per pass in a
    shuffled order. A kind a forced template has not taken ``GIVE_UP`` sites in a row (its profile
    does not offer it there) leaves that template's turn; "auto" keeps every kind."""

    GIVE_UP = 4

    def __init__(self, rng: random.Random, modes: tuple[str, ...], only: list[str] | None = None) -> None:
        self.rng = rng
        names = [t for t in dict.fromkeys(t for k in KINDS for t in templates_for(k)) if not only or t in only]
        if not names:
            raise ValueError(f"--templates {only}: none of them is a template of {KINDS} (known: "
                             f"{', '.join(dict.fromkeys(t for k in KINDS for t in templates_for(k)))})")
        self.todo = {t: [(k, d, m) for k in KINDS if t in templates_for(k) for d in DTYPES for m in modes]
                     for t in names}
        self.turn = {t: [] for t in self.todo}
        self.missed: dict[tuple[str, str], int] = {}
        self.step = 0

    def next(self) -> tuple[str, str, str, str]:
        live = [t for t in self.todo if self.todo[t]]
        template = live[self.step % len(live)]
        self.step += 1
        if not self.turn[template]:
            self.turn[template] = list(self.todo[template])
            self.rng.shuffle(self.turn[template])
        return (template, *self.turn[template].pop())

    def took(self, template: str, kind: str, took: bool) -> None:
        key = (template, kind)
        self.missed[key] = 0 if took or template == "auto" else self.missed.get(key, 0) + 1
        if self.missed[key] >= self.GIVE_UP:
            self.todo[template] = [c for c in self.todo[template] if c[0] != kind]
            self.turn[template] = [c for c in self.turn[template] if c[0] != kind]


class Watchdog:
    """Notes each finished chunk of calls; if none finishes for ``limit_s``, records a hang for what
    is running, saves the counts and ends the process (exit code 4): a hang is counted, not waited out."""

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
    """(fn(a, b), rewritten by ``template``?, chosen template) for this site; fn runs the compiled
    (GPU) or pass-rewritten (dry run) site."""
    from overlap_compile import config
    from overlap_compile.testing.patterns import gemm_then_collective

    forced = {} if template == "auto" else {"force_template": template}
    if dry_run:
        from torch.fx.experimental.proxy_tensor import make_fx

        from overlap_compile.passes.pipeline import run_on_graph

        gm = make_fx(gemm_then_collective(site["kind"], group, world), tracing_mode="fake")(a, b)
        with config.patch(**forced):
            record = run_on_graph(gm.graph, config.current())
        gm.recompile()
        s = record.sites[0]
        return gm, (s.rewritten and (template == "auto" or s.template == template)), s.template
    import functools

    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend

    report = oc.Report()

    def backend(gm, example_inputs):
        counters["compiles"] += 1
        return functools.partial(overlap_backend, report=report,
                                 mode="reduce-overhead" if mode == "cuda_graph" else None)(gm, example_inputs)

    with config.patch(**forced):
        fn = torch.compile(gemm_then_collective(site["kind"], group, world), backend=backend, dynamic=False)
        fn(a, b)  # compiled here, under the options
    sites = report.sites
    chosen = sites[0].template if sites and sites[0].rewritten else "baseline"
    ok = bool(sites) and sites[0].rewritten and (template == "auto" or chosen == template)
    return fn, ok, chosen


def _agreed(dev: torch.device, *values: int) -> list[int]:
    """Rank 0's ``values`` on every rank (a broadcast, which also keeps the ranks in step)."""
    t = torch.tensor(values, device=dev, dtype=torch.int64)
    dist.broadcast(t, 0)
    return [int(v) for v in t.tolist()]


def run_site(fn, eager, sets: list, tol: float, slice_s: float, min_calls: int, max_calls: int, dev, beat,
             step_begin=lambda: None) -> tuple:
    """Calls ``fn`` on the input sets in turn (consecutive calls never see the same inputs) for
    about ``slice_s`` seconds (rank 0's clock; at least ``min_calls``), each output compared with
    eager's for its set on the device, with no host sync per call. Returns (calls, wrong, max rel err)."""
    refs = [eager(a, b) for a, b in sets]
    wrong = torch.zeros((), dtype=torch.int64, device=dev)
    worst = torch.zeros((), dtype=torch.float32, device=dev)
    calls, chunk, t0 = 0, 8, time.monotonic()
    while True:
        for i in range(chunk):
            a, b = sets[(calls + i) % len(sets)]
            want = refs[(calls + i) % len(sets)]
            step_begin()  # reduce-overhead: a new step, the last call's output is no longer read
            got = fn(a, b)
            err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)
            bad = ~(err <= tol)  # NaN counts as wrong
            wrong += bad
            worst = torch.maximum(worst, torch.where(bad & err.isnan(), float("inf"), err))
            del got
        calls += chunk
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        beat()
        spent = time.monotonic() - t0
        more = calls < min_calls or (spent < slice_s and calls < max_calls)
        grow = chunk * 2 if spent / calls * chunk * 2 < 0.5 else chunk  # chunks of up to ~0.5 s
        go, chunk = _agreed(dev, int(more), min(grow, max(8, max_calls - calls)))
        if not go:
            return calls, int(wrong), float(worst)


def soak_worker(minutes: float, slice_s: float, min_calls: int, dry_run: bool, seed: int, state_dir: str,
                only: list[str] | None = None) -> dict:
    from overlap_compile import config, templates
    from overlap_compile.runtime import teardown
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
                         "timeouts": 0, "hangs": 0, "recompiles": 0, "errors": 0, "sites": 0, "sites_run": 0,
                         "chosen": {}, "max_rel_err": 0.0, "peak_mem_gib": 0.0}
        return rows[key]

    dog = Watchdog(config.current().signal_timeout_ms / 1000 + HANG_MARGIN_S, on_hang)
    deadline = time.monotonic() + minutes * 60
    todo = Cases(rng, ("eager",) if dry_run else ("eager", "cuda_graph"), only)
    step = 0
    while True:
        # every rank stops after the same round: rank 0's clock decides
        (go,) = _agreed(dev, 1 if (time.monotonic() < deadline or step == 0) else 0)
        if not go:
            break
        template, kind, dtype_name, mode = todo.next()
        site = draw_site(rng, world, small_dims=dry_run, kind=kind, dtype=dtype_name)
        dtype = getattr(torch, dtype_name)
        r = row(template, kind, dtype_name, mode)
        dog.beat((template, kind, dtype_name, mode))
        g = torch.Generator(device=dev).manual_seed(seed * 1000 + step * 10 + rank)
        rows_in = site["m"] // world if kind == "allgather_gemm" else site["m"]

        def fresh():
            return (torch.randn(rows_in, site["k"], device=dev, dtype=dtype, generator=g) / 4,
                    torch.randn(site["k"], site["n"], device=dev, dtype=dtype, generator=g) / 4)

        counters = {"compiles": 0}
        step += 1
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        fn = None
        try:
            sets = [fresh() for _ in range(RACE_SETS)]
            fn, took, chosen = _site_fn(site, template, mode, group, world, dry_run, *sets[0], counters)
            r["sites"] += 1
            r["chosen"][chosen] = r["chosen"].get(chosen, 0) + 1
            todo.took(template, kind, took)
            if took or template == "auto":  # a forced template that does not take the site: nothing to count
                calls, wrong, worst = run_site(fn, gemm_then_collective(kind, group, world), sets, TOL[dtype_name],
                                               0.0 if dry_run else slice_s, min_calls, MAX_CALLS, dev, dog.beat,
                                               torch.compiler.cudagraph_mark_step_begin if mode == "cuda_graph"
                                               else (lambda: None))
                r["sites_run"] += 1
                r["calls"] += calls
                r["wrong"] += wrong
                r["max_rel_err"] = max(r["max_rel_err"], worst)
            r["recompiles"] += max(0, counters["compiles"] - 1)
        except Exception as e:  # a failed call is counted; the ranks stay in step (same draws)
            name = type(e).__name__
            r["timeouts" if "Timeout" in name else "errors"] += 1
            r.setdefault("last_error", f"{site}: {name}: {str(e)[:300]}")
        r["peak_mem_gib"] = max(r["peak_mem_gib"], _peak_gib(dev))
        # the next site starts afresh, as after a recompile: the compiled code, its CUDA graphs and
        # the ops' buffers of the group go (all ranks idle first: no peer still writes into them)
        del fn
        if not dry_run:
            torch._dynamo.reset()
            torch.cuda.synchronize(dev)
            dist.barrier()
            teardown.release(group)
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


def summary(paths: list[str]) -> dict[str, dict]:
    """Soak files' rows summed per device and template: calls, failures (wrong + timeouts + hangs +
    errors), cases run and the fewest calls of a case that ran, for the README's figures."""
    out: dict[str, dict] = {}
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        for r in rows:
            key = (r["template"], r["kind"], r["dtype"], r["mode"])
            d = out.setdefault(r["device"], {}).setdefault(r["template"], {"calls": 0, "failures": 0, "cases": {}})
            d["calls"] += r["calls"]
            d["failures"] += r["wrong"] + r["timeouts"] + r["hangs"] + r["errors"]
            if r["calls"]:
                d["cases"][key] = d["cases"].get(key, 0) + r["calls"]
    for templates_ in out.values():
        for d in templates_.values():
            calls = d.pop("cases")
            d["cases_run"], d["fewest_calls_of_a_case"] = len(calls), min(calls.values(), default=0)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--world", type=int, default=None, help="processes (default: the GPUs, 2 for --dry-run)")
    ap.add_argument("--slice", type=float, default=2.0, help="seconds of calls per site (rank 0's clock)")
    ap.add_argument("--calls", type=int, default=64, help="at least this many calls per site")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--templates", default="", help="comma list: only these (auto = the predictor's choice); default all")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, the reference implementations")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--summarize", nargs="+", metavar="FILE", help="print soak files' totals per device and "
                    "template instead of running")
    args = ap.parse_args(argv)
    if args.summarize:
        totals = summary(args.summarize)
        for device, per in totals.items():
            for t, d in sorted(per.items()):
                print(f"{device}: {t:>16} {d['calls']:8d} calls, {d['failures']} failed, {d['cases_run']} cases run, "
                      f"fewest calls of a case {d['fewest_calls_of_a_case']}")
        return []
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
            run_distributed(soak_worker, world_size=world, args=(args.minutes, args.slice, args.calls, args.dry_run, args.seed, state,
                                                       [t for t in args.templates.split(",") if t] or None),
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
