"""Operator benchmark: GEMM + collective, sequential vs every template, on W GPUs (NCCL).

    python benchmarks/ops.py --world 4 --kinds gemm_allreduce,gemm_reducescatter --out $OUT

Per shape of ../shared/shapes.json (or --shapes): the sequential baseline (torch.mm then the
collective), PyTorch async-TP for reduce-scatter where available, and each template, each
host-launched ("eager") and CUDA-graph captured ("cuda_graph"); correctness is checked against
the baseline in the same run; the overlap bound is max(g, c) + min(g, c) / groups
(ANCHORS.md). Sites are built the way the compiler builds them: the pattern is traced with
make_fx, found by passes.find, and planned by the template's spec, so the benchmark runs the
exact plan a compiled model would.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from overlap_compile import templates  # noqa: E402
from timing import graphed, time_ms  # noqa: E402,F401  (signal_reorder_breakdown imports them from here too)
from overlap_compile.testing.patterns import collective, gemm_then_collective as sequential_fn  # noqa: E402

DEFAULT_SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shapes.json")  # copy of shared/shapes.json


def rewritten(kind: str, template: str, a: torch.Tensor, b: torch.Tensor, group: str, world: int):
    """The sequential pattern traced with make_fx and rewritten by the overlap pass with
    ``template`` forced: the op + glue a compiled model runs (minus Inductor's fusion)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from overlap_compile import config
    from overlap_compile.passes.pipeline import run_on_graph

    gm = make_fx(sequential_fn(kind, group, world), tracing_mode="fake")(a, b)
    name, _, only = template.partition("@")
    with config.patch(force_template=name), _only_configs(name, only):
        record = run_on_graph(gm.graph, config.current())
    gm.recompile()
    site = record.sites[0]
    return (lambda: gm(a, b)) if site.rewritten else None, site


@contextlib.contextmanager
def _only_configs(template: str, only: str):
    """``only`` = "key=value": the template's configs restricted to those with config[key] == value
    (e.g. "p2p_ring@transport=p2p": the copy-engine transport, whatever the predictor prefers)."""
    if not only:
        yield
        return
    from overlap_compile import predictor

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


def bench(kinds: list[str], shapes: dict, world: int, templates_to_run: list[str]) -> list[dict]:
    rank = dist.get_rank()
    group = dist.group.WORLD.group_name
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dev = torch.cuda.get_device_name() if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    date = datetime.date.today().isoformat()
    for kind in kinds:
        for shape in shapes[kind]:
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
            base = {"benchmark": "ops", "device": dev, "world_size": world, "torch": torch.__version__, "date": date,
                    "kind": kind, "shape": shape}
            modes = ("eager", "cuda_graph") if cuda else ("eager",)
            seq_eager = time_ms(lambda: seq(a, b))
            seq_graph = time_ms(graphed(lambda: seq(a, b))) if cuda else float("nan")
            for mode, ms in (("eager", seq_eager), ("cuda_graph", seq_graph))[: len(modes)]:
                rows.append({**base, "method": "sequential", "config": None, "mode": mode, "ms": ms,
                             "gemm_ms": gemm_ms, "comm_ms": comm_ms, "correct": True})
            for name in _expand(templates_to_run):
                fn, site = rewritten(kind, name, a, b, group, world)
                if fn is None:
                    continue
                config = site.config
                out = fn().reshape(ref.shape)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                # pieces the communication is cut into: wave groups, chunks, or p2p_ring's ring
                # steps (W stripes, each cut into ``slices``)
                groups = (len(config.get("wave_groups", [])) or config.get("chunks")
                          or config.get("slices", 1) * world)
                bound = max(gemm_ms, comm_ms) + min(gemm_ms, comm_ms) / max(groups, 1)
                for mode in modes:
                    try:
                        ms = time_ms(fn if mode == "eager" else graphed(fn))
                    except Exception as e:  # a template that cannot be captured is reported, not hidden
                        ms = float("nan")
                        if rank == 0:
                            print(f"{name} {kind} {shape} {mode}: {type(e).__name__}: {e}")
                    seq_ms = seq_eager if mode == "eager" else seq_graph
                    rows.append({**base, "method": name.split("@")[0], "config": config, "mode": mode, "ms": ms,
                                 "speedup": seq_ms / ms if ms == ms else None, "bound_ms": bound,
                                 "rel_err": err, "correct": err < 2e-2})
            if rank == 0:
                print(_table_rows([r for r in rows if r["kind"] == kind and r["shape"] == shape]), flush=True)
    return rows


def _table_rows(rows: list[dict]) -> str:
    out = []
    for r in rows:
        extra = f"  x{r['speedup']:.3f}  bound {r['bound_ms']:.3f}  err {r['rel_err']:.1e}" if "speedup" in r and r["speedup"] else ""
        out.append(f"{r['kind']:>20} {str(r['shape']):>20} {r['method']:>16} {r['mode']:>10} {r['ms']:8.3f} ms{extra}")
    return "\n".join(out)


def worker(kinds, shapes, templates_to_run, out_dir):
    world = dist.get_world_size()
    rows = bench(kinds, shapes, world, templates_to_run)
    if dist.get_rank() == 0 and out_dir:
        dev = (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu").replace(" ", "_")
        path = os.path.join(out_dir, f"ops-{dev}-w{world}-{datetime.date.today().isoformat()}.json")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        print("wrote", path)
    return len(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=max(torch.cuda.device_count(), 2))
    ap.add_argument("--kinds", default="gemm_allreduce,gemm_reducescatter")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--limit", type=int, default=0, help="first N shapes of each kind (0 = all)")
    ap.add_argument("--templates", default=",".join(templates.names()))
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--scale", type=int, default=1, help="divide every shape dim by this (CPU dry runs)")
    args = ap.parse_args()
    with open(args.shapes) as f:
        shapes = json.load(f)
    kinds = args.kinds.split(",")
    shapes = {k: [[d // args.scale for d in sh] for sh in shapes[k][: args.limit or None]] for k in kinds}
    from overlap_compile.testing.multiprocess import run_distributed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    run_distributed(worker, world_size=args.world, args=(kinds, shapes, args.templates.split(","), args.out),
                    backend=backend, timeout_s=3000)


if __name__ == "__main__":
    main()
