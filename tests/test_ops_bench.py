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
    # the bars lowered (gain and time saved) so that CPU-sized sites rewrite
    rows, _ = _dry_run(tmp_path / "low", {"OVERLAP_COMPILE_MIN_SPEEDUP": "0.01", "OVERLAP_COMPILE_MIN_SAVED_US": "0"})
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


def _async_tp_rows() -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from benchmarks import ops

    # CPU stand-ins for what a GPU has: torch's own reference implementations of the fused ops (they
    # call the functional collectives, which gloo runs), and the NCCL check the micro-pipeline pass
    # makes before fusing (a CPU build has no NCCL)
    lib = torch.library.Library("symm_mem", "IMPL")
    lib.impl("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback, "CPU")
    lib.impl("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback, "CPU")
    dist.is_nccl_available = lambda: True
    group, rows = dist.group.WORLD.group_name, {}
    for kind in KINDS:
        torch.manual_seed(dist.get_rank())
        a = torch.randn(32 if kind == "allgather_gemm" else 64, 16)
        b = torch.randn(16, 32)
        ref = ops.sequential_fn(kind, group, 2)(a, b)
        base = {"kind": kind, "shape": [64, 32, 16]}
        rows[kind] = ops._method_rows("async_tp", kind, a, b, ref, group, 2, ("eager",), base, {"eager": 1.0}, 1.0, 1.0)
    del lib
    return rows


def test_async_tp_rows_say_whether_async_tp_rewrote_the_site():
    from overlap_compile.testing.multiprocess import run_distributed

    rows = run_distributed(_async_tp_rows, world_size=2, timeout_s=600)[0]
    for kind, got in rows.items():
        (r,) = got  # one mode on CPU
        assert "error" not in r, r.get("error")
        # async-TP fuses all-gather -> matmul and matmul -> reduce-scatter, nothing else: the other
        # kinds run as compiled, and their rows say so
        assert r["config"] == {"rewritten": kind in ("allgather_gemm", "gemm_reducescatter")}, (kind, r["config"])
        assert (r["method"], r["mode"]) == ("async_tp", "eager") and r["correct"] and r["rel_err"] < 1e-5
        assert r["bound_ms"] is None and r["ms"] > 0


def test_auto_decides_once_per_launch_mode(monkeypatch):
    """auto's CUDA-graph row runs what the pass decides for a graph Inductor captures, its
    host-launched row what it decides for host launches; a template's rows share one site."""
    import torch

    from benchmarks import ops
    from overlap_compile.predictor import launch_mode

    decided = []

    def site(name, kind, a, b, group, world):
        decided.append((name, launch_mode()))
        return (lambda: torch.ones(2)), {"chosen": launch_mode()}, None, "why"

    monkeypatch.setattr(ops, "_site", site)
    monkeypatch.setattr(ops, "_times", lambda fn, modes, label: {m: 1.0 for m in modes})
    args = ("gemm_allreduce", None, None, torch.ones(2), "g", 2, ("eager", "cuda_graph"), {"shape": [2, 2, 2]},
            {"eager": 2.0, "cuda_graph": 2.0}, 1.0, 1.0)
    rows = ops._method_rows("auto", *args)
    assert decided == [("auto", "eager"), ("auto", "cuda_graph")]
    assert [(r["mode"], r["config"]["chosen"]) for r in rows] == [("eager", "eager"), ("cuda_graph", "cuda_graph")]
    decided.clear()
    rows = ops._method_rows("p2p_ring", *args)
    assert len(decided) == 1 and [r["mode"] for r in rows] == ["eager", "cuda_graph"]
