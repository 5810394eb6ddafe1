"""End-to-end: transformer blocks under torch.compile, default Inductor vs backend="overlap" vs
PyTorch async-TP vs the same compile without communication (the bound), training steps and
inference prefill.

    python benchmarks/e2e.py --world 2 --shapes 8b-small --out $OUT    # GPUs (NCCL), self-spawning
    torchrun --nproc-per-node 4 benchmarks/e2e.py --shapes 8b,70b       # or under torchrun
    python benchmarks/e2e.py --world 2 --models llama_dtensor,llama70_dtensor --shapes 8b   # 8B and 70B
    python benchmarks/e2e.py --world 4 --models mixtral_ep --shapes moe --modes default,reduce-overhead
    python benchmarks/e2e.py --dry-run                                  # CPU, gloo, world 2, tiny shapes

Per model (benchmarks/models) x shape x compile mode x activation checkpointing x variant:

* ``train``: forward + backward + AdamW step. The first ``--steps`` steps give the losses (same
  seed, same data for every variant: they must match the default backend's within --loss-rtol);
  the first includes compilation (``compile_s`` = first step - steady step); then the median step
  over ``--iters`` samples after 2 warm-up steps (CUDA events, ranks synchronised, slowest rank),
  each sample ``--train-calls`` steps back to back as a training loop runs them; ``train_cold_ms``:
  one step after a barrier, from an idle GPU.
* ``prefill``: forward under no_grad (its own compile, ``prefill_compile_s``), median time.
* ``--seqs L1,L2,...``: prefill at each length instead (training only if --phases asks), per
  ``--dynamic`` setting: compiled once with the sequence dim dynamic, or once per length; rows carry
  ``dynamic``, ``seq``, ``correct`` (output vs eager's) and ``compiles``; the verdict adds per length
  the static and dynamic speedups and the dynamic-shape rules (benchmarks/e2e_dynamic.py).
* the overlap variant's Report: every site with its kind, template and reason; ``pass_s`` = the
  pass's own share of the compile (compile time without the pass ~ compile_s - pass_s; the
  default variant's compile_s is the same model compiled without it).
* ``op_graph_calls``: how the template ops' host-launched calls went over the timed training steps,
  warm-up included (runtime.op_graphs: eager / captured / replayed / failed / declined;
  benchmarks/timing.py); ``op_graphs_declined``: the sites captured no more because their buffers
  moved between calls.
* ``fxgraph_cache_hit``: the overlap variant compiled a second time after torch._dynamo.reset()
  with Inductor's FX graph cache on (``--check-cache``: first overlap config of each model).
* failure modes met: ``graph_breaks`` (Dynamo's reasons), ``recompiles_timed`` (graphs compiled
  during the timed steps: should be 0), ``cudagraph_skips`` (reduce-overhead fell back to no CUDA
  graph), and ``failure`` on a raised error (oom, cuda_graph_capture, graph_break, recompile, error).
* first, when both Llama forms are asked for: the Megatron-style block against the DTensor block
  (same weights, eager), the ``check`` row.

Models and shapes: every model runs on the ``--shapes`` of its family (dense Llama or MoE), except
a model pinned to a shape (benchmarks/models' PINNED_SHAPE): ``llama70_dtensor`` is llama_dtensor on
the Llama-3-70B block ("70b"; dry run: "tiny-70b"). Named in ``--models`` it runs that shape whatever
``--shapes`` says; under ``--models all`` it runs when ``--shapes`` names its shape; and llama_dtensor
asked for the 70B shape runs as llama70_dtensor, so the 70B rows always say ``model:
"llama70_dtensor"`` and ``--models llama_dtensor,llama70_dtensor --shapes 8b`` gives 8B and 70B rows.

Variants: ``default`` (torch.compile), ``overlap`` (backend="overlap": the predictor decides;
``--force TEMPLATE`` forces one), ``async_tp`` (torch._inductor.config._micro_pipeline_tp with
symmetric memory enabled for the group; CUDA only; benchmarks/async_tp.py), ``nocomm`` (the bound:
torch.compile with every collective of the post-grad graphs replaced by a local op of the same
output, and the eager gradient all-reduce of a hand-written model (mixtral_ep's finalize_grads) a
no-op, benchmarks/nocomm.py; its losses differ by design and are not compared; its rows carry
``nocomm_replaced`` and ``nocomm_standins``, which stand-ins it ran), ``nocomm_nopad`` (MoE models only: nocomm with capacity factor 1.0, so the
expert GEMMs compute no padding slots; the ceiling of an overlap that hid every byte and skipped
the padding for free; its losses are not compared either; MoE rows carry ``capacity_factor``). ``train_gap_closed`` / ``prefill_gap_closed`` on the other variants' rows: the
share of the distance to the bound they cover, (inductor - variant) / (inductor - nocomm).
A failing variant is recorded with its error, never fatal. Configurations run model by model,
then compile mode, then variant, in the order asked (``--repeat N``: the variants of each model and
mode in turn N times, every other round in reverse order, each one's times the median over its
rounds, so a drift of the machine over the sweep or over a round falls on all of them alike;
``--interleave``: the variants compiled one after another and kept, then timed side by side, one
sample each per round, run_interleaved); ``--time-budget`` stops starting those that
would not fit (the longest one so far is the estimate) and lists them as skipped. Rows follow the benchmark schema (kind = model,
method = inductor | overlap | async_tp | nocomm, mode = eager | cuda_graph, ms = train step) and go to
<out>/e2e-<device>-w<world>-torch<v>-<date>.json (benchmarks/results_io.py), with a markdown table and PNGs (benchmarks/plot.py)
beside; rank 0 also appends each row to <out>/e2e-partial-<run>.jsonl as it lands. Exit status 1
when a loss or the model check disagrees.

Files: this one holds the shapes, the (model, shape) plan, the sweep every rank runs and the
command line; benchmarks/e2e_run.py runs and times one configuration; benchmarks/e2e_report.py
compares the rows, prints and writes them.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # the repository root

from benchmarks.e2e_report import (  # noqa: E402,F401  (compare, markdown, verdict: also e2e.* for the tests)
    ATTRIBUTION, compare, markdown, one_line, read_partial, run_file, verdict, write)
from benchmarks.e2e_run import (  # noqa: E402
    failure_kind, fresh_kernel_caches, prepare, run_config, second_compile_hits, time_together)
from benchmarks.e2e_run import finish as finish_config  # noqa: E402  (finish: this file's, the run's end)
from benchmarks.timing import Budget, on_every_rank, round_order  # noqa: E402,F401  (round_order: also e2e.* for the tests)

# tiny CPU shapes: 8 heads so that world 2..8 all divide them; E=4 experts for world 2 and 4
CPU_SHAPES = {
    "tiny": {"name": "tiny (CPU)", "hidden": 64, "intermediate": 128, "heads": 8, "kv_heads": 4, "seq": 32, "batch": 2},
    # the 70B block's proportions (intermediate = 3.5 x hidden): llama70_dtensor's dry-run stand-in
    "tiny-70b": {"name": "tiny 70B-like (CPU)", "hidden": 64, "intermediate": 224, "heads": 8, "kv_heads": 4, "seq": 32,
                 "batch": 2},
    # the long-context cell's stand-in (seq 16384 on GPUs); kv_heads 4 serves world 2 and 4
    "tiny-long": {"name": "tiny long (CPU)", "hidden": 64, "intermediate": 128, "heads": 8, "kv_heads": 4, "seq": 64,
                  "batch": 1},
    "tiny-moe": {"name": "tiny MoE (CPU)", "hidden": 64, "intermediate": 96, "heads": 8, "seq": 32, "batch": 2,
                 "E": 4, "topk": 2},
}
# smaller shapes that fit 2 GPUs comfortably, with the AdamW state and without checkpointing
SMALL_SHAPES = {
    "8b-small": {"name": "Llama-3-8B block, TP+SP, seq 4096", "hidden": 4096, "intermediate": 14336, "heads": 32,
                 "kv_heads": 8, "seq": 4096, "batch": 1},
    "moe-small": {"name": "Mixtral-8x7B block, EP, seq 4096", "hidden": 4096, "intermediate": 14336, "heads": 32,
                  "kv_heads": 8, "seq": 4096, "batch": 1, "E": 8, "topk": 2},
}
# GPU: with the harness's grace (GRACE_S) the run ends inside a 10-minute call, start-up included
DEFAULT_BUDGET_S = 360
GRACE_S = 180  # one configuration in flight past the budget, then the output
PHASES = ("train", "prefill")
VARIANTS = ("default", "overlap", "async_tp", "nocomm", "nocomm_nopad")


def shape_table(dry: bool) -> dict[str, dict]:
    """Shape key -> sizes: the CPU shapes on a dry run, else shapes.json's e2e set and the small ones."""
    if dry:
        return dict(CPU_SHAPES)
    from benchmarks.shape_sets import shapes_by_name

    e2e = shapes_by_name("e2e")
    l8 = e2e["Llama-3-8B block, TP+SP"]
    long = {**l8, "name": "Llama-3-8B block, TP+SP, seq 16384", "seq": 16384}
    return {"8b": l8, "70b": e2e["Llama-3-70B block, TP+SP"], "8b-16k": long,
            "moe": e2e["Mixtral-8x7B block, EP"], **SMALL_SHAPES}


def shape_keys(which: str, dry: bool) -> list[str]:
    named = shape_table(dry)
    keys = list(named) if which == "all" else which.split(",")
    bad = [k for k in keys if k not in named]
    if bad:
        raise SystemExit(f"--shapes: unknown {bad}; choose from {sorted(named)} or 'all'"
                         + (" (dry run: CPU shapes only)" if dry else ""))
    return keys


def load_shapes(which: str, dry: bool) -> list[dict]:
    """Shapes by key; a model only runs on shapes of its family (dense Llama vs MoE, by 'E')."""
    named = shape_table(dry)
    return [named[k] for k in shape_keys(which, dry)]


def family_of(shape: dict) -> str:
    return "moe" if "E" in shape else "llama"


def plan(models: str, shapes: str, dry: bool) -> list[tuple[str, dict]]:
    """(model, shape) pairs to run, in the order asked, for registered models (module docstring:
    a pinned model runs its own shape; its base model asked for that shape runs under its name)."""
    from benchmarks.models import FAMILY, MODELS, PINNED_SHAPE

    named, keys = shape_table(dry), shape_keys(shapes, dry)
    pinned_key = {m: (dry_key if dry else key) for m, (_, key, dry_key) in PINNED_SHAPE.items()}
    renamed = {(PINNED_SHAPE[m][0], k): m for m, k in pinned_key.items()}
    names = models.split(",") if models != "all" else [m for m in sorted(MODELS)
                                                       if m not in pinned_key or pinned_key[m] in keys]
    pairs: list[tuple[str, str]] = []
    for m in [m for m in names if m in MODELS]:
        own = [pinned_key[m]] if m in pinned_key else [k for k in keys if family_of(named[k]) == FAMILY[m]]
        pairs += [(renamed.get((m, k), m), k) for k in own]
    return [(m, named[k]) for m, k in dict.fromkeys(pairs)]


# ---- the sweep on every rank -------------------------------------------------------------------------


def schema_keys(model: str, shape: dict, variant: str, compile_mode: str, ckpt: bool, force: str | None) -> dict:
    """The common benchmark schema's keys (DESIGN.md), beside this benchmark's own. The overlap
    variant's ``config`` names what differs from the backend's defaults: a forced template, and
    each of ``ATTRIBUTION``'s options set otherwise (e.g. OVERLAP_COMPILE_DEFER_COMPUTE=1, to see
    what that pass gives)."""
    from overlap_compile import config as oc_config

    config = {}
    if variant == "overlap":
        opts, defaults = oc_config.current(), oc_config.Options()
        config = {**({"force_template": force} if force else {}),
                  **{name: getattr(opts, name) for name in ATTRIBUTION if getattr(opts, name) != getattr(defaults, name)}}
    return {"kind": model, "shape": shape["name"] + (" +ckpt" if ckpt else ""), "sizes": shape,
            "method": "inductor" if variant == "default" else variant,
            "config": config or None,
            "mode": "cuda_graph" if compile_mode == "reduce-overhead" else "eager",
            "model": model, "variant": variant, "compile_mode": compile_mode, "ckpt": ckpt}


def agree(rows: list[dict], device: str) -> None:
    """Every rank's error for the last configuration, so rank 0's row names a failure on any rank."""
    mine = rows[-1].get("error")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    others = [(r, e) for r, e in enumerate(everyone) if e and r != dist.get_rank()]
    if others and not mine:
        r, e = others[0]
        rows[-1].update(error=f"rank {r}: {e}", failure=rows[-1].get("failure", "error"))


def model_check(shape: dict, device: str, dtype, base: dict) -> dict:
    from benchmarks.models.equivalence import megatron_vs_dtensor

    # fp32: the two forms differ only in where sums are split (1e-6); bf16: one rounding of each
    # differently ordered sum. A sharding mistake shows as O(1).
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    row = {**base, "check": "llama_megatron vs llama_dtensor (eager, same weights)", "shape": shape["name"], "tol": tol}
    try:
        res = megatron_vs_dtensor(shape, device, dtype)
        row.update(res, correct=res["max_rel"] <= tol)
    except Exception as e:
        row.update(error=f"{type(e).__name__}: {e}"[:2000], failure=failure_kind(e), correct=False,
                   trace=traceback.format_exc()[-3000:])
    torch._dynamo.reset()
    return row


def worker(args_dict: dict) -> list[dict]:
    a = argparse.Namespace(**args_dict)
    dry = a.dry_run
    device = "cpu" if dry else f"cuda:{torch.cuda.current_device()}"
    dtype = torch.float32 if dry else torch.bfloat16
    from benchmarks.models import MISSING, MODELS

    rank0 = dist.get_rank() == 0
    partial = run_file(a.out, a.run_id, "partial") if getattr(a, "out", None) else None

    def emit(row: dict) -> None:
        if rank0:
            print(one_line(row), flush=True)
            if partial:  # a run cut off by a time limit keeps its rows
                os.makedirs(a.out, exist_ok=True)
                with open(partial, "a") as f:
                    f.write(json.dumps({k: v for k, v in row.items() if k != "trace"}) + "\n")

    # one-time costs (imports, compiler start-up) must not land on the first variant's compile time
    warm = torch.nn.Linear(8, 8).to(device)
    torch.compile(warm)(torch.randn(2, 8, device=device)).sum().backward()
    budget = Budget(a.time_budget, device, a.start_time)
    base = {"benchmark": "e2e", "device": "cpu" if dry else torch.cuda.get_device_name(),
            "world_size": dist.get_world_size(), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "dtype": str(dtype).replace("torch.", "")}
    rows: list[dict] = []
    variants = [v for v in a.variants.split(",") if not (dry and v == "async_tp")]  # async-TP: CUDA only
    models = a.models.split(",") if a.models != "all" else sorted(MODELS)
    shapes = load_shapes(a.shapes, dry)
    if {"llama_dtensor", "llama_megatron"} <= set(models) and a.check_models:
        first = next((s for s in shapes if family_of(s) == "llama"), None)
        if first is not None:
            rows.append(model_check(first, device, dtype, base))
            emit(rows[-1])
    cache_checked: set = set()
    for model_name in [m for m in models if m not in MODELS]:
        why = MISSING.get(model_name, f"unknown; models: {sorted(MODELS)}")
        rows.append({**base, "kind": model_name, "model": model_name, "error": f"not available: {why}",
                     "failure": "unavailable"})
        emit(rows[-1])
    for model_name, shape in plan(a.models, a.shapes, dry):
        for compile_mode in a.modes.split(","):
            seqs = getattr(a, "seqs", None) and "prefill" in a.phases.split(",")
            # with --seqs, the usual configurations run only for training, and first, as training
            # always does: on CPU (torch 2.13) a no_grad compile of the DTensor block, then its
            # inductor training compile, made the overlap training compile fail in the partitioner
            for ckpt in [c == "on" for c in a.ckpt.split(",")] if not seqs or "train" in a.phases.split(",") else []:
                if a.interleave:
                    for got in run_interleaved(a, model_name, shape, variants, compile_mode, ckpt, base, budget,
                                               device, dtype, cache_checked):
                        rows.append(got)
                        emit(got)
                    continue
                rounds: dict[str, list[dict]] = {}
                for r in range(a.repeat):
                    for variant in round_order(variants, r):
                        got = run_variant(a, model_name, shape, variant, compile_mode, ckpt, base, budget, device,
                                          dtype, cache_checked if r == 0 else None)
                        rounds.setdefault(variant, []).append(got)
                        if a.repeat == 1:
                            rows.append(got)
                            emit(got)
                if a.repeat > 1:
                    for variant in variants:
                        rows.append(merge_rounds(rounds[variant]))
                        emit(rows[-1])
            if seqs:
                for got in run_seqs(a, model_name, shape, compile_mode, variants, base, budget, device, dtype):
                    rows.append(got)
                    emit(got)
    return rows


def run_seqs(a, model_name: str, shape: dict, compile_mode: str, variants: list[str], base: dict, budget,
             device: str, dtype) -> list[dict]:
    """Prefill at each of ``--seqs`` (benchmarks/e2e_dynamic.py): per ``--dynamic`` setting and
    variant one configuration (one compile, or one per length), a row per length whose shape names
    the length and the setting, so compare() sets each against torch.compile's compiled the same way.
    Dense blocks only (the sequence-parallel forms); ``--repeat`` does not apply."""
    from benchmarks import e2e_dynamic
    from benchmarks.models import FAMILY

    if a.interleave:
        return run_seqs_side_by_side(a, model_name, shape, compile_mode, base, budget, device, dtype)
    out = []
    for dynamic in {"on": [True], "off": [False], "both": [True, False]}[a.dynamic]:
        for variant in variants:
            cfg = {**base, **schema_keys(model_name, shape, variant, compile_mode, False, a.force), "dynamic": dynamic}
            skip = ("dynamic prefill: dense blocks only" if FAMILY[model_name] != "llama"
                    else "async-TP: not measured at several lengths" if variant == "async_tp" else budget.should_skip())
            if skip:
                out.append({**cfg, "skipped": skip})
                continue
            t0 = time.monotonic()
            torch._dynamo.reset()
            try:
                from overlap_compile.compile_caches import no_compile_caches

                with no_compile_caches():
                    got = e2e_dynamic.run_lengths(model_name, shape, variant, compile_mode, dynamic,
                                                  a.seqs if dynamic else [s for s in a.seqs if s in a.static_seqs], a.iters,
                                                  a.force, device, dtype, a.loss_rtol)
            except Exception as e:  # building the model or its eager references failed
                got = [{"error": f"{type(e).__name__}: {e}"[:2000], "failure": failure_kind(e),
                        "trace": traceback.format_exc()[-3000:]}]
            finally:
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            rows = [{**cfg, **r, **({"ms": r["prefill_ms"]} if "prefill_ms" in r else {}),
                     **({"shape": e2e_dynamic.shape_label(shape["name"], r["seq"], dynamic),
                         "sizes": {**shape, "seq": r["seq"]}} if "seq" in r else {})} for r in got]
            agree(rows, device)
            budget.took(time.monotonic() - t0)
            out += rows
    return out


def run_seqs_side_by_side(a, model_name: str, shape: dict, compile_mode: str, base: dict, budget, device: str,
                          dtype) -> list[dict]:
    """``--seqs`` with ``--interleave``: torch.compile and overlap, dynamic and static, alive side
    by side and timed together at each length (e2e_dynamic.run_lengths_side_by_side); the rows
    as run_seqs makes them, in its order (dynamic first, then static; variants as asked)."""
    from benchmarks import e2e_dynamic
    from benchmarks.models import FAMILY

    cfgs = {(v, d): {**base, **schema_keys(model_name, shape, v, compile_mode, False, a.force), "dynamic": d}
            for v, d in e2e_dynamic.COMPILES}
    order = [(v, d) for d in (True, False) for v in ("default", "overlap")]
    skip = "dynamic prefill: dense blocks only" if FAMILY[model_name] != "llama" else budget.should_skip()
    if skip:
        return [{**cfgs[c], "skipped": skip} for c in order]
    t0 = time.monotonic()
    torch._dynamo.reset()
    limit = {"recompile_limit": max(torch._dynamo.config.recompile_limit, 4 * (len(a.seqs) + 2))}
    try:
        from overlap_compile.compile_caches import no_compile_caches

        with no_compile_caches(), torch._dynamo.config.patch(limit):
            got = e2e_dynamic.run_lengths_side_by_side(model_name, shape, compile_mode, a.seqs, a.static_seqs, a.iters,
                                                       a.force, device, dtype, a.loss_rtol)
    except Exception as e:  # building the models or their eager references failed
        got = {c: [{"error": f"{type(e).__name__}: {e}"[:2000], "failure": failure_kind(e),
                    "trace": traceback.format_exc()[-3000:]}] for c in order}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out = []
    for c in order:
        rows = [{**cfgs[c], **r, **({"ms": r["prefill_ms"]} if "prefill_ms" in r else {}),
                 **({"shape": e2e_dynamic.shape_label(shape["name"], r["seq"], c[1]),
                     "sizes": {**shape, "seq": r["seq"]}} if "seq" in r else {})} for r in got[c]]
        agree(rows, device)
        out += rows
    budget.took(time.monotonic() - t0)
    return out


def run_variant(a, model_name: str, shape: dict, variant: str, compile_mode: str, ckpt: bool, base: dict, budget,
                device: str, dtype, cache_checked: set | None) -> dict:
    """One configuration's row: its measurement, or why it was skipped (the time budget) or
    failed. ``cache_checked``: the models whose FX-cache hit was checked (None: not this round)."""
    rank0 = dist.get_rank() == 0
    inflight = run_file(a.out, a.run_id, "inflight") if getattr(a, "out", None) else None
    cfg = {**base, **schema_keys(model_name, shape, variant, compile_mode, ckpt, a.force)}
    skip = not_applicable(model_name, variant) or budget.should_skip()
    if skip:
        return {**cfg, "skipped": skip}
    t0 = time.monotonic()
    if rank0 and inflight:  # names the configuration if the run is killed inside it
        os.makedirs(a.out, exist_ok=True)
        with open(inflight, "w") as f:
            json.dump({k: cfg[k] for k in ("model", "shape", "compile_mode", "ckpt", "variant")}, f)
    from overlap_compile.compile_caches import no_compile_caches

    rows = []
    try:
        torch._dynamo.reset()
        # caches off: every variant compiles from scratch, so compile times compare
        kernels = fresh_kernel_caches() if a.fresh_caches else contextlib.nullcontext()
        with no_compile_caches(), kernels:
            # with --seqs, prefill is run_seqs' (at each length): here training only
            phases = [p for p in a.phases.split(",") if not (getattr(a, "seqs", None) and p == "prefill")]
            got = run_config(model_name, shape, variant, compile_mode, ckpt, phases, a.steps,
                             a.iters, a.force, device, dtype, a.train_calls)
        rows.append({**cfg, **got, "ms": got.get("train_ms", got.get("prefill_ms"))})
        want = cache_checked is not None and (a.check_cache == "all" or (a.check_cache == "first"
                                                                          and model_name not in cache_checked))
        if variant == "overlap" and want:
            cache_checked.add(model_name)
            rows[-1]["fxgraph_cache_hit"] = second_compile_hits(model_name, shape, compile_mode, a.force, device, dtype)
    except Exception as e:  # recorded, the sweep goes on
        rows.append(_error_row(cfg, e))
    finally:  # a failed variant must not leave its memory to the next
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    agree(rows, device)
    budget.took(time.monotonic() - t0)
    if rank0 and inflight and os.path.exists(inflight):
        os.remove(inflight)
    return rows[-1]


def not_applicable(model_name: str, variant: str) -> str | None:
    """Why the variant does not apply to the model (a skipped row), else None."""
    from benchmarks.models import FAMILY

    if variant == "async_tp" and FAMILY[model_name] == "moe":
        return "async-TP fuses TP all-gather/reduce-scatter matmuls; an EP block has none (its collectives are all-to-all)"
    if variant == "nocomm_nopad" and FAMILY[model_name] != "moe":
        return "nocomm_nopad removes expert capacity padding; a dense block has none"
    return None


def run_interleaved(a, model_name: str, shape: dict, variants: list[str], compile_mode: str, ckpt: bool, base: dict,
                    budget, device: str, dtype, cache_checked: set) -> list[dict]:
    """``--interleave``: the variants of one (model, shape, mode, ckpt) prepared one after another
    in one process, each on a model of its own and its peak memory counted from its own start
    (e2e_run.prepare), then timed side by side, one sample of each per round
    (e2e_run.time_together). A variant that does not apply is its row; where one fails to prepare,
    on any rank, the group is timed one variant after another instead (``_one_at_a_time``). The FX-cache check (``--check-cache``) runs after the timing: it resets
    Dynamo, which would drop the group's compiled code."""
    from overlap_compile.compile_caches import no_compile_caches

    rows: dict[str, dict] = {}
    cfgs = {v: {**base, **schema_keys(model_name, shape, v, compile_mode, ckpt, a.force)} for v in variants}
    skip = budget.should_skip()
    if skip:
        return [{**cfgs[v], "skipped": skip} for v in variants]
    t0 = time.monotonic()
    phases = [p for p in a.phases.split(",") if not (getattr(a, "seqs", None) and p == "prefill")]
    prepared = []
    torch._dynamo.reset()
    kernels = fresh_kernel_caches() if a.fresh_caches else contextlib.nullcontext()
    # every variant's graphs stay compiled beside the others' on the same code objects
    limit = {"recompile_limit": max(torch._dynamo.config.recompile_limit, 8 * len(variants))}
    with no_compile_caches(), kernels, torch._dynamo.config.patch(limit):
        for variant in variants:
            why = not_applicable(model_name, variant)
            if why:
                rows[variant] = {**cfgs[variant], "skipped": why}
                continue
            try:
                with contextlib.ExitStack() as stack:
                    prepared.append(prepare(model_name, shape, variant, compile_mode, ckpt, phases, a.steps, a.force,
                                            device, dtype, stack, warm_calls=2, beside_others=True))
            except Exception as e:  # recorded, the others go on
                rows[variant] = _error_row(cfgs[variant], e)
        failed = next((rows[v] for v in variants if "error" in rows.get(v, {})), None)
        if not on_every_rank(failed is None):  # every rank takes the same way on
            failed = failed or {"variant": "another rank", "error": "its preparation failed", "failure": "error"}
            prepared.clear()
            return _one_at_a_time(a, model_name, shape, variants, compile_mode, ckpt, base, budget, device, dtype,
                                  cache_checked, failed)
        try:
            time_together(prepared, a.iters, a.train_calls)
            for p in prepared:
                got = finish_config(p)
                rows[p.variant] = {**cfgs[p.variant], **got, "ms": got.get("train_ms", got.get("prefill_ms"))}
        except Exception as e:
            for p in prepared:
                rows[p.variant] = _error_row(cfgs[p.variant], e)
    del prepared
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    over = rows.get("overlap")
    if over is not None and "error" not in over and "skipped" not in over and (
            a.check_cache == "all" or (a.check_cache == "first" and model_name not in cache_checked)):
        cache_checked.add(model_name)
        over["fxgraph_cache_hit"] = second_compile_hits(model_name, shape, compile_mode, a.force, device, dtype)
    out = [rows[v] for v in variants]
    agree(out, device)
    budget.took(time.monotonic() - t0)
    return out


def _one_at_a_time(a, model_name: str, shape: dict, variants: list[str], compile_mode: str, ckpt: bool, base: dict,
                   budget, device: str, dtype, cache_checked: set, failed: dict) -> list[dict]:
    """A group whose preparation side by side failed (torch 2.11's CUDA-graph trees failed an
    internal assertion, ``len(node.tensor_weakrefs) == len(node.stack_traces)``, with a
    Megatron-style block under reduce-overhead): its variants timed one after another instead,
    each row saying why (``interleave_failed``), so no cell goes missing."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    why = f"{failed['variant']}: {failed['error'].splitlines()[0][:300] if failed['error'] else failed['failure']}"
    out = []
    for variant in variants:
        got = run_variant(a, model_name, shape, variant, compile_mode, ckpt, base, budget, device, dtype, cache_checked)
        out.append({**got, "interleave_failed": why})
    return out


def _error_row(cfg: dict, e: BaseException) -> dict:
    return {**cfg, "error": f"{type(e).__name__}: {e}"[:2000], "failure": failure_kind(e),
            "trace": traceback.format_exc()[-3000:]}


ROUND_TIMES = ("train_ms", "train_cold_ms", "prefill_ms")


def merge_rounds(rounds: list[dict]) -> dict:
    """One row for a configuration measured in several rounds: the first round's row (losses,
    sites, compile times) with each phase's time the median over the rounds that measured it,
    every round's time beside it (``train_ms_rounds``), and the first failure or skip if any."""
    import statistics

    failed = [r for r in rounds if "error" in r]
    measured = [r for r in rounds if "error" not in r and "skipped" not in r]
    if failed or not measured:  # a failure in any round is the configuration's; nothing measured: the skip
        return dict(failed[0] if failed else rounds[0], rounds=len(rounds))
    row = dict(measured[0])
    for key in ROUND_TIMES:
        got = [r[key] for r in measured if isinstance(r.get(key), (int, float))]
        if got:
            row[key], row[f"{key[:-3]}_ms_rounds"] = statistics.median(got), got
    first = measured[0]
    if "tokens_per_s" in first:
        row["tokens_per_s"] = first["tokens_per_s"] * first["train_ms"] / row["train_ms"]
    if "prefill_tokens_per_s" in first:
        row["prefill_tokens_per_s"] = first["prefill_tokens_per_s"] * first["prefill_ms"] / row["prefill_ms"]
    row["ms"] = row.get("train_ms", row.get("prefill_ms"))
    row["rounds"] = len(measured)
    return row


def _lengths(flag: str, text: str | None) -> list[int] | None:
    """A comma list of sequence lengths (>= 1), in order, each once; None when not given."""
    if not text:
        return None
    try:
        seqs = list(dict.fromkeys(int(v) for v in text.split(",")))
    except ValueError:
        raise SystemExit(f"{flag}: {text!r} is not a comma list of integers")
    if min(seqs) < 1:
        raise SystemExit(f"{flag}: lengths must be >= 1, got {seqs}")
    return seqs


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=None, help="processes to spawn (default: all GPUs; 2 on CPU); "
                    "ignored under torchrun")
    ap.add_argument("--models", default=None, help="comma list or 'all' (default: all registered; "
                    "llama70_dtensor runs the 70b shape only: see the module docstring)")
    ap.add_argument("--shapes", default=None, help="GPU: comma list of 8b, 70b, 8b-16k, moe, 8b-small, moe-small, or "
                    "'all' (default 8b,moe); dry run: tiny, tiny-70b, tiny-long, tiny-moe")
    ap.add_argument("--variants", default=None,
                    help="comma list of default, overlap, async_tp (CUDA only), nocomm (the comm-free bound), "
                    "nocomm_nopad (MoE: also no capacity padding in the expert GEMMs); default "
                    "default,overlap,async_tp,nocomm, with --seqs default,overlap")
    ap.add_argument("--modes", default="default", help="compile modes: comma list of default, reduce-overhead")
    ap.add_argument("--ckpt", default="off", help="activation checkpointing: comma list of off, on")
    ap.add_argument("--phases", default=None, help="comma list of train, prefill (default train,prefill; with "
                    "--seqs prefill)")
    ap.add_argument("--seqs", default=None,
                    help="prefill at each of these sequence lengths (comma list; benchmarks/e2e_dynamic.py): the model "
                    "built for the longest, dense blocks only; a length the world size does not divide into >= 2 "
                    "rows per rank is a skipped row")
    ap.add_argument("--static-seqs", default=None,
                    help="with --seqs: the lengths the static compiles run at (default: every --seqs length); the "
                    "decode-sized rule compares the dynamic compiles only, so these may leave decode lengths out")
    ap.add_argument("--dynamic", default="both", choices=("on", "off", "both"),
                    help="with --seqs: compile once with the sequence dim dynamic (on), once per length (off), or both")
    ap.add_argument("--steps", type=int, default=3, help="training steps whose losses are compared (>= 1)")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations (median)")
    ap.add_argument("--train-calls", type=int, default=3,
                    help="training steps run back to back per timed sample, as a training loop runs them "
                    "(train_ms); each row also carries train_cold_ms, one step after a barrier")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds over the variants of each (model, shape, mode): each variant compiled and timed "
                    "once per round, every other round in reverse order (round_order), its times the median "
                    "over rounds (each kept in *_ms_rounds), so a drift of the machine over the sweep or over a "
                    "round falls on every variant alike")
    ap.add_argument("--interleave", action="store_true",
                    help="the variants of each (model, shape, mode) compiled one after another in one process and "
                    "kept, then timed side by side: one sample of each per round, every other round in reverse "
                    "order (timing.time_interleaved); each row's times the median of its samples (kept in "
                    "*_ms_rounds) and its speedups and gap closed the medians of the rounds' own. A GPU's clocks "
                    "under its power cap follow its temperature, which moves over minutes of compiles: variants "
                    "timed minutes apart differ by more than the smaller gaps. Not with models their framework "
                    "compiles in place (torchtitan: --isolate)")
    ap.add_argument("--force", default=None, help="force this template in the overlap variant, or "
                    "TEMPLATE@{config as JSON} that configuration of it "
                    "(dry run default: signal_reorder, since on CPU the predictor keeps the baseline)")
    ap.add_argument("--check-cache", default="first", choices=("off", "first", "all"),
                    help="compile the overlap variant a second time to see the FX graph cache hit: for the "
                    "first overlap configuration of each model, all, or off")
    ap.add_argument("--no-check-models", dest="check_models", action="store_false",
                    help="skip the Megatron-vs-DTensor check run first")
    ap.add_argument("--fresh-caches", action="store_true",
                    help="empty Inductor/Triton kernel caches per configuration, so compile times compare "
                         "(slow on GPUs; the pass's own time, pass_s, is measured either way)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help=f"seconds; configurations that would not fit are skipped (default {DEFAULT_BUDGET_S} on GPUs, "
                         "none on a dry run; 0 = none)")
    ap.add_argument("--loss-rtol", type=float, default=None,
                    help="relative loss tolerance vs default, and of --seqs' outputs vs eager (max |diff| / "
                         "max |eager|) (default: 1e-4 fp32 CPU, 2e-2 bf16 GPU)")
    ap.add_argument("--isolate", action="store_true",
                    help="each variant in processes of its own: a framework whose process-wide state carries from one "
                    "compile to the next (seen with torchtitan: every other compile of its block in one process traced "
                    "a backward that recomputes the forward) then compiles every variant as a fresh process does")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, world 2, tiny shapes, no async-TP")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    a = ap.parse_args(argv)
    a.dry_run = a.dry_run or not torch.cuda.is_available()
    a.seqs = _lengths("--seqs", a.seqs)
    a.static_seqs = _lengths("--static-seqs", a.static_seqs) or a.seqs
    if a.static_seqs and not set(a.static_seqs) <= set(a.seqs or ()):
        raise SystemExit(f"--static-seqs: {sorted(set(a.static_seqs) - set(a.seqs or ()))} not among --seqs")
    a.phases = a.phases or ("prefill" if a.seqs else "train,prefill")
    a.variants = a.variants or ("default,overlap" if a.seqs else "default,overlap,async_tp,nocomm")
    for opt, vals, allowed in (("--modes", a.modes, ("default", "reduce-overhead")), ("--ckpt", a.ckpt, ("off", "on")),
                               ("--phases", a.phases, PHASES), ("--variants", a.variants, VARIANTS)):
        for v in vals.split(","):
            if v not in allowed:
                raise SystemExit(f"{opt}: {v!r} is not one of {', '.join(allowed)}")
    if a.interleave and (a.isolate or a.repeat > 1):
        raise SystemExit("--interleave times the variants side by side in one process: not with --isolate (a process "
                         "per variant) or --repeat (rounds of whole configurations); its rounds are --iters")
    if a.interleave and a.seqs and (a.dynamic != "both" or set(a.variants.split(",")) != {"default", "overlap"}):
        raise SystemExit("--seqs with --interleave times torch.compile and overlap, each compiled dynamic and static, "
                         "side by side: it needs --dynamic both and --variants default,overlap")
    if a.steps < 1 or a.iters < 1 or a.repeat < 1 or a.train_calls < 1:
        raise SystemExit(f"--steps ({a.steps}), --iters ({a.iters}), --repeat ({a.repeat}) and --train-calls "
                         f"({a.train_calls}) must be >= 1")
    if a.dry_run:
        a.world = a.world or 2
        a.shapes = a.shapes or "tiny,tiny-moe"
        a.force = a.force or "signal_reorder"
        a.time_budget = a.time_budget or 0.0
    else:
        a.world = a.world or torch.cuda.device_count()
        a.shapes = a.shapes or "8b,moe"
        a.time_budget = DEFAULT_BUDGET_S if a.time_budget is None else a.time_budget
    a.models = a.models or "all"
    load_shapes(a.shapes, a.dry_run)  # bad names fail here, not in every rank
    # fp32 on CPU: a rewrite changes only where sums are split (~1e-6 relative per op; 1e-4 leaves
    # room over 3 steps). bf16 on GPU: the rewritten graph computes the same GEMMs and collectives in
    # other orders and bf16 rounds each result at 2^-8 = 3.9e-3 relative; the loss is a mean over
    # ~1e7 elements, which averages that down, and 3 AdamW steps at lr 1e-4 barely move it: 2e-2
    # still catches a wrong shard or a dropped chunk, which change the loss by O(1).
    a.loss_rtol = a.loss_rtol if a.loss_rtol is not None else (1e-4 if a.dry_run else 2e-2)
    a.run_id = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    a.start_time = time.time()
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        return torchrun_main(a)
    from overlap_compile.testing.multiprocess import DistributedFailure, run_distributed

    # the harness kills the ranks after the budget plus room for one configuration in flight and the
    # output; without a budget, an hour
    timeout = a.time_budget + GRACE_S if a.time_budget else 3600
    try:
        rows = []
        for variants in a.variants.split(",") if a.isolate else [a.variants]:
            rows += run_distributed(worker, world_size=a.world, args=({**vars(a), "variants": variants},),
                                    backend="gloo" if a.dry_run else "nccl", timeout_s=timeout)[0]
    except DistributedFailure as e:  # keep what was measured before the failure
        rows, cfg = read_partial(a.out, a.run_id)
        print(f"run stopped: {str(e).splitlines()[0][:300]}; {len(rows)} rows measured before", flush=True)
        base = {"benchmark": "e2e", "device": "cpu" if a.dry_run else torch.cuda.get_device_name(0),
                "world_size": a.world, "torch": torch.__version__, "date": datetime.date.today().isoformat()}
        rows.append({**base, **(cfg or {}), "error": f"run stopped{' inside this configuration' if cfg else ''}: {e}"[:2000],
                     "failure": "timeout" if "did not finish" in str(e) else "error"})
    return finish(rows, a)


def torchrun_main(a: argparse.Namespace) -> int:
    backend = "gloo" if a.dry_run else "nccl"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    rows = worker(vars(a))
    # written before the teardown, which can hang after NCCL work captured in CUDA graphs
    # (pytorch/pytorch#115388; see testing/multiprocess.py)
    code = finish(rows, a) if int(os.environ["RANK"]) == 0 else 0
    from overlap_compile.runtime import teardown
    teardown.finish()  # barrier, release, destroy; every rank before the store's host leaves
    return code


def finish(rows: list[dict], a: argparse.Namespace) -> int:
    rows = compare(rows, a.loss_rtol)
    dynamic_notes = []
    if getattr(a, "seqs", None):  # before write(): the rules' verdicts go onto the dynamic rows
        from benchmarks.e2e_dynamic import summary

        rules_held, dynamic_notes = summary(rows)
        held = "all held" if rules_held else "NOT ALL HELD"
        dynamic_notes.append(f"dynamic-shape rules: {held} (not in the exit status)")
    stem = write(rows, a.out)
    print(open(stem + ".md").read())
    ok, notes = verdict(rows, a.loss_rtol)
    notes += dynamic_notes
    print("\n".join(notes))
    print("wrote", stem + ".json")
    print("e2e: OK" if ok else "e2e: CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
