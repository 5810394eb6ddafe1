"""One GPU, no communication: what moe_fused's routed payload (templates/moe_fused/routed.py) saves
and costs in one rank's expert work at EP = ``--world``, on the shapes.json "moe" set.

Per shape, one rank's dispatched slots ``[W, E_local, C, H]`` are filled by demo.moe's own routing
of random tokens (``uniform``: a random router; ``skewed``: a router leaning on expert 0, the
hot-expert case), then timed (CUDA events, medians, host-launched, bf16):

* ``capacity``: the section as written without its all-to-alls: the layout copy to
  ``[E_local, W * C, H]``, bmm over every slot, the copy back;
* ``routed``: routed.run with a loopback link (each piece "arrives" as it was sent: at W = 2
  the peer's piece has the shape it would have): the sizes scan, the host synchronisation,
  packing, the GEMMs over the routed rows only, the copies back, the zeros past them.

and ``routed`` again with one cuBLAS mm per expert instead of torch._grouped_mm
(``routed_mm_per_expert_ms``). Rows: fill (routed share of the slots), ms of each, ratio; JSON
under --out (results_io).

    python benchmarks/diagnostics/moe_routed_experts.py --out $OUT
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from benchmarks.results_io import write_rows  # noqa: E402
from benchmarks.timing import time_ms  # noqa: E402


def dispatched_slots(shape: dict, world: int, routing: str, dev, dtype) -> torch.Tensor:
    """The slots one rank's experts receive: every source's tokens routed by demo.moe.route."""
    from overlap_compile.demo.moe import capacity, route

    e, k, s, h = shape["E"], shape["topk"], shape["S"], shape["H"]
    cap = capacity(s, e, k, 1.25)
    e_local = e // world
    router = torch.randn(e, h, device=dev) / h ** 0.5
    if routing == "skewed":
        router[0] += 4.0 / h ** 0.5 * 8
    slots = torch.zeros(world, e_local, cap, h, device=dev, dtype=dtype)
    for src in range(world):
        x = torch.randn(s, h, device=dev, dtype=dtype).abs() + 0.1 if routing == "skewed" else \
            torch.randn(s, h, device=dev, dtype=dtype)
        slot, kept, _ = route(x, router, e, k, cap)
        buf = torch.zeros(e * cap, h, device=dev, dtype=dtype)
        buf.index_add_(0, slot, x.repeat_interleave(k, 0) * kept.to(dtype)[:, None])
        slots[src] = buf.view(e, cap, h)[:e_local]  # this rank's experts: the first E_local
    return slots


class Loopback:
    """A routed.run link that moves nothing: a piece arrives as it was sent (at W = 2 with the
    sizes the peer would have), the sizes exchange returns my own."""

    def __init__(self, world: int) -> None:
        self.world = world

    def rank_and_size(self):
        return 0, self.world

    def exchange_sizes(self, sizes):
        return sizes

    def start(self, send, to, rows_in, source, width):
        return send

    def finish(self, handle):
        return handle

    def close(self):
        pass


def profile_table(capacity, routed_work, routing: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("capacity", capacity), ("routed", routed_work)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"--- {name} ({routing}), 5 calls")
        for key in ("cuda_time_total", "cpu_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=40))


def main() -> None:
    from overlap_compile.templates.moe_fused import reference as ref
    from overlap_compile.templates.moe_fused import routed
    from overlap_compile.templates.moe_fused.packed import grouped_mm_runs
    from overlap_compile.templates.plans import MoePlan

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "..", "results"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile", default="", help="a shape name: print torch.profiler's table of both sides there")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    a = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    from benchmarks.shape_sets import shape_set

    shapes = shape_set("moe")
    if a.shapes:
        shapes = [s for s in shapes if s["name"] in a.shapes.split(",")]
    base = {"benchmark": "moe_routed_experts", "device": torch.cuda.get_device_name(), "world_size": a.world,
            "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    rows = []
    print(f"{'shape':>14} {'routing':>8} {'fill':>5} {'capacity ms':>11} {'routed ms':>9} {'ratio':>6} {'mm/expert':>9}")
    for shape in shapes:
        torch.manual_seed(0)
        e_local, h, ffn = shape["E"] // a.world, shape["H"], shape["I"]
        ws = [(torch.randn(e_local, h, ffn, device=dev) / h ** 0.5).to(dtype),
              (torch.randn(e_local, h, ffn, device=dev) / h ** 0.5).to(dtype),
              (torch.randn(e_local, ffn, h, device=dev) / ffn ** 0.5).to(dtype)]
        for routing in ("uniform", "skewed"):
            slots = dispatched_slots(shape, a.world, routing, dev, dtype)
            w, e, c, _ = slots.shape
            flat = slots.view(-1, h)
            plan = MoePlan("moe_fused", w, e, c, h, ffn, {"split": "source", "payload": "routed"})

            def capacity():
                by_expert = slots.transpose(0, 1).reshape(e, w * c, h)
                return ref.experts(by_expert, *ws).view(e, w, c, h).transpose(0, 1).reshape(-1, h)

            def routed_work():
                return routed.run(flat, *ws, "loopback", plan, link=Loopback(w))

            # same result on the routed rows (the rest: zeros both ways)
            want = capacity()
            got = routed_work()
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            fill = routed.routed_sizes(slots).sum().item() / (w * e * c)
            cap_ms, routed_ms = time_ms(capacity, a.iters), time_ms(routed_work, a.iters)
            grouped_from, routed.GROUPED_FROM_EXPERTS = routed.GROUPED_FROM_EXPERTS, 1 << 20
            try:  # one cuBLAS mm per expert throughout
                mm_ms = time_ms(routed_work, a.iters)
            finally:
                routed.GROUPED_FROM_EXPERTS = grouped_from
            if a.profile == shape["name"]:
                profile_table(capacity, routed_work, routing)
            rows.append({**base, "shape": shape["name"], "routing": routing, "fill": fill, "capacity_ms": cap_ms,
                         "routed_ms": routed_ms, "ratio": cap_ms / routed_ms,
                         "routed_mm_per_expert_ms": mm_ms, "rel_err": err,
                         "grouped_mm": e >= routed.GROUPED_FROM_EXPERTS and grouped_mm_runs(flat, ws[0])})
            print(f"{shape['name']:>14} {routing:>8} {fill:5.2f} {cap_ms:11.3f} {routed_ms:9.3f} "
                  f"{cap_ms / routed_ms:6.2f} {mm_ms:9.3f}  err {err:.1e}")
    print("wrote", write_rows(rows, a.out, "moe_routed_experts", base["device"], a.world, date=base["date"]))


if __name__ == "__main__":
    main()
