"""benchmarks/diagnostics/exposed_comm.py on CPU: the interval arithmetic and the attribution of
communication kernels to sites on synthetic timelines, then one dry run (gloo, world 2) that
produces the rows, the table and the plot's input."""
import pytest

from benchmarks.diagnostics import exposed_comm as ec


def test_union_merges_overlapping_and_touching_intervals():
    assert ec.union([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7)]) == [(0, 4), (5, 6)]
    assert ec.length([(0, 10), (2, 3), (9, 12)]) == 12
    assert ec.union([]) == [] and ec.length([]) == 0


def test_intersect_and_subtract():
    a, b = [(0, 10), (20, 30)], [(5, 25)]
    assert ec.intersect(a, b) == [(5, 10), (20, 25)]
    assert ec.subtract(a, b) == [(0, 5), (25, 30)]
    assert ec.subtract([(0, 10)], [(2, 3), (4, 5), (9, 12)]) == [(0, 2), (3, 4), (5, 9)]
    assert ec.subtract([(0, 10)], []) == [(0, 10)] and ec.intersect([(0, 1)], [(1, 2)]) == []


def test_hidden_and_exposed_split_communication_by_compute_beside_it():
    # comm [0, 10) and [12, 16); compute [2, 5) and [8, 14): hidden 3 + 2 + 2 = 7, exposed 7
    hidden, exposed = ec.hidden_and_exposed([(0, 10), (12, 16)], [(2, 5), (8, 14)])
    assert (hidden, exposed) == (7, 7)
    assert ec.hidden_and_exposed([(0, 4)], []) == (0, 4)


def test_collectives_by_name():
    nccl_rs = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    assert ec.collective_of(nccl_rs) == "reduce_scatter"
    assert ec.collective_of("ncclDevKernel_AllGather_RING_LL") == "all_gather"
    assert ec.collective_of("_c10d_functional.all_to_all_single.default") == "all_to_all"
    assert ec.collective_of("ncclDevKernel_SendRecv") == "send_recv"
    assert ec.collective_of("c10d::_allgather_base_") == "all_gather"
    assert ec.collective_of("triton_poi_fused_add_0") is None
    assert ec.comm_kernel("Memcpy DtoD (Device -> Device)", 20, compute_stream=7)
    assert not ec.comm_kernel("Memcpy DtoD (Device -> Device)", 7, compute_stream=7)
    assert ec.comm_kernel("Memcpy PtoP (Device -> Device)", 7, compute_stream=7)


def _sites(*spec):
    return [ec.Expected(f"s{i}", coll, rew, "signal_reorder" if rew else "baseline")
            for i, (coll, rew) in enumerate(spec)]


def test_collectives_as_written_take_one_kernel_each_in_order():
    sites = _sites(("all_gather", False), ("reduce_scatter", False), ("all_gather", False))
    got = ec.match_by_order([("all_gather", 1), ("reduce_scatter", 1), ("all_gather", 1), ("all_reduce", 1)], sites)
    assert got == [(0, "by order"), (1, "by order"), (2, "by order"), (None, "unmapped")]
    # a kernel of the wrong kind is not forced onto the next site
    assert ec.match_by_order([("all_reduce", 1), ("all_gather", 1)], sites) == [(None, "unmapped"), (0, "by order")]


def test_a_rewritten_site_takes_its_kernels_until_the_next_collective_as_written():
    sites = _sites(("all_gather", False), ("reduce_scatter", True), ("all_gather", False))
    events = [("all_gather", 1), ("reduce_scatter", 5), (None, 5), ("reduce_scatter", 5), ("all_gather", 1)]
    assert [k for k, _ in ec.match_by_order(events, sites)] == [0, 1, 1, 1, 2]
    # a kernel that fits both the rewritten site and the next collective as written: the stream tells
    sites = _sites(("reduce_scatter", True), ("reduce_scatter", False))
    got = ec.match_by_order([("reduce_scatter", 5), ("reduce_scatter", 5), ("reduce_scatter", 1)], sites, {1})
    assert got == [(0, "by order"), (0, "by order"), (1, "by order")]
    # no stream known: the rewritten site keeps it and the row says it was a guess
    assert ec.match_by_order([("reduce_scatter", 5)], sites) == [(0, "by order, ambiguous")]


def test_attribute_by_range_then_by_order():
    sites = _sites(("all_gather", False), ("reduce_scatter", True))
    calls = [ec.Range("overlap_compile::signal_reorder_gemm_collective", 1, 100.0, 200.0)]
    events = [ec.Event("ag", 1, 0, 10, True, "all_gather", launch=(1, 50.0)),
              ec.Event("rs", 1, 20, 30, True, "reduce_scatter", launch=(1, 150.0)),
              ec.Event("ar", 1, 40, 50, True, "all_reduce", launch=(1, 250.0))]
    ec.attribute(events, calls, sites, {1})
    assert [(e.site, e.how) for e in events] == [("s0", "by order"), ("s1", "by range"), (ec.OUTSIDE, "by order")]


def test_measure_splits_steps_at_the_markers():
    compute = [ec.Event("gemm", 7, t, t + 10) for t in (10, 110)]
    comm = [ec.Event("nccl_ag", 9, t + 5, t + 20, True, "all_gather") for t in (10, 110)]
    markers = [ec.Event("AllReduce_Sum_f64", 9, t - 2, t, True, "all_reduce", marker=True) for t in (10, 110)]
    got = ec.measure(compute + comm + markers, [], _sites(("all_gather", False)))
    assert got["steps"] == 2
    # per step: compute 10 us, comm 15 us of which 5 under the GEMM, span 20 us, no idle time
    assert got["compute_ms"] == pytest.approx(0.010) and got["hidden_ms"] == pytest.approx(0.005)
    assert got["exposed_ms"] == pytest.approx(0.010) and got["idle_ms"] == pytest.approx(0.0)
    site = got["sites"]["s0"]
    assert site["events"] == 1 and site["how"] == "by order" and site["start_ms"] == pytest.approx(0.005)
    # compute kernel time per role and per name, per step; communication left out
    assert got["roles_ms"] == {"gemm": pytest.approx(0.010)}
    assert got["top_kernels"] == [{"name": "gemm", "ms": pytest.approx(0.010), "count": 1}]


def test_compute_kernels_by_role():
    assert ec.role("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert ec.role("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma") == "attention"
    assert ec.role("triton_poi_fused_add_mul_0") == "fused (triton)"
    assert ec.role("Memcpy DtoD (Device -> Device)") == "copy"
    assert ec.role("_sum_kernel") == "other"


def test_dry_run_rows_per_site_and_variant(tmp_path):
    from overlap_compile.testing.multiprocess import run_distributed

    a = ec.parse(["--dry-run", "--variants", "default,overlap", "--steps", "1", "--iters", "1"])
    rows = run_distributed("benchmarks.diagnostics.exposed_comm.worker", world_size=2, args=(vars(a),),
                           timeout_s=300)[0]
    assert not [r for r in rows if "error" in r], [r.get("error") for r in rows]
    steps = {r["variant"]: r for r in rows if r["site"] == ec.SUMMARY}
    assert set(steps) == {"default", "overlap"} and all(s["steps"] == 1 for s in steps.values())
    sites = [r for r in rows if r["site"] != ec.SUMMARY]
    written = [r for r in sites if r["variant"] == "default" and r["site"] not in (ec.OUTSIDE, ec.UNMAPPED)]
    assert written and all(r["attribution"] == "by order" and r["template"] == "baseline" for r in written)
    rewritten = [r for r in sites if r["variant"] == "overlap" and r["template"] == "signal_reorder"]
    assert rewritten and all(r["attribution"] == "by range" for r in rewritten)
    assert all("measured_gain_ms" in r and "predicted_gain_ms" in r for r in rewritten)
    assert {r["graph"] for r in rewritten} >= {"forward", "backward"}
    assert "| overlap |" in ec.markdown(rows)
    assert all(isinstance(s["compute_roles_ms"], dict) and len(s["idle_ms_ranks"]) == 2 for s in steps.values())
    pytest.importorskip("matplotlib")
    from benchmarks.plot import plot_exposed_comm

    plot_exposed_comm(rows, str(tmp_path / "bars.png"))
    assert (tmp_path / "bars.png").exists()
