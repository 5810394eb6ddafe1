"""benchmarks/moe.py on CPU (--dry-run: gloo, tiny shapes) and benchmarks/plot.py on its rows: every
variant runs and matches the sequential layer, training rewrites the forward section (what
backward saves handed out) and leaves the backward one, the rows carry the common schema, and the
plotter draws the speedup bars and the latency against the expert count."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_rows_and_plots(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "moe.py"), "--dry-run", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (path,) = [tmp_path / p for p in os.listdir(tmp_path) if p.startswith("moe-cpu") and p.endswith(".json")]
    rows = json.loads(path.read_text())
    assert all("error" not in r for r in rows), [r["error"] for r in rows if "error" in r]
    by = {(r["shape"], r["phase"], r["variant"]): r for r in rows}
    for shape in ("tiny-8", "tiny-16"):
        fwd, train = by[(shape, "forward", "moe_fused")], by[(shape, "train", "moe_fused")]
        assert fwd["rel_err"] == 0.0 and train["rel_err"] == 0.0
        assert [s[3] for s in fwd["sites"]] == [True]
        # training: the forward section rewritten, the backward one (not the SwiGLU form) as written
        assert sorted((s[0].split("_")[0], s[3]) for s in train["sites"]) == [("backward", False), ("forward", True)]
        for r in (fwd, train):
            assert (r["kind"], r["method"], r["mode"]) == (f"moe_{r['phase']}", "moe_fused", "eager")
            assert r["experts"] == int(shape.split("-")[1]) and r["ms"] > 0
    plot = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plot.py"), str(path), "--out", str(tmp_path),
                           "--markdown"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert plot.returncode == 0, plot.stderr[-3000:]
    pngs = sorted(p for p in os.listdir(tmp_path) if p.endswith(".png"))
    assert any("moe_forward-eager.png" in p for p in pngs) and any("by-experts" in p for p in pngs), pngs
    assert "geomean moe_fused" in plot.stdout
