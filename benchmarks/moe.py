"""MoE layer benchmark: the expert-parallel layer (overlap_compile.demo.moe) under torch.compile,
sequential vs the overlap templates, over the shapes.json "moe" set.

    python benchmarks/moe.py --world 4 --out $OUT              # GPUs (NCCL), bf16
    python benchmarks/moe.py --dry-run                          # CPU, gloo, tiny shapes

Per shape (S tokens per rank, hidden H, expert FFN I, E experts, top-k), host-launched:

* ``forward`` (inference: no grad) -- ``sequential`` (torch.compile, the layer as written:
  all_to_all -> SwiGLU bmm -> all_to_all) vs ``moe_fused`` (forced: the piece pipeline, the
  predicted-best configuration) and, on GPUs, each transport forced: ``moe_fused_nccl``
  (``{"split": "source"}``, NCCL), ``moe_fused_p2p`` (``{"split": "source", "transport":
  "p2p"}``, copy engine, bmm experts) and ``moe_fused_p2p_kernel`` (the same with the persistent
  expert kernel, ``"experts": "fused"``);
* ``train`` (forward + backward) -- ``sequential`` vs ``moe_fused`` (forced) vs ``overlap`` (the
  predictor's choice). moe_fused takes the forward section (it also returns what backward
  saves); the backward section (the bmm gradients between two all-to-alls) is not the SwiGLU form
  and stays as written, with that reason in each row's ``sites``.

The output of each variant is checked against the sequential one in the same run. Median ms
(benchmarks/timing.py: CUDA events, ranks synchronised), tokens/s, rows to
<out>/moe-<device>-w<world>-torch<v>-<date>.json (benchmarks/results_io.py) and a table.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # the repository root

from benchmarks.results_io import write_rows  # noqa: E402
from benchmarks.timing import time_ms  # noqa: E402

DRY_SHAPES = [{"name": "tiny-8", "S": 64, "H": 32, "I": 48, "E": 8, "topk": 2},
              {"name": "tiny-16", "S": 64, "H": 32, "I": 48, "E": 16, "topk": 2}]


def compiled_layer(layer, force: str | None, report, config: dict | None = None):
    import overlap_compile as oc
    from overlap_compile.backend import overlap_backend

    fn = torch.compile(layer, backend=functools.partial(overlap_backend, report=report))
    options = {"force_template": force} if force else {}
    if config is not None:
        options["force_config"] = config

    def call(x):
        with oc.config.patch(**options):
            return fn(x)

    return call


def worker(shapes: list[dict], dry: bool, iters: int, out_dir: str | None = None) -> list[dict]:
    import overlap_compile as oc
    from overlap_compile.demo.moe import ExpertParallelMoE
    from overlap_compile.explain import no_compile_caches

    rank, w = dist.get_rank(), dist.get_world_size()
    device, dtype = ("cpu", torch.float32) if dry else (f"cuda:{rank}", torch.bfloat16)
    if not dry:
        torch.cuda.set_device(rank)
    base = {"benchmark": "moe", "device": "cpu" if dry else torch.cuda.get_device_name(), "world_size": w,
            "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    rows = []
    for shape in shapes:
        if shape["E"] % w:
            rows.append({**base, "shape": shape["name"], "error": f"E={shape['E']} not divisible by W={w}"})
            continue
        torch.manual_seed(0)
        layer = ExpertParallelMoE(shape["H"], shape["I"], shape["E"], shape["topk"], 1.25,
                                  dist.group.WORLD.group_name, w, rank).to(device=device, dtype=dtype)
        torch.manual_seed(1 + rank)
        x = torch.randn(shape["S"], shape["H"], device=device, dtype=dtype)
        tokens = w * shape["S"]
        forward = [("sequential", "baseline", None), ("moe_fused", "moe_fused", None)]
        if not dry:
            forward += [("moe_fused_nccl", "moe_fused", {"split": "source"}),
                        ("moe_fused_p2p", "moe_fused", {"split": "source", "transport": "p2p"}),
                        ("moe_fused_p2p_kernel", "moe_fused", {"split": "source", "transport": "p2p",
                                                               "experts": "fused"})]
        train = [("sequential", "baseline", None), ("moe_fused", "moe_fused", None), ("overlap", None, None)]
        for phase, variants in (("forward", forward), ("train", train)):
            ref_out, ref_ms = None, None
            for name, force, config in variants:
                # plus the common schema's keys (benchmarks/plot.py): kind, method, mode
                row = {**base, "shape": shape["name"], "phase": phase, "variant": name, "kind": f"moe_{phase}",
                       "method": name, "mode": "eager", "experts": shape["E"], "topk": shape["topk"],
                       "sizes": {k: shape[k] for k in ("S", "H", "I")}}
                try:
                    torch._dynamo.reset()
                    report = oc.Report()
                    with no_compile_caches():
                        fn = compiled_layer(layer, force, report, config)
                        if phase == "forward":
                            def step():
                                with torch.no_grad():
                                    return fn(x)
                        else:
                            xg = x.clone().requires_grad_()

                            def step():
                                y = fn(xg)
                                y.float().pow(2).mean().backward()
                                return y.detach()
                        out = step()
                        ms = time_ms(step, iters, warmup=2)
                    row.update(ms=ms, tokens_per_s=tokens / (ms / 1e3),
                               sites=[(s.graph, s.kind, s.template, s.rewritten) for s in report.sites],
                               configs=[s.config for s in report.sites],
                               reasons=sorted({s.reason for s in report.sites if not s.rewritten}))
                    if ref_out is None:
                        ref_out, ref_ms = out, ms
                    else:
                        row["speedup"] = ref_ms / ms
                        row["rel_err"] = ((out.float() - ref_out.float()).abs().max()
                                          / ref_out.float().abs().max().clamp_min(1e-6)).item()
                except Exception as e:  # recorded, the sweep goes on
                    row["error"] = f"{type(e).__name__}: {e}"[:1500]
                rows.append(row)
                if rank == 0 and out_dir:  # a run cut off by a time limit keeps its rows
                    os.makedirs(out_dir, exist_ok=True)
                    with open(os.path.join(out_dir, "moe-partial.jsonl"), "a") as f:
                        f.write(json.dumps(row) + "\n")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=torch.cuda.device_count() if torch.cuda.is_available() else 2)
    ap.add_argument("--limit", type=int, default=0, help="first N shapes (0 = all)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    a = ap.parse_args()
    dry = a.dry_run or not torch.cuda.is_available()
    if dry:
        shapes = DRY_SHAPES
    else:
        with open(os.path.join(HERE, "shapes.json")) as f:
            shapes = json.load(f)["moe"]
    shapes = shapes[: a.limit] if a.limit else shapes
    from overlap_compile.testing.multiprocess import run_distributed

    rows = run_distributed(worker, world_size=a.world, args=(shapes, dry, a.iters, a.out),
                           backend="gloo" if dry else "nccl", timeout_s=3600)[0]
    path = write_rows(rows, a.out, "moe", rows[0]["device"], rows[0]["world_size"], date=rows[0]["date"])
    print(f"{'shape':>14} {'phase':>8} {'variant':>11} {'ms':>9} {'x seq':>6} {'rel err':>8}  sites rewritten")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:>14} {r.get('phase', '-'):>8} {r.get('variant', '-'):>11}  ERROR {r['error'][:120]}")
            continue
        sp = f"{r['speedup']:.3f}" if "speedup" in r else "-"
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        done = sum(1 for s in r["sites"] if s[3])
        print(f"{r['shape']:>14} {r['phase']:>8} {r['variant']:>11} {r['ms']:9.3f} {sp:>6} {err:>8}  {done}/{len(r['sites'])}")
    print("wrote", path)


if __name__ == "__main__":
    main()
