"""One configuration of the end-to-end benchmark (benchmarks/e2e.py): a model compiled under one
variant (default, overlap, async_tp, nocomm, nocomm_nopad) and compile mode, its training steps and prefill
run and timed (benchmarks/timing.py), and what the compiler did along the way (graph breaks,
recompiles, CUDA-graph skips, the overlap pass's report). e2e.py runs these over its sweep on
every rank; e2e_report.py turns the rows into comparisons, tables and files.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from benchmarks.plot import E2E_BOUNDS
from benchmarks.timing import op_graph_calls_since, op_graph_counts, op_graph_progress, time_interleaved, time_ms


class Checkpointed(torch.nn.Module):
    """Activation checkpointing around the whole block (non-reentrant, as torchtitan does)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


# What a bound variant changes in the model's sizes. nocomm_nopad: slots for the mean expert load
# only (capacity factor 1.0), so the expert GEMMs run on as many rows as are routed and none of
# the padding the block as written computes: with the collectives removed too, the step's time if
# overlap hid every byte and skipped the padding at no cost (MoE blocks only; e2e.py skips others).
SIZE_CHANGES = {"nocomm_nopad": {"capacity_factor": 1.0}}


@contextlib.contextmanager
def variant_context(variant: str):
    """What the variant changes around torch.compile. Yields ``(nocomm pass or None, Inductor
    options)``: the options its torch.compile takes as well (``compiled``), so that its compiled
    code is its own: Dynamo keys compiled code by the backend, and two plain torch.compile calls
    with the same mode are the same backend to it, whatever Inductor's options were around them
    (a variant compiled beside torch.compile's own, as interleaved timing keeps them, would
    otherwise run the other's code)."""
    if variant == "async_tp":
        from benchmarks.async_tp import async_tp

        with async_tp():
            yield None, {"_micro_pipeline_tp": True}
    elif variant in E2E_BOUNDS:  # every bound runs without communication
        from benchmarks.nocomm import nocomm

        with nocomm() as p:
            yield p, {"post_grad_custom_post_pass": p}
    else:
        yield None, {}


def forced_options(force: str | None) -> dict:
    """``--force``'s text as overlap_compile options: "TEMPLATE" forces that template,
    "TEMPLATE@{config json}" that configuration of it (the diagnostics read it the same way)."""
    name, _, config = (force or "").partition("@")
    return {**({"force_template": name} if name else {}), **({"force_config": config} if config else {})}


@contextlib.contextmanager
def framework_mode(built, compile_mode: str):
    """A model its framework compiles (``Built.compile_with``) takes no ``mode=``: torchtitan's
    compile passes only a backend. The mode's Inductor options (CUDA graphs for reduce-overhead)
    are set around the whole configuration instead, which is what ``mode=`` does per compile."""
    if built.compile_with is None or compile_mode == "default":
        yield
        return
    from torch._inductor import config as inductor_config

    with inductor_config.patch(torch._inductor.list_mode_options(compile_mode)):
        yield


class RecordsSince:
    """The overlap pass's records of the process-wide report from now on, copied into ``report``
    by ``collect()``: a model compiled with the backend by name reports there."""

    def __init__(self, report) -> None:
        import overlap_compile as oc

        self.report, self.start = report, len(oc.last_report().records)

    def collect(self) -> None:
        import overlap_compile as oc

        for record in oc.last_report().records[self.start:]:
            self.report.add(record)
        self.start = len(oc.last_report().records)


def compiled(model, variant: str, compile_mode: str, force: str | None, report, compile_with=None,
             options: dict | None = None, dynamic: bool | None = None):
    """The callable a step runs and the overlap options it runs under. ``compile_with``: the
    model's framework compiles it in place, with the backend named as users name it. ``options``:
    the Inductor options of the variant (``variant_context``), given to torch.compile with the
    mode's own (torch.compile takes a mode or options, not both). ``dynamic``: torch.compile's
    (False: a static compile, a backend of its own beside a dynamic one of the same variant)."""
    mode_kw = {} if compile_mode == "default" else {"mode": compile_mode}
    if compile_with is not None:
        overrides = forced_options(force) if variant == "overlap" else {}
        if variant == "overlap":
            from overlap_compile.backend import register

            register()
        compile_with("overlap" if variant == "overlap" else "inductor", async_tp=variant == "async_tp")
        return model, overrides
    if variant == "overlap":
        import overlap_compile as oc
        from overlap_compile.backend import overlap_backend

        backend = functools.partial(overlap_backend, report=report, mode=mode_kw.get("mode"))
        overrides = forced_options(force)
        with oc.config.patch(**overrides):
            # the options are read when Dynamo hands over each graph: keep them for every call
            fn = torch.compile(model, backend=backend, dynamic=dynamic)
        return fn, overrides
    if options:
        return torch.compile(model, options={**torch._inductor.list_mode_options(compile_mode), **options},
                             dynamic=dynamic), {}
    return torch.compile(model, **mode_kw, dynamic=dynamic), {}


class CompileWatch:
    """Dynamo / Inductor counters over one configuration: graph breaks, graphs compiled (and how
    many of them during the timed steps, i.e. recompiles), CUDA-graph skips."""

    def __init__(self) -> None:
        from torch._dynamo.utils import counters

        self.counters = counters
        self.breaks0 = dict(counters["graph_break"])
        self.graphs0 = self.graphs()
        self.skips0 = counters["inductor"]["cudagraph_skips"]
        self.mark = self.graphs0

    def graphs(self) -> int:
        return self.counters["stats"]["unique_graphs"]

    def start_timed(self) -> None:
        self.mark = self.graphs()

    def compiled_since_mark(self) -> int:
        return self.graphs() - self.mark

    def summary(self, recompiles_timed: int) -> dict:
        breaks = {k[:300]: v - self.breaks0.get(k, 0) for k, v in self.counters["graph_break"].items()
                  if v - self.breaks0.get(k, 0) > 0}
        skips = self.counters["inductor"]["cudagraph_skips"] - self.skips0
        modes = ([f"graph_break x{sum(breaks.values())}"] if breaks else []) + \
                ([f"recompile during timed steps x{recompiles_timed}"] if recompiles_timed else []) + \
                ([f"cudagraph skipped x{skips}"] if skips else [])
        return {"graph_breaks": breaks, "dynamo_graphs": self.graphs() - self.graphs0,
                "recompiles_timed": recompiles_timed, "cudagraph_skips": skips, "failure_modes": modes}


def failure_kind(e: BaseException) -> str:
    """The failure modes worth telling apart in the results."""
    text = f"{type(e).__name__}: {e}".lower()
    if "outofmemory" in text or "out of memory" in text:
        return "oom"
    if "graph" in text and "captur" in text:
        return "cuda_graph_capture"
    if "unsupported" in type(e).__name__.lower() or "graph break" in text:
        return "graph_break"
    if "recompil" in text or "cache_size_limit" in text or "recompile_limit" in text:
        return "recompile"
    return "error"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mean_over_ranks(v: torch.Tensor) -> float:
    t = v.detach().double().reshape(1).to("cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@dataclasses.dataclass
class Prepared:
    """One configuration compiled, its losses taken and its calls warmed up (``prepare``): the
    row so far, the calls its timing makes (``train_step``: one training step, ``prefill``: one
    forward; None for a phase not run) and what ``finish`` reads once the timing is done."""
    row: dict
    train_step: Callable[[], Any] | None
    prefill: Callable[[], Any] | None
    watch: "CompileWatch"
    report: Any
    train_graphs: int
    variant: str
    base: int = 0  # bytes allocated when the configuration started: its peak counts from there
    # the first prefill and its warm-up, where not yet made (``time_alone`` makes it after the
    # training steps are timed, as a process running one configuration would)
    start_prefill: Callable[[int], None] | None = None
    recompiles: int = 0  # graphs compiled during the timed calls


def run_config(model_name: str, shape: dict, variant: str, compile_mode: str, ckpt: bool, phases: list[str],
               steps: int, iters: int, force: str | None, device: str, dtype, train_calls: int = 3) -> dict:
    """One configuration on its own: prepared, timed, finished; its row."""
    with contextlib.ExitStack() as stack:
        p = prepare(model_name, shape, variant, compile_mode, ckpt, phases, steps, force, device, dtype, stack)
        time_alone(p, iters, train_calls)
    return finish(p)


def prepare(model_name: str, shape: dict, variant: str, compile_mode: str, ckpt: bool, phases: list[str],
            steps: int, force: str | None, device: str, dtype, stack: contextlib.ExitStack,
            warm_calls: int = 0, beside_others: bool = False) -> Prepared:
    """Build the model, compile it as the variant compiles it, run ``steps`` training steps (the
    losses compared with the default variant's) and the first prefill (its compile), then
    ``warm_calls`` more of each (so that a peak read now is the steady one: interleaved timing).
    The variant's contexts are entered on ``stack``: its compiles take what they change, and a
    compiled call made after ``stack`` closes runs the same code (the variants that patch
    Inductor's options pass them to torch.compile too: ``compiled``). ``beside_others``: other
    variants stay alive beside this one (interleaved timing), which a model its framework
    compiles in place, naming the backend, cannot do: a clear error then."""
    import overlap_compile as oc
    from benchmarks.models import build
    from overlap_compile.runtime import cublas_workspaces

    row: dict = {}
    # what earlier configurations of the process left allocated (compiled code, caches, the other
    # variants of an interleaved group) is not this one's: its peak counts from here
    base = 0
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.synchronize()
        # cuBLAS keeps a workspace per (handle, stream) from the first GEMM on it: made before this
        # point (the process's first configuration builds its model's weights with GEMMs around)
        # it would fall in the base and out of this configuration's peak, which every later one
        # then counts again. Released here, each configuration's peak holds its own, as it would
        # in a process of its own
        cublas_workspaces.release()
        base = torch.cuda.memory_allocated()
    row["mem_base_gib"] = base / 2**30
    built = build(model_name, {**shape, **SIZE_CHANGES.get(variant, {})}, device, dtype, seed=0)
    if beside_others and built.compile_with is not None:
        raise ValueError(f"{model_name} is compiled in place by its framework, which names the backend: its "
                         "variants cannot live side by side in one process (interleaved timing); time it "
                         "one variant at a time, in processes of their own (e2e.py --isolate)")
    if hasattr(built.model, "moe"):  # what the bound changed is visible in its row
        row["capacity_factor"] = built.model.moe.cf
    model = Checkpointed(built.model) if ckpt else built.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    report = oc.Report()
    watch = CompileWatch()
    # CUDA-graph trees reuse output memory across replays: a new step must be announced
    step_begin = torch.compiler.cudagraph_mark_step_begin if compile_mode == "reduce-overhead" else (lambda: None)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    records = RecordsSince(report)
    stack.enter_context(framework_mode(built, compile_mode))
    nocomm_pass, options = stack.enter_context(variant_context(variant))
    fn, overrides = compiled(model, variant, compile_mode, force, report, built.compile_with, options)
    finalize_grads = built.finalize_grads
    if nocomm_pass is not None:  # the bounds: no gradient all-reduce outside the graphs either
        from benchmarks.nocomm import STANDINS, without_eager_all_reduce

        finalize_grads = without_eager_all_reduce(finalize_grads, nocomm_pass.replaced)
        row["nocomm_replaced"] = nocomm_pass.replaced  # the same Counter: what later compiles replace counts too
        row["nocomm_standins"] = STANDINS

    def train_step() -> torch.Tensor:
        step_begin()
        with oc.config.patch(**overrides):
            y = fn(built.x)
            loss = built.to_local(y).float().pow(2).mean()
            loss.backward()
        finalize_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def prefill():
        step_begin()
        with torch.no_grad(), oc.config.patch(**overrides):
            return fn(built.x)

    if "train" in phases:
        t0 = time.perf_counter()
        losses = [train_step()]
        sync()
        row["compile_s"] = time.perf_counter() - t0  # less one step's time once it is timed (finish)
        losses += [train_step() for _ in range(steps - 1)]
        row["losses"] = [mean_over_ranks(v) for v in losses]
        for _ in range(warm_calls):
            train_step()
        row["tokens"] = built.tokens
    if built.compile_with is not None:
        records.collect()
    train_graphs = len(report.records)  # the graphs compiled so far are the training step's

    def start_prefill(warm: int) -> None:
        """The first prefill (its compile), then ``warm`` more."""
        t0 = time.perf_counter()
        prefill()
        sync()
        row["prefill_compile_s"] = time.perf_counter() - t0
        for _ in range(warm):
            prefill()
        row["tokens"] = built.tokens
        if built.compile_with is not None:
            records.collect()

    p = Prepared(row, train_step if "train" in phases else None, prefill if "prefill" in phases else None,
                 watch, report, train_graphs, variant, base, start_prefill if "prefill" in phases else None)
    if warm_calls:  # side by side: every call compiled and warm before any is timed, the peak read now
        if p.start_prefill is not None:
            p.start_prefill(warm_calls)
            p.start_prefill = None
        sync()
        _read_memory(row, variant, base)
    return p


def time_alone(p: Prepared, iters: int, train_calls: int) -> None:
    """Time one prepared configuration by itself (``time_ms``): a training loop's steps back to
    back (``train_ms``), one step after a barrier (``train_cold_ms``), then the first prefill
    (its compile) and prefill (``prefill_ms``)."""
    if p.train_step is not None:
        p.watch.start_timed()
        calls_before = op_graph_counts()  # over the timed steps, warm-up included
        # a training loop's steady state: steps back to back, the next one queued while this
        # one runs; one step after a barrier starts from an idle GPU, and its first collective
        # waits for the slower rank's host to get there, a wait nocomm never pays
        p.row["train_ms"] = time_ms(p.train_step, iters, warmup=2, calls=train_calls)
        p.row["train_calls"] = train_calls
        p.row["train_cold_ms"] = time_ms(p.train_step, iters, warmup=0, calls=1)
        p.row["op_graph_calls"] = op_graph_calls_since(calls_before)
        p.recompiles += p.watch.compiled_since_mark()
    if p.prefill is not None:
        if p.start_prefill is not None:
            p.start_prefill(0)
            p.start_prefill = None
        p.watch.start_timed()
        p.row["prefill_ms"] = time_ms(p.prefill, iters, warmup=2)
        p.recompiles += p.watch.compiled_since_mark()


def time_together(prepared: list[Prepared], iters: int, train_calls: int) -> None:
    """Time prepared configurations side by side (``timing.time_interleaved``: one sample of each
    per round, the order reversed every other round), each phase in turn; each row's time is
    the median of its samples, every sample kept in ``<phase>_ms_rounds`` (round i of every row
    was taken side by side: ``e2e_report.compare`` takes ratios round by round), and the row
    says ``interleaved``: the names of the group's variants."""
    for p in prepared:
        p.watch.start_timed()
    calls_before = op_graph_counts()  # the template ops' calls: the overlap variant's
    names = [p.variant for p in prepared]
    phases = (("train_ms", "train_step", train_calls, 2), ("train_cold_ms", "train_step", 1, 0),
              ("prefill_ms", "prefill", 1, 2))
    for key, call, calls, warmup in phases:
        fns = {p.variant: getattr(p, call) for p in prepared if getattr(p, call) is not None}
        if not fns:
            continue
        # side by side the ops' buffers move with the others' calls: warm up until their graphs settle
        got = time_interleaved(fns, iters, warmup=warmup, calls=calls, settle=op_graph_progress)
        for p in prepared:
            if p.variant in got:
                p.row[key] = statistics.median(got[p.variant])
                p.row[f"{key[:-3]}_ms_rounds"] = got[p.variant]
                if key == "train_ms":
                    p.row["train_calls"] = train_calls
    calls = op_graph_calls_since(calls_before)
    for p in prepared:
        p.row["interleaved"] = names
        p.recompiles += p.watch.compiled_since_mark()
        if p.train_step is not None and p.variant == "overlap":
            p.row["op_graph_calls"] = calls


def _read_memory(row: dict, variant: str, base: int) -> None:
    """The configuration's peak so far (from its start), symmetric buffers of the overlap variant
    included (``peak_mem_gib``)."""
    if not torch.cuda.is_available():
        return
    from overlap_compile.runtime import op_graphs, symm

    # the overlap variant's peak counts what the library holds: its symmetric buffers that torch
    # maps outside the caching allocator (kept for the life of the process, so alive at that
    # peak too), and beside it the template ops' graph pool (reserved for their replays). The
    # variants after it in a process leave them out: not theirs (e2e releases nothing between).
    ours = variant == "overlap"
    row["symm_outside_gib"] = symm.bytes_outside_allocator() / 2**30 if ours else 0.0
    row["peak_mem_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30 + row["symm_outside_gib"]
    if ours:
        row["op_graphs_gib"] = op_graphs.pool_bytes(torch.cuda.current_device()) / 2**30
        row["op_graphs_declined"] = len(op_graphs.declined())  # sites whose buffers never settled


def finish(p: Prepared) -> dict:
    """What is read once the timing is done: compile times less one call, tokens/s, recompiles
    and op-graph calls over the timing, the nocomm pass's counts, the peak memory (unless
    ``prepare`` read it), the overlap pass's sites; the row."""
    row, report = p.row, p.report
    if "train_ms" in row:
        row["compile_s"] = max(0.0, row["compile_s"] - row["train_ms"] / 1e3)
        row["tokens_per_s"] = row["tokens"] / (row["train_ms"] / 1e3)
    if "prefill_ms" in row:
        row["prefill_compile_s"] = max(0.0, row["prefill_compile_s"] - row["prefill_ms"] / 1e3)
        row["prefill_tokens_per_s"] = row["tokens"] / (row["prefill_ms"] / 1e3)
    row.pop("tokens", None)
    row.update(p.watch.summary(p.recompiles))
    if "nocomm_replaced" in row:
        row["nocomm_replaced"] = dict(row["nocomm_replaced"])
    if "peak_mem_gib" not in row:
        _read_memory(row, p.variant, p.base)
    if p.variant == "overlap":
        # "measured": the sites settled by measuring (passes/settle.py), or with
        # OVERLAP_COMPILE_SEARCH=measure every site's measured and predicted gain; comm_ms /
        # hidden_ms / chosen_ms: the predicted parts benchmarks/plan.py's forecast adds up
        row["sites"] = [{"graph": s.graph, "phase": "train" if i < p.train_graphs else "prefill", "kind": s.kind,
                         "template": s.template, "rewritten": s.rewritten, "reason": s.reason, "gemms": s.gemms,
                         "predicted_ms": s.predicted_ms, "measured": s.measured, "comm_ms": s.comm_ms,
                         "hidden_ms": s.hidden_ms, "chosen_ms": s.chosen_ms, "host_clock": s.host_clock,
                         "baseline_host_ms": s.baseline_host_ms, "chosen_host_ms": s.chosen_host_ms}
                        for i, rec in enumerate(report.records) for s in rec.sites]
        row["rewritten"] = sum(s.rewritten for s in report.sites)
        row["pass_s"] = report.pass_seconds
        compile_s = row.get("compile_s", 0.0) + row.get("prefill_compile_s", 0.0)
        row["pass_share_of_compile"] = report.pass_seconds / compile_s if compile_s > 0 else None
    return row


def second_compile_hits(model_name, shape, compile_mode, force, device, dtype) -> int:
    """Compile the overlap variant twice (dynamo reset between) with the FX graph cache on: hits
    on the second compile, counted by Inductor. The backend is given no Report of its own (its
    records go to the global one): a compile given one runs with the caches off."""
    import overlap_compile as oc
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from benchmarks.models import build

    def once():
        torch._dynamo.reset()
        built = build(model_name, shape, device, dtype, seed=0)
        with framework_mode(built, compile_mode):
            fn, overrides = compiled(built.model, "overlap", compile_mode, force, None, built.compile_with)
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
