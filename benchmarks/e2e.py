"""End-to-end: transformer blocks under torch.compile, default Inductor vs backend="overlap" vs
PyTorch async-TP, training steps and inference prefill.

    python benchmarks/e2e.py --world 2 --out $OUT                       # GPUs (NCCL), e2e shapes
    python benchmarks/e2e.py --world 2 --models llama_megatron --modes default,reduce-overhead
    python benchmarks/e2e.py --dry-run                                  # CPU, gloo, tiny shapes

Per model (benchmarks/models) x shape x compile mode x activation checkpointing x variant:

* ``train``: forward + backward + AdamW step. The first ``--steps`` steps give the losses
  (same seed, same data for every variant: the losses must match the default backend's), the
  first of them includes compilation (``compile_s`` = first step - steady step); then the median
  step time over ``--iters`` steps (CUDA events, ranks synchronised, slowest rank).
* ``prefill``: forward under no_grad (a separate compile), median time.
* the overlap variant's Report: every site with its kind, template and reason.
* ``fxgraph_cache``: the overlap variant compiled a second time after torch._dynamo.reset() with
  Inductor's FX graph cache on; the hit counter must rise.

Variants: ``default`` (torch.compile), ``overlap`` (backend="overlap": the predictor decides;
``--force TEMPLATE`` forces one, e.g. on CPU where the predictor rightly keeps the baseline),
``async_tp`` (torch._inductor.config._micro_pipeline_tp with symmetric memory enabled for the
group; CUDA only). A failing variant is recorded with its error, never fatal. ``--time-budget``
stops starting new configurations and says which were skipped.

Rows follow the benchmark schema (device, world_size, torch, date, ...) and go to
<out>/e2e-<device>-w<world>-<date>.json with a markdown table beside.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from timing import time_ms  # noqa: E402

CPU_SHAPE = {"name": "tiny (CPU)", "hidden": 64, "intermediate": 128, "heads": 8, "seq": 32, "batch": 2, "E": 4, "topk": 2}
TWO_GPU_SHAPE = {"name": "Llama-3-8B block, TP+SP, seq 4096", "hidden": 4096, "intermediate": 14336, "heads": 32,
                 "kv_heads": 8, "seq": 4096, "batch": 1}


def load_shapes(which: str, dry: bool) -> list[dict]:
    if dry:
        return [CPU_SHAPE]
    with open(os.path.join(HERE, "shapes.json")) as f:
        e2e = json.load(f)["e2e"]
    named = {"8b": e2e[0], "70b": e2e[1], "moe": e2e[2], "8b-small": TWO_GPU_SHAPE}
    out = []
    for key in which.split(","):
        if key not in named:
            raise SystemExit(f"--shapes: unknown {key!r}; choose from {sorted(named)}")
        out.append(named[key])
    return out


# ---- one configuration ---------------------------------------------------------------------------


class Checkpointed(torch.nn.Module):
    """Activation checkpointing around the whole block (non-reentrant, as torchtitan does)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


@contextlib.contextmanager
def variant_context(variant: str):
    if variant != "async_tp":
        yield
        return
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(dist.group.WORLD.group_name)
    with inductor_config.patch({"_micro_pipeline_tp": True}):
        yield


def compiled(model, variant: str, mode: str, force: str | None, report):
    mode_kw = {} if mode == "default" else {"mode": mode}
    if variant == "overlap":
        import overlap_compile as oc
        from overlap_compile.backend import overlap_backend

        backend = functools.partial(overlap_backend, report=report, mode=mode_kw.get("mode"))
        overrides = {"force_template": force} if force else {}
        with oc.config.patch(**overrides):
            # the options are read when Dynamo hands over each graph: keep them for every call
            fn = torch.compile(model, backend=backend)
        return fn, overrides
    return torch.compile(model, **mode_kw), {}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mean_over_ranks(v: float) -> float:
    t = torch.tensor([v], dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def run_config(model_name: str, shape: dict, variant: str, mode: str, ckpt: bool, steps: int, iters: int,
               force: str | None, device: str, dtype) -> dict:
    import overlap_compile as oc
    from benchmarks.models import build

    row = {"model": model_name, "shape": shape["name"], "variant": variant, "mode": mode, "ckpt": ckpt}
    built = build(model_name, shape, device, dtype, seed=0)
    model = Checkpointed(built.model) if ckpt else built.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    report = oc.Report()
    with variant_context(variant):
        fn, overrides = compiled(model, variant, mode, force, report)

        def train_step() -> float:
            with oc.config.patch(**overrides):
                y = fn(built.x)
                loss = built.to_local(y).float().pow(2).mean()
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        losses = []
        t0 = time.perf_counter()
        losses.append(train_step())
        sync()
        first_s = time.perf_counter() - t0
        for _ in range(steps - 1):
            losses.append(train_step())
        row["losses"] = [mean_over_ranks(float(v)) for v in losses]
        row["train_ms"] = time_ms(train_step, iters, warmup=0)
        row["compile_s"] = max(0.0, first_s - row["train_ms"] / 1e3)
        row["tokens_per_s"] = built.tokens / (row["train_ms"] / 1e3)

        def prefill():
            with torch.no_grad(), oc.config.patch(**overrides):
                return fn(built.x)

        prefill()
        row["prefill_ms"] = time_ms(prefill, iters, warmup=0)
    if variant == "overlap":
        row["sites"] = [{"graph": s.graph, "kind": s.kind, "template": s.template, "rewritten": s.rewritten,
                         "reason": s.reason} for s in report.sites]
        row["rewritten"] = sum(s.rewritten for s in report.sites)
        # what the pass itself costs, against this variant's whole compile (first step - steady)
        row["pass_s"] = report.pass_seconds
        row["pass_share_of_compile"] = report.pass_seconds / row["compile_s"] if row["compile_s"] > 0 else None
    return row


def second_compile_hits(model_name, shape, mode, force, device, dtype) -> int:
    """Compile the overlap variant twice (dynamo reset between) with the FX graph cache on: hits
    on the second compile, counted by Inductor."""
    import overlap_compile as oc
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from benchmarks.models import build

    def once():
        torch._dynamo.reset()
        built = build(model_name, shape, device, dtype, seed=0)
        fn, overrides = compiled(built.model, "overlap", mode, force, oc.Report())
        with oc.config.patch(**overrides):
            built.to_local(fn(built.x)).float().sum().backward()

    with inductor_config.patch({"fx_graph_cache": True}):
        once()
        before = counters["inductor"]["fxgraph_cache_hit"]
        once()
        return counters["inductor"]["fxgraph_cache_hit"] - before


@contextlib.contextmanager
def fresh_kernel_caches():
    """Empty Inductor / Triton on-disk kernel caches for one configuration: otherwise the variant
    compiled first pays for kernels the later ones reuse, and compile times don't compare."""
    import tempfile

    try:  # in-process module cache, keyed by kernel source
        from torch._inductor.codecache import PyCodeCache

        PyCodeCache.cache_clear()
    except (ImportError, AttributeError):
        pass
    keys = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    old = {k: os.environ.get(k) for k in keys}
    with tempfile.TemporaryDirectory(prefix="e2e-cache-") as tmp:
        for k in keys:
            os.environ[k] = os.path.join(tmp, k.lower())
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# ---- the sweep on every rank -------------------------------------------------------------------------


def worker(args_dict: dict) -> list[dict]:
    a = argparse.Namespace(**args_dict)
    dry = a.dry_run
    device = f"cuda:{dist.get_rank()}" if not dry else "cpu"
    dtype = torch.float32 if dry else torch.bfloat16
    if not dry:
        torch.cuda.set_device(dist.get_rank())
    from benchmarks.models import MODELS
    from overlap_compile.explain import no_compile_caches

    # one-time costs (imports, compiler start-up) must not land on the first variant's compile time
    warm = torch.nn.Linear(8, 8).to(device)
    torch.compile(warm)(torch.randn(2, 8, device=device)).sum().backward()
    deadline = time.monotonic() + a.time_budget if a.time_budget else None
    rows, base = [], {"benchmark": "e2e", "device": "cpu" if dry else torch.cuda.get_device_name(),
                      "world_size": dist.get_world_size(), "torch": torch.__version__,
                      "date": datetime.date.today().isoformat(), "dtype": str(dtype).replace("torch.", "")}
    variants = [v for v in a.variants.split(",") if not (dry and v == "async_tp")]
    for model_name in a.models.split(","):
        if model_name not in MODELS:
            rows.append({**base, "model": model_name, "error": f"not available (models: {sorted(MODELS)})"})
            continue
        for shape in load_shapes(a.shapes, dry):
            for mode in a.modes.split(","):
                for ckpt in [c == "on" for c in a.ckpt.split(",")]:
                    for variant in variants:
                        flag = torch.tensor([float(deadline is not None and time.monotonic() > deadline)])
                        dist.broadcast(flag.to(device), 0)  # rank 0's clock decides for all
                        cfg = {**base, "model": model_name, "shape": shape["name"], "variant": variant,
                               "mode": mode, "ckpt": ckpt}
                        if flag.item():
                            rows.append({**cfg, "skipped": "time budget spent"})
                            continue
                        try:
                            torch._dynamo.reset()
                            # caches off: every variant compiles from scratch, so compile times compare
                            kernels = fresh_kernel_caches() if a.fresh_caches else contextlib.nullcontext()
                            with no_compile_caches(), kernels:
                                rows.append({**base, **run_config(model_name, shape, variant, mode, ckpt, a.steps,
                                                              a.iters, a.force, device, dtype)})
                            if getattr(a, "check_cache", False) and variant == "overlap" and "sites" in rows[-1]:
                                rows[-1]["fxgraph_cache_hit"] = second_compile_hits(
                                    model_name, shape, mode, a.force, device, dtype)
                        except Exception as e:  # recorded, the sweep goes on
                            rows.append({**cfg, "error": f"{type(e).__name__}: {e}"[:2000],
                                         "trace": traceback.format_exc()[-3000:]})
                        if dist.get_rank() == 0:
                            print(one_line(rows[-1]), flush=True)
                            if getattr(a, "out", None):  # a run cut off by a time limit keeps its rows
                                os.makedirs(a.out, exist_ok=True)
                                with open(os.path.join(a.out, "e2e-partial.jsonl"), "a") as f:
                                    f.write(json.dumps({k: v for k, v in rows[-1].items() if k != "trace"}) + "\n")
    return rows


# ---- output ---------------------------------------------------------------------------------------


def one_line(r: dict) -> str:
    head = f"{r.get('model', '-'):>15} {r.get('shape', '-')[:34]:>34} {r.get('mode', '-'):>15} ckpt={int(r.get('ckpt', 0))} {r.get('variant', '-'):>9}"
    if "error" in r:
        return head + "  ERROR " + r["error"].splitlines()[0][:160]
    if "skipped" in r:
        return head + "  skipped: " + r["skipped"]
    extra = (f"  rewritten {r['rewritten']}/{len(r['sites'])}, pass {r['pass_s']:.2f} s" if "sites" in r else "")
    return (head + f"  train {r['train_ms']:8.3f} ms  prefill {r['prefill_ms']:8.3f} ms  compile {r['compile_s']:6.1f} s"
            f"  loss[-1] {r['losses'][-1]:.6f}{extra}")


def compare(rows: list[dict], loss_rtol: float) -> list[dict]:
    """Speedups over the default variant of the same configuration, and the loss check."""
    key = lambda r: (r["model"], r["shape"], r["mode"], r["ckpt"])  # noqa: E731
    default = {key(r): r for r in rows if r.get("variant") == "default" and "train_ms" in r}
    for r in rows:
        d = default.get(key(r)) if "train_ms" in r else None
        if d is None or r is d:
            continue
        r["train_speedup"] = d["train_ms"] / r["train_ms"]
        r["prefill_speedup"] = d["prefill_ms"] / r["prefill_ms"]
        r["compile_overhead"] = r["compile_s"] / d["compile_s"] - 1 if d["compile_s"] > 0 else None
        r["loss_matches_default"] = all(abs(x - y) <= loss_rtol * max(abs(y), 1e-12)
                                        for x, y in zip(r["losses"], d["losses"]))
    return rows


def write(rows: list[dict], out: str) -> str:
    os.makedirs(out, exist_ok=True)
    dev = rows[0]["device"].replace(" ", "_")
    stem = os.path.join(out, f"e2e-{dev}-w{rows[0]['world_size']}-torch{torch.__version__.split('+')[0]}-{rows[0]['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    lines = ["| model | shape | mode | ckpt | variant | train ms | x default | prefill ms | x default | compile s | "
             "loss = default | sites rewritten |", "|" + "---|" * 12]
    for r in rows:
        if "train_ms" not in r:
            lines.append(f"| {r.get('model')} | {r.get('shape')} | {r.get('mode')} | {r.get('ckpt')} | {r.get('variant')} | "
                         f"{r.get('error', r.get('skipped', ''))[:80]} |||||||")
            continue
        sp = lambda k: f"{r[k]:.3f}" if k in r else "-"  # noqa: E731
        sites = f"{r['rewritten']}/{len(r['sites'])}" if "sites" in r else "-"
        lines.append(f"| {r['model']} | {r['shape']} | {r['mode']} | {int(r['ckpt'])} | {r['variant']} | "
                     f"{r['train_ms']:.3f} | {sp('train_speedup')} | {r['prefill_ms']:.3f} | {sp('prefill_speedup')} | "
                     f"{r['compile_s']:.1f} | {r.get('loss_matches_default', '-')} | {sites} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return stem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=torch.cuda.device_count() if torch.cuda.is_available() else 2)
    ap.add_argument("--models", default="llama_dtensor,llama_megatron")
    ap.add_argument("--shapes", default="8b", help="comma list of 8b, 70b, moe, 8b-small (GPU)")
    ap.add_argument("--variants", default="default,overlap,async_tp")
    ap.add_argument("--modes", default="default", help="comma list of default, reduce-overhead")
    ap.add_argument("--ckpt", default="off", help="comma list of off, on")
    ap.add_argument("--steps", type=int, default=3, help="training steps whose losses are compared")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--force", default=None, help="force this template in the overlap variant")
    ap.add_argument("--check-cache", action="store_true", help="also compile the overlap variant twice (FX cache)")
    ap.add_argument("--fresh-caches", action="store_true",
                    help="empty Inductor/Triton kernel caches per configuration, so compile times compare "
                         "(slow on GPUs; the pass's own time, pass_s, is measured either way)")
    ap.add_argument("--time-budget", type=float, default=0.0, help="seconds; later configurations are skipped")
    ap.add_argument("--loss-rtol", type=float, default=None,
                    help="relative loss tolerance vs default (default: 1e-4 fp32 CPU, 2e-2 bf16 GPU)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    a = ap.parse_args()
    dry = a.dry_run or not torch.cuda.is_available()
    a.dry_run = dry
    for m in a.modes.split(","):
        if m not in ("default", "reduce-overhead"):
            raise SystemExit(f"--modes: {m!r} is not one of default, reduce-overhead")
    # fp32 on CPU: only summation order differs (1e-4). bf16 on GPU: the rewritten graph computes
    # the same GEMMs and collectives in another order; bf16 rounding of a loss is ~4e-3 per op.
    rtol = a.loss_rtol if a.loss_rtol is not None else (1e-4 if dry else 2e-2)
    from overlap_compile.testing.multiprocess import run_distributed

    rows = run_distributed(worker, world_size=a.world, args=(vars(a),), backend="gloo" if dry else "nccl",
                           timeout_s=3600)[0]
    rows = compare(rows, rtol)
    stem = write(rows, a.out)
    print(open(stem + ".md").read())
    print("wrote", stem + ".json")


if __name__ == "__main__":
    main()
