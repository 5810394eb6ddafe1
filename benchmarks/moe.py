"""MoE layer benchmark: the expert-parallel layer (overlap_compile.demo.moe) under torch.compile,
sequential vs the overlap templates vs the comm-free bound, over the shapes.json "moe" set.

    python benchmarks/moe.py --world 2 --out $OUT --time-budget 300        # GPUs (NCCL), bf16
    python benchmarks/moe.py --world 2 --experts-sweep 8,16,32,64 --limit 1  # latency vs expert count
    python benchmarks/moe.py --dry-run                                       # CPU, gloo, world 2, tiny shapes

Cases: each shape (S tokens per rank, hidden H, expert FFN I, E experts, top-k) at its own E, or with
``--experts-sweep`` at each listed E with its other sizes fixed (a size set met twice runs once; a
case whose E is not the shape's is named ``<shape> E=<e>``). Per case, compile mode, phase and
variant, one compile, timed on each routing:

* phases: ``forward`` (inference, no grad) and ``train`` (forward + backward of mean(y^2)).
* variants (``--variants``; sequential always runs, it is the baseline):
  ``sequential`` (the layer as written: all_to_all -> SwiGLU bmm experts -> all_to_all, compiled
  with every site forced to the baseline); ``nocomm`` (the bound: the same compile with every
  all-to-all of the forward and backward graphs replaced by a local copy of the same output shape,
  benchmarks/nocomm.py; the row carries ``nocomm_replaced``, and ``all_to_all_in_graphs`` = 0 with
  no site left for the overlap pass); ``moe_fused`` (forced: the piece pipeline, the predicted-best
  configuration); on GPUs, each path forced: ``moe_fused_nccl`` (``{"split":
  "source"}``, NCCL), ``moe_fused_p2p`` (``{"split": "source", "transport": "p2p"}``, copy engine,
  bmm experts), ``moe_fused_p2p_kernel`` (the same with the persistent expert kernel, ``"experts":
  "fused"``), ``moe_fused_p2p_kernel_skip`` (and the kernel skipping the tiles past the routed
  rows, ``"skip_padding": true``: sizes found and exchanged on the device), ``moe_fused_p2p_packed``
  (copy engine, ``"experts": "packed"``: grouped GEMMs on the routed rows, sizes on the device,
  both phases); ``moe_fused_routed`` (``{"split": "source", "payload": "routed"}``: only the routed
  rows travel and meet the experts, any device, both phases); ``overlap`` (the predictor's choice). In training, moe_fused takes the forward
  section (it also returns what backward saves) and the backward section goes to
  moe_fused_backward (d_h per source piece, sent home at once; the weight gradients once after the
  last piece, over NCCL or, with ``"transport": "p2p"``, the copy engine); the capacity pieces
  and the expert kernel have no backward path, so those forced configs leave the backward as
  written, with that reason in each row's ``sites``.
* routing (``--routing``): ``uniform`` (the random router, inputs N(0, 1)) and ``skewed`` (one hot
  expert: inputs N(0, 1) + 1, still random and non-zero, and the router's row of expert 0 biased by
  SKEW_BIAS / H along the all-ones direction, so most tokens' first choice is expert 0). Each row
  carries the routing it measured, averaged over the ranks: ``hot_share`` (share of first choices
  on expert 0) and ``dropped_share`` (choices past the capacity). The layer is capacity-padded
  (static shapes), so skew changes which slots are filled and what is dropped, not the bytes moved
  or the expert GEMM sizes.
* compile modes (``--modes``): ``default`` (host-launched: the schema's ``mode: "eager"``) and
  ``reduce-overhead`` (CUDA graphs through Inductor's cudagraph trees: ``mode: "cuda_graph"``);
  the row's ``compile_mode`` says which, and ``cudagraph_skips`` > 0 says Inductor fell back to
  host launches (always so on a CPU dry run).

Numbers: median ms over ``--iters`` calls after warm-up (benchmarks/timing.py: CUDA events, ranks
synchronised, the slowest rank's median), random non-zero inputs, the baseline in the same run.
Every other row of a (case, routing, compile mode, phase) carries ``speedup`` = sequential ms / ms,
and where the bound ran ``bound_ms``, ``bound_speedup`` = sequential / nocomm and ``gap_closed`` =
(sequential - ms) / (sequential - nocomm), the share of the communication gap closed (None when
the bound is no faster); the sequential row carries ``comm_ms`` = sequential - nocomm. The output
of each variant is checked against the sequential one of the same routing (``rel_err``), except
nocomm's, which differs by design (no exchange: each rank runs the experts on its own slots), so
its row has no rel_err and says so in ``rel_err_note``. ``op_graph_calls``: how the template ops'
host-launched calls went over the timed calls, warm-up included (runtime.op_graphs: run as written,
captured, replayed from a graph, capture failed); the table's last column shows replayed/all.

``--time-budget SECONDS`` (from the launch; default DEFAULT_BUDGET_S on GPUs, none on a dry run):
a (case, compile mode, phase) block is not started when less is left than the longest block so far,
and its rows say ``skipped``; the rows measured are kept. Rows go to
<out>/moe-<device>-w<world>-torch<v>-<date>.json (benchmarks/results_io.py), with a markdown table
(.md) and PNGs beside (benchmarks/plot.py: speedup bars with the bound per phase, routing and mode;
latency against the expert count, one line per variant, one panel per routing and mode); rank 0
appends each row to <out>/moe-partial-<run>.jsonl as it lands, and a run stopped by its time
limit writes the rows measured before.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # the repository root

from benchmarks.results_io import result_stem, write_rows  # noqa: E402
from benchmarks.timing import Budget, op_graph_calls_since, op_graph_counts, time_ms  # noqa: E402

DRY_SHAPES = [{"name": "tiny-8", "S": 64, "H": 32, "I": 48, "E": 8, "topk": 2},
              {"name": "tiny-16", "S": 64, "H": 32, "I": 48, "E": 16, "topk": 2}]
# name -> (force_template, force_config); "overlap": the predictor decides
VARIANTS = {
    "sequential": ("baseline", None),
    "nocomm": ("baseline", None),
    "moe_fused": ("moe_fused", None),
    "moe_fused_nccl": ("moe_fused", {"split": "source"}),
    "moe_fused_p2p": ("moe_fused", {"split": "source", "transport": "p2p"}),
    "moe_fused_p2p_kernel": ("moe_fused", {"split": "source", "transport": "p2p", "experts": "fused"}),
    "moe_fused_p2p_kernel_skip": ("moe_fused", {"split": "source", "transport": "p2p", "experts": "fused",
                                                "skip_padding": True}),
    "moe_fused_routed": ("moe_fused", {"split": "source", "payload": "routed"}),
    "moe_fused_p2p_packed": ("moe_fused", {"split": "source", "transport": "p2p", "experts": "packed"}),
    "overlap": (None, None),
}
PATHS = ("moe_fused_nccl", "moe_fused_p2p", "moe_fused_p2p_kernel", "moe_fused_p2p_kernel_skip",
         "moe_fused_p2p_packed")  # GPUs only
ROUTINGS = ("uniform", "skewed")
MODES = ("default", "reduce-overhead")
PHASES = ("forward", "train")
CAPACITY_FACTOR = 1.25
SKEW_BIAS = 6.0  # added to expert 0's logit for an input of mean 1 (module docstring)
# GPU: with the grace, the run ends inside run_multigpu.sh's MOE_TIMEOUT (480 s), start-up included
DEFAULT_BUDGET_S = 300
GRACE_S = 120  # one block in flight past the budget (a block: ~10 compiles), then the output
NOCOMM_NOTE = "none: nocomm replaces the all-to-alls by local copies, so its output differs by design"


# ---- cases, layer, inputs ------------------------------------------------------------------------------


def cases(shapes: list[dict], sweep: list[int] | None) -> list[dict]:
    """Each shape at its own E, or at each E of ``sweep``; one case per distinct size set, named by
    a shape of exactly those sizes where there is one."""
    def sizes(s: dict) -> tuple:
        return tuple(s[k] for k in ("S", "H", "I", "E", "topk"))

    named = {sizes(s): s["name"] for s in reversed(shapes)}  # the first shape of those sizes names them
    out, seen = [], set()
    for s in shapes:
        for e in (sweep or [s["E"]]):
            c = {**s, "E": e}
            if sizes(c) in seen:
                continue
            seen.add(sizes(c))
            c["name"] = named.get(sizes(c), f"{s['name']} E={e}")
            out.append(c)
    return out


def build_layer(case: dict, world: int, rank: int, group_name: str, device, dtype):
    from overlap_compile.demo.moe import ExpertParallelMoE

    torch.manual_seed(0)  # the same router on every rank (its local experts get the same draws too)
    return ExpertParallelMoE(case["H"], case["I"], case["E"], case["topk"], CAPACITY_FACTOR, group_name,
                             world, rank).to(device=device, dtype=dtype)


def routing_inputs(router: torch.Tensor, case: dict, routing: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(router, x) for ``routing``, on the CPU in float32 (the caller moves them): x ~ N(0, 1) per
    rank; skewed: x + 1 and expert 0's router row + SKEW_BIAS / H (expert 0's logit + ~SKEW_BIAS)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r}: one of {ROUTINGS}")
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(case["S"], case["H"], generator=g)
    router = router.detach().float().cpu().clone()
    if routing == "skewed":
        x = x + 1.0
        router[0] += SKEW_BIAS / case["H"]
    return router, x


def routing_stats(x: torch.Tensor, router: torch.Tensor, case: dict) -> dict:
    """This rank's share of first choices on expert 0 and of choices dropped past the capacity."""
    from overlap_compile.demo.moe import capacity, route

    first = (x.float() @ router.float().t()).argmax(-1)
    cap = capacity(x.shape[0], case["E"], case["topk"], CAPACITY_FACTOR)
    _, kept, _ = route(x, router, case["E"], case["topk"], cap)
    return {"hot_share": (first == 0).float().mean().item(), "dropped_share": 1 - kept.float().mean().item()}


def compiled_layer(layer, force: str | None, config: dict | None, report, compile_mode: str):
    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend

    mode = None if compile_mode == "default" else compile_mode
    fn = torch.compile(layer, backend=functools.partial(overlap_backend, report=report, mode=mode))
    options = {"force_template": force} if force else {}
    if config is not None:
        options["force_config"] = config

    def call(x):
        with oc.config.patch(**options):
            return fn(x)

    return call


def graph_collectives(report, name: str = "all_to_all_single") -> int:
    """Calls of the functional collective ``name`` left in the post-grad graphs Inductor compiled
    (after every pass; a rewritten site's op holds its own communication)."""
    return sum(r.after.count(f"_c10d_functional.{name}.") for r in report.records)


# ---- the sweep on every rank ---------------------------------------------------------------------------


def measure(layer, name: str, phase: str, compile_mode: str, inputs: dict, iters: int, device, dtype) -> dict:
    """routing -> (row fields, output) for one variant: compiled once, timed on each routing."""
    import overlap_compile as oc
    from benchmarks.e2e_run import CompileWatch
    from overlap_compile.compile_caches import no_compile_caches

    force, config = VARIANTS[name]
    torch._dynamo.reset()
    report = oc.Report()
    step_begin = torch.compiler.cudagraph_mark_step_begin if compile_mode == "reduce-overhead" else (lambda: None)
    if name == "nocomm":
        from benchmarks.nocomm import STANDINS, nocomm
        bound = nocomm()
    else:
        bound = contextlib.nullcontext()
    got = {}
    with no_compile_caches(), bound as nocomm_pass:
        fn = compiled_layer(layer, force, config, report, compile_mode)
        # over the variant: graphs compiled and CUDA-graph skips are the compile's (first routing);
        # recompiles_timed is each routing's own (0: the compile is reused)
        watch = CompileWatch()
        for routing, (router, x) in inputs.items():
            fields: dict = {}
            try:
                with torch.no_grad():
                    layer.router.copy_(router.to(device=device, dtype=dtype))
                x = x.to(device=device, dtype=dtype)
                if phase == "forward":
                    def step():
                        step_begin()
                        with torch.no_grad():
                            return fn(x)
                else:
                    xg = x.clone().requires_grad_()

                    def step():
                        step_begin()
                        # a training step's zero_grad: under CUDA-graph trees, accumulating into the
                        # last step's gradients reads outputs the next replay overwrites (seen, 1x H100)
                        layer.zero_grad(set_to_none=True)
                        xg.grad = None
                        y = fn(xg)
                        y.float().pow(2).mean().backward()
                        return y.detach()
                out = step().clone()  # CUDA-graph outputs are overwritten by the next replay
                watch.start_timed()
                calls_before = op_graph_counts()  # over the timed calls, warm-up included
                ms = time_ms(step, iters, warmup=3)
                fields.update(ms=ms, tokens_per_s=layer.world * x.shape[0] / (ms / 1e3),
                              op_graph_calls=op_graph_calls_since(calls_before),
                              **watch.summary(watch.compiled_since_mark()))
            except Exception as e:  # recorded, the sweep goes on
                fields.update(error=f"{type(e).__name__}: {e}"[:1500], trace=traceback.format_exc()[-3000:])
                out = None
            sites = report.sites
            fields.update(sites=[(s.graph, s.kind, s.template, s.rewritten) for s in sites],
                          configs=[s.config for s in sites],
                          reasons=sorted({s.reason for s in sites if not s.rewritten}),
                          all_to_all_in_graphs=graph_collectives(report))
            if nocomm_pass is not None:
                fields["nocomm_replaced"] = dict(nocomm_pass.replaced)
                fields["nocomm_standins"] = STANDINS
            got[routing] = (fields, out)
    return got


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def mean_over_ranks(d: dict) -> dict:
    keys = sorted(d)
    t = torch.tensor([d[k] for k in keys], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return {k: v / dist.get_world_size() for k, v in zip(keys, t.tolist())}


def variants_for(phase: str, wanted: list[str], dry: bool) -> list[str]:
    return [v for v in wanted if not (v in PATHS and dry)]


def worker(args_dict: dict) -> list[dict]:
    a = argparse.Namespace(**args_dict)
    rank, w = dist.get_rank(), dist.get_world_size()
    dry = a.dry_run
    device, dtype = ("cpu", torch.float32) if dry else (f"cuda:{rank}", torch.bfloat16)
    if not dry:
        torch.cuda.set_device(rank)
    base = {"benchmark": "moe", "device": "cpu" if dry else torch.cuda.get_device_name(), "world_size": w,
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "dtype": str(dtype).replace("torch.", "")}
    partial = os.path.join(a.out, f"moe-partial-{a.run_id}.jsonl") if a.out else None
    budget = Budget(a.time_budget, "cpu" if dry else device, a.start_time)
    rows: list[dict] = []

    def emit(new: list[dict]) -> None:
        rows.extend(new)
        if rank == 0:
            for r in new:
                what = (f"{r['ms']:.3f} ms" if "ms" in r else f"ERROR {r['error'][:150]}" if "error" in r
                        else f"skipped ({r.get('skipped', '')[:80]})")
                print(f"{r['shape']} {r.get('routing', '')} {r.get('mode', '')} {r.get('phase', '')} "
                      f"{r.get('variant', '')}: {what}", flush=True)
        if rank == 0 and partial:  # a run cut off by a time limit keeps its rows
            os.makedirs(a.out, exist_ok=True)
            with open(partial, "a") as f:
                for r in new:
                    f.write(json.dumps({k: v for k, v in r.items() if k != "trace"}) + "\n")

    for case in cases(a.shapes, a.experts_sweep):
        head = {**base, "shape": case["name"], "experts": case["E"], "topk": case["topk"],
                "sizes": {k: case[k] for k in ("S", "H", "I")}}
        if case["E"] % w:
            emit([{**head, "error": f"E={case['E']} not divisible by W={w}"}])
            continue
        layer = build_layer(case, w, rank, dist.group.WORLD.group_name, device, dtype)
        inputs = {r: routing_inputs(layer.router, case, r, rank) for r in a.routing}
        stats = {r: mean_over_ranks(routing_stats(x, router, case)) for r, (router, x) in inputs.items()}
        for compile_mode in a.modes:
            for phase in a.phases:
                names = variants_for(phase, a.variants, dry)

                def row(name: str, routing: str) -> dict:
                    force, config = VARIANTS[name]
                    return {**head, "phase": phase, "variant": name, "routing": routing, **stats[routing],
                            "compile_mode": compile_mode,
                            # the common schema's keys (DESIGN.md; benchmarks/plot.py)
                            "kind": f"moe_{phase}", "method": name,
                            "mode": "cuda_graph" if compile_mode == "reduce-overhead" else "eager",
                            "config": ({"force_template": force, "force_config": config}
                                       if name not in ("sequential", "nocomm", "overlap") else None)}

                skip = budget.should_skip()
                if skip:
                    emit([{**row(n, r), "skipped": skip} for n in names for r in a.routing])
                    continue
                t0 = time.monotonic()
                ref: dict = {}
                for name in names:
                    try:
                        got = measure(layer, name, phase, compile_mode, inputs, a.iters, device, dtype)
                    except Exception as e:  # the compile wrapper itself failed
                        err = f"{type(e).__name__}: {e}"[:1500]
                        got = {r: ({"error": err, "trace": traceback.format_exc()[-3000:]}, None) for r in a.routing}
                    # every rank's errors, so that rank 0's rows (the ones kept) name a failure on any rank
                    errors: list = [None] * w
                    dist.all_gather_object(errors, {rt: f.get("error") for rt, (f, _) in got.items()})
                    new = []
                    for routing, (fields, out) in got.items():
                        r = {**row(name, routing), **fields}
                        other = next(((i, e[routing]) for i, e in enumerate(errors) if i != rank and e[routing]), None)
                        if other and "error" not in r:
                            r["error"], out = f"rank {other[0]}: {other[1]}", None
                            r.pop("ms", None), r.pop("tokens_per_s", None)
                        if out is not None and name == "sequential":
                            ref[routing] = out
                        elif out is not None and name == "nocomm":
                            r["rel_err_note"] = NOCOMM_NOTE
                        elif out is not None and routing in ref:
                            r["rel_err"] = rel_err(out, ref[routing])
                        new.append(r)
                    emit(new)
                    gc.collect()
                    if not dry:
                        torch.cuda.empty_cache()
                budget.took(time.monotonic() - t0)
        del layer
    return rows


# ---- rows -> comparisons, table, files -----------------------------------------------------------------


def derive(rows: list[dict]) -> list[dict]:
    """speedup, bound_ms, bound_speedup, gap_closed on each row beside its sequential one (same
    case, routing, compile mode, phase); comm_ms (sequential - nocomm) on the sequential row."""
    from benchmarks.plot import gap_closed

    def key(r: dict) -> tuple:
        return (r.get("shape"), r.get("experts"), r.get("routing"), r.get("compile_mode"), r.get("phase"))

    timed = [r for r in rows if isinstance(r.get("ms"), (int, float)) and "variant" in r]
    seq = {key(r): r["ms"] for r in timed if r["variant"] == "sequential"}
    bound = {key(r): r["ms"] for r in timed if r["variant"] == "nocomm"}
    for r in timed:
        k = key(r)
        if k not in seq:
            continue
        if r["variant"] == "sequential":
            if k in bound and seq[k] > bound[k]:
                r["comm_ms"] = seq[k] - bound[k]
            continue
        r["speedup"] = seq[k] / r["ms"]
        if k in bound:
            r.update(bound_ms=bound[k], bound_speedup=seq[k] / bound[k],
                     gap_closed=gap_closed(seq[k], r["ms"], bound[k]))
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'shape':>16} {'E':>3} {'routing':>8} {'hot':>5} {'mode':>11} {'phase':>8} {'variant':>20} {'ms':>9} "
            f"{'x seq':>6} {'bound':>6} {'gap':>6} {'rel err':>8}  rewritten  op graphs")
    lines = [head]
    fell_back = False

    def mode_text(r: dict) -> str:
        nonlocal fell_back
        if r.get("mode") == "cuda_graph" and r.get("cudagraph_skips"):
            fell_back = True
            return "cuda_graph*"
        return r.get("mode", "-")

    block: dict = {}  # rows of one (case, compile mode, phase) together, routing by routing

    def order(r: dict) -> tuple:
        b = block.setdefault((r.get("shape"), r.get("experts"), r.get("compile_mode"), r.get("phase")), len(block))
        return (b, r.get("routing") != "uniform", r.get("routing") or "")

    skipped: dict = {}
    for r in sorted(rows, key=order):
        if "skipped" in r:  # one line per skipped block, at the end
            skipped.setdefault((r["shape"], r.get("mode"), r.get("phase")), r["skipped"])
            continue
        lead = (f"{r['shape']:>16} {r.get('experts', '-'):>3} {r.get('routing', '-'):>8} "
                f"{r.get('hot_share', float('nan')):5.2f} {mode_text(r):>11} {r.get('phase', '-'):>8} "
                f"{r.get('variant', '-'):>20}")
        if "error" in r:
            lines.append(f"{lead}  ERROR {r['error']}"[:260])
            continue

        def f(k: str, fmt: str) -> str:
            return format(r[k], fmt) if r.get(k) is not None else "-"

        done = sum(1 for s in r["sites"] if s[3])
        calls = r.get("op_graph_calls") or {}
        graphs = f"{calls.get('replayed', 0)}/{sum(calls.values())}" if sum(calls.values()) else "-"
        lines.append(f"{lead} {r['ms']:9.3f} {f('speedup', '.3f'):>6} {f('bound_speedup', '.3f'):>6} "
                     f"{f('gap_closed', '.0%'):>6} {f('rel_err', '.1e'):>8}  {done}/{len(r['sites']):<8} {graphs}")
    lines += [f"skipped: {shape} {mode} {phase}: {why}" for (shape, mode, phase), why in skipped.items()]
    if fell_back:
        lines.append("cuda_graph*: Inductor skipped the CUDA graph (cudagraph_skips > 0): host-launched")
    return "\n".join(lines)


def write(rows: list[dict], out: str) -> str:
    """The rows (JSON), the plotter's markdown (.md) and PNGs beside; returns the JSON path."""
    from benchmarks import plot

    first = next((r for r in rows if "device" in r), {"device": "cpu", "world_size": 0})
    path = write_rows(rows, out, "moe", first["device"], first["world_size"], date=first.get("date"))
    stem = result_stem(out, "moe", first["device"], first["world_size"], date=first.get("date"))
    with open(stem + ".md", "w") as f:
        f.write(table(rows) + "\n" + plot.markdown(rows) + "\n")
    try:
        pngs = plot.plot(rows, out, os.path.basename(stem)) + plot.plot_by_experts(rows, out, os.path.basename(stem))
    except ImportError as e:  # no matplotlib: the rows and the table still stand
        pngs = []
        print(f"no plots: {e}")
    for p in pngs:
        print("wrote", p)
    return path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=None, help="processes (default: all GPUs; dry run 2)")
    ap.add_argument("--limit", type=int, default=0, help="first N shapes (0 = all), before the experts sweep")
    ap.add_argument("--experts-sweep", default="", help="comma list of expert counts, e.g. 8,16,32,64: each shape "
                    "at each, its other sizes fixed (default: each shape at its own E)")
    ap.add_argument("--routing", default=",".join(ROUTINGS), help="comma list of uniform, skewed")
    ap.add_argument("--modes", default=",".join(MODES), help="compile modes: comma list of default (host-launched), "
                    "reduce-overhead (CUDA graphs)")
    ap.add_argument("--phases", default=",".join(PHASES), help="comma list of forward, train")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS)
                    + " (sequential always runs: the baseline; the moe_fused_* paths: GPUs and forward only)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls (median)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help=f"seconds from the launch; blocks that would not fit are skipped (default {DEFAULT_BUDGET_S} "
                    "on GPUs, none on a dry run; 0 = none)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, world 2, tiny shapes, no forced paths")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    a.start_time = time.time()
    a.run_id = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    a.dry_run = a.dry_run or not torch.cuda.is_available()
    for opt, allowed in (("routing", ROUTINGS), ("modes", MODES), ("phases", PHASES), ("variants", tuple(VARIANTS))):
        vals = getattr(a, opt).split(",")
        bad = [v for v in vals if v not in allowed]
        if bad:
            raise SystemExit(f"--{opt}: {bad} not among {', '.join(allowed)}")
        setattr(a, opt, vals)
    a.variants = ["sequential"] + [v for v in VARIANTS if v in a.variants and v != "sequential"]
    try:
        a.experts_sweep = [int(e) for e in a.experts_sweep.split(",")] if a.experts_sweep else None
    except ValueError:
        raise SystemExit(f"--experts-sweep: {a.experts_sweep!r} is not a comma list of integers")
    if a.iters < 1:
        raise SystemExit("--iters must be >= 1")
    if a.dry_run:
        a.world = a.world or 2
        a.time_budget = a.time_budget or 0.0
        shapes = DRY_SHAPES
    else:
        a.world = a.world or torch.cuda.device_count()
        a.time_budget = DEFAULT_BUDGET_S if a.time_budget is None else a.time_budget
        from benchmarks.shape_sets import shape_set

        shapes = shape_set("moe")
    a.shapes = shapes[: a.limit] if a.limit else shapes
    return a


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse(argv)
    from overlap_compile.testing.multiprocess import DistributedFailure, run_distributed

    timeout = a.time_budget + GRACE_S if a.time_budget else 3600
    try:
        rows = run_distributed(worker, world_size=a.world, args=(vars(a),),
                               backend="gloo" if a.dry_run else "nccl", timeout_s=timeout)[0]
    except DistributedFailure as e:  # keep what was measured before the failure
        path = os.path.join(a.out, f"moe-partial-{a.run_id}.jsonl")
        rows = [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []
        print(f"run stopped: {str(e).splitlines()[0][:300]}; {len(rows)} rows measured before", flush=True)
        rows.append({"benchmark": "moe", "device": "cpu" if a.dry_run else torch.cuda.get_device_name(0),
                     "world_size": a.world, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                     "error": f"run stopped: {e}"[:2000]})
    rows = derive(rows)
    path = write(rows, a.out)
    print(table(rows))
    print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
