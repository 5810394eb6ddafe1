"""Operator benchmark: GEMM + collective, sequential vs the predictor's choice vs PyTorch
async-TP vs every template, on W GPUs (NCCL).

    python benchmarks/ops.py --world 4 --kinds gemm_allreduce,gemm_reducescatter --out $OUT
    python benchmarks/ops.py --world 2 --kinds all --templates auto,async_tp --time-budget 200
    python benchmarks/ops.py --dry-run          # CPU, gloo, world 2, every kind's first shape / 128

Per shape of shapes.json (or --shapes): the sequential baseline (torch.mm then the collective),
then each method of ``--templates``, each host-launched ("eager") and CUDA-graph captured
("cuda_graph"); correctness is checked against the baseline in the same run; the overlap bound is
max(g, c) + min(g, c) / groups (ANCHORS.md). Shapes run round-robin over the kinds (the first
shape of each, then the second ...); ``--time-budget`` skips those that would not fit. Methods:

* a template name (``NAME@key=value`` restricts its configs): the site rewritten with that
  template forced (no row where it does not support the site);
* ``auto``: what the compiled pass runs for the site: the overlap pass without a forced template,
  i.e. the predictor's decision under the profile in effect (``OVERLAP_COMPILE_PROFILE``; default
  the built-in one of the GPU); the sequential site when it keeps the baseline. ``config``:
  ``{"chosen": template or "baseline", **its config}``, ``reason`` says why;
* ``async_tp``: the sequential site under torch.compile with Inductor's micro-pipeline TP and
  symmetric memory for the group (benchmarks/async_tp.py). Every kind gets its row, rewritten or
  not (all-reduce and all-to-all are not: what a user of async-TP gets); ``config: {"rewritten":
  bool}`` says whether the compiled code calls a fused op. CUDA only: skipped with a note on CPU.

Sites are built the way the compiler builds them: the pattern is traced with make_fx, found by
passes.find, and planned by the template's spec, so the benchmark runs the exact plan a compiled
model would. A method that fails is recorded with its error (ms NaN), the run goes on. Rows follow
DESIGN.md's schema and go to <out>/ops-<device>-w<world>-torch<v>-<date>.json (benchmarks/results_io.py).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # the repository root

from benchmarks.results_io import run_file, write_rows  # noqa: E402
from benchmarks.timing import Budget, graphed, time_ms  # noqa: E402
from overlap_compile import templates  # noqa: E402
from overlap_compile.testing.patterns import KINDS, collective, gemm_then_collective as sequential_fn  # noqa: E402

DEFAULT_SHAPES = os.path.join(HERE, "shapes.json")  # copy of shared/shapes.json
PSEUDO = ("auto", "async_tp")  # methods of --templates that are not templates
DRY_SCALE = 128  # dry run: shapes.json's dims / 128 (8192 -> 64 rows)


def rewritten(kind: str, template: str, a: torch.Tensor, b: torch.Tensor, group: str, world: int):
    """The sequential pattern traced with make_fx and rewritten by the overlap pass with
    ``template`` forced: the op + glue a compiled model runs (minus Inductor's fusion). Template
    ``auto``: nothing forced, the predictor decides; the function then runs whatever it left (the
    sequential site when it kept the baseline)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from overlap_compile import config
    from overlap_compile.passes.pipeline import run_on_graph

    gm = make_fx(sequential_fn(kind, group, world), tracing_mode="fake")(a, b)
    name, _, only = template.partition("@")
    forced = {} if name == "auto" else {"force_template": name}
    with config.patch(**forced), _only_configs(name, only):
        record = run_on_graph(gm.graph, config.current())
    gm.recompile()
    site = record.sites[0]
    return (lambda: gm(a, b)) if site.rewritten or name == "auto" else None, site


def async_tp_site(kind: str, a: torch.Tensor, b: torch.Tensor, group: str, world: int):
    """The sequential site compiled by torch.compile under async-TP: (fn, whether the compiled code
    calls a fused op). Call it inside ``benchmarks.async_tp.async_tp(group)`` and keep that open
    while fn runs (``_method_context``). Compiled here, on first call, with Inductor's caches off so
    its code is generated (and seen) in this run."""
    from torch._inductor.utils import run_and_get_code

    from benchmarks.async_tp import rewrote
    from overlap_compile.compile_caches import no_compile_caches

    with no_compile_caches():  # run_and_get_code resets Dynamo: a fresh static-shape graph per shape
        fn = torch.compile(sequential_fn(kind, group, world), dynamic=False, fullgraph=True)
        _, code = run_and_get_code(fn, a, b)
    return (lambda: fn(a, b)), rewrote(code)


def _method_context(name: str, group: str):
    """Settings a method's compiled site runs under, held over its compile and its timing alike (a
    recompile during timing must not see other settings)."""
    if name == "async_tp":
        from benchmarks.async_tp import async_tp

        return async_tp(group)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _only_configs(template: str, only: str):
    """``only`` = "key=value": the template's configs restricted to those with config[key] == value
    (e.g. "p2p_ring@transport=p2p": the copy-engine transport, whatever the predictor prefers).
    ``only`` = "unproven": the template measured on site kinds its GPU refusal still holds back
    (e.g. "tile_fused@unproven": its reduce-scatter and all-reduce, to learn whether to offer them)."""
    if not only or template == "auto":
        yield
        return
    from overlap_compile import predictor

    if only == "unproven":
        spec = templates.get_spec(template)
        spec.gpu_refusal = lambda match: None
        try:
            yield
        finally:
            del spec.gpu_refusal
        return

    key, _, value = only.partition("=")
    spec = templates.get_spec(template)
    predictor.clear_cache()  # rankings are cached per site signature, whatever the candidates were
    cands, default = spec.candidates, spec.default_config
    spec.candidates = lambda m, p: [c for c in cands(m, p) if str(c.get(key)) == value] or [spec.default_config(m)]
    spec.default_config = lambda m: {**default(m), key: value}
    try:
        yield
    finally:
        del spec.candidates, spec.default_config
        predictor.clear_cache()


def _expand(names: list[str]) -> list[str]:
    """Templates as named; "NAME@key=value" restricts NAME's configs (``_only_configs``), e.g.
    ``--templates p2p_ring,p2p_ring@transport=nccl`` measures the predictor's pick (the copy
    engine on one node's GPUs) beside the NCCL send/recv transport."""
    return list(dict.fromkeys(names))


def _site(name: str, kind: str, a, b, group: str, world: int):
    """(fn or None, row config, bound groups or None, reason or None) of one method on one site."""
    if name == "async_tp":
        fn, fused = async_tp_site(kind, a, b, group, world)
        return fn, {"rewritten": fused}, None, None
    fn, site = rewritten(kind, name, a, b, group, world)
    config = dict(site.config or {})
    # pieces the communication is cut into: wave groups, chunks, or p2p_ring's ring steps (W
    # stripes, each cut into ``slices``); none when the baseline is kept (auto)
    groups = (len(config.get("wave_groups", [])) or config.get("chunks") or config.get("slices", 1) * world) \
        if site.rewritten else None
    if name == "auto":
        config = {"chosen": site.template, **config}
    return fn, config, groups, site.reason if name == "auto" else None


def _times(fn, modes: tuple[str, ...], label: str) -> dict[str, float]:
    """mode -> ms; a mode that fails (e.g. a capture) is NaN and printed, not hidden."""
    out = {}
    for mode in modes:
        try:
            out[mode] = time_ms(fn if mode == "eager" else graphed(fn))
        except Exception as e:
            out[mode] = float("nan")
            if dist.get_rank() == 0:
                print(f"{label} {mode}: {type(e).__name__}: {e}")
    return out


def _method_rows(name: str, kind: str, a, b, ref, group: str, world: int, modes, base: dict, seq_ms: dict,
                 gemm_ms: float, comm_ms: float) -> list[dict]:
    """One method's rows on one site (one per mode); none where a forced template does not apply.
    ``auto`` decides once per mode, as the pass does for a graph Inductor captures (CUDA graph:
    mode="reduce-overhead") or launches from the host (default mode): the decisions differ."""
    if name == "auto":
        return [row for mode in modes
                for row in _mode_rows(name, kind, a, b, ref, group, world, (mode,), base, seq_ms, gemm_ms, comm_ms)]
    return _mode_rows(name, kind, a, b, ref, group, world, modes, base, seq_ms, gemm_ms, comm_ms)


def _mode_rows(name: str, kind: str, a, b, ref, group: str, world: int, modes, base: dict, seq_ms: dict,
               gemm_ms: float, comm_ms: float) -> list[dict]:
    from torch._inductor import config as ic

    label = f"{name} {kind} {base['shape']}"
    try:
        with _method_context(name, group):
            with ic.patch({"triton.cudagraphs": modes == ("cuda_graph",)}):  # the launch mode decided for
                fn, config, groups, reason = _site(name, kind, a, b, group, world)
            if fn is None:
                return []
            out = fn().reshape(ref.shape)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            times = _times(fn, modes, label)
    except Exception as e:  # a method that fails is a row with its error; the sweep goes on
        if dist.get_rank() == 0:
            print(f"{label}: {type(e).__name__}: {e}")
        return [{**base, "method": name.split("@")[0], "config": None, "mode": mode, "ms": float("nan"),
                 "error": f"{type(e).__name__}: {e}"[:2000], "correct": False} for mode in modes]
    bound = max(gemm_ms, comm_ms) + min(gemm_ms, comm_ms) / max(groups, 1) if groups else None
    return [{**base, "method": name.split("@")[0], "config": config, "mode": mode, "ms": ms,
             "speedup": seq_ms[mode] / ms if ms == ms else None, "bound_ms": bound,
             "rel_err": err, "correct": err < 2e-2, **({"reason": reason} if reason else {})}
            for mode, ms in times.items()]


def bench_shape(kind: str, shape: list[int], world: int, methods: list[str], cuda: bool) -> list[dict]:
    """Every row of one shape: the sequential baseline, then each method, measured in this run."""
    rank = dist.get_rank()
    group = dist.group.WORLD.group_name
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    m, n, k = shape
    torch.manual_seed(rank)
    full = torch.randn(m, k, device=device, dtype=dtype) / k**0.25
    b = torch.randn(k, n, device=device, dtype=dtype) / k**0.25
    # an all-gather site's input is this rank's shard of the M rows; the GEMM is over all of them
    a = full[rank * (m // world):(rank + 1) * (m // world)].contiguous() if kind == "allgather_gemm" else full
    seq = sequential_fn(kind, group, world)
    ref = seq(a, b)
    gemm_ms = time_ms(lambda: full @ b)
    y = a if kind == "allgather_gemm" else full @ b
    comm_ms = time_ms(lambda: collective(kind, y, group, world))
    base = {"benchmark": "ops", "device": torch.cuda.get_device_name() if cuda else "cpu", "world_size": world,
            "torch": torch.__version__, "date": datetime.date.today().isoformat(), "kind": kind, "shape": shape}
    modes = ("eager", "cuda_graph") if cuda else ("eager",)
    seq_ms = {"eager": time_ms(lambda: seq(a, b))}
    if cuda:
        seq_ms["cuda_graph"] = time_ms(graphed(lambda: seq(a, b)))
    rows = [{**base, "method": "sequential", "config": None, "mode": mode, "ms": ms, "gemm_ms": gemm_ms,
             "comm_ms": comm_ms, "correct": True} for mode, ms in seq_ms.items()]
    for name in _expand(methods):
        if name == "async_tp" and not cuda:
            continue  # symmetric memory: CUDA only (noted once in main())
        rows += _method_rows(name, kind, a, b, ref, group, world, modes, base, seq_ms, gemm_ms, comm_ms)
    return rows


def shape_order(kinds: list[str], shapes: dict) -> list[tuple[str, list[int]]]:
    """Shape i of every kind before shape i + 1 of any: a time budget that runs out leaves every
    kind measured on its first shapes."""
    most = max((len(shapes[k]) for k in kinds), default=0)
    return [(k, shapes[k][i]) for i in range(most) for k in kinds if i < len(shapes[k])]


def bench(kinds: list[str], shapes: dict, world: int, templates_to_run: list[str], cuda: bool | None = None,
          time_budget: float = 0.0, start: float | None = None, partial: str | None = None) -> list[dict]:
    """Every shape's rows; ``partial`` (rank 0): a JSON-lines file each shape's rows are appended
    to as they land, so a run that dies (a rank's CUDA error kills the group) keeps what it measured."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    budget = Budget(time_budget, "cuda" if cuda else "cpu", start or time.time())
    rows = []
    for kind, shape in shape_order(kinds, shapes):
        skip = budget.should_skip()
        if skip:
            if dist.get_rank() == 0:
                print(f"{kind} {shape} skipped: {skip}", flush=True)
            continue
        t0 = time.monotonic()
        got = bench_shape(kind, shape, world, templates_to_run, cuda)
        budget.took(time.monotonic() - t0)
        rows += got
        if dist.get_rank() == 0:
            print(_table_rows(got), flush=True)
            if partial:
                with open(partial, "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in got)
    return rows


def _table_rows(rows: list[dict]) -> str:
    out = []
    for r in rows:
        extra = f"  x{r['speedup']:.3f}  err {r['rel_err']:.1e}" if r.get("speedup") else ""
        extra += f"  bound {r['bound_ms']:.3f}" if r.get("bound_ms") else ""
        extra += f"  {r['config']}" if r["method"] in PSEUDO and r.get("config") else ""
        out.append(f"{r['kind']:>20} {str(r['shape']):>20} {r['method']:>16} {r['mode']:>10} {r['ms']:8.3f} ms{extra}")
    return "\n".join(out)


def worker(kinds, shapes, templates_to_run, out_dir, cuda=None, time_budget=0.0, start=None):
    world = dist.get_world_size()
    partial = None
    if dist.get_rank() == 0 and out_dir:
        os.makedirs(out_dir, exist_ok=True)
        partial = run_file(out_dir, "ops", f"{datetime.datetime.now():%Y%m%d-%H%M%S}", "partial")
    rows = bench(kinds, shapes, world, templates_to_run, cuda, time_budget, start, partial)
    if dist.get_rank() == 0 and out_dir:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        print("wrote", write_rows(rows, out_dir, "ops", device, world))
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=None, help="processes (default: all GPUs, at least 2; dry run 2)")
    ap.add_argument("--kinds", default="gemm_allreduce,gemm_reducescatter",
                    help=f"comma list of {', '.join(KINDS)}, or 'all' (dry run default: all)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--limit", type=int, default=0, help="first N shapes of each kind (0 = all; dry run default 1)")
    ap.add_argument("--templates", default=",".join(PSEUDO + templates.names()),
                    help="methods beside sequential: template names (NAME@key=value restricts the configs), "
                    "auto (the predictor's choice), async_tp (PyTorch async-TP, CUDA only); default all")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--scale", type=int, default=None, help=f"divide every shape dim by this (dry run default {DRY_SCALE})")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds from the launch; a shape that would not fit (the longest so far is the estimate) "
                    "is skipped, with a note; shapes run round-robin over the kinds (0 = no budget)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, world 2, small shapes, no async-TP")
    a = ap.parse_args(argv)
    a.start_time = time.time()
    a.dry_run = a.dry_run or not torch.cuda.is_available()
    if a.dry_run:
        a.world, a.limit = a.world or 2, a.limit or 1
        a.scale = a.scale or DRY_SCALE
        a.kinds = "all" if a.kinds == ap.get_default("kinds") else a.kinds
    a.world = a.world or max(torch.cuda.device_count(), 2)
    a.scale = a.scale or 1
    a.kinds = ",".join(KINDS) if a.kinds == "all" else a.kinds
    bad = [k for k in a.kinds.split(",") if k not in KINDS]
    if bad:
        raise SystemExit(f"--kinds: unknown {bad}; choose from {', '.join(KINDS)} or 'all'")
    return a


def main(argv: list[str] | None = None) -> list[dict]:
    """Rank 0's rows (also written to --out)."""
    args = parse(argv)
    with open(args.shapes) as f:
        shapes = json.load(f)
    kinds = args.kinds.split(",")
    shapes = {k: [[d // args.scale for d in sh] for sh in shapes[k][: args.limit or None]] for k in kinds}
    methods = args.templates.split(",")
    if args.dry_run and "async_tp" in methods:
        print("async_tp: not measured on a dry run (symmetric memory needs CUDA); no async_tp rows")
    from overlap_compile.testing.multiprocess import run_distributed

    backend = "gloo" if args.dry_run else "nccl"
    return run_distributed(worker, world_size=args.world, backend=backend, timeout_s=3000,
                           args=(kinds, shapes, methods, args.out, not args.dry_run, args.time_budget, args.start_time))[0]


if __name__ == "__main__":
    main()
