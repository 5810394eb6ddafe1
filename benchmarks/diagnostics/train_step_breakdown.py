"""Where an end-to-end model's training step spends its GPU time, kernel by kernel: the e2e
benchmark's block (benchmarks/models, e.g. mixtral_ep) under torch.compile on one GPU (a one-rank
NCCL group: the collectives are local), or on W GPUs under torchrun, profiled with torch.profiler
over a few steps (rank 0's kernels reported; the step time is the slowest rank's).

    python benchmarks/diagnostics/train_step_breakdown.py --model mixtral_ep --out $OUT
    python benchmarks/diagnostics/train_step_breakdown.py --model mixtral_ep --backend overlap
    torchrun --nproc-per-node 2 benchmarks/diagnostics/train_step_breakdown.py --backend overlap --out $OUT

Kernels are put in roles by name (moe_breakdown.role_of, plus ``attention`` for the
flash / efficient attention kernels). For a MoE block it also prints the expert slots' fill (the
share of capacity rows a token was routed to), which bounds what skipping the padding in the
expert GEMMs can save. Writes train_step_breakdown-<device>-w1-torch<v>-<date>-<model>-<backend>.json.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root
sys.path.insert(0, HERE)

ATTENTION = ("flash", "fmha", "attention", "sdpa")


def role(name: str) -> str:
    from moe_breakdown import role_of

    return "attention" if any(p in name.lower() for p in ATTENTION) else role_of(name)


def moe_fill(block, x: torch.Tensor) -> dict | None:
    """The expert slots' fill for this input: routed rows / capacity rows, per expert and overall."""
    moe = getattr(block, "moe", None)
    if moe is None:
        return None
    from overlap_compile.demo.moe import capacity, route

    with torch.no_grad():
        h = x + block.attention(block.attention_norm(x))
        t = block.ffn_norm(h).reshape(-1, moe.hidden)
        cap = capacity(t.shape[0], moe.num_experts, moe.top_k, moe.cf)
        slot, kept, _ = route(t, moe.router, moe.num_experts, moe.top_k, cap)
        per_expert = torch.bincount(slot[kept] // cap, minlength=moe.num_experts).tolist()
    return {"capacity": cap, "routed_per_expert": per_expert,
            "fill": sum(per_expert) / (cap * moe.num_experts), "dropped": int((~kept).sum())}


def busy_and_span_ms(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(how long some kernel or copy ran, first start to last end), ms, of device ``intervals``
    (start, end in us, the profiler's): span - busy is time the GPU sat idle, waiting on the host,
    on a peer (stream waits are not kernels) or on nothing queued."""
    busy, end_so_far = 0.0, None
    for start, end in sorted(intervals):
        if end_so_far is None or start > end_so_far:
            busy += end - start
            end_so_far = end
        elif end > end_so_far:
            busy += end - end_so_far
            end_so_far = end
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    return busy / 1e3, span / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral_ep")
    ap.add_argument("--shape", default=None, help="e2e shape name (default: the model's first)")
    ap.add_argument("--backend", default="inductor", choices=("inductor", "overlap"))
    ap.add_argument("--force", default=None, help="with --backend overlap: TEMPLATE or TEMPLATE@{config json} forced")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--tag", default="", help="appended to the results file's name (runs of one backend apart)")
    a = ap.parse_args()
    from moe_breakdown import launched_group

    launched_group("train_step_breakdown", 29533)
    rank0 = dist.get_rank() == 0
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.e2e import family_of, load_shapes
    from benchmarks.models import FAMILY, build

    shapes = [s for s in load_shapes("all", False) if family_of(s) == FAMILY[a.model]]
    shape = next(s for s in shapes if a.shape is None or s["name"] == a.shape)
    built = build(a.model, shape, "cuda", torch.bfloat16, seed=0)
    import overlap_compile as oc

    from benchmarks.e2e_run import forced_options

    forced = forced_options(a.force)
    with oc.config.patch(**forced):
        from overlap_compile.backend import overlap_backend

        fn = torch.compile(built.model, backend=overlap_backend if a.backend == "overlap" else "inductor")
    opt = torch.optim.AdamW(built.model.parameters(), lr=1e-4)

    def step() -> None:
        with oc.config.patch(**forced):
            loss = built.to_local(fn(built.x)).float().pow(2).mean()
            loss.backward()
        built.finalize_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        step()
    torch.cuda.synchronize()
    slowest = torch.tensor([(time.perf_counter() - t0) * 1e3 / a.iters], device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    step_ms = slowest.item()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.iters):
            step()
        torch.cuda.synchronize()
    kernels: collections.Counter = collections.Counter()
    intervals = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            kernels[ev.name] += ev.device_time / 1e3 / a.iters
            intervals.append((ev.time_range.start, ev.time_range.end))
    busy_ms, span_ms = busy_and_span_ms(intervals)
    ranks: list = [None] * dist.get_world_size()  # every rank's (kernels, busy, span) per step
    dist.all_gather_object(ranks, {"kernel_ms": sum(kernels.values()), "busy_ms": busy_ms / a.iters,
                                   "span_ms": span_ms / a.iters})
    roles: collections.Counter = collections.Counter()
    for name, ms in kernels.items():
        roles[role(name)] += ms
    busy = sum(kernels.values())
    fill = moe_fill(built.model, built.x)
    if not rank0:
        from overlap_compile.runtime import teardown
        teardown.finish()  # barrier, release, destroy; every rank before the store's host leaves
        return
    world = dist.get_world_size()
    print(f"{a.model} {shape['name']} ({a.backend}, W={world}): step {step_ms:.2f} ms, rank 0's kernels {busy:.2f} ms")
    print("  " + "  ".join(f"{r} {ms:.2f} ({ms / busy:.0%})" for r, ms in roles.most_common()))
    for r, got in enumerate(ranks):  # kernels overlapping (copy engine beside compute) count once in busy
        print(f"  rank {r}: kernels {got['kernel_ms']:.2f} ms, GPU busy {got['busy_ms']:.2f} ms of a "
              f"{got['span_ms']:.2f} ms span per step: idle {got['span_ms'] - got['busy_ms']:.2f} ms")
    if fill:
        print(f"  expert slots: fill {fill['fill']:.3f}, capacity {fill['capacity']}, routed {fill['routed_per_expert']}, "
              f"dropped {fill['dropped']}")
    for name, ms in kernels.most_common(a.top):
        print(f"    {ms:8.3f} ms  {role(name):12s} {name[:110]}")
    if a.out:
        from benchmarks.results_io import write_rows

        row = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": a.model, "shape": shape,
               "backend": a.backend, "force": a.force, "step_ms": step_ms, "kernel_ms": busy,
               "roles_ms": dict(roles.most_common()), "moe_fill": fill, "ranks": ranks,
               "kernels_ms": [[n, ms, role(n)] for n, ms in kernels.most_common()]}
        path = write_rows([row], a.out, "train_step_breakdown", row["device"], world,
                          suffix=f"-{a.model}-{a.backend}{'-forced' if a.force else ''}{'-' + a.tag if a.tag else ''}")
        print("wrote", path)
    from overlap_compile.runtime import teardown
    teardown.finish()  # barrier, release, destroy; every rank before the store's host leaves


if __name__ == "__main__":
    main()
