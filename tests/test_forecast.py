"""report.forecast: what it counts as hidden (the rewrites, measured where GPUs measured them), what
it keeps apart (compute moved beside collectives left as written), the comm-free bound's stand-in
copies behind ``gap_share``; and benchmarks/diagnostics/forecast_check.py, which holds the forecast
against e2e rows."""
import glob
import os
import sys

import pytest

from overlap_compile.report import SiteReport, forecast, forecast_line, standin_bytes

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)


def _site(**kw) -> dict:
    site = {"graph": "forward", "kind": "gemm_reducescatter", "template": "p2p_ring", "rewritten": True,
            "measured": None, "gemms": [[8192, 4096, 2048]], "predicted_ms": {"baseline": 0.45, "p2p_ring": 0.35},
            "comm_ms": 0.166, "hidden_ms": 0.0, "chosen_ms": 0.35}
    return {**site, **kw}


def test_compute_beside_a_collective_left_as_written_is_kept_apart():
    """A site left as written whose collective defer_compute gives a weight gradient to hide behind
    (hidden_ms, already off its baseline) adds nothing to hidden_ms: it goes to deferred_ms, and
    with_deferred_share is the share with it."""
    kept = _site(graph="backward", template="baseline", rewritten=False, hidden_ms=0.148,
                 predicted_ms={"baseline": 1.344, "p2p_ring": 1.388}, chosen_ms=1.344, gemms=[[8192, 4096, 14336]])
    fc = forecast([_site(), kept])
    assert fc["all"]["hidden_ms"] == pytest.approx(0.1)
    assert fc["all"]["deferred_ms"] == pytest.approx(0.148)
    assert fc["backward"]["hidden_ms"] == 0 and fc["backward"]["hidden_share"] == 0
    assert fc["all"]["hidden_share"] == pytest.approx(0.1 / 0.332)
    assert fc["all"]["with_deferred_share"] == pytest.approx(0.248 / 0.332)
    assert "not counted: 0.148 ms" in forecast_line(fc["all"])


def test_a_rewritten_site_gains_against_the_site_as_written_without_deferred_compute():
    """A rewritten site whose collective would have had compute beside it, left as written, saves
    what the site as written (nothing beside it) takes over the op, capped at its collective."""
    site = _site(graph="backward", hidden_ms=0.273, predicted_ms={"baseline": 5.082, "p2p_ring": 5.102},
                 chosen_ms=5.102, comm_ms=0.307)
    fc = forecast([site])["all"]
    assert fc["hidden_ms"] == pytest.approx(5.082 + 0.273 - 5.102) and fc["deferred_ms"] == 0


def test_band_is_what_a_rewrite_would_add_over_nothing():
    """A site kept as written inside the model's error band: what the best rewrite would save of
    its collective if it measured as predicted (the deferred credit is not counted, so nothing is
    taken off for it)."""
    kept = _site(template="baseline", rewritten=False, hidden_ms=0.141, chosen_ms=0.269,
                 predicted_ms={"baseline": 0.269, "p2p_ring": 0.293}, comm_ms=0.158,
                 measured={"note": "within the model error band: ..."})
    fc = forecast([kept])["all"]
    assert fc["band_ms"] == pytest.approx(0.269 + 0.141 - 0.293)
    assert fc["hidden_ms"] == 0 and fc["with_band_share"] == pytest.approx(0.117 / 0.158)


def test_measured_gain_stands_for_the_predicted_one():
    """Where settle timed the site as written and the chosen op on the group, the forecast counts
    the measured gain (capped at the collective); a measurement of another template changes
    nothing."""
    measured = {"baseline_ms": 0.42, "ms": 0.37, "template": "p2p_ring", "config": {"slices": 1}}
    assert forecast([_site(measured=measured)])["all"]["hidden_ms"] == pytest.approx(0.05)
    big = {**measured, "ms": 0.1}
    assert forecast([_site(measured=big)])["all"]["hidden_ms"] == pytest.approx(0.166)
    other = {**measured, "template": "priority_stream"}
    assert forecast([_site(measured=other)])["all"]["hidden_ms"] == pytest.approx(0.1)
    report_site = SiteReport(kind="gemm_reducescatter", graph="forward", node="rs", template="p2p_ring",
                             config={"slices": 2}, predicted_ms={"baseline": 0.45}, reason="", signature="",
                             gemms=[(8192, 4096, 2048)], world_size=2, dtype="bfloat16", comm_ms=0.166,
                             chosen_ms=0.35, measured=measured)
    assert forecast([report_site])["all"]["hidden_ms"] == pytest.approx(0.1)  # measured another config


def test_standin_copies_come_off_the_gap_to_the_bound():
    """The comm-free bound's stand-in for an all-gather copies the shard W times (each read and
    written); for a reduce-scatter it copies the own chunk: at the profile's copy bandwidth, that
    much of the collectives' time is no gap between torch.compile and the bound."""
    ag = _site(kind="allgather_gemm", gemms=[[8192, 3072, 4096]], predicted_ms={"baseline": 0.5}, chosen_ms=0.4,
               comm_ms=0.158)
    rs = _site()
    full = 8192 * 4096 * 2
    assert standin_bytes("allgather_gemm", ag["gemms"], 2, 2) == 2 * full
    assert standin_bytes("gemm_reducescatter", rs["gemms"], 2, 2) == full
    assert standin_bytes("gemm_allreduce", rs["gemms"], 2, 2) == 2 * full
    from overlap_compile.predictor import load_profile

    h200 = load_profile("h200")
    gbps = h200.raw["gemm"]["copy_gbps"]  # measured: a copy kernel's, not the HBM's peak
    assert gbps < h200.gemm.mem_gbps
    fc = forecast([ag, rs], "h200", world_size=2, dtype="bfloat16")["all"]
    standin = (full * 2 + full) / (gbps * 1e9) * 1e3
    assert fc["standin_ms"] == pytest.approx(standin)
    assert fc["gap_share"] == pytest.approx(0.2 / (0.324 - standin))
    bare = forecast([ag, rs])["all"]  # no profile, no world size: no stand-in term
    assert bare["standin_ms"] == 0 and bare["gap_share"] == pytest.approx(bare["hidden_share"])
    fp32 = forecast([ag], "h200", world_size=2, dtype="float32")["all"]
    assert fp32["standin_ms"] == pytest.approx(min(0.158, 2 * full * 2 / (gbps * 1e9) * 1e3))


def _e2e_rows() -> list[dict]:
    """One configuration, measured: default / overlap / nocomm, train and prefill, its sites."""
    base = {"benchmark": "e2e", "device": "NVIDIA H200", "world_size": 2, "dtype": "bfloat16", "model": "m",
            "shape": "s", "compile_mode": "default", "ckpt": False}
    fwd = _site()
    bwd_rw = _site(graph="backward", kind="allgather_gemm", gemms=[[8192, 7168, 4096]], comm_ms=0.158,
                   predicted_ms={"baseline": 0.88, "p2p_ring": 0.76}, chosen_ms=0.76)
    bwd_kept = _site(graph="backward", template="baseline", rewritten=False, hidden_ms=0.148, chosen_ms=1.3,
                     predicted_ms={"baseline": 1.3})
    sites = [{**fwd, "phase": "train"}, {**bwd_rw, "phase": "train"}, {**bwd_kept, "phase": "train"},
             {**fwd, "graph": "forward_1", "phase": "prefill"}]
    return [{**base, "variant": "default", "train_ms": 15.0, "prefill_ms": 4.5},
            {**base, "variant": "overlap", "train_ms": 14.7, "prefill_ms": 4.4, "sites": sites},
            {**base, "variant": "nocomm", "train_ms": 14.5, "prefill_ms": 4.3,
             "nocomm_replaced": {"all_gather_into_tensor": 3, "reduce_scatter_tensor": 3, "all_reduce (eager)": 5}}]


def test_forecast_check_cells():
    """Per phase: the measured share (torch.compile - overlap over torch.compile - nocomm), the
    forecast beside it, the backward's measured gain estimated as train - prefill, and the
    collectives the bound replaced that are no site."""
    from benchmarks.diagnostics import forecast_check

    cells = forecast_check.check(_e2e_rows(), "f.json")
    by = {c["phase"]: c for c in cells}
    train, prefill = by["train"], by["prefill"]
    assert train["measured_comm_ms"] == pytest.approx(0.5) and train["measured_hidden_ms"] == pytest.approx(0.3)
    assert train["measured_share"] == pytest.approx(0.6) and prefill["measured_share"] == pytest.approx(0.5)
    assert train["measured_backward_ms"] == pytest.approx(0.2)
    assert train["graphs"]["backward"]["hidden_ms"] == pytest.approx(0.12)
    assert train["graphs"]["backward"]["deferred_ms"] == pytest.approx(0.148)
    assert train["forecast"]["hidden_ms"] == pytest.approx(0.22) and train["profile"] == "h200"
    assert train["collectives_not_sites"] == 2 and train["eager_outside_graphs"] == 5
    assert [s["first"] for s in train["sites"]] == [True, True, False]
    assert train["sites"][1]["split_ms"] != 0 and train["sites"][2]["split_ms"] == 0
    err = forecast_check.errors(cells)
    assert err["train"]["gap_share"][2] == 1
    text = forecast_check.table(cells, sites=True) + forecast_check.summary(cells)
    assert "| f.json | m | default | train | 60% |" in text and "backward, summed over 1 cells" in text
    # these rows carry no nocomm_standins: a bound from before its all-gather stand-in was one cat
    assert train["bound_standins"] == 1 and "before its all-gather stand-in was one cat" in text
    from benchmarks.nocomm import STANDINS

    now = [{**r, "nocomm_standins": STANDINS} if r["variant"] == "nocomm" else r for r in _e2e_rows()]
    assert "before its all-gather stand-in" not in forecast_check.table(forecast_check.check(now, "f.json"))


def test_forecast_check_takes_rows_timed_side_by_side_round_by_round():
    """Rows of e2e.py --interleave: the measured share from the rounds' own ratios
    (e2e_report.speedup), not from the medians, which come from different rounds."""
    from benchmarks.diagnostics import forecast_check

    group = ["default", "overlap", "nocomm"]
    rounds = {"default": [15.0, 16.0, 17.0], "overlap": [14.7, 15.68, 16.66], "nocomm": [14.5, 15.5, 16.5]}
    rows = [{**r, "interleaved": group, "train_ms_rounds": rounds[r["variant"]],
             # medians from other rounds than each other's: 16.0 / 14.0 / 15.9 would say overlap beats the bound
             "train_ms": {"default": 16.0, "overlap": 14.0, "nocomm": 15.9}[r["variant"]]} for r in _e2e_rows()]
    train = next(c for c in forecast_check.check(rows, "f.json") if c["phase"] == "train")
    # every round: overlap 2% under torch.compile, the bound ~3.1-3.3% under it
    s_o = 1 / 0.98
    s_b = sorted(d / b for d, b in zip(rounds["default"], rounds["nocomm"]))[1]
    assert train["measured_share"] == pytest.approx((1 - 1 / s_o) / (1 - 1 / s_b))
    assert train["measured_hidden_ms"] == pytest.approx(16.0 * 0.02)


ZOO = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "e2e-*-w2-*-zoo-*.json")))


@pytest.mark.skipif(not ZOO, reason="no zoo e2e results committed")
def test_committed_zoo_rows_keep_the_deferred_credit_out():
    """On the committed model-zoo rows: the forecast holds against the measured gap closed better
    without the credit for compute beside collectives left as written than with it, in training
    steps (where that credit is; the backward's measured gain, train - prefill, stays below what
    the credit promised), and it never counts the credit as hidden."""
    from benchmarks.diagnostics import forecast_check

    cells = forecast_check.check_files(ZOO, ["*:titan_llama3_70b", "*zoo-8b.json:titan_*"])
    train = [c for c in cells if c["phase"] == "train"]
    assert train
    for c in train:
        fc = c["forecast"]
        kept = sum(s["deferred_ms"] for s in c["sites"])
        assert fc["deferred_ms"] == pytest.approx(kept)
        assert fc["hidden_ms"] == pytest.approx(sum(s["gain_ms"] for s in c["sites"]))
    # where a credit was given (cells compiled with defer_compute on): without it the forecast is closer
    credited = [c for c in train if c["forecast"]["deferred_ms"] > 0]
    assert credited
    err = forecast_check.errors(credited)["train"]
    assert err["gap_share"][1] < err["with_deferred_share"][1], err
    bwd = [c for c in train if "measured_backward_ms" in c and "backward" in c["graphs"]]
    promised = sum(c["graphs"]["backward"]["hidden_ms"] + c["graphs"]["backward"]["deferred_ms"] for c in bwd)
    assert sum(c["measured_backward_ms"] for c in bwd) < promised / 2
