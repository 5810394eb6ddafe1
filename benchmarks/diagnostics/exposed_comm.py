"""Where a training step's exposed communication sits, per collective: an e2e model (benchmarks/
models) compiled as benchmarks/e2e_run.py compiles it, one variant at a time (default, overlap,
nocomm, ...), warmed up, then 1-3 steps profiled on every rank with torch.profiler.

    torchrun --nproc-per-node 2 benchmarks/diagnostics/exposed_comm.py --model dtensor_gqa_8b \\
        --mode reduce-overhead --variants default,overlap,nocomm --out $OUT
    python benchmarks/diagnostics/exposed_comm.py --dry-run      # CPU, gloo, world 2, tiny shapes

Each profiled step starts with a marker all-reduce (fp64, in an ``exposed_comm.marker`` range):
its end is the step's time zero on every rank, so the ranks' timelines line up. GPU work is
communication when it is an NCCL kernel, a peer copy, a device copy off the compute stream, or a
template's flag / wait kernel (``COMM_KERNELS``); the rest is compute. Per collective site of the
step: communication time, the part under compute (hidden), the rest (exposed), the template, the
predicted gain and the measured one (exposed as written, in the default variant, minus exposed
here). The step's row also has each rank's idle and exposed time, the template ops' host-launched
outcomes over the timed steps (runtime.op_graphs) and compute kernel time summed per role
(``ROLES``) with rank 0's top kernels: a per-kernel sum compares only between variants at the same
place in the process (the GPUs' clocks fall as they heat). ``attribution``: "by range" (launched
inside the template op's call, which the dispatcher records as a profiler range; not under CUDA
graphs), "by order" (the step's communication kernels
in issue order against the graphs' collectives in graph order), "unmapped". Dry run: the
"kernels" are CPU ops (c10d calls, outermost aten ops), the times no GPU's. Writes
exposed_comm-<device>-w<W>-torch<v>-<date>-<model>-<mode>.json, .md and a stacked-bar .png.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root

from benchmarks.diagnostics.ranks import as_rank, under_torchrun  # noqa: E402

MARKER = "exposed_comm.marker"
ALIGN = "AllReduce_Sum_f64"  # the marker's NCCL kernel: no step all-reduces fp64
# GPU work that moves data between ranks or waits for it (besides NCCL and peer copies), by name:
# the templates' flag, wait and push kernels (runtime/spin_wait.py, tile_fused/jit_kernels.py)
COMM_KERNELS = ("nccl", "wait_kernel", "_notify_kernel", "_barrier_kernel", "_push_kernel")
# device activities that are no work of the GPU's (synchronisation records)
NOT_WORK = ("Event Sync", "Stream Sync", "Stream Wait", "Context Sync", "Device Sync")
OUTSIDE = "outside the graphs"
UNMAPPED = "unmapped"
TOP_KERNELS = 25  # compute kernels kept per variant, most time first
# what a compute kernel does, by name (first match wins): where a variant's extra compute goes
ROLES = (("attention", ("flash", "fmha", "attention", "sdpa")),  # before gemm: cuDNN's carry "sm90_"
         ("gemm", ("gemm", "cutlass", "nvjet", "sm90_", "xmma", "cublas", "bmm")),
         ("copy", ("memcpy", "memset", "copy_kernel", "direct_copy")),
         ("fused (triton)", ("triton_",)))


# ---- interval arithmetic (pure) ------------------------------------------------------------------


def union(intervals) -> list[tuple[float, float]]:
    """The sorted, disjoint union of (start, end) intervals; touching ones merge, empty ones go."""
    out: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals) -> float:
    """Total time covered by ``intervals`` (overlaps counted once)."""
    return sum(e - s for s, e in union(intervals))


def intersect(a, b) -> list[tuple[float, float]]:
    """Time covered by both ``a`` and ``b``, as a union."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[tuple[float, float]]:
    """Time covered by ``a`` and not by ``b``, as a union."""
    out = []
    b = union(b)
    for s, e in union(a):
        for bs, be in b:
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
            if s >= e:
                break
        if e > s:
            out.append((s, e))
    return out


def hidden_and_exposed(comm, compute) -> tuple[float, float]:
    """(hidden, exposed) of communication intervals ``comm`` against ``compute``: hidden is the
    communication time some compute ran beside, exposed the rest (nothing else ran then)."""
    hidden = length(intersect(comm, compute))
    return hidden, length(comm) - hidden


# ---- what ran ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Event:
    """One piece of device work (a CPU op on the dry run), times in us. ``launch``: the host op
    that launched it as (thread, host time), where the profiler linked them."""

    name: str
    stream: int
    start: float
    end: float
    comm: bool = False
    collective: str | None = None
    launch: tuple[int, float] | None = None
    marker: bool = False
    site: str | None = None
    how: str = UNMAPPED


def role(name: str) -> str:
    """A compute kernel's role (ROLES), "other" when no name part matches."""
    low = name.lower()
    return next((r for r, parts in ROLES if any(p in low for p in parts)), "other")


def collective_of(name: str) -> str | None:
    """The collective an NCCL kernel, c10d op or graph target performs, from its name (NCCL's
    all-to-all is a SendRecv kernel: "send_recv"); None for anything else."""
    n = name.lower().replace("_", "")
    for key, coll in (("reducescatter", "reduce_scatter"), ("allgather", "all_gather"), ("allreduce", "all_reduce"),
                      ("alltoall", "all_to_all"), ("sendrecv", "send_recv"), ("send", "send_recv"),
                      ("recv", "send_recv"), ("broadcast", "broadcast"), ("barrier", "barrier")):
        if key in n:
            return coll
    return None


def comm_kernel(name: str, stream: int, compute_stream: int | None) -> bool:
    """Whether a GPU activity is communication: NCCL and the templates' flag / wait kernels by
    name, every peer copy, and device-to-device copies off the compute stream (copy-engine
    transfers the templates issue on their own streams)."""
    if any(k in name for k in COMM_KERNELS) or name.startswith("Memcpy PtoP"):
        return True
    return name.startswith("Memcpy DtoD") and compute_stream is not None and stream != compute_stream


def compute_stream_of(events: list[Event]) -> int | None:
    """The stream with the most non-communication time: the compute stream."""
    busy: dict[int, float] = {}
    for e in events:
        if not any(k in e.name for k in COMM_KERNELS) and not e.name.startswith("Memcpy"):
            busy[e.stream] = busy.get(e.stream, 0.0) + e.end - e.start
    return max(busy, key=busy.get) if busy else None


def outermost(ops: list[Event]) -> list[Event]:
    """The ops no other op of the same thread (``stream``) encloses."""
    out, open_end = [], {}
    for op in sorted(ops, key=lambda o: (o.stream, o.start, -o.end)):
        if op.start >= open_end.get(op.stream, float("-inf")):
            out.append(op)
            open_end[op.stream] = op.end
    return out


@dataclasses.dataclass
class Range:
    """A host range: a template op's call or a step's marker."""

    name: str
    thread: int
    start: float
    end: float


def _kineto(prof) -> list:
    return list(prof.profiler.kineto_results.events())


def host_ranges(kev) -> list[Range]:
    """The template ops' calls ("overlap_compile::<op>", recorded by the dispatcher, or a range
    named "overlap_compile.<...>") and the markers, from the profile's CPU events."""
    out = []
    for k in kev:
        name = k.name()
        if k.device_type() == torch.autograd.DeviceType.CPU and (name.startswith("overlap_compile") or name == MARKER):
            start = k.start_ns() / 1e3
            out.append(Range(name, k.start_thread_id(), start, start + k.duration_ns() / 1e3))
    return sorted(out, key=lambda r: r.start)


def gpu_events(kev) -> list[Event]:
    """Every kernel, copy and memset of the profile with its stream and launching host op; user
    annotations (ranges drawn on the GPU timeline) and synchronisation records left out."""
    cpu = [k for k in kev if k.device_type() == torch.autograd.DeviceType.CPU]
    # a kernel links to the torch op that launched it; the runtime calls ("cuda...", "cu...") keep
    # ids of their own, looked up only where no op has the id (both sit inside the op's range)
    ops = {k.correlation_id(): k for k in cpu if k.name().startswith("cu")}
    ops.update({k.correlation_id(): k for k in cpu if not k.name().startswith("cu")})
    ranges = {k.name() for k in cpu if k.is_user_annotation()}  # their GPU-side copies are no work either
    out = []
    for k in kev:
        name = k.name()
        if (k.device_type() != torch.autograd.DeviceType.CUDA or k.is_user_annotation() or k.duration_ns() <= 0
                or name.startswith(NOT_WORK) or name in ranges):
            continue
        op = ops.get(k.linked_correlation_id()) if k.linked_correlation_id() else None
        start = k.start_ns() / 1e3
        out.append(Event(name, k.device_resource_id(), start, start + k.duration_ns() / 1e3,
                         launch=(op.start_thread_id(), op.start_ns() / 1e3) if op is not None else None))
    compute = compute_stream_of(out)
    for e in out:
        e.comm = comm_kernel(e.name, e.stream, compute)
        e.collective = collective_of(e.name) if "nccl" in e.name.lower() else None
        e.marker = ALIGN in e.name
    return out


def cpu_events(kev) -> list[Event]:
    """The dry run's stand-in for kernels: each c10d collective call (communication, launched by
    itself) and the outermost other aten ops of the calling threads (compute)."""
    ops = [Event(k.name(), k.start_thread_id(), k.start_ns() / 1e3, (k.start_ns() + k.duration_ns()) / 1e3)
           for k in kev if k.device_type() == torch.autograd.DeviceType.CPU and not k.is_user_annotation()]
    comm = [o for o in ops if o.name.startswith("c10d::")]
    for o in comm:
        o.comm, o.collective, o.launch = True, collective_of(o.name), (o.stream, o.start)
    threads = {o.stream for o in comm}
    # aten ops inside a collective call are the collective's; enclosing ranges (compiled regions,
    # template calls) are no work of their own
    calls = [o for o in ops if o.stream in threads and o.name.startswith(("aten::", "c10d::", "_c10d"))]
    compute = [o for o in outermost(calls) if o.name.startswith("aten::")]
    ranges = [r for r in host_ranges(kev) if r.name == MARKER]
    for o in comm:
        o.marker = any(r.thread == o.stream and r.start <= o.start <= r.end for r in ranges)
    return comm + compute


# ---- which site each communication kernel belongs to -----------------------------------------------


@dataclasses.dataclass
class Expected:
    """One collective of the step in graph order: ``rewritten`` sites run a template op (any
    number of communication kernels), the others one kernel of their collective."""

    label: str
    collective: str | None
    rewritten: bool
    template: str = "baseline"
    site: object = None  # the overlap Report's SiteReport, where the pass saw this collective


def fits(collective: str | None, want: Expected) -> bool:
    if want.rewritten:  # a template's copies and flag kernels carry no collective
        return collective is None or want.collective is None or collective in (want.collective, "send_recv")
    return collective == want.collective or (want.collective == "all_to_all" and collective == "send_recv")


def match_by_order(events: list[tuple[str | None, int]], expected: list[Expected],
                   known_streams: set | None = None) -> list[tuple[int | None, str]]:
    """(index into ``expected`` or None, how) per communication kernel ``(collective, stream)``,
    kernels in issue order. A collective as written takes the next kernel of its kind; a
    rewritten site takes every fitting kernel until the next collective as written matches. When
    a kernel fits both, the stream tells (``known_streams``: those the collectives as written ran
    on), else the rewritten site keeps it ("by order, ambiguous")."""
    streams = set(known_streams or ())
    out, i = [], 0
    for coll, stream in events:
        j, candidate = i, None
        while j < len(expected) and expected[j].rewritten:
            if candidate is None and fits(coll, expected[j]):
                candidate = j
            j += 1
        fixed = j if j < len(expected) and fits(coll, expected[j]) else None
        if fixed is not None and (candidate is None or stream in streams):
            out.append((fixed, "by order"))
            streams.add(stream)
            i = fixed + 1
        elif candidate is not None:
            out.append((candidate, "by order" if fixed is None or streams else "by order, ambiguous"))
            i = candidate
        else:
            out.append((None, UNMAPPED))
    return out


def attribute(events: list[Event], ranges: list[Range], expected: list[Expected], marker_streams: set) -> None:
    """Set ``site`` and ``how`` of one step's communication events (issue order): a kernel
    launched inside the k-th template call of the step belongs to the k-th rewritten site ("by
    range"); the others by order (``match_by_order``), the collectives after the graphs' last
    (eager gradient reductions) to ``OUTSIDE``."""
    rewritten = [x for x in expected if x.rewritten]
    templates = {x.template for x in rewritten}
    calls = [r for r in ranges if r.name != MARKER and any(t in r.name for t in templates)]
    calls = [c for c in calls if not any(o is not c and o.thread == c.thread and o.start <= c.start and c.end <= o.end
                                         for o in calls)]  # a call's own inner ranges are no calls
    rest = []
    for e in events:
        call = None
        if e.launch is not None:
            inside = [k for k, r in enumerate(calls) if r.thread == e.launch[0] and r.start <= e.launch[1] <= r.end]
            call = inside[-1] if inside else None  # the innermost: a range inside the op's own
        if call is not None and call < len(rewritten) and rewritten[call].template in calls[call].name:
            e.site, e.how = rewritten[call].label, "by range"
        else:
            rest.append(e)
    tail = Expected(OUTSIDE, None, True, template="-")
    # the marker ran on the default group's stream, where collectives as written run too
    got = match_by_order([(e.collective, e.stream) for e in rest], expected + [tail], marker_streams)
    for e, (k, how) in zip(rest, got):
        e.site, e.how = ((expected + [tail])[k].label, how) if k is not None else (UNMAPPED, UNMAPPED)
    # more collectives after the graphs than in them: a graph ran more often than it was compiled
    # (one block's graph for every layer), so the order says little
    if sum(e.site == OUTSIDE and e.collective is not None for e in rest) > sum(not x.rewritten for x in expected):
        for e in rest:
            e.how = "by order, ambiguous" if e.how == "by order" else e.how


# ---- the graphs' collectives ---------------------------------------------------------------------


def _recorder_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class CollectiveRecorder(CustomGraphPass):
        """Inductor's post-grad pre-pass: each graph's collectives in graph order, before any
        post pass (the overlap pass, nocomm) changes them. Reads only."""

        def __init__(self) -> None:
            self.graphs: list[tuple[str, list[tuple[str, str | None]]]] = []

        def __call__(self, graph) -> None:
            from overlap_compile.passes.pipeline import graph_role

            nodes = [(n.name, collective_of(str(n.target))) for n in graph.nodes
                     if n.op == "call_function" and str(n.target).startswith("_c10d_functional")
                     and "wait_tensor" not in str(n.target)]
            self.graphs.append((graph_role(graph), nodes))

        def __deepcopy__(self, memo):  # Inductor copies its config: keep recording into this one
            return self

        def uuid(self):
            return None  # no cache key: the caches are off anyway (the graphs must be seen)

    return CollectiveRecorder()


def expected_sites(graphs, records) -> list[Expected]:
    """The step's collectives in issue order: each recorded graph's (forward, then backward as
    compiled), joined with the overlap Report's sites of the same graph (``records``, aligned by
    position when the counts agree). A collective that a rewritten site absorbed (no longer in the
    graph after the pass, e.g. a MoE combine) gets no entry."""
    out, seen = [], {}
    aligned = len(records) == len(graphs)
    for g, (role, nodes) in enumerate(graphs):
        seen[role] = seen.get(role, -1) + 1
        name = role if seen[role] == 0 else f"{role}_{seen[role]}"
        rec = records[g] if aligned else None
        sites = {s.node: s for s in rec.sites} if rec is not None else {}
        for node, coll in nodes:
            s = sites.get(node)
            label = f"{name}:{node}"
            if s is not None and s.rewritten:
                out.append(Expected(label, coll, True, s.template, s))
            elif rec is None or rec.after == rec.before or re.search(rf"\b{re.escape(node)} = ", rec.after):
                out.append(Expected(label, coll, False, site=s))
    return out


# ---- one rank's measurement ------------------------------------------------------------------------


def measure(events: list[Event], ranges: list[Range], expected: list[Expected]) -> dict:
    """One rank's profiled steps: per step window (a marker's end to the next marker's start),
    the summary (compute busy, communication, hidden, exposed, idle; ms per step) and per site
    its communication, hidden and exposed time and when its first kernel started (from the
    step's time zero). Sites in ``expected`` order, then ``OUTSIDE`` and ``UNMAPPED``."""
    markers = sorted((e for e in events if e.marker), key=lambda e: e.start)
    host_marks = [r for r in ranges if r.name == MARKER]
    steps = len(markers)
    total = dict.fromkeys(("span_ms", "compute_ms", "comm_ms", "hidden_ms", "exposed_ms", "idle_ms"), 0.0)
    sites: dict[str, dict] = {}
    roles: dict[str, float] = {}
    kernels: dict[str, list] = {}
    for s, m in enumerate(markers):
        t0 = m.end
        t1 = markers[s + 1].start if s + 1 < steps else max(e.end for e in events)
        h0 = host_marks[s].end if s < len(host_marks) else float("-inf")
        h1 = host_marks[s + 1].start if s + 1 < len(host_marks) else float("inf")
        work = [e for e in events if not e.marker and t0 <= e.start < t1]
        comm = sorted((e for e in work if e.comm), key=lambda e: e.start)
        attribute(comm, [r for r in ranges if h0 <= r.start < h1], expected, {m.stream for m in markers})
        compute = [(e.start, e.end) for e in work if not e.comm]
        for e in (e for e in work if not e.comm):  # kernel time summed (streams overlap), per role and name
            ms, r = (e.end - e.start) / 1e3 / steps, role(e.name)
            roles[r] = roles.get(r, 0.0) + ms
            k = kernels.setdefault(e.name, [0.0, 0.0])
            k[0] += ms
            k[1] += 1 / steps
        hidden, exposed = hidden_and_exposed([(e.start, e.end) for e in comm], compute)
        span = (max(e.end for e in work) - t0) if work else 0.0
        for key, v in (("span_ms", span), ("compute_ms", length(compute)), ("comm_ms", hidden + exposed),
                       ("hidden_ms", hidden), ("exposed_ms", exposed),
                       ("idle_ms", span - length([(e.start, e.end) for e in work]))):
            total[key] += v / 1e3 / steps
        for label in dict.fromkeys(e.site for e in comm):
            mine = [e for e in comm if e.site == label]
            h, x = hidden_and_exposed([(e.start, e.end) for e in mine], compute)
            row = sites.setdefault(label, {"events": 0.0, "comm_ms": 0.0, "hidden_ms": 0.0, "exposed_ms": 0.0,
                                           "start_ms": 0.0, "how": set()})
            row["events"] += len(mine) / steps
            row["how"] |= {e.how for e in mine}
            for key, v in (("comm_ms", h + x), ("hidden_ms", h), ("exposed_ms", x), ("start_ms", mine[0].start - t0)):
                row[key] += v / 1e3 / steps
    order = [x.label for x in expected] + [OUTSIDE, UNMAPPED]
    for row in sites.values():  # the weakest tie of any of its kernels
        row["how"] = next(h for h in (UNMAPPED, "by order, ambiguous", "by order", "by range") if h in row["how"])
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    return {"steps": steps, **total, "roles_ms": roles,
            "top_kernels": [{"name": n[:160], "ms": v[0], "count": v[1]} for n, v in top],
            "sites": {k: sites[k] for k in sorted(sites, key=order.index)}}


# ---- running a variant -----------------------------------------------------------------------------


def run_variant(a, model_name: str, shape: dict, variant: str, device: str, dtype) -> dict:
    """One variant on this rank: built, compiled as e2e_run compiles it, warmed up, timed, then
    ``a.steps`` steps profiled. Returns this rank's measurement, the expected sites, the step time."""
    import overlap_compile as oc
    from overlap_compile.compile_caches import no_compile_caches
    from torch._inductor import config as inductor_config
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.e2e_run import SIZE_CHANGES, RecordsSince, compiled, framework_mode, variant_context
    from benchmarks.timing import op_graph_calls_since, op_graph_counts
    from benchmarks.models import build

    torch._dynamo.reset()
    built = build(model_name, {**shape, **SIZE_CHANGES.get(variant, {})}, device, dtype, seed=0)
    opt = torch.optim.AdamW(built.model.parameters(), lr=1e-4)
    report, recorder = oc.Report(), _recorder_class()
    records = RecordsSince(report)
    cuda = device.startswith("cuda")
    # CUDA-graph trees reuse output memory across replays: each step is announced
    step_begin = torch.compiler.cudagraph_mark_step_begin if a.mode == "reduce-overhead" else (lambda: None)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with no_compile_caches(), inductor_config.patch(post_grad_custom_pre_pass=recorder), \
            framework_mode(built, a.mode), variant_context(variant) as (nocomm_pass, options):
        fn, overrides = compiled(built.model, variant, a.mode, a.force, report, built.compile_with, options)
        finalize = built.finalize_grads
        if nocomm_pass is not None:  # the bound: no eager gradient all-reduce either
            from benchmarks.nocomm import without_eager_all_reduce

            finalize = without_eager_all_reduce(finalize, nocomm_pass.replaced)

        def step() -> None:
            step_begin()
            with oc.config.patch(**overrides):
                loss = built.to_local(fn(built.x)).float().pow(2).mean()
                loss.backward()
            finalize()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        sync()
        calls_before = op_graph_counts()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            step()
        sync()
        step_ms = (time.perf_counter() - t0) * 1e3 / a.iters
        timed_calls = op_graph_calls_since(calls_before)
        dist.barrier()
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(a.steps):
                with record_function(MARKER):  # the step's time zero on every rank
                    dist.all_reduce(torch.ones(1, dtype=torch.float64, device=device))
                step()
            sync()
        profiled_calls = op_graph_calls_since(calls_before)
        if built.compile_with is not None:
            records.collect()
    kev = _kineto(prof)
    ranges = host_ranges(kev)
    events = gpu_events(kev) if cuda else cpu_events(kev)
    expected = expected_sites(recorder.graphs, report.records if variant == "overlap" else [])
    got = measure(events, ranges, expected)
    got["step_ms"] = step_ms
    # host-launched template ops replayed from graphs (runtime/op_graphs): a capture in a timed or
    # profiled step is host time the step pays
    got["op_graph_calls"] = {"timed": timed_calls, "timed_and_profiled": profiled_calls}
    if nocomm_pass is not None:
        got["nocomm_replaced"] = dict(nocomm_pass.replaced)
    return {"measured": got, "expected": [_expected_row(x) for x in expected]}


def _expected_row(x: Expected) -> dict:
    """What the rows say about a site besides its times: its collective, template and the
    pass's prediction (predicted gain = predicted as written - predicted chosen)."""
    s = x.site
    graph, node = x.label.split(":", 1)
    row = {"site": x.label, "graph": graph, "node": node, "collective": x.collective, "template": x.template,
           "site_kind": getattr(s, "kind", None)}
    if s is not None:
        base, chosen = s.predicted_ms.get("baseline"), s.chosen_ms
        row.update(predicted_ms=s.predicted_ms, predicted_comm_ms=s.comm_ms, predicted_hidden_ms=s.hidden_ms,
                   predicted_gain_ms=(base - chosen) if base is not None and chosen is not None else None,
                   measured=s.measured, reason=s.reason)
    return row


# ---- rows, table, plot -----------------------------------------------------------------------------

SUMMARY = "(step)"


def rows_of(per_rank: list[dict], base: dict) -> list[dict]:
    """One variant's rows from every rank's ``run_variant``: a summary row (site "(step)") and
    one per site, each time the mean over ranks (per rank in ``*_ranks``); ``start_spread_ms``:
    how much later the last rank's first kernel of the site started than the first rank's."""
    ms = [r["measured"] for r in per_rank]
    keys = ("span_ms", "compute_ms", "comm_ms", "hidden_ms", "exposed_ms", "idle_ms")
    summary = {**base, "site": SUMMARY, "step_ms": max(m["step_ms"] for m in ms), "steps": ms[0]["steps"],
               **{k: sum(m[k] for m in ms) / len(ms) for k in keys},
               "exposed_ms_ranks": [m["exposed_ms"] for m in ms], "idle_ms_ranks": [m["idle_ms"] for m in ms],
               "op_graph_calls_ranks": [m.get("op_graph_calls") for m in ms]}
    names = dict.fromkeys(r for m in ms for r in m.get("roles_ms", {}))
    summary["compute_roles_ms"] = {r: sum(m["roles_ms"].get(r, 0.0) for m in ms) / len(ms) for r in names}
    summary["top_kernels_rank0"] = ms[0].get("top_kernels", [])
    if "nocomm_replaced" in ms[0]:
        summary["nocomm_replaced"] = ms[0]["nocomm_replaced"]
    info = {x["site"]: x for x in per_rank[0]["expected"]}
    rows = [summary]
    for label in dict.fromkeys(k for m in ms for k in m["sites"]):
        got = [m["sites"].get(label) for m in ms]
        have = [g for g in got if g is not None]
        row = {**base, **info.get(label, {"site": label, "template": None}),
               "attribution": next(h for h in (UNMAPPED, "by order, ambiguous", "by order", "by range")
                                   if any(g["how"] == h for g in have)),
               "events": have[0]["events"],
               **{k: sum(g[k] for g in have) / len(ms) for k in ("comm_ms", "hidden_ms", "exposed_ms")},
               "exposed_ms_ranks": [g["exposed_ms"] if g else 0.0 for g in got],
               "start_spread_ms": (max(g["start_ms"] for g in have) - min(g["start_ms"] for g in have))
               if len(have) == len(got) else None}
        rows.append(row)
    return rows


def add_gains(rows: list[dict]) -> None:
    """Per site of each (model, mode): ``exposed_as_written_ms`` (the default variant's exposed
    time of the same site) and ``measured_gain_ms`` (that minus this variant's)."""
    written = {(r["model"], r["compile_mode"], r["site"]): r["exposed_ms"] for r in rows
               if r.get("variant") == "default" and "exposed_ms" in r}
    for r in rows:
        w = written.get((r["model"], r["compile_mode"], r["site"]))
        if w is not None and "exposed_ms" in r:
            r["exposed_as_written_ms"], r["measured_gain_ms"] = w, w - r["exposed_ms"]


def _f(v, fmt=".3f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(rows: list[dict]) -> str:
    """Per (model, mode): the variants' summaries, then their sites, most exposed first."""
    out = []
    for key in dict.fromkeys((r["model"], r["compile_mode"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["compile_mode"]) == key]
        out += [f"\n**{key[0]}, {key[1]}** (ms per step, mean over ranks)\n",
                "| variant | step | span | compute | comm | hidden | exposed | idle |", "|---" * 8 + "|"]
        for r in (r for r in mine if r["site"] == SUMMARY):
            out.append(f"| {r['variant']} | " + " | ".join(_f(r.get(k)) for k in (
                "step_ms", "span_ms", "compute_ms", "comm_ms", "hidden_ms", "exposed_ms", "idle_ms")) + " |")
        if "error" in " ".join(r.get("error", "") for r in mine):
            out += [f"- {r['variant']}: {r['error']}" for r in mine if r.get("error")]
        for r in (r for r in mine if r["site"] == SUMMARY and "idle_ms_ranks" in r):
            out.append(f"- {r['variant']}: idle per rank {', '.join(_f(v) for v in r['idle_ms_ranks'])} ms; "
                       f"exposed per rank {', '.join(_f(v) for v in r['exposed_ms_ranks'])} ms; "
                       f"host-launched op calls per rank (timed steps) "
                       f"{[{k: v for k, v in (c or {}).get('timed', {}).items() if v} for c in r['op_graph_calls_ranks']]}")
        summaries = [r for r in mine if r["site"] == SUMMARY and r.get("compute_roles_ms")]
        names = list(dict.fromkeys(k for r in summaries for k in r["compute_roles_ms"]))
        if names:  # compute kernel time per role, summed over streams: where extra compute goes
            out += ["", "| variant | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
            out += [f"| {r['variant']} | " + " | ".join(_f(r["compute_roles_ms"].get(n, 0.0)) for n in names) + " |"
                    for r in summaries]
        out += ["", "| variant | site | collective | template | attribution | kernels | comm | hidden | exposed "
                "| as written | measured gain | predicted gain |", "|---" * 12 + "|"]
        for r in sorted((r for r in mine if r["site"] != SUMMARY and "exposed_ms" in r),
                        key=lambda r: (r["variant"], -r["exposed_ms"])):
            out.append(f"| {r['variant']} | {r['site']} | {r.get('collective') or '-'} | {r.get('template') or '-'} | "
                       f"{r['attribution']} | {r['events']:g} | " + " | ".join(_f(r.get(k)) for k in (
                           "comm_ms", "hidden_ms", "exposed_ms", "exposed_as_written_ms", "measured_gain_ms",
                           "predicted_gain_ms")) + " |")
    return "\n".join(out)


# ---- the command line ------------------------------------------------------------------------------


def worker(args: dict) -> list[dict]:
    """Every rank: each variant in turn; rank 0 returns the rows (the others an empty list)."""
    import traceback

    from benchmarks.e2e import CPU_SHAPES, shape_table
    from benchmarks.models import PINNED_SHAPE

    a = argparse.Namespace(**args)
    device = "cpu" if a.dry_run else f"cuda:{torch.cuda.current_device()}"
    dtype = torch.float32 if a.dry_run else torch.bfloat16
    if a.model in PINNED_SHAPE:
        _, key, dry_key = PINNED_SHAPE[a.model]
        shape = (CPU_SHAPES[dry_key] if a.dry_run else shape_table(False)[key])
    else:
        shape = shape_table(a.dry_run)[a.shape or ("tiny" if a.dry_run else "8b")]
    base = {"benchmark": "exposed_comm", "device": "cpu" if a.dry_run else torch.cuda.get_device_name(),
            "world_size": dist.get_world_size(), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "kind": a.model, "model": a.model, "shape": shape["name"],
            "mode": "cuda_graph" if a.mode == "reduce-overhead" else "eager", "compile_mode": a.mode,
            "timing": "cpu ops (dry run)" if a.dry_run else "gpu kernels"}
    rows: list[dict] = []
    for variant in a.variants.split(","):
        cfg = {**base, "variant": variant, "method": "inductor" if variant == "default" else variant,
               "config": {"force_template": a.force} if variant == "overlap" and a.force else None}
        try:
            mine = run_variant(a, a.model, shape, variant, device, dtype)
        except Exception as e:  # recorded, the other variants still run
            mine = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        failed = [(r, m["error"]) for r, m in enumerate(everyone) if "error" in m]
        if failed:
            rows.append({**cfg, "site": SUMMARY, "error": f"rank {failed[0][0]}: {failed[0][1]}"})
            if dist.get_rank() == 0:
                print(everyone[failed[0][0]].get("trace", ""), flush=True)
        else:
            rows += rows_of(everyone, cfg)
    add_gains(rows)
    return rows if dist.get_rank() == 0 else []


def finish(rows: list[dict], a: argparse.Namespace) -> None:
    print(markdown(rows), flush=True)
    if not a.out:
        return
    from benchmarks.results_io import result_stem, write_rows

    dev, world = rows[0]["device"], rows[0]["world_size"]
    path = write_rows(rows, a.out, "exposed_comm", dev, world, suffix=f"-{a.model}-{a.mode}")
    stem = result_stem(a.out, "exposed_comm", dev, world, suffix=f"-{a.model}-{a.mode}")
    with open(stem + ".md", "w") as f:
        f.write(markdown(rows) + "\n")
    try:
        from benchmarks.plot import plot_exposed_comm

        print("wrote", plot_exposed_comm(rows, stem + ".png"))
    except ImportError as e:  # no matplotlib: the rows and the table still stand
        print(f"no plot ({e})")
    print("wrote", path)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="an e2e model (benchmarks/models; default dtensor_gqa_8b, "
                    "dry run megatron_fused_8b)")
    ap.add_argument("--shape", default=None, help="e2e shape key for an unpinned model (default 8b; dry run tiny)")
    ap.add_argument("--mode", default="default", choices=("default", "reduce-overhead"))
    ap.add_argument("--variants", default="default,overlap,nocomm",
                    help="comma list of e2e variants (default, overlap, async_tp, nocomm); default first gives "
                         "the 'as written' column")
    ap.add_argument("--force", default=None, help="overlap variant: TEMPLATE or TEMPLATE@{config json} "
                    "(dry run default: signal_reorder; on CPU the predictor keeps the baseline)")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (1-3), each after its own marker")
    ap.add_argument("--iters", type=int, default=5, help="steps timed without the profiler (step_ms)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, world 2, tiny shapes")
    ap.add_argument("--world", type=int, default=2, help="processes the dry run spawns")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args(argv)
    if not 1 <= a.steps <= 3:
        raise SystemExit(f"--steps {a.steps}: profile 1 to 3 steps")
    a.model = a.model or ("megatron_fused_8b" if a.dry_run else "dtensor_gqa_8b")
    if a.dry_run:
        a.force = a.force or "signal_reorder"
        a.variants = ",".join(v for v in a.variants.split(",") if v != "async_tp")
    return a


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse(argv)
    if under_torchrun():  # this process is one rank
        return as_rank(worker, lambda rows: finish(rows, a), vars(a), a.dry_run)
    if not a.dry_run:
        raise SystemExit("on GPUs run it under torchrun (module docstring); --dry-run spawns its own CPU ranks")
    from overlap_compile.testing.multiprocess import run_distributed

    rows = run_distributed("benchmarks.diagnostics.exposed_comm.worker", world_size=a.world, args=(vars(a),),
                           backend="gloo", timeout_s=600)[0]
    finish(rows, a)
    return rows


if __name__ == "__main__":
    main()
