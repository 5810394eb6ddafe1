"""Put one-GPU kernel measurements into a hardware profile, where the predictor reads them.

    python benchmarks/fitting/profile_measures.py --profile h200 --gemm gemm-...json --experts moe_experts-...json \
        --out h200.json

* ``--gemm`` (benchmarks/gemm.py --signal-at ...): the signalling epilogue's cost per signalling
  point, the geometric mean over shapes of (signal kernel / plain kernel with the same config) - 1
  under CUDA graphs -> ``signal_epilogue`` {"group_end": x, "next_tile": y}. The predictor offers
  signal_reorder's "next_tile" point only once this is there (models.sr_epilogue).
* ``--experts`` (benchmarks/moe_experts.py): the persistent expert kernel's time over bmm's, the
  geometric mean over cases of the config moe_fused runs (expert_kernel.ExpertTiles' defaults;
  files without it: the best correct config per case) with arrival waits on, CUDA graph ->
  ``moe.expert_kernel_vs_bmm``. moe_fused offers ``"experts": "fused"`` only once this is there.

* ``--ops`` (benchmarks/ops.py with ``auto``, W >= 2): the host time a template's op exposes when
  replayed from its CUDA graph (runtime.op_graphs), over the site's own: per site where auto ran
  the same template host-launched and under CUDA graphs, (op host-launched - op CUDA graph) /
  (sequential host-launched - sequential CUDA graph), the median per template ->
  ``op_overhead_ms.replayed`` (``ratio_to_site``: the largest template median). These are the times
  a call launched from an idle GPU loses to its host, the ops' own rows; the earlier figure (0.41,
  priority_stream at W=1, benchmarks/host_profile.py) priced p2p_ring below the site it replaces,
  where on 2x H100 it exposed 1.2x the site's host time.

Only rows marked correct count (ops rows: each method's row where it is not marked wrong). Each value goes into the profile's notes with the file it came
from; the result is written as JSON (``--out``).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository root


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def signal_epilogue(rows: list[dict]) -> dict[str, float]:
    """{signal_at: geomean(1 + overhead) - 1} over the CUDA-graph triton_signal rows."""
    per_point: dict[str, list[float]] = {}
    for r in rows:
        if r.get("method") != "triton_signal" or r.get("mode", "cuda_graph") != "cuda_graph":
            continue
        over = r.get("overhead_vs_same_config")
        if over is None or not r.get("correct", False):
            continue
        point = (r.get("config") or {}).get("signal_at", "group_end")
        per_point.setdefault(point, []).append(1.0 + float(over))
    return {p: geomean(v) - 1.0 for p, v in per_point.items() if p != "none"}


def expert_kernel_ratio(rows: list[dict]) -> float | None:
    """geomean over cases of (kernel ms with waits) / bmm ms, CUDA graph, correct rows only: the
    default config's rows where the file has them, else the best config's per case."""
    from benchmarks.moe_experts import config_label
    from overlap_compile.templates.moe_fused.expert_kernel import ExpertTiles

    default = config_label(ExpertTiles())
    only_default = any(r.get("config") == default and r.get("method") == "fused_waits" for r in rows)
    best: dict[tuple, float] = {}
    bmm: dict[tuple, float] = {}
    for r in rows:
        if r.get("mode") != "cuda_graph" or "ms" not in r:
            continue
        key = (r.get("shape"), r.get("world"))
        if r.get("method") == "bmm":
            bmm[key] = float(r["ms"])
        elif r.get("method") == "fused_waits" and r.get("correct") and (r.get("config") == default or not only_default):
            best[key] = min(best.get(key, math.inf), float(r["ms"]))
    ratios = [best[k] / bmm[k] for k in best if k in bmm]
    return geomean(ratios) if ratios else None


def replay_host_ratios(rows: list[dict]) -> dict[str, tuple[float, int]]:
    """{template: (median host-time ratio of its replayed op to the site, sites)}: see the module
    docstring (``--ops``). Sites whose sequential host time is not above 5 us are left out (no
    ratio to take)."""
    import statistics

    by_site: dict[tuple, dict] = {}
    for r in rows:
        if r.get("benchmark", "ops") == "ops" and r.get("correct", True) and isinstance(r.get("ms"), (int, float)):
            by_site.setdefault((r["kind"], tuple(r["shape"])), {})[(r["method"], r["mode"])] = r
    per: dict[str, list[float]] = {}
    for site in by_site.values():
        seq_e, seq_g = site.get(("sequential", "eager")), site.get(("sequential", "cuda_graph"))
        op_e, op_g = site.get(("auto", "eager")), site.get(("auto", "cuda_graph"))
        if not (seq_e and seq_g and op_e and op_g):
            continue
        chosen = {(op_e.get("config") or {}).get("chosen"), (op_g.get("config") or {}).get("chosen")}
        seq_host = seq_e["ms"] - seq_g["ms"]
        if len(chosen) != 1 or None in chosen or "baseline" in chosen or seq_host <= 0.005:
            continue
        per.setdefault(chosen.pop(), []).append((op_e["ms"] - op_g["ms"]) / seq_host)
    return {t: (statistics.median(v), len(v)) for t, v in per.items()}


def update(profile: dict, gemm_rows: list[dict] | None, expert_rows: list[dict] | None,
           sources: dict[str, str], ops_rows: list[dict] | None = None) -> dict:
    out = copy.deepcopy(profile)
    out.setdefault("notes", [])
    if ops_rows is not None:
        ratios = replay_host_ratios(ops_rows)
        if not ratios:
            raise ValueError("no site in the ops file where auto ran one template host-launched and under CUDA graphs")
        replayed = out.setdefault("op_overhead_ms", {}).setdefault("replayed", {})
        replayed["per_template"] = {t: round(r, 3) for t, (r, _) in sorted(ratios.items())}
        replayed["ratio_to_site"] = round(max(r for r, _ in ratios.values()), 3)
        replayed["source"] = (f"{sources['ops']}: (op host-launched - op CUDA graph) / (sequential host-launched - "
                              "sequential CUDA graph), median per template over the sites auto rewrote with it in "
                              "both modes (" + ", ".join(f"{t} {r:.2f} over {n}" for t, (r, n) in sorted(ratios.items()))
                              + "); ratio_to_site: the largest")
        out["notes"].append(f"op_overhead_ms.replayed from {sources['ops']}")
    if gemm_rows is not None:
        epi = signal_epilogue(gemm_rows)
        if "group_end" not in epi:
            raise ValueError("no correct CUDA-graph triton_signal rows for signal_at='group_end' in the gemm file")
        out["signal_epilogue"] = epi
        out["notes"].append("signal_epilogue (signalling kernel / plain kernel, same config, CUDA graph, geomean): "
                            + ", ".join(f"{k} {v:+.2%}" for k, v in sorted(epi.items())) + f" from {sources['gemm']}")
    if expert_rows is not None:
        ratio = expert_kernel_ratio(expert_rows)
        if ratio is None:
            raise ValueError("no correct CUDA-graph fused_waits rows with a bmm row of the same case in the experts file")
        out.setdefault("moe", {})["expert_kernel_vs_bmm"] = ratio
        out["notes"].append(f"moe.expert_kernel_vs_bmm = {ratio:.3f} (persistent expert kernel with arrival waits / "
                            f"bmm experts, CUDA graph, geomean) from {sources['experts']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a built-in profile name or a profile JSON path")
    ap.add_argument("--gemm", default=None)
    ap.add_argument("--experts", default=None)
    ap.add_argument("--ops", default=None, help="benchmarks/ops.py rows with auto (W >= 2): the replayed host ratio")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from overlap_compile import predictor

    base = predictor.load_profile(a.profile).raw
    def load(path: str) -> list[dict]:
        with open(path) as f:
            return json.load(f)

    prof = update(base, load(a.gemm) if a.gemm else None, load(a.experts) if a.experts else None,
                  {"gemm": os.path.basename(a.gemm or ""), "experts": os.path.basename(a.experts or ""),
                   "ops": os.path.basename(a.ops or "")}, load(a.ops) if a.ops else None)
    predictor.profile.profile_from_dict(prof, source=a.out)  # still a valid profile
    with open(a.out, "w") as f:
        json.dump(prof, f, indent=1)
    print("wrote", a.out, "with", {k: prof[k] for k in ("signal_epilogue", "moe") if k in prof},
          prof.get("op_overhead_ms", {}).get("replayed"))


if __name__ == "__main__":
    main()
