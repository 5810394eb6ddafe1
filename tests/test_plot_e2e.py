"""benchmarks/plot.py on end-to-end rows: one bar chart per (model, compile mode, phase) with the
nocomm bound, the share of the gap closed, (inductor - method) / (inductor - nocomm), in the
markdown table; and e2e.py's own rows carry the same numbers (compare)."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import e2e, plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = "Llama-3-8B block, TP+SP"
# (compile mode, variant) -> (train ms, prefill ms)
TIMES = {("default", "default"): (100.0, 40.0), ("default", "async_tp"): (95.0, 38.0),
         ("default", "overlap"): (90.0, 42.0), ("default", "nocomm"): (80.0, 30.0),
         # the bound no faster than inductor: no gap to close
         ("reduce-overhead", "default"): (50.0, 20.0), ("reduce-overhead", "overlap"): (49.0, 19.0),
         ("reduce-overhead", "nocomm"): (50.0, 21.0)}


def _rows() -> list[dict]:
    base = {"benchmark": "e2e", "device": "NVIDIA H200", "world_size": 2, "torch": "2.11.0", "date": "2026-11-24"}
    rows = []
    for (mode, variant), (train, prefill) in TIMES.items():
        keys = e2e.schema_keys("llama_dtensor", {"name": SHAPE}, variant, mode, False, None)
        rows.append({**base, **keys, "train_ms": train, "prefill_ms": prefill, "ms": train})
    keys = e2e.schema_keys("llama_dtensor", {"name": SHAPE}, "overlap", "default", True, None)
    rows.append({**base, **keys, "error": "OutOfMemoryError: ...", "failure": "oom"})  # no times: left out
    return rows


def test_gap_closed():
    assert plot.gap_closed(100.0, 90.0, 80.0) == pytest.approx(0.5)
    assert plot.gap_closed(100.0, 105.0, 80.0) == pytest.approx(-0.25)  # slower than inductor
    assert plot.gap_closed(50.0, 49.0, 50.0) is None and plot.gap_closed(50.0, 49.0, 51.0) is None


def test_e2e_bars_and_gaps_per_model_mode_phase():
    bars = plot.e2e_bars(_rows())
    assert sorted(bars) == [("llama_dtensor", m, p) for m in ("default", "reduce-overhead") for p in ("prefill", "train")]
    train = bars[("llama_dtensor", "default", "train")][SHAPE]
    assert train == {"inductor": 100.0, "async_tp": 95.0, "overlap": 90.0, "nocomm": 80.0}
    gaps = plot.e2e_gaps(bars[("llama_dtensor", "default", "train")])[SHAPE]
    assert gaps == pytest.approx({"async_tp": 0.25, "overlap": 0.5})
    prefill = plot.e2e_gaps(bars[("llama_dtensor", "default", "prefill")])[SHAPE]
    assert prefill == pytest.approx({"async_tp": 0.2, "overlap": -0.2})
    assert plot.e2e_gaps(bars[("llama_dtensor", "reduce-overhead", "train")])[SHAPE] == {"overlap": None}


def test_png_per_model_mode_phase_and_markdown(tmp_path):
    path = tmp_path / "e2e-NVIDIA_H200-w2-torch2.11.0-2026-11-24.json"
    path.write_text(json.dumps(_rows()))
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "plot.py"), str(path), "--markdown"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for mode in ("default", "reduce-overhead"):
        for phase in ("train", "prefill"):
            png = tmp_path / f"{path.stem}-e2e-llama_dtensor-{mode}-{phase}.png"
            assert png.exists() and png.stat().st_size > 1000, png
    lines = run.stdout.splitlines()
    head = lines.index("**llama_dtensor, default, train** (ms; gap closed = (inductor - method) / (inductor - nocomm))")
    assert lines[head + 2] == ("| shape | inductor | async_tp | overlap | nocomm | gap closed async_tp | "
                               "gap closed overlap |")
    assert lines[head + 4] == f"| {SHAPE} | 100.000 | 95.000 | 90.000 | 80.000 | 25% | 50% |"


def test_e2e_compare_carries_the_gap_and_leaves_nocomm_out_of_the_loss_check():
    rows = _rows()
    for r in rows:
        r["losses"] = [1.0, 0.9] if r["variant"] != "nocomm" else [0.5, 0.4]
    rows = e2e.compare(rows, 1e-4)
    by = {(r["compile_mode"], r["variant"]): r for r in rows if "ms" in r}
    assert by[("default", "overlap")]["train_gap_closed"] == pytest.approx(0.5)
    assert by[("default", "async_tp")]["prefill_gap_closed"] == pytest.approx(0.2)
    assert by[("reduce-overhead", "overlap")]["train_gap_closed"] is None
    assert "train_gap_closed" not in by[("default", "nocomm")]
    assert "loss_matches_default" not in by[("default", "nocomm")]
    assert by[("default", "overlap")]["loss_matches_default"]
    ok, notes = e2e.verdict(rows, 1e-4)
    assert ok, notes
    assert "| 50% / -20% |" in e2e.markdown(rows)


def test_the_nopad_bound_is_a_bound_not_a_gap_closer():
    """nocomm_nopad (MoE: no communication, no capacity padding) gets its speedup over inductor,
    no share of the gap, no loss check, and sits after nocomm as a bound in the tables."""
    rows = _rows()
    keys = e2e.schema_keys("llama_dtensor", {"name": SHAPE}, "nocomm_nopad", "default", False, None)
    rows.append({**rows[0], **keys, "train_ms": 70.0, "prefill_ms": 25.0, "ms": 70.0})
    for r in rows:
        r["losses"] = [0.5, 0.4] if r["variant"].startswith("nocomm") else [1.0, 0.9]
    by = {(r["compile_mode"], r["variant"]): r for r in e2e.compare(rows, 1e-4) if "ms" in r}
    nopad = by[("default", "nocomm_nopad")]
    assert nopad["train_speedup"] == pytest.approx(100 / 70) and "train_gap_closed" not in nopad
    assert "loss_matches_default" not in nopad and e2e.verdict(rows, 1e-4)[0]
    bars = plot.e2e_bars(rows)[("llama_dtensor", "default", "train")]
    assert plot.e2e_gaps(bars)[SHAPE] == pytest.approx({"async_tp": 0.25, "overlap": 0.5})
    table = plot.markdown_e2e(rows)
    assert "| shape | inductor | async_tp | overlap | nocomm | nocomm_nopad | gap closed async_tp | " \
           "gap closed overlap |" in table


def test_plots_take_the_gap_closed_of_rows_timed_side_by_side():
    """Rows of e2e.py --interleave: the gap closed the table prints (from the rounds' own ratios)
    is the one the plots and the markdown print, not one recomputed from the medians."""
    rows = [r for r in _rows() if r["compile_mode"] == "default" and "ms" in r]
    group = [r["variant"] for r in rows]
    # every round: overlap 6% under inductor, the bound 20% under it; the medians (TIMES) say 10%
    samples = {"default": [100.0, 90.0, 110.0], "async_tp": [97.0, 87.3, 106.7], "overlap": [94.0, 84.6, 103.4],
               "nocomm": [80.0, 72.0, 88.0]}
    for r in rows:
        r.update(interleaved=group, train_ms_rounds=samples[r["variant"]])
    rows = e2e.compare(rows, 1e-4)
    ov = next(r for r in rows if r["variant"] == "overlap")
    assert ov["train_gap_closed"] == pytest.approx(0.3)
    bars = plot.e2e_bars(rows)[("llama_dtensor", "default", "train")]
    gaps = plot.e2e_gaps(bars, rows, ("llama_dtensor", "default", "train"))[SHAPE]
    assert gaps["overlap"] == pytest.approx(0.3) and gaps["async_tp"] == pytest.approx(0.15)
    assert plot.e2e_gaps(bars)[SHAPE]["overlap"] == pytest.approx(0.5)  # what the medians alone say
    assert "| 15% | 30% |" in plot.markdown_e2e(rows)


def test_e2e_compare_carries_the_predicted_hidden_share_per_phase():
    """An overlap row's sites (as e2e_run keeps them, with their phase) give the share of their
    collectives' time the pass predicted to hide (a site left as written with compute beside its
    collective counts nothing), and of the gap to the nocomm bound, whose stand-in copy kernels
    (a reduce-scatter's: its own half of the 8192 x 4096 bf16 rows read and written, at the h200
    profile's copy bandwidth) come off the collectives' time, beside the measured gap closed."""
    rows = _rows()
    site = {"graph": "forward", "kind": "gemm_reducescatter", "rewritten": True, "measured": None,
            "gemms": [[8192, 4096, 2048]],
            "predicted_ms": {"baseline": 1.0, "p2p_ring": 0.9}, "comm_ms": 0.2, "hidden_ms": 0.0, "chosen_ms": 0.9}
    kept = {**site, "graph": "backward", "rewritten": False, "predicted_ms": {"baseline": 0.85, "p2p_ring": 0.9},
            "hidden_ms": 0.15, "chosen_ms": 0.85}
    overlap = next(r for r in rows if r["variant"] == "overlap" and r["compile_mode"] == "default")
    overlap["sites"] = [{**site, "phase": "train"}, {**kept, "phase": "train"}, {**site, "phase": "prefill"}]
    overlap["rewritten"] = 2
    rows = e2e.compare(rows, 1e-4)
    assert overlap["train_forecast_hidden"] == pytest.approx(0.1 / 0.4)
    assert overlap["prefill_forecast_hidden"] == pytest.approx(0.5)
    from overlap_compile.predictor import load_profile
    from overlap_compile.predictor.models import copy_gbps

    copy = 2 * (8192 // 2) * 4096 * 2 / (copy_gbps(load_profile("h200")) * 1e9) * 1e3
    assert overlap["train_forecast_gap"] == pytest.approx(0.1 / (0.4 - 2 * copy))
    assert overlap["prefill_forecast_gap"] == pytest.approx(0.1 / (0.2 - copy))
    assert "| 25% / 50% |" in e2e.markdown(rows)


@pytest.mark.parametrize("off,suffix", [({}, ""), ({"measure_uncertain": False}, "-nosettle"),
                                        ({"defer_compute": True}, "-defer"),
                                        ({"defer_compute": True, "prioritize_deferred": True}, "-defer-prioritize")])
def test_rows_with_an_option_off_go_to_their_own_file(tmp_path, off, suffix):
    """run_multigpu.sh's E2E_NOSETTLE_ARGS / E2E_DEFER_ARGS runs: the overlap rows' config names
    the option set against its default, and the file says so, so they never overwrite the run
    with the defaults."""
    from benchmarks import e2e_report
    from overlap_compile import config

    with config.patch(**off):
        rows = [r for r in _rows() if "ms" in r]
    assert [r["config"] for r in rows if r["variant"] == "overlap"] == [off or None] * 2
    stem = e2e_report.write(e2e.compare(rows, 1e-4), str(tmp_path))
    assert os.path.basename(stem) == f"e2e-NVIDIA_H200-w2-torch2.11.0-2026-11-24{suffix}"
    assert os.path.exists(stem + ".json") and os.path.exists(stem + ".md")


def test_summary_relative_to_inductor_with_the_gap_closed(tmp_path):
    summary = plot.e2e_summary(_rows())
    (cells,) = summary.values()
    by_cell = {label: (rel, gaps) for label, rel, gaps in cells}
    rel, gaps = by_cell["default, train"]
    assert rel == {"inductor": 1.0, "async_tp": 0.95, "overlap": 0.9, "nocomm": 0.8}
    assert gaps["overlap"] == pytest.approx(0.5) and gaps["async_tp"] == pytest.approx(0.25)
    assert by_cell["default, prefill"][1]["overlap"] == pytest.approx(-0.2)  # slower than inductor
    assert by_cell["reduce-overhead, train"][1] == {"overlap": None}  # no gap: nothing to close
    (png,) = plot.plot_e2e_summary(_rows(), str(tmp_path), "run")
    assert png.endswith("run-e2e-summary.png") and os.path.getsize(png) > 0


def test_a_method_keeps_its_colour_in_every_panel():
    """A panel that lacks a method (its row failed) must not shift the others' colours."""
    from benchmarks.plot import E2E_METHODS, _e2e_colour

    colours = [_e2e_colour(m) for m in E2E_METHODS]
    assert len(set(colours)) == len(colours)
    assert _e2e_colour("overlap") == _e2e_colour("overlap[p2p_ring]") == colours[E2E_METHODS.index("overlap")]
