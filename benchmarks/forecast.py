"""The predicted share of a block's collective time the overlap pass hides, from its Report's sites:
what benchmarks/plan.py forecasts on a CPU and e2e.py's rows carry beside what the GPUs measured."""
from __future__ import annotations


def forecast(sites: list) -> dict:
    """Per graph and in all (``"all"``): the sites' collectives as written (``comm_ms``), what
    the decisions are predicted to hide of it (``hidden_ms``, ``hidden_share``), and what the
    sites inside the model's error band would add if they measured as predicted (``band_ms``,
    ``with_band_share``: where GPUs measure them, passes/settle.py, their decision already
    says). ``sites``: SiteReports, or the dicts e2e.py's rows keep of them."""
    out: dict = {}
    for s in sites:
        get = s.get if isinstance(s, dict) else lambda k, s=s: getattr(s, k, None)
        g = out.setdefault(get("graph"), {"comm_ms": 0.0, "hidden_ms": 0.0, "band_ms": 0.0, "sites": 0, "rewritten": 0})
        predicted = get("predicted_ms") or {}
        base, chosen, comm = predicted.get("baseline"), get("chosen_ms"), get("comm_ms") or 0.0
        if base is None or chosen is None:
            continue
        as_written = base + (get("hidden_ms") or 0.0)  # the site alone, nothing under its collective
        g["comm_ms"] += comm
        g["hidden_ms"] += min(comm, as_written - chosen)
        g["sites"] += 1
        g["rewritten"] += bool(get("rewritten"))
        note = (get("measured") or {}).get("note", "")
        if not get("rewritten") and note.startswith("within the model error"):
            best = min(v for k, v in predicted.items() if k != "baseline" and v is not None)
            g["band_ms"] += max(0.0, min(comm, as_written - best) - (as_written - chosen))
    total = {k: sum(g[k] for g in out.values()) for k in ("comm_ms", "hidden_ms", "band_ms", "sites", "rewritten")}
    out["all"] = total
    for g in out.values():
        g["hidden_share"] = g["hidden_ms"] / g["comm_ms"] if g["comm_ms"] else None
        g["with_band_share"] = (g["hidden_ms"] + g["band_ms"]) / g["comm_ms"] if g["comm_ms"] else None
    return out
