"""benchmarks/ops.py --dry-run (CPU, gloo, world 2, every kind's first shape scaled down): the
``auto`` method runs what the compiled pass would for each site and names it in ``config.chosen``:
the sequential site where the predictor keeps the baseline (on CPU, by default), the rewritten one
where it picks a template (min_speedup lowered); async-TP is left out on CPU with a note."""
import json
import os
import subprocess
import sys

from overlap_compile import templates
from overlap_compile.testing.patterns import KINDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dry_run(tmp_path, env: dict) -> tuple[list[dict], str]:
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ops.py"), "--dry-run", "--templates",
                          "auto,async_tp", "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=600, env={**os.environ, "PYTHONPATH": ROOT, **env})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (path,) = [tmp_path / p for p in os.listdir(tmp_path) if p.startswith("ops-cpu-w2") and p.endswith(".json")]
    return json.loads(path.read_text()), run.stdout


def _by_kind(rows: list[dict], method: str) -> dict:
    return {r["kind"]: r for r in rows if r["method"] == method}


def test_auto_rows_name_the_predictors_choice(tmp_path):
    rows, out = _dry_run(tmp_path / "default", {})
    assert {r["method"] for r in rows} == {"sequential", "auto"}  # no async_tp rows on CPU ...
    assert "async_tp: not measured on a dry run" in out  # ... and a note saying so
    auto, seq = _by_kind(rows, "auto"), _by_kind(rows, "sequential")
    assert set(auto) == set(seq) == set(KINDS)
    for kind, r in auto.items():
        # the CPU profile's predictor keeps every site sequential: auto times the sequential site
        assert r["config"] == {"chosen": "baseline"} and "min_speedup" in r["reason"], r
        assert r["correct"] and r["rel_err"] == 0.0 and r["ms"] > 0 and r["mode"] == "eager"
        assert r["bound_ms"] is None and r["shape"] == seq[kind]["shape"]


def test_auto_runs_the_template_the_predictor_picks(tmp_path):
    rows, _ = _dry_run(tmp_path / "low", {"OVERLAP_COMPILE_MIN_SPEEDUP": "0.01"})
    auto = _by_kind(rows, "auto")
    assert set(auto) == set(KINDS)
    for r in auto.values():
        chosen = r["config"]["chosen"]
        assert chosen in templates.names() and len(r["config"]) > 1, r["config"]  # the template and its config
        assert r["correct"] and r["bound_ms"] > 0 and "predicted" in r["reason"], r


def test_shapes_run_round_robin_over_kinds():
    from benchmarks import ops

    shapes = {"gemm_allreduce": [[1, 1, 1], [2, 2, 2], [3, 3, 3]], "gemm_alltoall": [[4, 4, 4]]}
    assert ops.shape_order(["gemm_allreduce", "gemm_alltoall"], shapes) == [
        ("gemm_allreduce", [1, 1, 1]), ("gemm_alltoall", [4, 4, 4]), ("gemm_allreduce", [2, 2, 2]),
        ("gemm_allreduce", [3, 3, 3])]
