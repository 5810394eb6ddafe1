"""What the pass saw and did, per compiled graph and per site: the object ``explain`` returns.

    report = oc.explain(model, x, backward=True)
    print(report)                          # one row per site
    report.sites[0].template, .reason, .predicted_ms
    report.graphs["forward"].before / .after
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from typing import Any


@dataclasses.dataclass
class SiteReport:
    kind: str
    graph: str
    node: str  # the collective node's name in the graph before the rewrite
    template: str  # chosen template, or "baseline"
    config: dict | None
    predicted_ms: dict[str, float | None]  # candidate label -> predicted ms ("baseline" included)
    reason: str
    signature: str
    gemms: list[tuple[int, int, int]]
    world_size: int
    dtype: str
    comm_bytes: int = 0
    output_fuses: bool = False  # the collective's readers fuse a permuted read (Match.output_fuses)
    workspace: dict | None = None  # bytes the rewritten site holds (TemplateSpec.workspace_bytes)
    host_clock: dict | None = None  # host-launched graphs: the site on the simulated clocks (decide.Decision)
    measured: dict | None = None  # search="measure": measured vs predicted gain (passes.decision.Decision)
    # predicted ms: the site's collective as written (all a rewrite can hide), the part of the site
    # as written that defer_compute's GEMMs hide (already off predicted_ms["baseline"]), and what
    # runs (the chosen candidate, or the site as written with that taken off)
    comm_ms: float = 0.0
    hidden_ms: float = 0.0
    chosen_ms: float | None = None
    # the host time per call inside those predictions (host-launched graphs; 0 under CUDA graphs):
    # the site as written's launches and the chosen op's
    baseline_host_ms: float = 0.0
    chosen_host_ms: float = 0.0
    # a site with a symbolic row count (passes/symbolic_decide.py): per M bucket lo, hi, the M
    # priced (at), template, config, baseline_ms, chosen_ms, reason; None for static sites
    buckets: list | None = None
    # left as written with GEMMs moved under its collective, which runs on the high-priority
    # stream (passes/prioritize.py): defer_compute's credit (hidden_ms) is then counted as hidden
    prioritized: bool = False

    @property
    def rewritten(self) -> bool:
        return self.template != "baseline"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GraphRecord:
    name: str  # "forward", "backward" (a repeated name gets a suffix: "forward_1")
    before: str
    after: str
    sites: list[SiteReport]
    profile: str | None = None
    pass_seconds: float = 0.0  # wall time of find -> decide -> rewrite on this graph (compile-time cost)
    error: str | None = None  # the pass failed on this graph and left it unchanged (why)
    # collectives left as written that got compute moved under them (passes/defer_compute.py)
    deferred: list[str] = dataclasses.field(default_factory=list)
    # of those, the collectives run on the high-priority stream, or why not (passes/prioritize.py)
    prioritized: list[str] = dataclasses.field(default_factory=list)
    # MoE dispatch buffers filled by moe_scatter_rows, or why not (passes/moe_scatter.py)
    moe_buffers: list[str] = dataclasses.field(default_factory=list)
    # every rewritten site symbolic and as written up to some M: per site (M's sympy expression,
    # that M) (passes/as_written_rows.py); calls at or below every one of them can run
    # torch.compile's own graph (row_dispatch.py)
    as_written_up_to: list | None = None
    # what the backend made of it: one line per dispatch built on this graph (row_dispatch.py); a
    # list shared by the copies Report.add makes, since the backend adds it after the pass
    dispatched: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Report:
    records: list[GraphRecord] = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, record: GraphRecord) -> None:
        """Keep ``record``; a name this report already has gets a suffix ("forward_1") on this
        report's own copy, since the same record also goes to other reports (the process-wide
        one) under the name it has there."""
        with self._lock:
            names = {r.name for r in self.records}
            name, i = record.name, 1
            while name in names:
                name = f"{record.name}_{i}"
                i += 1
            if name != record.name:
                record = dataclasses.replace(record, name=name,
                                             sites=[dataclasses.replace(s, graph=name) for s in record.sites])
            self.records.append(record)

    @property
    def pass_seconds(self) -> float:
        """Total time the overlap pass took over every recorded graph."""
        return sum(r.pass_seconds for r in self.records)

    @property
    def sites(self) -> list[SiteReport]:
        return [s for r in self.records for s in r.sites]

    @property
    def graphs(self) -> dict[str, GraphRecord]:
        return {r.name: r for r in self.records}

    def table(self) -> str:
        header = ["graph", "kind", "node", "GEMM (MxNxK)", "template", "predicted ms", "reason"]
        rows = []
        for s in self.sites:
            gemm = ", ".join("x".join(map(str, g)) for g in s.gemms)
            pred = _best_per_template(s.predicted_ms)
            reason = s.reason
            if s.workspace:
                mib = {k: v / 2**20 for k, v in s.workspace.items()}
                reason += (f" [workspace {mib.get('persistent', 0):.1f} MiB kept + {mib.get('per_call', 0):.1f} MiB per call"
                           + (f"; as written {mib['section_as_written']:.1f} MiB" if "section_as_written" in mib else "")
                           + "]")
            if s.measured:
                reason = f"{_gains(s.measured)}; {reason}"
            rows.append([s.graph, s.kind, s.node, gemm, s.template, pred, reason])
        errors = [r.error for r in self.records if r.error]
        deferred = [f"{r.name}: {d}" for r in self.records for d in r.deferred]
        streams = [f"{r.name}: {p}" for r in self.records for p in r.prioritized]
        buffers = [f"{r.name}: {b}" for r in self.records for b in r.moe_buffers]
        if not rows:
            return "\n".join(errors + deferred + streams + buffers or ["overlap_compile: no GEMM/collective sites found"])
        widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header) - 1)]
        lines = []
        for r in [header] + rows:
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + str(r[-1]))
        lines.insert(1, "-" * min(160, len(lines[0])))
        lines += errors
        lines += [f"compute under a collective left as written, {d}" for d in deferred]
        lines += [f"collective left as written, {p}" for p in streams]
        lines += buffers
        lines += [f"{r.name}: every rewritten site runs as written at "
                  + ", ".join(f"M={e} <= {m}" for e, m in r.as_written_up_to)
                  + "".join(f"; {d}" for d in r.dispatched)
                  for r in self.records if r.as_written_up_to]
        profiles = sorted({r.profile for r in self.records if r.profile})
        if profiles:
            lines.append(f"profile: {', '.join(profiles)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def forecast(self) -> dict:
        """The predicted share of the sites' collective time the pass hides (``forecast``), under
        the profile the graphs were decided with (the first recorded)."""
        profile = next((r.profile for r in self.records if r.profile), None)
        return forecast(self.sites, profile)

    def to_json(self) -> str:
        return json.dumps(
            {"graphs": [{"name": r.name, "profile": r.profile, "error": r.error, "deferred": r.deferred,
                         "prioritized": r.prioritized, "moe_buffers": r.moe_buffers,
                         "as_written_up_to": [[str(e), m] for e, m in r.as_written_up_to or []],
                         "dispatched": r.dispatched, "sites": [s.to_dict() for s in r.sites]} for r in self.records]},
            indent=2,
            default=str,
        )

    def timeline(self, site: SiteReport | int, path: str, profile: Any = None, measured_ms: float | None = None) -> str:
        """PNG Gantt chart of the site's predicted schedule (chosen candidate and baseline)."""
        from .predictor.timeline import draw_timeline

        s = self.sites[site] if isinstance(site, int) else site
        record = next((r for r in self.records if s in r.sites), None)
        return draw_timeline(s, profile or (record.profile if record else None) or "auto", path, measured_ms=measured_ms)

    def dump(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        for r in self.records:
            for which in ("before", "after"):
                with open(os.path.join(directory, f"{r.name}.{which}.py"), "w") as f:
                    f.write(getattr(r, which))
        with open(os.path.join(directory, "report.txt"), "w") as f:
            f.write(self.table() + "\n")
        with open(os.path.join(directory, "report.json"), "w") as f:
            f.write(self.to_json())
        for i, s in enumerate(self.sites):
            if s.comm_bytes:  # a site that was recognised but not analysable has no schedule to draw
                self.timeline(s, os.path.join(directory, f"timeline_{s.graph}_{i}_{s.node}.png"))
        for r in self.records:
            if any(s.host_clock for s in r.sites):
                self.host_clocks(r, os.path.join(directory, f"host_clocks_{r.name}.png"))

    def host_clocks(self, record: "GraphRecord | str", path: str) -> str:
        """PNG of a host-launched graph's sites on the simulated host and GPU clocks
        (passes/host_pacing.py): why an op's host time was hidden or exposed."""
        from .predictor.timeline import draw_host_clocks

        r = self.graphs[record] if isinstance(record, str) else record
        return draw_host_clocks(r.name, r.sites, path)


def _best_per_template(predicted: dict[str, float | None]) -> str:
    """Baseline and the best prediction of each template (the JSON keeps every candidate)."""
    best: dict[str, float] = {}
    for label, ms in predicted.items():
        if ms is not None:
            name = label.split("[", 1)[0]
            best[name] = min(ms, best.get(name, ms))
    return " ".join(f"{k}={v:.3f}" for k, v in best.items()) or "-"


_GLOBAL = Report()


def global_report() -> Report:
    """Everything the pass recorded in this process (``overlap_compile.last_report()``)."""
    return _GLOBAL


def _gains(m: dict) -> str:
    """'measured 1.12x vs predicted 1.25x (p2p_ring)': a site's gains under search="measure"."""
    if "note" in m:
        return m["note"]
    meas = "failed" if m["measured_gain"] is None else f"{m['measured_gain']:.2f}x"
    return f"measured {meas} vs predicted {m['predicted_gain']:.2f}x ({m['template']})"


_SUMMED = ("comm_ms", "hidden_ms", "deferred_ms", "band_ms", "standin_ms", "sites", "rewritten")


def standin_bytes(kind: str, gemms: list, world: int, itemsize: int) -> int:
    """Bytes (read + written) of the one local kernel that stands for a site's collective in the
    comm-free bound (benchmarks/nocomm.py): an all-gather's W copies of the shard (each read and
    written), a reduce-scatter's own chunk copied (read + written), an all-reduce's or
    all-to-all's copy; an MoE section has two all-to-alls. ``gemms``: the site's (M, N, K)."""
    if not gemms or world < 1:
        return 0
    m, n, k = (int(v) for v in gemms[0])
    full = m * (k if kind in ("allgather_gemm", "moe") else n) * itemsize  # the collective's whole buffer
    if kind == "allgather_gemm":
        return 2 * full
    if kind == "gemm_reducescatter":
        return 2 * full // world
    return (4 if kind == "moe" else 2) * full


def forecast(sites: list, profile: Any = None, world_size: int | None = None, dtype: str | None = None) -> dict:
    """Per graph and in all (``"all"``), in predicted ms:

    - ``comm_ms``: the sites' collectives as written (the profile's curves: a collective inside a
      step runs at its curve; what a step's first collective spends waiting for the slowest rank is
      no collective's price and no rewrite hides it, see benchmarks/diagnostics/forecast_check.py).
    - ``hidden_ms`` / ``hidden_share``: what the rewritten sites are predicted to save of it, the
      site as written against the chosen op (in a host-launched graph, GPU time against GPU time
      where the host's lead hides both host times); where GPUs timed a site as written and the
      chosen op (passes/settle.py, ``search="measure"``), the gain they measured.
      A site left as written whose collective passes/prioritize.py put on the high-priority
      stream beside the GEMMs defer_compute moved under it counts that credit here.
    - ``deferred_ms`` / ``with_deferred_share``: what the compute passes/defer_compute.py moves
      beside the collectives left as written, and left on the process group's stream, would hide
      if the collective ran beside it. Not in ``hidden_ms``: c10d issues the collective on a
      stream of default priority behind which the GEMMs are launched, and a GEMM may starve NCCL
      of SMs (DESIGN.md); measured training steps have come out both near and well short of it
      (benchmarks/diagnostics/forecast_check.py, benchmarks/RESULTS.md). 0 unless defer_compute
      is on.
    - ``band_ms`` / ``with_band_share``: what the sites left as written inside the model's error
      band would add if they measured as predicted (on GPUs passes/settle.py measures them).
    - ``standin_ms`` / ``gap_share``: e2e.py's "gap closed" compares with a comm-free bound in which
      each collective becomes one local copy kernel (benchmarks/nocomm.py), so the bound is short
      of the step without communication by those copies; ``gap_share`` = hidden over (comm -
      copies) forecasts that metric. ``standin_ms`` needs ``profile`` (its copy bandwidth) and each
      site's world size and dtype (``world_size`` / ``dtype`` stand in where a site lacks them);
      without them it is 0 and ``gap_share`` equals ``hidden_share``.

    ``sites``: SiteReports, or the dicts e2e.py's rows keep of them. ``profile``: a
    HardwareProfile or a profile name (predictor.loaded_profile)."""
    from .predictor.models import ITEMSIZE

    copy_gbps = _copy_gbps(profile)
    out: dict = {}
    for s in sites:
        get = s.get if isinstance(s, dict) else lambda k, s=s: getattr(s, k, None)
        g = out.setdefault(get("graph"), dict.fromkeys(_SUMMED, 0.0) | {"sites": 0, "rewritten": 0})
        predicted = get("predicted_ms") or {}
        base, chosen, comm = predicted.get("baseline"), get("chosen_ms"), get("comm_ms") or 0.0
        if base is None or chosen is None:
            continue
        as_written = base + (get("hidden_ms") or 0.0)  # the site alone, nothing under its collective
        # host-launched: where the GPU work queued ahead of the site hides both host times (the
        # simulated clocks of passes/host_pacing.py), the graph spends the GPU times alone
        hosts = (get("baseline_host_ms") or 0.0, get("chosen_host_ms") or 0.0)
        if (get("host_clock") or {}).get("lead", 0.0) >= max(hosts) > 0:
            as_written, chosen = as_written - hosts[0], chosen - hosts[1]
        saved = min(comm, as_written - chosen)
        g["comm_ms"] += comm
        if get("rewritten"):
            measured = _measured_gain(get("measured"), get("template"), get("config"))
            g["hidden_ms"] += saved if measured is None else min(comm, measured)
        elif get("prioritized"):  # compute beside its collective on the high-priority stream
            g["hidden_ms"] += max(0.0, saved)
        else:  # the site as written with compute beside its collective (defer_compute's credit)
            g["deferred_ms"] += max(0.0, saved)
        g["sites"] += 1
        g["rewritten"] += bool(get("rewritten"))
        note = (get("measured") or {}).get("note", "")
        if not get("rewritten") and note.startswith("within the model error"):
            best = min(v for k, v in predicted.items() if k != "baseline" and v is not None)
            g["band_ms"] += max(0.0, min(comm, as_written - best))
        world, dt = get("world_size") or world_size, get("dtype") or dtype
        if copy_gbps and world and comm > 0:
            nbytes = standin_bytes(get("kind") or "", get("gemms") or [], int(world), ITEMSIZE.get(str(dt), 2))
            g["standin_ms"] += min(comm, nbytes / (copy_gbps * 1e9) * 1e3)
    out["all"] = {k: sum(g[k] for g in out.values()) for k in _SUMMED}
    for g in out.values():
        c = g["comm_ms"]
        g["hidden_share"] = g["hidden_ms"] / c if c else None
        g["with_band_share"] = (g["hidden_ms"] + g["band_ms"]) / c if c else None
        g["with_deferred_share"] = (g["hidden_ms"] + g["deferred_ms"]) / c if c else None
        g["gap_share"] = g["hidden_ms"] / (c - g["standin_ms"]) if c > g["standin_ms"] else None
    return out


def _measured_gain(measured: dict | None, template: str | None, config: dict | None) -> float | None:
    """ms the rewrite saved on the site when passes/settle.py (or ``search="measure"``) timed the
    site as written and the chosen op on the group (``measured`` of a SiteReport); None where it
    timed something else or nothing."""
    m = measured or {}
    base, ms = m.get("baseline_ms"), m.get("ms")
    if base is None or ms is None or m.get("template") != template:
        return None
    if config is not None and m.get("config") is not None and m["config"] != config:
        return None
    return base - ms


def _copy_gbps(profile: Any) -> float | None:
    """The profile's copy bandwidth (GB/s, predictor.models.copy_gbps), from a HardwareProfile or a
    profile name; None when there is none or the name is unknown."""
    if profile is None:
        return None
    from .predictor.models import copy_gbps

    if isinstance(profile, str):
        from .predictor import loaded_profile

        try:
            profile = loaded_profile(profile)
        except Exception:  # an unknown name or a file gone since: no stand-in term
            return None
    return copy_gbps(profile) if getattr(profile, "gemm", None) is not None else None


def forecast_line(total: dict) -> str:
    """One line of ``forecast(...)["all"]`` for a person."""
    line = (f"forecast: the sites' collectives take {total['comm_ms']:.3f} ms as written; the pass is predicted to "
            f"hide {total['hidden_ms']:.3f} ms of it ({total['hidden_share']:.0%}); {total['with_band_share']:.0%} "
            f"if the sites inside the model's error band measure as predicted (on GPUs they are measured)")
    if total.get("deferred_ms"):
        line += (f"; not counted: {total['deferred_ms']:.3f} ms that compute moved beside the collectives left as "
                 f"written would hide if they ran beside it ({total['with_deferred_share']:.0%} with it)")
    return line
