"""benchmarks/moe.py on CPU (--dry-run: gloo, world 2, tiny shapes) and benchmarks/plot.py on its rows.

One dry run (training, reduce-overhead, an expert sweep 4, 8, both routings, sequential / nocomm /
moe_fused) and its files: the bound's graphs hold no all-to-all, moe_fused matches sequential and
rewrites the forward section only, the skewed inputs send most first choices to expert 0 (computed
here from the same inputs), speedup / bound / gap closed follow from the rows' ms, the latency-vs-
experts and speedup PNGs are written. Beside it, without compiling: the sweep's cases, the command
line's defaults, and a time budget that is already spent (every block skipped, rows kept)."""
import contextlib
import io
import json
import os

import pytest
import torch

from benchmarks import moe, plot, timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--dry-run", "--limit", "1", "--experts-sweep", "4,8", "--modes", "reduce-overhead", "--phases", "train",
        "--variants", "sequential,nocomm,moe_fused", "--iters", "1"]


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the ranks are processes of their own: main's table only
        returned = moe.main([*ARGS, "--out", str(out)])
    (path,) = [out / p for p in os.listdir(out) if p.startswith("moe-cpu") and p.endswith(".json")]
    rows = json.loads(path.read_text())
    assert rows == json.loads(json.dumps(returned))
    return out, path, rows, printed.getvalue()


def test_rows_cover_the_sweep_routings_and_mode(dry):
    _, _, rows, _ = dry
    assert all("error" not in r and "skipped" not in r for r in rows), [r.get("error") or r.get("skipped") for r in rows]
    assert sorted((r["experts"], r["routing"], r["variant"]) for r in rows) == sorted(
        (e, rt, v) for e in (4, 8) for rt in ("uniform", "skewed") for v in ("sequential", "nocomm", "moe_fused"))
    for r in rows:
        assert r["shape"] == ("tiny-8" if r["experts"] == 8 else "tiny-8 E=4")  # the sweep names its new size
        assert (r["kind"], r["method"], r["phase"]) == ("moe_train", r["variant"], "train")
        assert (r["mode"], r["compile_mode"]) == ("cuda_graph", "reduce-overhead")
        assert r["cudagraph_skips"] >= 1, "on CPU, Inductor falls back to host launches, and the row says so"
        assert r["sizes"] == {"S": 64, "H": 32, "I": 48} and r["topk"] == 2
        assert r["tokens_per_s"] == pytest.approx(2 * 64 / (r["ms"] / 1e3))


def test_rows_count_the_op_graph_outcomes(dry):
    """Each row counts how the template ops' host-launched calls went (runtime.op_graphs) over its
    timed calls; on CPU the ops run the reference pipeline, which never goes through op_graphs,
    so every count is 0 and the table's column shows "-"."""
    _, _, rows, printed = dry
    for r in rows:
        assert set(r["op_graph_calls"]) == set(timing.OP_GRAPH_CALLS) and not any(r["op_graph_calls"].values()), r
    assert "op graphs" in printed.splitlines()[next(i for i, line in enumerate(printed.splitlines())
                                                   if line.strip().startswith("shape"))]


def test_skewed_routing_sends_most_first_choices_to_expert_0(dry):
    _, _, rows, _ = dry
    for e in (4, 8):
        case = {**moe.DRY_SHAPES[0], "E": e}
        layer = moe.build_layer(case, 2, 0, "unused", "cpu", torch.float32)
        share = {}
        for routing in ("uniform", "skewed"):
            per_rank = []
            for rank in (0, 1):
                router, x = moe.routing_inputs(layer.router, case, routing, rank)
                assert x.std() > 0.5 and bool((x != 0).all()), "random, non-zero inputs"
                per_rank.append(((x @ router.t()).argmax(-1) == 0).float().mean().item())
            share[routing] = sum(per_rank) / 2
            for r in rows:
                if (r["experts"], r["routing"]) == (e, routing):
                    assert r["hot_share"] == pytest.approx(share[routing])
        assert share["skewed"] > 0.9 and share["uniform"] < 0.5, share
        # capacity-padded: the hot expert overflows, so the skewed run drops more choices
        drops = {r["routing"]: r["dropped_share"] for r in rows if r["experts"] == e}
        assert drops["skewed"] > drops["uniform"]


def test_bound_row_has_no_all_to_all_and_no_rel_err(dry):
    _, _, rows, _ = dry
    for r in rows:
        if r["variant"] == "nocomm":
            assert r["sites"] == [], "the overlap pass found no all-to-all site left"
            assert r["all_to_all_in_graphs"] == 0 and r["nocomm_replaced"] == {"all_to_all_single": 4}
            assert "rel_err" not in r and r["rel_err_note"].startswith("none")
        elif r["variant"] == "sequential":
            assert r["all_to_all_in_graphs"] == 4  # dispatch + combine, forward and backward
            assert [s[2] for s in r["sites"]] == ["baseline", "baseline"]


def test_moe_fused_matches_and_rewrites_the_forward_section(dry):
    _, _, rows, _ = dry
    for r in rows:
        if r["variant"] == "moe_fused":
            assert r["rel_err"] <= 1e-6
            # training: both sections rewritten (the backward by moe_fused_backward)
            assert sorted((s[0].split("_")[0], s[3]) for s in r["sites"]) == [("backward", True), ("forward", True)]
            assert r["config"]["force_template"] == "moe_fused"


def test_speedup_bound_and_gap_closed_follow_from_the_rows(dry):
    _, _, rows, _ = dry
    by = {(r["experts"], r["routing"], r["variant"]): r for r in rows}
    for (e, routing, variant), r in by.items():
        seq, bound = by[(e, routing, "sequential")]["ms"], by[(e, routing, "nocomm")]["ms"]
        if variant == "sequential":
            assert "speedup" not in r
            assert r.get("comm_ms") == (pytest.approx(seq - bound) if seq > bound else None)
            continue
        assert r["speedup"] == pytest.approx(seq / r["ms"])
        assert r["bound_ms"] == bound and r["bound_speedup"] == pytest.approx(seq / bound)
        assert r["gap_closed"] == (pytest.approx((seq - r["ms"]) / (seq - bound)) if seq > bound else None)


def test_files_and_plots(dry):
    out, path, rows, stdout = dry
    stem = path.stem
    partial = [p for p in os.listdir(out) if p.startswith("moe-partial-")]
    assert len(partial) == 1 and len((out / partial[0]).read_text().splitlines()) == len(rows)
    for routing in ("uniform", "skewed"):
        png = out / f"{stem}-moe_train-{routing}-cuda_graph.png"  # speedup bars with the bound
        assert png.exists() and png.stat().st_size > 1000
    (by_experts,) = [p for p in os.listdir(out) if "by-experts" in p]
    assert (out / by_experts).stat().st_size > 1000
    panels = plot.by_experts(rows)
    ((kind, _), panel), = panels.items()
    assert kind == "moe_train" and sorted(panel) == [("skewed", "cuda_graph"), ("uniform", "cuda_graph")]
    for lines in panel.values():
        assert sorted(lines) == ["moe_fused", "nocomm", "sequential"]
        assert all([e for e, _ in pts] == [4, 8] for pts in lines.values())
    md = (out / f"{stem}.md").read_text()
    assert "**moe_train-skewed, cuda_graph**" in md and "geomean nocomm" in md
    assert "nocomm" in stdout and "moe_fused" in stdout


def test_cases_of_an_expert_sweep():
    with open(os.path.join(ROOT, "benchmarks", "shapes.json")) as f:
        shapes = json.load(f)["moe"]
    got = moe.cases(shapes[:3], [8, 16, 32, 64])
    # MoE-1 and MoE-2 differ only in E: MoE-2's sizes are one point of MoE-1's sweep, named by it
    assert [c["name"] for c in got] == ["MoE-1", "MoE-1 E=16", "MoE-2", "MoE-1 E=64",
                                        "MoE-3 E=8", "MoE-3 E=16", "MoE-3", "MoE-3 E=64"]
    assert [c["E"] for c in got] == [8, 16, 32, 64] * 2 and {c["topk"] for c in got[4:]} == {5}
    assert moe.cases(shapes[:2], None) == shapes[:2]


def test_command_line_defaults_and_checks():
    a = moe.parse(["--dry-run"])
    assert a.routing == ["uniform", "skewed"] and a.modes == ["default", "reduce-overhead"]
    assert a.phases == ["forward", "train"] and a.variants == list(moe.VARIANTS)
    assert a.world == 2 and a.time_budget == 0.0 and a.experts_sweep is None
    assert moe.parse(["--dry-run", "--variants", "overlap,nocomm"]).variants == ["sequential", "nocomm", "overlap"]
    assert moe.variants_for("train", list(moe.VARIANTS), dry=False) == list(moe.VARIANTS)  # every path on GPUs
    assert moe.variants_for("forward", list(moe.VARIANTS), dry=True) == ["sequential", "nocomm", "moe_fused",
                                                                         "moe_fused_routed", "overlap"]
    for bad in (["--routing", "hot"], ["--modes", "max-autotune"], ["--experts-sweep", "8,x"]):
        with pytest.raises(SystemExit):
            moe.parse(["--dry-run", *bad])


def test_spent_time_budget_skips_every_block_and_keeps_the_rows(tmp_path):
    import torch.distributed as dist

    a = moe.parse(["--dry-run", "--time-budget", "0.001", "--phases", "forward", "--variants", "nocomm",
                   "--out", str(tmp_path)])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = moe.worker(vars(a))
    finally:
        dist.destroy_process_group()
    assert len(rows) == 2 * 2 * 2 * 2  # shapes x modes x (sequential, nocomm) x routings
    assert all(r["skipped"].startswith("time budget") and "ms" not in r for r in rows)
    (partial,) = os.listdir(tmp_path)
    assert len((tmp_path / partial).read_text().splitlines()) == len(rows)
