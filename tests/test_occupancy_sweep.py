"""benchmarks/diagnostics/occupancy_sweep.py: its configurations are valid priority_stream configs (cuBLAS
first, then every tile / stages / programs point) and a CPU dry run over gloo produces correct,
schema-shaped rows for both stream priorities."""
import json
import os
import subprocess
import sys

from overlap_compile.templates.priority_stream import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.diagnostics.occupancy_sweep import PRIORITIES, PROGRAM_FRACTIONS, TILES, sweep_configs  # noqa: E402


def test_sweep_configs_are_valid_and_complete():
    cfgs = sweep_configs(132, 4)
    assert cfgs[0]["block_m"] is None and len(cfgs) == 1 + len(TILES) * len(PROGRAM_FRACTIONS)
    assert all(reference.config_problem(c) is None for c in cfgs)
    assert {c["programs"] for c in cfgs[1:]} == {int(132 * f) for f in PROGRAM_FRACTIONS}


def test_dry_run_rows(tmp_path):
    script = "benchmarks/diagnostics/occupancy_sweep.py"
    proc = subprocess.run([sys.executable, script, "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    rows = json.loads(path.read_text())
    assert [r["method"] for r in rows] == ["sequential"] + ["priority_stream"] * len(PRIORITIES)
    assert all(r["correct"] for r in rows[1:]) and all(r["ms"] > 0 for r in rows)
    assert [r["config"]["priority"] for r in rows[1:]] == PRIORITIES
