"""What the capacity padding costs the expert GEMMs of a training step, and what skipping it
without a host synchronisation buys: one rank's SwiGLU experts at EP=W, forward and forward +
backward (autograd), on one GPU, CUDA-graph replays.

    python benchmarks/diagnostics/expert_gemm_padding.py --shapes Mixtral-8x7B,MoE-4 --out $OUT

Rows per (source, expert) come from demo.moe's routing of random tokens (the e2e benchmark's
inputs: capacity factor 1.25). Variants:
  bmm            the layer as written: [E, W*C, H] with every capacity row (cuBLAS bmm)
  grouped        the routed rows packed expert by expert into a buffer of the static size
                 E*W*C, torch._grouped_mm with the group ends on the device (no host read; the
                 rows past the last group are in no group); the pack (index_select) and the
                 unpack (index_copy into zeros) included
  grouped_gemm   the same GEMMs without the pack and unpack
  mm_host        one cuBLAS mm per expert on its routed rows, sizes known on the host (the best a
                 host synchronisation could buy)
Prints ms and the ratio to bmm per shape, writes expert_gemm_padding-<device>-w1-torch<v>-<date>.json (rows).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root


def routed_counts(case: dict, world: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """rows[s][e] routed from source s to this rank's (rank 0's) expert e, and the capacity C."""
    from overlap_compile.demo.moe import capacity, route

    g = torch.Generator(device="cpu").manual_seed(seed)
    e_all, h, k = case["E"], case["H"], case["topk"]
    tokens = case["S"]  # per rank, as the e2e benchmark routes them
    router = torch.randn(e_all, h, generator=g) / h ** 0.5
    cap = capacity(tokens, e_all, k, 1.25)
    rows = []
    for _ in range(world):
        x = torch.randn(tokens, h, generator=g)
        slot, kept, _ = route(x, router, e_all, k, cap)
        per = torch.bincount(slot[kept] // cap, minlength=e_all).tolist()
        rows.append(per[:e_all // world])
    return rows, cap


def swiglu_bmm(x, w1, w3, w2):
    return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)


def swiglu_grouped(x, offs, w1, w3, w2):
    gm = torch._grouped_mm
    return gm(F.silu(gm(x, w1, offs=offs)) * gm(x, w3, offs=offs), w2, offs=offs)


def swiglu_mm(xs, w1, w3, w2):
    return [F.silu(x @ a) * (x @ c) @ b for x, a, c, b in zip(xs, w1, w3, w2)]


def case_times(case: dict, world: int, device, dtype, iters: int) -> dict:
    from benchmarks.timing import graphed, time_ms

    rows, cap = routed_counts(case, world)
    e, h, i = case["E"] // world, case["H"], case["I"]
    wc = world * cap
    gen = torch.Generator(device=device).manual_seed(1)
    ws = [torch.randn(e, a, b, device=device, dtype=dtype, generator=gen) / a ** 0.5
          for a, b in ((h, i), (h, i), (i, h))]
    slots = torch.randn(e, world, cap, h, device=device, dtype=dtype, generator=gen)
    valid = torch.zeros(e, world, cap, dtype=torch.bool)
    for s in range(world):
        for j in range(e):
            valid[j, s, :rows[s][j]] = True
    slots *= valid.to(device=device, dtype=dtype)[..., None]        # zeros past the routed rows
    flat = slots.view(e * wc, h)
    index = valid.view(-1).nonzero().squeeze(1).to(device)          # packed row -> slot row
    total = index.numel()
    per_expert = valid.view(e, wc).sum(1)
    offs = torch.cumsum(per_expert, 0).to(device=device, dtype=torch.int32)
    # the static-size packing: the index padded to E*W*C rows with a zero row's index
    pad_index = torch.cat([index, torch.full((e * wc - total,), int((~valid.view(-1)).nonzero()[0]), device=device)])
    grad = torch.randn(e * wc, h, device=device, dtype=dtype, generator=gen)
    params = [w.requires_grad_() for w in ws]
    host_rows = per_expert.tolist()

    def fwd_bmm(train):
        x = flat.view(e, wc, h).requires_grad_(train)
        y = swiglu_bmm(x, *params)
        return torch.autograd.grad(y, [x, *params], grad.view(e, wc, h)) if train else y

    def fwd_grouped(train, pack=True):
        x = (flat.index_select(0, pad_index) if pack else flat).detach().requires_grad_(train)
        y = swiglu_grouped(x, offs, *params)
        if not train:
            return flat.new_zeros(e * wc, h).index_copy_(0, index, y[:total]) if pack else y
        return torch.autograd.grad(y, [x, *params], grad)

    def fwd_mm(train):
        xs = list(flat.index_select(0, index).split(host_rows))
        xs = [t.detach().requires_grad_(train) for t in xs]
        ys = swiglu_mm(xs, *params)
        return torch.autograd.grad(ys, [*xs, *params], list(grad[:total].split(host_rows))) if train else ys

    variants = {"bmm": fwd_bmm, "grouped": fwd_grouped, "grouped_gemm": lambda t: fwd_grouped(t, pack=False),
                "mm_host": fwd_mm}
    out = {"shape": case["name"], "world": world, "capacity": cap, "rows": rows, "fill": total / (e * wc),
           "ms": {}}
    for phase, train in (("forward", False), ("train", True)):
        for name, fn in variants.items():
            with torch.set_grad_enabled(train):
                try:
                    run = graphed(lambda: fn(train))
                except RuntimeError as err:  # not capturable: timed host-launched, and said so
                    out.setdefault("host_launched", {})[f"{phase}/{name}"] = str(err)[:200]
                    run = lambda: fn(train)  # noqa: E731
                out["ms"][f"{phase}/{name}"] = time_ms(run, iters=iters, warmup=3)
    # correctness of the grouped forward against bmm on the routed rows (rows past them are zero)
    with torch.no_grad():
        ref = swiglu_bmm(flat.view(e, wc, h), *params).view(e * wc, h)
        got = fwd_grouped(False)
        out["grouped_rel_err"] = float((got.float() - ref.float()).norm() / ref.float().norm())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="Mixtral-8x7B,MoE-4,MoE-1")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("expert_gemm_padding needs a GPU")
    device, dtype = torch.device("cuda", 0), torch.bfloat16
    from benchmarks.shape_sets import shapes_by_name

    shapes = shapes_by_name("moe")
    rows = []
    for name in a.shapes.split(","):
        r = case_times(shapes[name], a.world, device, dtype, a.iters)
        rows.append(r)
        base = {p: r["ms"][f"{p}/bmm"] for p in ("forward", "train")}
        cells = "  ".join(f"{k} {ms:.3f} ({base[k.split('/')[0]] / ms:.2f}x)" for k, ms in r["ms"].items())
        print(f"{name} W={a.world} fill {r['fill']:.3f} rel err {r['grouped_rel_err']:.1e}: {cells}", flush=True)
    if a.out:
        from benchmarks.results_io import write_rows

        path = write_rows(rows, a.out, "expert_gemm_padding", torch.cuda.get_device_name(), 1)
        print("wrote", path)


if __name__ == "__main__":
    main()
