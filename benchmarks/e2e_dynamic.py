"""Prefill at several sequence lengths for the end-to-end benchmark (``e2e.py --seqs ... --dynamic``).

``run_lengths``: one configuration (model, compile mode, variant, dynamic on or off) run at every
length. Dynamic: compiled once, the first length being the compile's hint, with
``torch._dynamo.mark_dynamic`` on the input's sequence dimension (a DTensor input's Shard dim, which
Dynamo carries to the local tensor; a plain local shard's dim from ``LOCAL_SEQ_DIM``). Static: a
fresh compile per length (``torch._dynamo.reset()`` between lengths, automatic dynamic off). The
model is built for the longest length (its RoPE tables), each length gets new inputs, its outputs are
checked against eager's and it is timed; the overlap variant is also timed in rounds alternating
with torch.compile's compile of the same kind, alive beside it (``paired_reference``). ``summary``:
per length the static and dynamic speedups over torch.compile compiled the same way (paired where
timed so), (dynamic - 1) / (static - 1) and the two rules.
"""
from __future__ import annotations

import contextlib
import json
import time

import torch
import torch.distributed as dist

DECODE_MAX = 256  # tokens: a decode-sized row count, held to DECODE_FLOOR instead of GAIN_SHARE
GAIN_SHARE = 0.9  # prefill: (dynamic speedup - 1) >= GAIN_SHARE x (static speedup - 1)
DECODE_FLOOR = 0.99  # decode-sized: dynamic overlap >= this x torch.compile's dynamic compile (1% noise)
# calls timed back to back per sample: a barrier releases the ranks up to a few tenths of a ms
# apart, and a rank's first collective waits for the other; in a sample of one call of a
# fraction of a millisecond that skew, not the compile, decides the time
CALLS_PER_SAMPLE = 8
# decode-sized lengths: rounds of the paired timing per --iters (a round's ratio of two host-bound
# calls spreads by several percent, the rule asks for 1%: the median of more rounds)
PAIRED_ROUNDS_PER_ITER = 3
# the sequence dim of a model's plain (non-DTensor) input, by form: [seq/W, batch, hidden] for the
# Megatron-LM layout, [batch, seq/W, hidden] for the others
LOCAL_SEQ_DIM = {"megatron_fused": 0, "llama_megatron": 1, "titan_llama3": 1}


def form_of(model_name: str) -> str:
    from benchmarks.models import PINNED_SHAPE

    return PINNED_SHAPE.get(model_name, (model_name,))[0]


def sequence_dim(x, model_name: str) -> int:
    shards = [p.dim for p in getattr(x, "placements", ()) if p.is_shard()]
    if shards:
        return shards[0]
    if form_of(model_name) not in LOCAL_SEQ_DIM:
        raise ValueError(f"{model_name}: the sequence dim of its input is not known (e2e_dynamic.LOCAL_SEQ_DIM)")
    return LOCAL_SEQ_DIM[form_of(model_name)]


def why_not(seq: int, world: int) -> str | None:
    """Why a length cannot run on ``world`` ranks of a sequence-parallel block, or None."""
    if seq % world:
        return f"seq {seq} is not a multiple of the world size {world}: sequence parallelism shards the sequence"
    if seq // world < 2:  # a size-1 dim is specialised, so the dynamic compile could not take it
        return f"seq {seq} leaves 1 row per rank, and Dynamo specialises sizes 0 and 1"
    return None


def input_at(x, dim: int, seq: int, seed: int = 0):
    """A new input like ``x`` with ``seq`` tokens: a DTensor from the same global tensor on every
    rank, sharded as ``x`` is; a plain local shard (seq / W rows) of this rank's own draw."""
    shape = list(x.shape)
    if hasattr(x, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        shape[dim] = seq
        g = torch.Generator().manual_seed(seed * 100003 + seq)
        full = torch.randn(shape, generator=g).to(device=x.device, dtype=x.dtype)
        return distribute_tensor(full, x.device_mesh, x.placements)
    shape[dim] = seq // dist.get_world_size()
    g = torch.Generator().manual_seed((seed * 100003 + seq) * 1024 + dist.get_rank())
    return torch.randn(shape, generator=g).to(device=x.device, dtype=x.dtype)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref| over every rank's shard."""
    t = torch.stack([(y.float() - ref.float()).abs().max(), ref.float().abs().max()]).reshape(2)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return (t[0] / t[1].clamp_min(1e-30)).item()


def _plain(v):  # JSON-safe (a symbolic size kept in a report becomes its text)
    return json.loads(json.dumps(v, default=str))


def site_row(s) -> dict:
    return _plain({"graph": s.graph, "phase": "prefill", "kind": s.kind, "template": s.template,
                   "rewritten": s.rewritten, "reason": s.reason, "gemms": s.gemms, "predicted_ms": s.predicted_ms,
                   "comm_ms": s.comm_ms, "hidden_ms": s.hidden_ms, "chosen_ms": s.chosen_ms, "buckets": s.buckets})


def static_compile() -> dict:
    """Dynamo options that keep every compile static: no automatic dynamic, no profile from an
    earlier compile of the same code (PGO) that would make the sequence dim dynamic anyway."""
    from torch._dynamo import config

    names = ("automatic_dynamic_shapes", "automatic_dynamic_local_pgo", "automatic_dynamic_remote_pgo")
    return {n: False for n in names if hasattr(config, n)}


def run_lengths(model_name: str, shape: dict, variant: str, compile_mode: str, dynamic: bool, seqs: list[int],
                iters: int, force: str | None, device: str, dtype, rtol: float) -> list[dict]:
    """Rows (seq, dynamic, prefill_ms, max_rel, correct, compiles, ...) of one configuration, one
    per length in the order given; a length the world cannot shard gets a ``skipped`` row, an
    error ends the configuration with an ``error`` row."""
    import overlap_compile as oc
    from overlap_compile.templates.bucketed import choices_made, clear_choices

    from benchmarks.e2e_run import (SIZE_CHANGES, CompileWatch, RecordsSince, compiled, failure_kind,
                                    framework_mode, sync, variant_context)
    from benchmarks.models import build
    from benchmarks.plot import E2E_BOUNDS
    from benchmarks.timing import time_ms, time_pair

    world = dist.get_world_size()
    rows: list[dict] = []
    runnable = [s for s in seqs if not why_not(s, world)]
    if not runnable:
        return [{"seq": s, "dynamic": dynamic, "skipped": why_not(s, world)} for s in seqs]
    built = build(model_name, {**shape, **SIZE_CHANGES.get(variant, {}), "seq": max(runnable)}, device, dtype, seed=0)
    dim = sequence_dim(built.x, model_name)
    inputs = {s: input_at(built.x, dim, s) for s in runnable}
    with torch.no_grad():  # eager first: a framework's compile_with compiles the model in place
        refs = {s: built.to_local(built.model(inputs[s])) for s in runnable}
    report = oc.Report()
    records = RecordsSince(report)
    step_begin = torch.compiler.cudagraph_mark_step_begin if compile_mode == "reduce-overhead" else (lambda: None)
    with framework_mode(built, compile_mode), variant_context(variant) as (_, options), \
            torch._dynamo.config.patch({} if dynamic else static_compile()):
        fn, overrides = compiled(built.model, variant, compile_mode, force, report, built.compile_with, options)

        def prefill(x):
            step_begin()
            # the options a forced run compiled under, where there are any: none is what users run
            with torch.no_grad(), (oc.config.patch(**overrides) if overrides else contextlib.nullcontext()):
                return fn(x)

        reference = None
        for s in seqs:
            row: dict = {"seq": s, "dynamic": dynamic, "sizes_seq_built": max(runnable)}
            if why_not(s, world):
                rows.append({**row, "skipped": why_not(s, world)})
                continue
            try:
                if not dynamic and s != runnable[0]:
                    torch._dynamo.reset()  # this length's own compile
                x = inputs[s]
                if dynamic:
                    torch._dynamo.mark_dynamic(x, dim)
                if reference is None or not dynamic:  # dynamic: one, at the first length; static: per length
                    reference = paired_reference(built, variant, compile_mode, x, step_begin)
                watch, first_record = CompileWatch(), len(report.records)
                clear_choices()
                t0 = time.perf_counter()
                y = prefill(x)
                sync()
                row["prefill_first_s"] = time.perf_counter() - t0  # the compile's, where this length made one
                err = rel_err(built.to_local(y), refs[s])
                del y
                watch.start_timed()
                row["prefill_ms"] = time_ms(lambda: prefill(x), iters, warmup=2, calls=CALLS_PER_SAMPLE)
                recompiles = watch.compiled_since_mark()
                # a replay too (reduce-overhead: the CUDA graph's, not the warm-up run's)
                err = max(err, rel_err(built.to_local(prefill(x)), refs[s]))
                if reference is not None:
                    rounds = iters * (PAIRED_ROUNDS_PER_ITER if s <= DECODE_MAX else 1)
                    row["paired"] = time_pair(lambda: prefill(x), lambda: reference(x), rounds, warmup=2,
                                              calls=CALLS_PER_SAMPLE)
            except Exception as e:  # the rows so far stay; the sweep goes on with the next configuration
                import traceback

                rows.append({**row, "error": f"{type(e).__name__}: {e}"[:2000], "failure": failure_kind(e),
                             "trace": traceback.format_exc()[-3000:]})
                break
            if built.compile_with is not None:
                records.collect()
            row.update(watch.summary(recompiles), max_rel=err, out_rtol=rtol,
                       correct=None if variant in E2E_BOUNDS else err <= rtol,
                       prefill_tokens_per_s=shape["batch"] * s / (row["prefill_ms"] / 1e3))
            row["compiles"] = row["dynamo_graphs"]  # graphs compiled at this length, the first call's included
            if variant == "overlap":
                new = report.records[first_record:]
                if new:  # the graphs compiled at this length: their sites, symbolic ones with buckets
                    row["sites"] = [site_row(site) for rec in new for site in rec.sites]
                    row["rewritten"] = sum(site["rewritten"] for site in row["sites"])
                    row["pass_s"] = sum(rec.pass_seconds for rec in new)
                # what the bucketed ops ran at this length: (M, template)
                row["bucket_choices"] = [list(c) for c in sorted({(m, t) for m, t, _ in choices_made()})]
            rows.append(row)
            del refs[s]
    return rows


COMPILES = (("default", True), ("overlap", True), ("default", False), ("overlap", False))  # (variant, dynamic)


def run_lengths_side_by_side(model_name: str, shape: dict, compile_mode: str, seqs: list[int], static_seqs: list[int],
                             iters: int, force: str | None, device: str, dtype, rtol: float) -> dict[tuple, list[dict]]:
    """``e2e.py --seqs ... --interleave``: torch.compile and the overlap backend, each compiled
    dynamic and static (``COMPILES``), all four alive, each on a model of its own (same weights);
    at every length the four (the static ones at ``static_seqs``) are checked against eager and
    timed side by side, one sample of each per round (timing.time_interleaved), so the static
    and the dynamic speedup come from the same rounds. The static compiles are torch.compile's
    ``dynamic=False`` (a compile per length, no reset: the dynamic ones stay). Returns
    (variant, dynamic) -> rows as ``run_lengths`` makes them, the overlap rows' ``paired`` from
    the rounds beside torch.compile compiled the same way."""
    import statistics

    import overlap_compile as oc
    from overlap_compile.templates.bucketed import choices_made, clear_choices

    from benchmarks.e2e_run import CompileWatch, compiled, failure_kind, sync
    from benchmarks.models import build
    from benchmarks.timing import op_graph_progress, time_interleaved

    world = dist.get_world_size()
    runnable = [s for s in seqs if not why_not(s, world)]
    out: dict[tuple, list[dict]] = {c: [] for c in COMPILES}
    if not runnable:
        for (v, dyn) in COMPILES:
            out[(v, dyn)] = [{"seq": s, "dynamic": dyn, "skipped": why_not(s, world)} for s in seqs
                             if dyn or s in static_seqs]
        return out
    step_begin = torch.compiler.cudagraph_mark_step_begin if compile_mode == "reduce-overhead" else (lambda: None)
    calls, reports, built_first = {}, {}, None
    for c in COMPILES:
        built = build(model_name, {**shape, "seq": max(runnable)}, device, dtype, seed=0)
        if built.compile_with is not None:
            raise ValueError(f"{model_name} is compiled in place by its framework: its four compiles cannot live side "
                             "by side (run --seqs without --interleave)")
        built_first = built_first or built
        reports[c] = oc.Report()
        fn, overrides = compiled(built.model, c[0], compile_mode, force, reports[c], None, None,
                                 dynamic=None if c[1] else False)

        def call(x, fn=fn, overrides=overrides):
            step_begin()
            with torch.no_grad(), (oc.config.patch(**overrides) if overrides else contextlib.nullcontext()):
                return fn(x)

        calls[c] = call
    dim = sequence_dim(built_first.x, model_name)

    def static(c=None):  # a static compile's calls: a new length compiles again, never goes dynamic
        return torch._dynamo.config.patch(static_compile()) if c is None or not c[1] else contextlib.nullcontext()

    for s in seqs:
        active = [c for c in COMPILES if c[1] or s in static_seqs]
        if why_not(s, world):
            for c in active:
                out[c].append({"seq": s, "dynamic": c[1], "skipped": why_not(s, world)})
            continue
        x = input_at(built_first.x, dim, s)
        with torch.no_grad():
            ref = built_first.to_local(built_first.model(x))
        rows, inputs, first = {}, {}, {}
        try:
            clear_choices()
            for c in active:
                rows[c] = {"seq": s, "dynamic": c[1], "sizes_seq_built": max(runnable)}
                xc = x.detach().clone() if not hasattr(x, "device_mesh") else input_at(built_first.x, dim, s)
                if c[1]:
                    torch._dynamo.mark_dynamic(xc, dim)
                inputs[c] = xc
                first[c] = len(reports[c].records)
                watch = CompileWatch()
                t0 = time.perf_counter()
                with static(c):
                    y = calls[c](xc)
                    sync()
                rows[c]["prefill_first_s"] = time.perf_counter() - t0
                rows[c]["max_rel"] = rel_err(built_first.to_local(y), ref)
                rows[c].update(watch.summary(0))
                rows[c]["compiles"] = rows[c]["dynamo_graphs"]  # graphs compiled at this length
                del y
            fns = {c: (lambda c=c: calls[c](inputs[c])) for c in active}
            rounds = iters * (PAIRED_ROUNDS_PER_ITER if s <= DECODE_MAX else 1)
            timed = CompileWatch()
            with static():  # side by side the ops' buffers move with the others' calls: until their graphs settle
                got = time_interleaved(fns, rounds, warmup=2, calls=CALLS_PER_SAMPLE, settle=op_graph_progress)
            recompiles = timed.compiled_since_mark()
            names = [f"{v}/{'dynamic' if dyn else 'static'}" for v, dyn in active]
            for c in active:  # a replay too (reduce-overhead: the CUDA graph's, not the warm-up run's)
                with static(c):
                    rows[c]["max_rel"] = max(rows[c]["max_rel"], rel_err(built_first.to_local(calls[c](inputs[c])), ref))
                r = rows[c]
                r["prefill_ms"] = statistics.median(got[c])
                r["prefill_ms_rounds"] = got[c]
                r["interleaved"] = names
                if recompiles:
                    r["failure_modes"] = r.get("failure_modes", []) + [f"recompile during timed steps x{recompiles}"]
                    r["recompiles_timed"] = recompiles
                r.update(out_rtol=rtol, correct=r["max_rel"] <= rtol,
                         prefill_tokens_per_s=shape["batch"] * s / (r["prefill_ms"] / 1e3))
                ref_c = ("default", c[1])
                if c[0] == "overlap" and ref_c in got:
                    mine, theirs = got[c], got[ref_c]
                    r["paired"] = {"a_ms": statistics.median(mine), "b_ms": statistics.median(theirs),
                                   "ratio": statistics.median(b / a for a, b in zip(mine, theirs)), "rounds": rounds}
                    new = reports[c].records[first[c]:]
                    if new:  # the graphs compiled at this length: their sites, symbolic ones with buckets
                        r["sites"] = [site_row(site) for rec in new for site in rec.sites]
                        r["rewritten"] = sum(site["rewritten"] for site in r["sites"])
                        r["pass_s"] = sum(rec.pass_seconds for rec in new)
                    if c[1]:  # what the bucketed ops ran at this length: (M, template); static ones make none
                        r["bucket_choices"] = [list(t) for t in sorted({(m, t) for m, t, _ in choices_made()})]
        except Exception as e:  # the rows so far stay; the sweep goes on with the next configuration
            import traceback

            for c in active:
                out[c].append({**rows.get(c, {"seq": s, "dynamic": c[1]}), "error": f"{type(e).__name__}: {e}"[:2000],
                               "failure": failure_kind(e), "trace": traceback.format_exc()[-3000:]})
            break
        for c in active:
            out[c].append(rows[c])
    return out


def paired_reference(built, variant: str, compile_mode: str, x, step_begin):
    """The overlap compile's reference: torch.compile's own compile of the same model, compiled
    the same way (dynamic or static) at ``x``'s length and alive beside it, so the two are timed
    in alternating rounds (timing.time_pair). Host-launched calls of a few milliseconds and less
    (decode-sized ones under CUDA graphs too: guards, subclass unwrapping, the graph's launch)
    run at a host speed that drifts between configurations timed minutes apart by more than the
    rules' margins. None where there is nothing to pair: another variant, or a model its
    framework compiles in place."""
    from benchmarks.e2e_run import compiled

    if variant != "overlap" or built.compile_with is not None:
        return None
    ref, _ = compiled(built.model, "default", compile_mode, None, None)

    def call(x):
        step_begin()
        with torch.no_grad():
            return ref(x)

    call(x)
    return call


def shape_label(name: str, seq: int, dynamic: bool) -> str:
    """A dynamic-prefill row's shape: e2e_report.compare pairs rows of the same shape, so each
    length and setting is compared with torch.compile's at that length, compiled the same way."""
    return f"{name}, seq {seq}, {'dynamic' if dynamic else 'static'}"


def _paired_speedup(row: dict | None) -> float | None:
    """A row's speedup over torch.compile: its paired rounds' (written onto it as
    ``paired_speedup``) where it has them, else e2e_report.compare's ``prefill_speedup``."""
    if not row:
        return None
    if row.get("paired"):
        row["paired_speedup"] = row["paired"]["ratio"]
        return row["paired_speedup"]
    return row.get("prefill_speedup")


def summary(rows: list[dict]) -> tuple[bool, list[str]]:
    """Per (model, mode, variant) and length, after e2e_report.compare: the static and dynamic
    speedups (each from the row's paired rounds where it has them: ``_paired_speedup``), gain
    share (dynamic - 1) / (static - 1) and the rule for the length (prefill: gain >= GAIN_SHARE x
    the static one; seq <= DECODE_MAX: dynamic speedup >= DECODE_FLOOR), written onto the dynamic
    rows (``static_speedup``, ``gain_share``, ``rule``, ``rule_ok``); the compiles after the first
    length beside torch.compile's. Returns (every rule held, lines)."""
    from benchmarks.plot import E2E_BOUNDS

    by = {(r["model"], r["compile_mode"], r["variant"], r["dynamic"], r["seq"]): r
          for r in rows if "seq" in r and "prefill_ms" in r}
    groups = sorted({k[:3] for k in by if k[2] != "default" and k[2] not in E2E_BOUNDS})
    ok, lines = True, []
    for model, mode, variant in groups:
        lines.append(f"dynamic prefill, {model} {mode} {variant}: seq, static x, dynamic x, gain share, rule")
        for seq in sorted({k[4] for k in by if k[:3] == (model, mode, variant)}):
            dyn, st = by.get((model, mode, variant, True, seq)), by.get((model, mode, variant, False, seq))
            # each speedup from its paired rounds where the row has them (paired_reference)
            ds, ss = (_paired_speedup(r) for r in (dyn, st))
            paired = bool((dyn or {}).get("paired")) and (seq <= DECODE_MAX or bool((st or {}).get("paired")))
            share = (ds - 1) / (ss - 1) if ds is not None and ss is not None and abs(ss - 1) > 1e-9 else None
            if seq <= DECODE_MAX:
                rule = f">= {DECODE_FLOOR}x torch.compile dynamic"
                held = None if ds is None else ds >= DECODE_FLOOR
            else:
                rule = f"gain >= {GAIN_SHARE:.0%} of static"
                held = None if ds is None or ss is None else (ds - 1) >= GAIN_SHARE * (ss - 1)
            rule += ", paired rounds" if paired else ""
            if dyn is not None:
                dyn.update(static_speedup=ss, gain_share=share, rule=rule, rule_ok=held)
            ok &= bool(held)
            f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
            verdict = {True: "PASS", False: "FAIL", None: "NOT MEASURED"}[held]
            lines.append(f"  {seq:>6} {f(ss, '.3f'):>7} {f(ds, '.3f'):>7} {f(share, '.2f'):>6}  {rule}: {verdict}")
        for who in (variant, "default"):
            later = [r.get("compiles", 0) for k, r in by.items() if k[:4] == (model, mode, who, True)][1:]  # run order
            lines.append(f"  {who}: dynamic compile, graphs compiled after the first length: {sum(later)}")
        mine = sum(r.get("compiles", 0) for k, r in by.items() if k[:4] == (model, mode, variant, True))
        theirs = sum(r.get("compiles", 0) for k, r in by.items() if k[:4] == (model, mode, "default", True))
        ok &= mine <= theirs
    return ok, lines
