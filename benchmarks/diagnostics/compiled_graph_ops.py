"""What Inductor's post-grad graphs of an e2e model hold, per compile variant, and the step time
each gives: GEMMs, attention, collectives counted per graph (forward, backward), on W GPUs.

    torchrun --nproc-per-node 2 benchmarks/diagnostics/compiled_graph_ops.py --model titan_llama3_8b \
        --variants default,default+pass,nocomm,overlap

Variants: ``default`` (torch.compile as the model compiles itself), ``default+pass`` (the same with
a post-grad custom pass that only counts: does a custom pass alone change the step?), ``nocomm``
(benchmarks/nocomm.py), ``overlap``. A backward holding more GEMMs or collectives than another
variant's recomputes forward work that the partitioner chose differently.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

KEYS = ("mm", "attention", "all_gather", "reduce_scatter", "all_reduce")


ALL_OPS = False  # --all-ops: every call_function target, not only KEYS


def op_counts(graph: torch.fx.Graph) -> dict[str, int]:
    counts = collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function")
    return {k: v for k, v in sorted(counts.items()) if ALL_OPS or any(key in k for key in KEYS)}


class CountingPass:
    """A post-grad custom pass that records the op counts of every graph and changes nothing."""

    def __init__(self, seen: list, chained=None) -> None:
        self.seen, self.chained = seen, chained

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.seen.append(op_counts(graph))
        if self.chained is not None:
            self.chained(graph)

    def uuid(self):
        return None


def run_variant(model: str, variant: str, iters: int) -> dict:
    from torch._inductor import config as inductor_config

    from benchmarks.e2e import load_shapes
    from benchmarks.e2e_run import compiled
    from benchmarks.models import PINNED_SHAPE, build
    from benchmarks.nocomm import nocomm
    from benchmarks.timing import time_ms

    import overlap_compile as oc

    shape = load_shapes(PINNED_SHAPE[model][1], False)[0]
    seen: list = []
    torch._dynamo.reset()
    built = build(model, shape, "cuda", torch.bfloat16)
    ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    if variant == "default+pass":
        ctx = inductor_config.patch({"post_grad_custom_post_pass": CountingPass(seen)})
    elif variant == "nocomm":
        ctx = nocomm()
    with ctx as p:
        if variant in ("nocomm", "overlap"):  # count what the variant's pass is handed
            counting = CountingPass(seen, inductor_config.post_grad_custom_post_pass)
            stack = inductor_config.patch({"post_grad_custom_post_pass": counting})
        else:
            stack = contextlib.nullcontext()
        with stack:
            fn, _ = compiled(built.model, variant.split("+")[0], "default", None, oc.Report(), built.compile_with)
            opt = torch.optim.AdamW(built.model.parameters(), lr=1e-4)

            def step() -> None:
                built.to_local(fn(built.x)).float().pow(2).mean().backward()
                built.finalize_grads()
                opt.step()
                opt.zero_grad(set_to_none=True)

            ms = time_ms(step, iters, warmup=3)
    del p
    return {"variant": variant, "train_ms": ms, "graphs": seen}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="titan_llama3_8b")
    ap.add_argument("--variants", default="default,default+pass,nocomm,overlap")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--all-ops", action="store_true", help="count every op, not only GEMMs, attention, collectives")
    a = ap.parse_args()
    global ALL_OPS
    ALL_OPS = a.all_ops
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    for variant in a.variants.split(","):
        got = run_variant(a.model, variant, a.iters)
        if dist.get_rank() == 0:
            print(f"{a.model} {variant}: train step {got['train_ms']:.2f} ms", flush=True)
            for i, g in enumerate(got["graphs"]):
                print(f"    graph {i}: {g}", flush=True)
    dist.barrier()
    from overlap_compile.runtime import teardown
    teardown.finish()  # barrier, release, destroy; every rank before the store's host leaves


if __name__ == "__main__":
    main()
