"""Where a moe_fused call's time goes, per configuration and kernel: the forward op's copy-engine
run (templates/moe_fused/kernels.run, with the intermediates a training graph saves) and the
backward's (backward_p2p.run) on W GPUs, on slots filled the way demo.moe's router fills them
(expert_gemm_padding.routed_counts: capacity factor 1.25, routed rows first, then zeros).

    python benchmarks/diagnostics/moe_op_profile.py --world 2 --shapes MoE-1,Mixtral-8x7B --out $OUT \\
        --configs '{"split":"source","transport":"p2p"}' '{"split":"source","transport":"p2p","experts":"packed"}'

Per shape and configuration: forward, backward and both timed as CUDA-graph replays and
host-launched (benchmarks/timing.py: medians, the slowest rank), and one replay of both profiled
(op_timeline.profile_replay); rank 0 prints the kernels' device time summed by name (the copy
engine's copies included), most first, and the span. Every rank's rows go to
moe_op_profile-<device>-w<W>-torch<v>-<date>.json under --out. What a configuration adds or
saves is read off here, kernel by kernel, not guessed from the layer's totals.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root
sys.path.insert(0, HERE)

SAVES = ("tokens", "gate", "up", "act")


def filled_slots(case: dict, world: int, rank: int, dev, dtype) -> tuple[torch.Tensor, float]:
    """This rank's dispatch slots [W * E_local * C, H]: per destination and expert the rows the
    router sends there (drawn with this rank's seed), then zeros; and the share routed."""
    from expert_gemm_padding import routed_counts

    rows, cap = routed_counts(case, world, seed=rank)
    e = case["E"] // world
    g = torch.Generator(device=dev).manual_seed(rank)
    slots = torch.randn(world, e, cap, case["H"], device=dev, dtype=dtype, generator=g)
    for d in range(world):
        for j in range(e):
            slots[d, j, rows[d][j]:] = 0
    return slots.view(-1, case["H"]), sum(map(sum, rows)) / (world * e * cap)


def by_kernel(acts: list[dict]) -> list[tuple[str, float, int]]:
    """(name, total us, count) over a replay's activities, most time first."""
    total: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for a in acts:
        total[a["name"]] += a["dur"]
        count[a["name"]] += 1
    return [(name, us, count[name]) for name, us in total.most_common()]


def case_rows(case: dict, configs: list[dict], iters: int) -> list[dict]:
    from op_timeline import profile_replay

    from benchmarks.timing import graphed, time_ms
    from overlap_compile.templates.moe_fused import backward_p2p, kernels
    from overlap_compile.templates.plans import MoePlan

    rank, w = dist.get_rank(), dist.get_world_size()
    group, dev, dt = dist.group.WORLD.group_name, torch.device("cuda", rank), torch.bfloat16
    e, h, f = case["E"] // w, case["H"], case["I"]
    buf, fill = filled_slots(case, w, rank, dev, dt)
    cap = buf.shape[0] // (w * e)
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    ws = [torch.randn(e, a, b, device=dev, dtype=dt, generator=gen) / a ** 0.5 for a, b in ((h, f), (h, f), (f, h))]
    wts = [t.transpose(1, 2) for t in ws]
    grad, _ = filled_slots(case, w, rank + 7, dev, dt)  # the combine's gradient: zeros past the routed rows
    rows = []
    for cfg in configs:
        fwd = MoePlan("moe_fused", w, e, cap, h, f, cfg, saves=SAVES)
        bwd = MoePlan("moe_fused", w, e, cap, h, f, cfg, direction="backward")
        why = kernels.usable(group, dev, fwd)
        if why is not None:
            raise SystemExit(f"moe_op_profile: the copy-engine path cannot run here: {why}")
        kept: dict = {}

        def forward():
            kept["fwd"] = kernels.run(buf, *ws, group, fwd)

        def backward():
            _, tokens, gate, up, act = kept["fwd"]
            return backward_p2p.run(grad, tokens.transpose(1, 2), gate, up, act.transpose(1, 2), *wts, group, bwd)

        def both():
            forward()
            return backward()

        forward()
        row = {"shape": case["name"], "config": cfg, "fill": fill, "capacity": cap, "rank": rank, "ms": {}}
        for name, fn in (("forward", forward), ("backward", backward), ("train", both)):
            row["ms"][f"{name}/host"] = time_ms(fn, iters=iters, warmup=3)
            row["ms"][f"{name}/cuda_graph"] = time_ms(graphed(fn), iters=iters, warmup=3)
        acts = profile_replay(both)
        row["span_us"] = max((a["start"] + a["dur"] for a in acts), default=0.0)
        row["kernels"] = [{"name": n, "us": us, "count": c} for n, us, c in by_kernel(acts)]
        kernels.check_errors(dev)
        rows.append(row)
        if rank == 0:
            times = "  ".join(f"{k} {v:.3f}" for k, v in row["ms"].items())
            print(f"== {case['name']} {json.dumps(cfg)} fill {fill:.2f}: {times} ms; replay span "
                  f"{row['span_us'] / 1e3:.3f} ms", flush=True)
            for n, us, c in by_kernel(acts)[:18]:
                print(f"  {us / 1e3:8.3f} ms  x{c:<3} {n[:110]}")
        del kept
        torch.cuda.empty_cache()
    return rows


def worker(shapes: list[str], configs: list[dict], iters: int, out: str) -> list[dict]:
    from benchmarks.results_io import write_rows

    torch.cuda.set_device(dist.get_rank())
    from benchmarks.shape_sets import shape_set

    cases = [c for c in shape_set("moe") if not shapes or c["name"] in shapes]
    rows = [r for case in cases for r in case_rows(case, configs, iters)]
    base = {"benchmark": "moe_op_profile", "device": torch.cuda.get_device_name(), "world_size": dist.get_world_size(),
            "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [{**base, **r} for r in rows])
    if dist.get_rank() == 0 and out:
        print("wrote", write_rows([r for per in gathered for r in per], out, "moe_op_profile", base["device"],
                                 base["world_size"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shapes", default="MoE-1", help="comma list of shapes.json moe names ('' = all)")
    ap.add_argument("--configs", nargs="+", default=['{"split":"source","transport":"p2p"}',
                                                     '{"split":"source","transport":"p2p","experts":"packed"}'],
                    help="moe_fused configurations, one JSON object each")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < a.world:
        raise SystemExit(f"moe_op_profile needs {a.world} GPUs (the copy-engine path), found "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    configs = [json.loads(c) for c in a.configs]
    from overlap_compile.testing.multiprocess import run_distributed

    run_distributed(worker, world_size=a.world, backend="nccl", timeout_s=900,
                    args=([s for s in a.shapes.split(",") if s], configs, a.iters, a.out))


if __name__ == "__main__":
    main()
