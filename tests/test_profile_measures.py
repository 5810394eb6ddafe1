"""benchmarks/fitting/profile_measures.py: one-GPU measurements (gemm.py --signal-at, moe_experts.py) into a
profile, on synthetic rows in the benchmarks' schemas; the profile it writes makes the predictor
offer the measured options."""
import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks.fitting import profile_measures as PM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gemm_rows():
    rows = []
    for shape, (ge, nt) in {(4096, 8192, 2048): (0.05, 0.01), (8192, 8192, 4096): (0.02, 0.0)}.items():
        for point, over in (("group_end", ge), ("next_tile", nt), ("none", -0.01)):
            rows.append({"benchmark": "gemm", "method": "triton_signal", "mode": "cuda_graph", "shape": list(shape),
                         "config": {"signal_at": point}, "ms": 1.0 + over, "correct": True,
                         "overhead_vs_same_config": over})
        rows.append({"method": "triton_signal", "mode": "eager", "config": {"signal_at": "group_end"},
                     "correct": True, "overhead_vs_same_config": 0.5})  # host-launched: not used
    rows.append({"method": "triton_signal", "mode": "cuda_graph", "config": {"signal_at": "next_tile"},
                 "correct": False, "overhead_vs_same_config": -0.5})  # wrong results: not used
    return rows


def _expert_rows():
    rows = []
    for shape, bmm, fused in (("MoE-1", 1.0, [0.9, 0.8]), ("MoE-4", 2.0, [2.2, 2.5])):
        rows.append({"method": "bmm", "mode": "cuda_graph", "shape": shape, "world": 2, "ms": bmm})
        for ms in fused:
            rows.append({"method": "fused_waits", "mode": "cuda_graph", "shape": shape, "world": 2, "ms": ms,
                         "correct": True})
        rows.append({"method": "fused_waits", "mode": "cuda_graph", "shape": shape, "world": 2, "ms": 0.01,
                     "correct": False})
    return rows


def test_values_from_rows():
    epi = PM.signal_epilogue(_gemm_rows())
    assert set(epi) == {"group_end", "next_tile"}
    assert epi["group_end"] == pytest.approx(math.sqrt(1.05 * 1.02) - 1)
    assert epi["next_tile"] == pytest.approx(math.sqrt(1.01 * 1.0) - 1)
    assert PM.expert_kernel_ratio(_expert_rows()) == pytest.approx(math.sqrt(0.8 / 1.0 * 2.2 / 2.0))
    # a file with the default config's rows: those count, not a faster other config
    from benchmarks.moe_experts import config_label
    from overlap_compile.templates.moe_fused.expert_kernel import ExpertTiles

    labelled = [dict(r, config="other") for r in _expert_rows()]
    for r in labelled:
        if r["method"] == "fused_waits" and r["ms"] in (0.9, 2.5):
            r["config"] = config_label(ExpertTiles())
    assert PM.expert_kernel_ratio(labelled) == pytest.approx(math.sqrt(0.9 / 1.0 * 2.5 / 2.0))
    with pytest.raises(ValueError, match="no correct CUDA-graph fused_waits rows"):
        PM.update({"notes": []}, None, [r for r in _expert_rows() if r["method"] == "bmm"], {"experts": "x"})


def test_written_profile_makes_the_predictor_offer_the_measured_options(tmp_path):
    gemm, experts = tmp_path / "gemm.json", tmp_path / "experts.json"
    gemm.write_text(json.dumps(_gemm_rows()))
    experts.write_text(json.dumps(_expert_rows()))
    out = tmp_path / "h200-measured.json"
    script = os.path.join(ROOT, "benchmarks", "fitting", "profile_measures.py")
    proc = subprocess.run([sys.executable, script, "--profile", "h200",
                           "--gemm", str(gemm), "--experts", str(experts), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from overlap_compile import predictor
    from overlap_compile.templates.signal_reorder import model as sr_model
    from overlap_compile.templates.moe_fused.model import expert_kernel_ratio

    prof = predictor.load_profile(str(out))
    assert sr_model.sr_epilogue(prof) == pytest.approx(PM.signal_epilogue(_gemm_rows()))
    assert expert_kernel_ratio(prof) == pytest.approx(PM.expert_kernel_ratio(_expert_rows()))
    assert any("signal_epilogue" in n for n in prof.raw["notes"]) and any("expert_kernel_vs_bmm" in n
                                                                          for n in prof.raw["notes"])


def _ops_rows():
    """Three sites: two rewritten by p2p_ring in both modes (host ratios 1.5 and 0.5 -> median 1.0),
    one where auto chose differently per mode (left out)."""
    rows = []

    def site(shape, seq, op, chosen):
        for mode, ms in zip(("eager", "cuda_graph"), seq):
            rows.append({"benchmark": "ops", "kind": "gemm_reducescatter", "shape": shape, "method": "sequential",
                         "mode": mode, "ms": ms, "correct": True})
        for mode, ms, c in zip(("eager", "cuda_graph"), op, chosen):
            rows.append({"benchmark": "ops", "kind": "gemm_reducescatter", "shape": shape, "method": "auto",
                         "mode": mode, "ms": ms, "config": {"chosen": c}, "correct": True})

    site([1, 1, 1], (1.1, 1.0), (0.95, 0.8), ("p2p_ring", "p2p_ring"))
    site([2, 2, 2], (2.2, 2.0), (1.9, 1.8), ("p2p_ring", "p2p_ring"))
    site([3, 3, 3], (3.1, 3.0), (5.0, 2.0), ("baseline", "p2p_ring"))
    return rows


def test_replayed_host_ratio_from_ops_rows():
    ratios = PM.replay_host_ratios(_ops_rows())
    assert set(ratios) == {"p2p_ring"}
    assert ratios["p2p_ring"][0] == pytest.approx(1.0) and ratios["p2p_ring"][1] == 2
    prof = PM.update({"notes": []}, None, None, {"ops": "ops.json"}, _ops_rows())
    replayed = prof["op_overhead_ms"]["replayed"]
    assert replayed["per_template"] == {"p2p_ring": 1.0} and replayed["ratio_to_site"] == 1.0
    assert "ops.json" in replayed["source"]
    with pytest.raises(ValueError, match="auto ran one template"):
        PM.update({"notes": []}, None, None, {"ops": "x"}, _ops_rows()[-4:])
