"""benchmarks/diagnostics/memory_account.py on CPU: its Inductor override applies inside its block
only, and one dry run (gloo, world 2, tiny shapes) gives every variant and phase a row per rank
whose table fields are real numbers."""
import math

from benchmarks.diagnostics import memory_account as ma


def test_reorder_for_peak_memory_is_forced_inside_the_block_only():
    from overlap_compile import backend, config, inductor_hook

    with config.patch(defer_compute=True):
        p = inductor_hook.make_pass()
        assert inductor_hook.inductor_patches(p)["reorder_for_peak_memory"] is False
        with ma.reorder_for_peak_memory_forced():
            assert backend.inductor_patches(p)["reorder_for_peak_memory"] is True
            assert inductor_hook.inductor_patches(p)["post_grad_custom_post_pass"] is p
        assert backend.inductor_patches(p)["reorder_for_peak_memory"] is False


def test_dry_run_rows_are_real_numbers():
    from overlap_compile.testing.multiprocess import run_distributed

    a = ma.parse(["--dry-run", "--models", "megatron_fused_8b", "--steps", "1", "--warmup", "1"])
    rows = run_distributed("benchmarks.diagnostics.memory_account.worker", world_size=2, args=(vars(a),),
                           timeout_s=600)[0]
    assert not [r for r in rows if "error" in r], [r.get("error") for r in rows]
    got = {(r["variant"], r["phase"], r["rank"]) for r in rows}
    assert got == {(v, p, k) for v in ma.VARIANTS for p in ma.PHASES for k in (0, 1)}
    for r in rows:
        for field in ma.TABLE + ("vs", "vs_steady", "base", "start"):
            v = r[field]
            assert isinstance(v, float) and math.isfinite(v) and v >= 0, (field, v, r["variant"], r["phase"])
        assert r["peak"] >= r["steady"] > 0 and r["peak"] >= r["first"] > 0
        # the phase's peak is the largest of its windows' (first, warm-up, steady), named by peak_in
        assert r["peak_in"] in ("first", "warmup", "steady")
        assert r["peak_in"] == "warmup" or r["peak"] == r[r["peak_in"]]
    overlap = [r for r in rows if r["variant"] != "inductor"]
    assert all(r["templates"].get("signal_reorder") for r in overlap)  # the dry run forces it
    assert all(r["config"]["reorder_for_peak_memory"] for r in rows if r["variant"] == "overlap_reorder")
    assert all(r["config"]["defer_compute"] is True for r in rows if r["variant"] in ("overlap_defer", "overlap_reorder"))
    table = ma.markdown(rows)
    assert all(f"| {v} |" in table for v in ma.VARIANTS)


def test_live_at_peak_replays_the_trace_and_groups_by_site():
    from benchmarks.diagnostics.memory_account import live_at_peak

    lib = [{"filename": "/x/torch/_ops.py", "line": 1, "name": "__call__"},
           {"filename": "/r/overlap_compile/templates/p2p_ring/kernels.py", "line": 42, "name": "run"}]
    gen = [{"filename": "/tmp/torchinductor_u/ab/cabc.py", "line": 7, "name": "call"}]
    mib = 2 ** 20
    trace = [{"action": "alloc", "addr": 1, "size": 4 * mib, "frames": gen},
             {"action": "alloc", "addr": 2, "size": 8 * mib, "frames": lib},
             {"action": "alloc", "addr": 3, "size": 2 * mib, "frames": lib},
             {"action": "free_requested", "addr": 2, "size": 8 * mib},
             {"action": "free_completed", "addr": 2, "size": 8 * mib},  # counted once, when requested
             {"action": "alloc", "addr": 4, "size": 1 * mib, "frames": gen},
             {"action": "free_requested", "addr": 99, "size": 1},  # allocated before the trace: ignored
             ]
    got = live_at_peak(trace)
    assert got["peak_mib"] == 14
    # a window after the first peak: its own peak, with what was allocated before it still counted
    assert live_at_peak(trace, start=5)["peak_mib"] == 7
    assert live_at_peak(trace, start=5)["sites"][0] == {"site": "cabc.py:7 call", "mib": 5, "count": 2, "before": 1}
    assert got["sites"] == [{"site": "kernels.py:42 run", "mib": 10, "count": 2, "before": 0},
                            {"site": "cabc.py:7 call", "mib": 4, "count": 1, "before": 0}]


def test_markdown_names_the_calls_that_held_the_peak():
    """--at-peak: the live set is the phase's own peak's, whichever calls it came in (under
    reduce-overhead the CUDA-graph trees' warm-up and recording calls), and the table says which."""
    row = {"model": "m", "compile_mode": "reduce-overhead", "phase": "train", "variant": "overlap", "rank": 0,
           "peak_in": "warmup", "templates": {}, "measured_sites": 0, **{c: 1.0 for c in ma.TABLE},
           "at_peak": {"peak_mib": 4771.0, "sites": [{"site": "base.py:258 op", "mib": 224.0, "count": 1, "before": 0}]}}
    text = ma.markdown([row])
    assert "4771 MiB allocated at the phase's peak, in its warmup calls" in text
    assert "| site | MiB | blocks | of them allocated before the warmup calls |" in text
    assert "| `base.py:258 op` | 224.0 | 1 | 0 |" in text
