"""What the overlap pass would do to the end-to-end Llama blocks, on a CPU, at their real sizes.

    python benchmarks/plan.py                                   # 8b and 70b, W=2, both modes, h200
    python benchmarks/plan.py --shapes 8b --world 2,4,8 --modes reduce-overhead --profile h100

Each block (``--models``: llama_dtensor, the DTensor form e2e.py's headline rows run, or
llama_megatron; ``benchmarks/models/llama.py``) is built on the meta device on a fake process group
and planned by ``overlap_compile.plan``: traced, partitioned and passed through Inductor's
post-grad passes as a GPU compile would be, in seconds and with no memory. Per site it prints the
decision and its reason; per block, the forecast (``Report.forecast``) of the metric e2e.py
measures on GPUs: of the time the sites' collectives take as written, how much the pass is
predicted to hide (its rewrites; what the compute defer_compute puts beside the collectives left
as written would hide is printed apart, not counted). Sites inside the model's error band are
measured on GPUs (passes/settle.py); here they keep their predicted decision, so the forecast
also gives what they would add if measured as predicted.

Rows (``benchmark: "plan"``, one per site, ``method`` the decision, ``predicted_ms`` what runs)
go to ``--out`` as ``plan-<profile>-w<W>-torch<v>-<date>.json`` with a markdown table beside it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SHAPES = {"8b": "Llama-3-8B block, TP+SP", "70b": "Llama-3-70B block, TP+SP"}


def e2e_sizes(key: str) -> dict:
    from benchmarks.shape_sets import shapes_by_name

    return shapes_by_name("e2e")[SHAPES[key]]


def _meta_block(model: str, sizes: dict, world: int, group: str):
    """(block, input) of ``model`` on the meta device, rank 0 of a fake group of ``world``."""
    from overlap_compile.demo.common import meta_block

    block, x = meta_block(sizes, world)
    if model == "llama_dtensor":
        return block, x
    import torch

    from benchmarks.models.llama import MegatronLlamaBlock
    from overlap_compile.demo.models import LlamaBlock

    full = LlamaBlock(sizes["hidden"], sizes["intermediate"], sizes["heads"]).to(device="meta", dtype=torch.bfloat16)
    return MegatronLlamaBlock(full, 0, world, group), x.to_local()


def plan_block(sizes: dict, world: int, mode: str, profile: str, model: str = "llama_dtensor", **options):
    """The Report of the block's training step (forward and backward) as the pass would compile it."""
    import torch

    import overlap_compile as oc
    from overlap_compile.testing.fake_group import fake_process_group

    torch._dynamo.reset()
    with fake_process_group(world) as group:
        block, x = _meta_block(model, sizes, world, group)
        return oc.plan(block, x, backward=True, mode=mode, profile=profile, **options)


def rows_of(report, shape: str, world: int, mode: str, profile: str, model: str) -> list[dict]:
    import torch

    rows = []
    for s in report.sites:
        rows.append({
            "benchmark": "plan", "device": f"plan:{profile}", "world_size": world, "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "kind": s.kind, "shape": s.gemms, "model": model, "block": shape,
            "graph": s.graph, "method": s.template, "config": s.config,
            "mode": "cuda_graph" if mode == "reduce-overhead" else "eager", "compile_mode": mode,
            "ms": s.chosen_ms, "predicted_ms": s.chosen_ms, "baseline_ms": s.predicted_ms.get("baseline"),
            "comm_ms": s.comm_ms, "hidden_by_defer_ms": s.hidden_ms, "reason": s.reason,
        })
    return rows


def markdown(blocks: list[tuple[str, str, int, str, dict, list[dict]]]) -> str:
    lines = ["| model | block | W | compile mode | sites rewritten | collectives as written ms | predicted hidden ms | "
             "share | with the band measured as predicted |", "|---|---|---|---|---|---|---|---|---|"]
    for model, shape, world, mode, fc, _ in blocks:
        a = fc["all"]
        lines.append(f"| {model} | {SHAPES[shape]} | {world} | {mode} | {a['rewritten']}/{a['sites']} | {a['comm_ms']:.3f} | "
                     f"{a['hidden_ms']:.3f} | {a['hidden_share']:.0%} | {a['with_band_share']:.0%} |")
    lines += ["", "| block | W | mode | graph | kind | GEMMs | decision | predicted ms (as written) | reason |",
              "|---|---|---|---|---|---|---|---|---|"]
    for _, shape, world, mode, _, rows in blocks:
        for r in rows:
            gemms = ", ".join("x".join(map(str, g)) for g in r["shape"])
            lines.append(f"| {shape} | {world} | {mode} | {r['graph']} | {r['kind']} | {gemms} | {r['method']} | "
                         f"{r['predicted_ms']:.3f} ({r['baseline_ms'] + r['hidden_by_defer_ms']:.3f}) | {r['reason']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from overlap_compile.report import forecast_line

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama_dtensor", help="comma list of llama_dtensor, llama_megatron")
    ap.add_argument("--shapes", default="8b,70b", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--world", default="2", help="comma list of world sizes")
    ap.add_argument("--modes", default="default,reduce-overhead", help="comma list of default, reduce-overhead")
    ap.add_argument("--profile", default="h200", help="a built-in profile name or a profile JSON path")
    ap.add_argument("--out", default=None, help="directory for the rows and the table (default: print only)")
    a = ap.parse_args(argv)
    models, shapes, modes = a.models.split(","), a.shapes.split(","), a.modes.split(",")
    worlds = [int(w) for w in a.world.split(",")]
    bad = ([m for m in models if m not in ("llama_dtensor", "llama_megatron")] + [s for s in shapes if s not in SHAPES]
           + [m for m in modes if m not in ("default", "reduce-overhead")])
    if bad:
        raise SystemExit(f"unknown {bad}: --models takes llama_dtensor / llama_megatron, --shapes {sorted(SHAPES)}, "
                         "--modes default / reduce-overhead")
    blocks = []
    for model in models:
        for shape in shapes:
            for world in worlds:
                for mode in modes:
                    report = plan_block(e2e_sizes(shape), world, mode, a.profile, model)
                    fc, rows = report.forecast(), rows_of(report, shape, world, mode, a.profile, model)
                    blocks.append((model, shape, world, mode, fc, rows))
                    print(f"== {model}, {SHAPES[shape]}, W={world}, {mode}, profile {a.profile}")
                    print(report)
                    print(forecast_line(fc["all"]) + "\n")
    if a.out:
        from benchmarks.results_io import result_stem, write_rows

        for world in worlds:
            rows = [r for b in blocks if b[2] == world for r in b[5]]
            path = write_rows(rows, a.out, "plan", a.profile, world)
            with open(result_stem(a.out, "plan", a.profile, world) + ".md", "w") as f:
                f.write(markdown([b for b in blocks if b[2] == world]))
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
