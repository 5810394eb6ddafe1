"""What the comm-free bound's stand-ins cost on one GPU, against what the forecast prices them at.

    python benchmarks/diagnostics/standin_copies.py --out $OUT
    python benchmarks/diagnostics/standin_copies.py --limit 1      # smoke run

e2e.py's ``nocomm`` variant replaces each collective by one local op of the output's shape
(benchmarks/nocomm.py): an all-gather by its shard repeated W times, a reduce-scatter by this
rank's chunk copied, an all-reduce by a copy. The bound is short of the step without
communication by these kernels, and ``report.forecast`` subtracts their price (``standin_ms``:
bytes read + written at the profile's HBM bandwidth) from the collectives' to forecast the share
of the gap closed. Per TP+SP block of benchmarks/shapes.json (the activations' [tokens, hidden]
at W = ``--worlds``) this times:
- the ``oc_nocomm`` op itself, as the bound runs it;
- for the all-gather, the ways of writing W copies of a shard: ``Tensor.repeat`` (one strided
  copy kernel), ``torch.cat`` (one batched copy of contiguous pieces), W slice copies;
- a contiguous clone of the same bytes: the copy bandwidth the GPU reaches.
CUDA graphs of 10 calls (kernel time) and host-launched, alternating rounds, medians. Rows (one
schema, results_io) go to <out>/standin_copies-<device>-w1-torch<v>-<date>.json, a table beside.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root


def blocks(limit: int) -> list[dict]:
    """The dense TP+SP blocks of the e2e shape set (the MoE block's all-to-alls are no row copies)."""
    from benchmarks.shape_sets import shape_set

    dense = [b for b in shape_set("e2e") if "E" not in b]
    return dense[: limit or None]


def candidates(x, world: int, rank: int) -> dict:
    """name -> (collective, callable, bytes read + written) for one shard ``x`` [rows, hidden]."""
    import torch

    import benchmarks.nocomm  # noqa: F401  (defines torch.ops.oc_nocomm)

    ops = torch.ops.oc_nocomm
    shard = x.numel() * x.element_size()
    full = x.new_empty((world * x.shape[0], x.shape[1]))
    rows = x.shape[0]

    def copies():
        out = torch.empty_like(full)
        for i in range(world):
            out[i * rows:(i + 1) * rows].copy_(x)
        return out

    gathered = world * shard + shard  # the shard read, the whole output written
    return {
        "all_gather: oc_nocomm.repeat_rows": ("all_gather", lambda: ops.repeat_rows(x, world), gathered),
        "all_gather: Tensor.repeat": ("all_gather", lambda: x.repeat(world, 1), gathered),
        "all_gather: torch.cat": ("all_gather", lambda: torch.cat([x] * world), gathered),
        "all_gather: W slice copies": ("all_gather", copies, gathered),
        "reduce_scatter: oc_nocomm.chunk_rows": ("reduce_scatter", lambda: ops.chunk_rows(full, world, rank),
                                                  2 * shard),
        "all_reduce: oc_nocomm.copy": ("all_reduce", lambda: ops.copy(x), 2 * shard),
        "clone of the gathered bytes": ("copy", lambda: full.clone(), 2 * world * shard),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "..", "results"))
    ap.add_argument("--worlds", default="2,4,8", help="comma-separated world sizes (the shard is tokens / W)")
    ap.add_argument("--repeat", type=int, default=3, help="alternating rounds (median)")
    ap.add_argument("--rep", type=int, default=40, help="do_bench repetition time (ms)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N blocks (smoke runs)")
    args = ap.parse_args()

    import torch

    from benchmarks.results_io import write_rows
    from benchmarks.timing import kernel_and_host_timers, one_gpu
    from overlap_compile.predictor.models import hbm_ms

    dev, device, profile, date = one_gpu()
    rows, seen = [], set()

    for block in blocks(args.limit):
        for world in (int(w) for w in args.worlds.split(",")):
            shape = (block["seq"] * block["batch"] // world, block["hidden"])
            if (shape, world) in seen:
                continue
            seen.add((shape, world))
            x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
            cands = candidates(x, world, rank=world - 1)
            want = torch.cat([x] * world)
            for name, (coll, fn, _) in cands.items():
                if coll == "all_gather":
                    assert torch.equal(fn(), want), f"{name} at {shape}, W={world}: not W copies of the shard"
            timed = {name: kernel_and_host_timers(fn, args.rep) for name, (_, fn, _) in cands.items()}
            for mode in ("cuda_graph", "eager"):
                got = {name: [] for name in timed}
                for _ in range(args.repeat):
                    for name, t in timed.items():
                        got[name].append(t[mode]())
                for name, samples in got.items():
                    coll, _, nbytes = cands[name]
                    ms = statistics.median(samples)
                    rows.append({"benchmark": "standin_copies", "device": device, "world_size": 1,
                                 "torch": torch.__version__, "date": date, "kind": block["name"],
                                 "shape": list(shape), "world": world, "collective": coll, "method": name,
                                 "mode": mode, "ms": ms, "bytes": nbytes, "gbps": nbytes / ms / 1e6,
                                 "priced_ms": hbm_ms(profile, nbytes), "profile": profile.name, "dtype": "bfloat16"})
            line = "  ".join(f"{r['method'].split(': ')[-1]} {r['ms']:.3f} ms ({r['gbps']:.0f} GB/s)"
                             for r in rows[-len(cands):])
            print(f"{block['name']} {shape} W={world} (eager) {line}", flush=True)
            del x, want, cands, timed
            torch.cuda.empty_cache()

    table = markdown(rows)
    path = write_rows(rows, args.out, "standin_copies", device, 1, date=date, table=table)
    print(f"\nwrote {path}\n\n{table}")


def markdown(rows: list[dict]) -> str:
    """Per method: the median bandwidth reached and the median of measured / priced time, CUDA graph
    and host-launched, over the shapes."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = ["| stand-in | CUDA graph: GB/s, measured / priced | host-launched: GB/s, measured / priced |",
             "|---|---|---|"]
    for name in methods:
        cells = []
        for mode in ("cuda_graph", "eager"):
            got = [r for r in rows if r["method"] == name and r["mode"] == mode]
            cells.append(f"{statistics.median(r['gbps'] for r in got):.0f}, "
                         f"{statistics.median(r['ms'] / r['priced_ms'] for r in got):.2f}x" if got else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
