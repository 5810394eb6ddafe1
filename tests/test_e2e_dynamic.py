"""e2e.py's dynamic-shape prefill on CPU over gloo (world 2), the dry run's command
(``--dry-run --dynamic both --seqs ... --models megatron_fused_8b --phases prefill``): per length a
dynamic and a static row for torch.compile and the overlap backend (signal_reorder forced), every
output equal to eager's, the dynamic compile made once (no graph compiled after the first length),
one static compile per length, a length the world size does not shard skipped with its reason, and
the report's per-length speedups, gain share and rules on the dynamic rows (decode-sized lengths:
the overlap compile timed beside torch.compile's in alternating rounds)."""
import pytest

from benchmarks import e2e, e2e_dynamic
from overlap_compile.testing.multiprocess import run_distributed

SEQS = (16, 24, 5, 40)  # 5: not a multiple of the world size
SEQS_SIDE_BY_SIDE = (16, 5, 40)  # four compiles at every length: fewer lengths


def _sweeps(*args: dict) -> list:
    return [e2e.worker(a) for a in args]


def _parse(*extra: str):
    a = e2e.parse(["--dry-run", "--dynamic", "both", "--seqs", ",".join(map(str, SEQS)), "--models",
                   "megatron_fused_8b", "--phases", "prefill", "--iters", "1", "--no-check-models", *extra])
    a.out = None  # no partial-results file from tests
    return a


@pytest.fixture(scope="module")
def sweeps():
    """One distributed run: the configurations one after another, then the four compiles side by
    side (``--interleave``)."""
    alone, together = _parse(), _parse("--interleave", "--seqs", ",".join(map(str, SEQS_SIDE_BY_SIDE)),
                                       "--static-seqs", "16")
    got = run_distributed(_sweeps, world_size=2, args=(vars(alone), vars(together)), timeout_s=600)[0]
    return [e2e.compare(g, alone.loss_rtol) for g in got]


@pytest.fixture(scope="module")
def rows(sweeps):
    return sweeps[0]


@pytest.fixture(scope="module")
def rows_side_by_side(sweeps):
    return sweeps[1]


def _row(rows, variant, dynamic, seq):
    found = [r for r in rows if (r.get("variant"), r.get("dynamic"), r.get("seq")) == (variant, dynamic, seq)]
    assert len(found) == 1, (variant, dynamic, seq, [e2e.one_line(r) for r in rows])
    return found[0]


def test_flags_default_to_prefill_and_the_two_compilers():
    a = e2e.parse(["--dry-run", "--seqs", "16,24,16"])
    assert (a.phases, a.variants, a.dynamic, a.seqs) == ("prefill", "default,overlap", "both", [16, 24])
    assert a.static_seqs == [16, 24]  # the static compiles run at every length unless told
    assert e2e.parse(["--dry-run", "--seqs", "16,24,40", "--static-seqs", "24,40"]).static_seqs == [24, 40]
    with pytest.raises(SystemExit, match=r"--static-seqs: \[8\] not among --seqs"):
        e2e.parse(["--dry-run", "--seqs", "16,24", "--static-seqs", "8,24"])


def test_every_length_dynamic_and_static_equal_to_eager(rows):
    assert not [r for r in rows if "error" in r], [e2e.one_line(r) for r in rows if "error" in r]
    for variant in ("default", "overlap"):
        for dynamic in (True, False):
            for seq in (16, 24, 40):
                r = _row(rows, variant, dynamic, seq)
                assert r["correct"] is True and r["max_rel"] <= 1e-4, e2e.one_line(r)
                assert r["shape"] == e2e_dynamic.shape_label("tiny (CPU)", seq, dynamic) and r["sizes"]["seq"] == seq
                assert r["prefill_ms"] > 0 and r["ms"] == r["prefill_ms"] and r["recompiles_timed"] == 0
            skipped = _row(rows, variant, dynamic, 5)
            assert "not a multiple of the world size 2" in skipped["skipped"]


def test_dynamic_compiles_once_static_once_per_length(rows):
    for variant in ("default", "overlap"):
        assert [_row(rows, variant, True, s)["compiles"] for s in (16, 24, 40)] == [1, 0, 0], variant
        assert [_row(rows, variant, False, s)["compiles"] for s in (16, 24, 40)] == [1, 1, 1], variant


def test_overlap_sites_symbolic_with_buckets_only_when_dynamic(rows):
    dyn = _row(rows, "overlap", True, 16)
    symbolic = [s for s in dyn["sites"] if s["buckets"]]
    assert symbolic and all(s["template"] in ("bucketed", "baseline") for s in symbolic), dyn["sites"]
    assert any(s["template"] == "bucketed" for s in symbolic)
    assert all(b["template"] for s in symbolic for b in s["buckets"])
    # what ran at each length: the forced template, at M = world x batch x rows per rank
    assert [_row(rows, "overlap", True, s)["bucket_choices"] for s in (16, 24, 40)] == [
        [[2 * s, "signal_reorder"]] for s in (16, 24, 40)]
    static = _row(rows, "overlap", False, 24)
    assert static["sites"] and not any(s["buckets"] for s in static["sites"])
    # the same sites either way: `s, b, _ = gathered.shape` reads the all-gather's symbolic size,
    # which must not hide the QKV all-gather (passes/graph_utils.size_reads_after_waits)
    kinds = sorted(s["kind"] for s in static["sites"])
    assert sorted(s["kind"] for s in dyn["sites"]) == kinds and kinds.count("allgather_gemm") == 2, dyn["sites"]


def test_report_speedups_gain_share_and_rules(rows):
    ok, lines = e2e_dynamic.summary(rows)
    text = "\n".join(lines)
    assert "megatron_fused_8b default overlap" in text and "graphs compiled after the first length: 0" in text
    for seq in (16, 24, 40):
        r = _row(rows, "overlap", True, seq)
        assert r["prefill_speedup"] > 0 and r["static_speedup"] > 0
        assert r["rule"].startswith(">= 0.99x")  # all decode-sized here
        # timed beside torch.compile's compile of the same kind (dynamic / static) in alternating rounds
        paired, static = r["paired"], _row(rows, "overlap", False, seq)
        assert paired["rounds"] == e2e_dynamic.PAIRED_ROUNDS_PER_ITER and paired["a_ms"] > 0 and paired["b_ms"] > 0
        assert r["paired_speedup"] == paired["ratio"] and r["rule"].endswith("paired rounds")
        assert r["rule_ok"] == (paired["ratio"] >= e2e_dynamic.DECODE_FLOOR)
        assert r["static_speedup"] == static["paired"]["ratio"] == static["paired_speedup"]
        assert "paired" not in _row(rows, "default", True, seq)
        if abs(r["static_speedup"] - 1) > 1e-9:
            assert r["gain_share"] == pytest.approx((r["paired_speedup"] - 1) / (r["static_speedup"] - 1))
    assert ok == all(_row(rows, "overlap", True, s)["rule_ok"] for s in (16, 24, 40))
    okv, notes = e2e.verdict(rows, 1e-4)
    assert okv and "prefill outputs at each length: 12/12 equal eager's" in notes


def test_rule_for_prefill_lengths_is_the_gain_share():
    base = {"model": "m", "compile_mode": "default", "ckpt": False}
    rows = [{**base, "variant": v, "dynamic": d, "seq": 1024, "prefill_ms": 1.0} for v in ("default", "overlap")
            for d in (True, False)]
    dyn, static = rows[2], rows[3]  # overlap's
    dyn["prefill_speedup"], static["prefill_speedup"] = 1.095, 1.10
    ok, _ = e2e_dynamic.summary(rows)
    assert ok and dyn["rule_ok"] and dyn["gain_share"] == pytest.approx(0.95) and dyn["rule"] == "gain >= 90% of static"
    dyn["prefill_speedup"] = 1.085  # 85% of the static gain
    ok, lines = e2e_dynamic.summary(rows)
    assert not ok and not dyn["rule_ok"] and any("FAIL" in line for line in lines)
    # paired rounds on both rows: their ratios decide, not the rows' own speedups
    dyn["paired"] = {"a_ms": 1.0, "b_ms": 1.1, "ratio": 1.10, "rounds": 20}
    static["paired"] = {"a_ms": 1.0, "b_ms": 1.1, "ratio": 1.10, "rounds": 20}
    ok, _ = e2e_dynamic.summary(rows)
    assert ok and dyn["rule_ok"] and dyn["gain_share"] == pytest.approx(1.0) and dyn["rule"].endswith("paired rounds")


def test_rule_for_decode_lengths_reads_the_paired_rounds():
    base = {"model": "m", "compile_mode": "default", "ckpt": False}
    rows = [{**base, "variant": v, "dynamic": True, "seq": 64, "prefill_ms": 1.0} for v in ("default", "overlap")]
    dyn = rows[1]
    dyn["prefill_speedup"] = 0.80  # timed minutes apart from torch.compile's row: the host drifted
    dyn["paired"] = {"a_ms": 1.0, "b_ms": 0.995, "ratio": 0.995, "rounds": 20}
    ok, lines = e2e_dynamic.summary(rows)
    assert ok and dyn["rule_ok"] and dyn["paired_speedup"] == 0.995 and "paired rounds: PASS" in "\n".join(lines)
    dyn["paired"]["ratio"] = 0.98
    ok, _ = e2e_dynamic.summary(rows)
    assert not ok and not dyn["rule_ok"]
    del dyn["paired"], dyn["paired_speedup"]  # no paired rounds: the row's own speedup
    ok, _ = e2e_dynamic.summary(rows)
    assert not ok and dyn["rule"] == ">= 0.99x torch.compile dynamic"


def test_side_by_side_the_four_compiles_are_timed_in_the_same_rounds(rows_side_by_side):
    """--interleave: torch.compile and overlap, dynamic and static (the static ones at 16 tokens
    only: --static-seqs), alive together; every output equal to eager's, the dynamic compiles made
    once, and each overlap row's paired ratio the median of the rounds' own, from the same rounds
    as the other rows'."""
    rows = rows_side_by_side
    assert not [r for r in rows if "error" in r], [e2e.one_line(r) for r in rows if "error" in r]
    lengths = {True: (16, 40), False: (16,)}
    for variant in ("default", "overlap"):
        for dynamic, seqs in lengths.items():
            for seq in seqs:
                r = _row(rows, variant, dynamic, seq)
                assert r["correct"] is True, e2e.one_line(r)
                assert len(r["interleaved"]) == (4 if seq == 16 else 2) and r["prefill_ms"] > 0
                if seq == 16:
                    assert r["compiles"] >= 1, e2e.one_line(r)  # each compile's first length compiles
                else:
                    assert r["compiles"] == 0, e2e.one_line(r)  # no graph compiled after the first length
        assert "not a multiple" in _row(rows, variant, True, 5)["skipped"]
        assert not [r for r in rows if (r.get("variant"), r.get("dynamic"), r.get("seq")) == (variant, False, 40)]
    for dynamic, seqs in lengths.items():
        for seq in seqs:
            ov, ref = _row(rows, "overlap", dynamic, seq), _row(rows, "default", dynamic, seq)
            mine, theirs = ov["prefill_ms_rounds"], ref["prefill_ms_rounds"]
            assert len(mine) == len(theirs) == e2e_dynamic.PAIRED_ROUNDS_PER_ITER  # decode-sized: more rounds
            assert ov["paired"]["ratio"] == pytest.approx(sorted(b / a for a, b in zip(mine, theirs))[1])
            assert ov["prefill_speedup"] == pytest.approx(ov["paired"]["ratio"])  # e2e_report.speedup, same rounds
    sites = _row(rows, "overlap", True, 16)["sites"]
    assert any(s["template"] == "bucketed" for s in sites)
    assert not any(s["template"] == "bucketed" for s in _row(rows, "overlap", False, 16)["sites"])
    ok, lines = e2e_dynamic.summary(rows)
    assert any("paired rounds" in line for line in lines)


def test_side_by_side_needs_both_compiles_of_both_variants():
    for extra in (["--dynamic", "on"], ["--variants", "default,overlap,nocomm"]):
        with pytest.raises(SystemExit, match="--seqs with --interleave"):
            e2e.parse(["--dry-run", "--seqs", "16,24", "--interleave", *extra])


@pytest.mark.parametrize("template", ["p2p_ring", "tile_fused"])
def test_allgather_sites_rewritten_at_every_length(template):
    """Templates that take the all-gather sites too: the shard's flattening view is sized from the
    graph's inputs, not from a size read off the gathered tensor the rewrite replaces (that made a
    cycle, and Inductor's topological sort failed on every dynamic compile)."""
    a = e2e.parse(["--dry-run", "--dynamic", "on", "--seqs", "16,24", "--models", "megatron_fused_8b",
                   "--phases", "prefill", "--iters", "1", "--no-check-models", "--force", template])
    a.out = None
    got = e2e.compare(run_distributed(e2e.worker, world_size=2, args=(vars(a),), timeout_s=600)[0], a.loss_rtol)
    assert not [r for r in got if "error" in r], [e2e.one_line(r) for r in got if "error" in r]
    for seq in (16, 24):
        r = _row(got, "overlap", True, seq)
        assert r["correct"] is True, e2e.one_line(r)
    sites = _row(got, "overlap", True, 16)["sites"]
    assert sum(s["kind"] == "allgather_gemm" and s["template"] == "bucketed" for s in sites) == 2, sites
