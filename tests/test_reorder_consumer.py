"""benchmarks/diagnostics/reorder_consumer.py on CPU (--dry-run): the compiled reorder + residual + RMSNorm
equals the plain consumer for every shape and tile layout asked for, edge tiles included."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_over_shapes_and_layouts(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "diagnostics", "reorder_consumer.py")
    proc = subprocess.run([sys.executable, script, "--dry-run",
                           "--shapes", "200x96,256x128", "--blocks", "64x32x4,32x64x1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = [p for p in os.listdir(tmp_path) if p.startswith("reorder-consumer-cpu")]
    rows = json.load(open(tmp_path / path))
    assert sorted((tuple(r["shape"]), tuple(r["block"])) for r in rows) == [
        ((200, 96), (32, 64, 1)), ((200, 96), (64, 32, 4)), ((256, 128), (32, 64, 1)), ((256, 128), (64, 32, 4))]
    assert all(r["correct"] and r["max_rel_err"] == 0.0 for r in rows)
