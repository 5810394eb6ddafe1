"""Decode-sized calls of a dynamic compile, each variant timed beside torch.compile's own dynamic
compile in alternating rounds (timing.time_pair), with an A/A row: a second torch.compile of the
same model against the first, which says what the pairing itself reads as a difference.

    torchrun --nproc-per-node 2 benchmarks/diagnostics/decode_pairs.py --model megatron_fused_8b \
        --mode default --seqs 16,64,256 --out $OUT

Every variant and the reference are compiled once, dynamic on the input's sequence dim, at the
first of ``--hint`` (a prefill length, as e2e_dynamic compiles), all alive in one process:

    inductor-again      a second torch.compile (the A/A row)
    overlap             backend="overlap"
    overlap-as-written  the same with every bucket's choice forced to "as written"
    overlap-no-defer    the same with defer_compute off (Inductor's peak-memory reordering on)
    overlap-op-every-call  the same with whole_graph_as_written off: no torch.compile graph for the
                        M every rewritten site runs as written (row_dispatch.py), the ops run at every M
    overlap-written-direct  the same with replay_written off: an "as written" bucket launches
                        the GEMM and the collective from Python instead of a replayed op

Per (variant, length): the paired medians (variant, reference), their ratio (reference / variant:
the variant's speedup), and each rank's host ms per call of the variant and the reference
(back-to-back calls). Writes decode_pairs-<device>-w<W>-torch<v>-<date>-<model>-<mode>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from benchmarks.diagnostics.dynamic_profile import VARIANT_OPTIONS  # noqa: E402
from benchmarks.diagnostics.ranks import diagnostic_main  # noqa: E402

VARIANTS = ("inductor-again", "overlap", "overlap-as-written", "overlap-no-defer", "overlap-op-every-call",
            "overlap-written-direct")


def measure(a: argparse.Namespace) -> list[dict]:
    import overlap_compile as oc
    from overlap_compile.templates import bucketed

    from benchmarks.e2e import plan
    from benchmarks.e2e_dynamic import CALLS_PER_SAMPLE, input_at, sequence_dim
    from benchmarks.e2e_run import compiled, framework_mode
    from benchmarks.models import build
    from benchmarks.timing import host_ms_per_call, time_pair

    seqs = [int(s) for s in a.seqs.split(",")]
    hint = int(a.hint)
    shape = dict(plan(a.model, "8b", dry=False)[0][1])
    built = build(a.model, {**shape, "seq": max(seqs + [hint])}, "cuda", torch.bfloat16, seed=0)
    dim = sequence_dim(built.x, a.model)
    inputs = {s: input_at(built.x, dim, s) for s in seqs + [hint]}
    for x in inputs.values():
        torch._dynamo.mark_dynamic(x, dim)
    step_begin = torch.compiler.cudagraph_mark_step_begin if a.mode == "reduce-overhead" else (lambda: None)
    as_written = {"on": False}
    real_choose = bucketed._choose_at

    def choose(table, m, group):  # "as written" for the variant that forces it, else the decision's
        if as_written["on"]:
            return bucketed.BASELINE, None, "forced as written"
        return real_choose(table, m, group)

    bucketed._choose_at = choose

    def make(variant: str):
        backend = "overlap" if variant.startswith("overlap") else "default"
        with oc.config.patch(**VARIANT_OPTIONS.get(variant, {})):
            fn, overrides = compiled(built.model, backend, a.mode, None, oc.Report(), None)
        overrides = {**VARIANT_OPTIONS.get(variant, {}), **overrides}

        def call(x):
            step_begin()
            as_written["on"] = variant == "overlap-as-written"
            try:
                with torch.no_grad(), (oc.config.patch(**overrides) if overrides else contextlib.nullcontext()):
                    return fn(x)
            finally:
                as_written["on"] = False

        return call

    rows = []
    try:
        with framework_mode(built, a.mode):
            ref = make("default")
            ref(inputs[hint])
            fns = {}
            for v in a.variants.split(","):
                fns[v] = make(v)
                fns[v](inputs[hint])
            for s in seqs:
                x = inputs[s]
                for v, fn in fns.items():
                    bucketed.clear_choices()
                    got = time_pair(lambda: fn(x), lambda: ref(x), a.iters, warmup=3, calls=CALLS_PER_SAMPLE)
                    choices = sorted({(m, t) for m, t, _ in bucketed.choices_made()})
                    host = [host_ms_per_call(lambda: fn(x), 20), host_ms_per_call(lambda: ref(x), 20)]
                    every: list = [None] * dist.get_world_size()
                    dist.all_gather_object(every, host)
                    rows.append({"model": a.model, "mode": a.mode, "variant": v, "seq": s, "hint": hint,
                                 "ms": got["a_ms"], "reference_ms": got["b_ms"], "speedup": got["ratio"],
                                 "rounds": got["rounds"], "choices": choices,
                                 "host_ms_per_rank": [h[0] for h in every],
                                 "reference_host_ms_per_rank": [h[1] for h in every]})
    finally:
        bucketed._choose_at = real_choose
    return rows


def write(rows: list[dict], a: argparse.Namespace) -> None:
    print(f"{a.model} {a.mode}: seq, variant, ms, reference ms, speedup, host ms per rank (variant / reference)")
    for r in rows:
        hv = "/".join(f"{h:.3f}" for h in r["host_ms_per_rank"])
        hr = "/".join(f"{h:.3f}" for h in r["reference_host_ms_per_rank"])
        print(f"  {r['seq']:>5} {r['variant']:<19} {r['ms']:.3f} {r['reference_ms']:.3f} {r['speedup']:.3f}  "
              f"{hv} | {hr}  {r['choices']}")
    if a.out:
        from benchmarks.results_io import write_rows

        print("wrote", write_rows(rows, a.out, "decode_pairs", torch.cuda.get_device_name(), dist.get_world_size(),
                                  suffix=f"-{a.model}-{a.mode}", default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="megatron_fused_8b")
    ap.add_argument("--mode", default="default", choices=("default", "reduce-overhead"))
    ap.add_argument("--seqs", default="16,64,256")
    ap.add_argument("--hint", default="1024", help="the length each compile is made at (its size hint)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    diagnostic_main(lambda: measure(a), lambda rows: write(rows, a))


if __name__ == "__main__":
    main()
