"""Where a dynamic-shape compile's prefill time goes, per length: torch.compile's dynamic compile
beside the overlap backend's, and the overlap compile with every bucket forced to "as written"
(the bucketed ops' baseline path: what the ops themselves cost, apart from the choices), and
with defer_compute off (Inductor's peak-memory reordering left on).

    torchrun --nproc-per-node 2 benchmarks/diagnostics/dynamic_profile.py --model megatron_fused_8b \
        --mode reduce-overhead --seqs 1024,64 --out $OUT

Per (variant, length): GPU ms per call (CUDA events, median, slowest rank), host ms per call
(back-to-back calls, no sync: what the host spends launching), and from profiled calls, per
rank: the kernels by role (GEMM, NCCL, copy, Triton, other) with counts, the CUDA-graph launches
and the library's ops called from the host (outside any graph) per call, plus the bucket
choices. ``--top`` lists the kernels whose time differs most from torch.compile's; ``--python``
adds each rank's Python functions per call (cProfile).
Writes dynamic_profile-<device>-w<W>-torch<v>-<date>-<model>-<mode>.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from benchmarks.diagnostics.ranks import diagnostic_main  # noqa: E402

VARIANTS = ("default", "overlap", "overlap-as-written", "overlap-no-defer", "overlap-op-every-call")
# variant -> overlap_compile options it compiles under ("overlap-no-defer": nothing moved under the
# collectives kept as written, so Inductor's peak-memory reordering stays on; "overlap-op-every-call":
# no torch.compile graph for the M every rewritten site runs as written (row_dispatch.py), so the
# bucketed ops run at every M)
VARIANT_OPTIONS = {"overlap-no-defer": {"defer_compute": False},
                   "overlap-op-every-call": {"whole_graph_as_written": False},
                   "overlap-written-direct": {"replay_written": False}}


def role(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(p in n for p in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul")):
        return "gemm"
    if any(p in n for p in ("memcpy", "memset", "copy")):
        return "copy"
    if n.startswith("triton"):
        return "triton"
    return "other"


def kernels_of(fn, calls: int = 3) -> tuple[dict, collections.Counter, collections.Counter]:
    """Per role (ms per call, kernels per call), per kernel name (ms per call) and per host-side
    op or runtime call (self CPU ms per call) over ``calls``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    by_role: dict = collections.defaultdict(lambda: [0.0, 0])
    by_name: collections.Counter = collections.Counter()
    host: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.device_type.name != "CUDA":
            host[e.name[:90]] += e.self_cpu_time_total / 1e3 / calls
            # host side: CUDA-graph launches and the library's ops run outside a graph, per call
            if e.name == "cudaGraphLaunch" or e.name.startswith("overlap_compile::"):
                by_role[e.name][1] += 1 / calls
            continue
        ms = e.device_time / 1e3 / calls if hasattr(e, "device_time") else e.cuda_time / 1e3 / calls
        by_role[role(e.name)][0] += ms
        by_role[role(e.name)][1] += 1 / calls
        by_name[e.name[:90]] += ms
    return {k: [round(v[0], 4), round(v[1], 1)] for k, v in by_role.items()}, by_name, host


def host_ms(fn, calls: int = 20) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    return t


def python_top(fn, calls: int = 30, top: int = 25) -> list[list]:
    """The host's Python functions over ``calls`` back-to-back calls (cProfile): [function, own ms
    per call, cumulative ms per call], largest own time first."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = [[f"{os.path.basename(f)}:{line}:{name}", tt * 1e3 / calls, ct * 1e3 / calls]
            for (f, line, name), (_, _, tt, ct, _) in stats.items()]
    return [[n, round(t, 4), round(c, 4)] for n, t, c in sorted(rows, key=lambda r: -r[1])[:top]]


def run(model_name: str, mode: str, variant: str, seqs: list[int], iters: int, python: bool = False) -> list[dict]:
    import overlap_compile as oc
    from overlap_compile.templates import bucketed

    from benchmarks.e2e_dynamic import input_at, sequence_dim
    from benchmarks.e2e_run import compiled, framework_mode, variant_context
    from benchmarks.models import build
    from benchmarks.timing import time_ms

    from benchmarks.e2e import plan

    torch._dynamo.reset()
    shape = dict(plan(model_name, "8b", dry=False)[0][1])
    built = build(model_name, {**shape, "seq": max(seqs)}, "cuda", torch.bfloat16, seed=0)
    dim = sequence_dim(built.x, model_name)
    inputs = {s: input_at(built.x, dim, s) for s in seqs}
    real_choose = bucketed._choose_at
    if variant == "overlap-as-written":
        bucketed._choose_at = lambda table, m, group: (bucketed.BASELINE, None, "forced as written")
    rows = []
    step_begin = torch.compiler.cudagraph_mark_step_begin if mode == "reduce-overhead" else (lambda: None)
    try:
        with framework_mode(built, mode), variant_context("overlap" if variant.startswith("overlap") else variant):
            with oc.config.patch(**VARIANT_OPTIONS.get(variant, {})):
                fn, overrides = compiled(built.model, "overlap" if variant.startswith("overlap") else variant, mode,
                                         None, oc.Report(), built.compile_with)
            overrides = {**VARIANT_OPTIONS.get(variant, {}), **overrides}

            for s in seqs:
                x = inputs[s]
                torch._dynamo.mark_dynamic(x, dim)

                def call(x=x):
                    step_begin()
                    with torch.no_grad(), oc.config.patch(**overrides):
                        return fn(x)

                bucketed.clear_choices()
                call()
                gpu = time_ms(call, iters, warmup=3)
                host = host_ms(call)
                roles, names, host_ops = kernels_of(call)
                rows.append({"model": model_name, "mode": mode, "variant": variant, "seq": s,
                             "rank": dist.get_rank(), "gpu_ms": gpu,
                             "host_ms": host, "roles": roles, "kernels": dict(names.most_common(40)),
                             "host_ops": dict(host_ops.most_common(40)),
                             "choices": sorted({(m, t) for m, t, _ in bucketed.choices_made()}),
                             **({"python_top": python_top(call)} if python else {})})
    finally:
        bucketed._choose_at = real_choose
        bucketed.clear_choices()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="megatron_fused_8b")
    ap.add_argument("--mode", default="reduce-overhead", choices=("default", "reduce-overhead"))
    ap.add_argument("--seqs", default="1024,64")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--python", action="store_true", help="also the host's Python functions per call (cProfile)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    diagnostic_main(lambda: measure(a), lambda rows: write(rows, a))


def measure(a: argparse.Namespace) -> list[dict]:
    """Every rank's rows, on every rank: a rank that launches late shows up as the peer's
    collective waiting, so the profile of one rank alone cannot say which rank is slow."""
    seqs = [int(s) for s in a.seqs.split(",")]
    rows = []
    for v in a.variants.split(","):
        try:
            rows += run(a.model, a.mode, v, seqs, a.iters, a.python)
        except Exception as e:  # the other variants still run
            rows.append({"model": a.model, "mode": a.mode, "variant": v, "rank": dist.get_rank(),
                         "error": f"{type(e).__name__}: {e}"[:1500]})
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, json.dumps(rows, default=str))
    return [r for text in every for r in json.loads(text)]


def write(rows: list[dict], a: argparse.Namespace) -> None:
    """Rank 0: the table, the kernels and host ops that differ most from torch.compile's, the JSON."""
    print(f"{a.model} {a.mode}: seq, variant, rank, gpu ms, host ms, per role ms (kernels), choices")
    for r in rows:
        if "error" in r:
            print(f"  {r['variant']} rank {r.get('rank')}: ERROR {r['error'][:300]}")
            continue
        roles = " ".join(f"{k}={v[0]:.3f}({v[1]:.0f})" for k, v in sorted(r["roles"].items()))
        print(f"  {r['seq']:>6} {r['variant']:<19} {r['rank']} {r['gpu_ms']:7.3f} {r['host_ms']:7.3f}  {roles}  "
              f"{r['choices']}")
    base = {(r["seq"], r["rank"]): r for r in rows if r.get("variant") == "default" and "error" not in r}
    for r in rows:
        if r.get("variant") == "default" or "error" in r or (r["seq"], r["rank"]) not in base:
            continue
        for key, what in (("kernels", "ms per call"), ("host_ops", "host self ms per call")):
            diff = collections.Counter(r[key])
            diff.subtract(base[(r["seq"], r["rank"])][key])
            top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:a.top]
            print(f"  seq {r['seq']} rank {r['rank']} {r['variant']} minus default, {what}: "
                  + "; ".join(f"{k[:60]} {v:+.3f}" for k, v in top))
    for r in rows:
        for name, own, cum in r.get("python_top", [])[:12]:
            print(f"  python seq {r['seq']} rank {r['rank']} {r['variant']}: {own:.4f} own {cum:.4f} cum ms  {name}")
    if a.out:
        from benchmarks.results_io import write_rows

        print("wrote", write_rows(rows, a.out, "dynamic_profile", torch.cuda.get_device_name(),
                                  dist.get_world_size(), suffix=f"-{a.model}-{a.mode}", default=str))


if __name__ == "__main__":
    main()
