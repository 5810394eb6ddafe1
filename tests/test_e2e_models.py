"""The end-to-end benchmark's models and training loop on CPU over gloo (world 2): the
Megatron-style block equals the DTensor block for the same weights, and training with the overlap
backend (a template forced: on CPU the predictor rightly keeps the baseline) gives the default
backend's losses, with and without activation checkpointing.

One distributed run serves every test (process start-up and compiles dominate the time)."""
import pytest

from benchmarks import e2e
from benchmarks.timing import OP_GRAPH_CALLS
from overlap_compile.testing.multiprocess import run_distributed

FORCED = "signal_reorder"


def _args(**overrides) -> dict:
    a = e2e.parse(["--dry-run", "--shapes", "tiny", "--variants", "default,overlap", "--phases", "train",
                   "--steps", "3", "--iters", "1", "--force", FORCED, "--check-cache", "off", "--no-check-models"])
    a.out = None  # no partial-results file from tests
    return {**vars(a), **overrides}


def everything(plain: dict, ckpt: dict, interleaved: dict):
    """On every rank: the eager model check, then the three sweeps."""
    import torch

    from benchmarks.models.equivalence import megatron_vs_dtensor

    check = megatron_vs_dtensor(e2e.CPU_SHAPES["tiny"], "cpu", torch.float32)
    return check, e2e.worker(plain), e2e.worker(ckpt), e2e.worker(interleaved)


INTERLEAVED = ["default", "overlap", "nocomm"]


@pytest.fixture(scope="module")
def results():
    plain = _args(models="llama_dtensor")
    ckpt = _args(models="llama_megatron", ckpt="on", check_cache="first", repeat=2)  # two rounds of variants
    # the variants side by side in one process, timed one sample each per round
    # (and the Megatron-style rows of the other tests: the same steps on the same data as ``plain``)
    interleaved = _args(models="llama_megatron", variants=",".join(INTERLEAVED), phases="train,prefill", iters=3,
                        interleave=True)
    per_rank = run_distributed(everything, world_size=2, args=(plain, ckpt, interleaved), timeout_s=600)
    _, rows, ckpt_rows, interleaved_rows = per_rank[0]
    return ([c for c, _, _, _ in per_rank], e2e.compare(rows, 1e-4), e2e.compare(ckpt_rows, 1e-4),
            e2e.compare(interleaved_rows, 1e-4))


def _by_model(results) -> dict:
    """(model, variant) -> row: llama_dtensor from the plain sweep, llama_megatron from the
    side-by-side one (both train the same 3 steps on the same data)."""
    _, rows, _, interleaved = results
    return {(r["model"], r["variant"]): r for r in rows + interleaved}


def test_megatron_block_equals_dtensor_block(results):
    checks = results[0]
    for check in checks:  # output, input gradient and every weight gradient (norms after finalize_grads)
        assert check["max_rel"] <= 1e-5, check
    by = _by_model(results)
    # same full weights, same data, same optimizer: the two parallel forms train the same way
    for a, b in zip(by[("llama_dtensor", "default")]["losses"], by[("llama_megatron", "default")]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_training_with_overlap_matches_default(results):
    by = _by_model(results)
    assert [r.get("error") for r in by.values()] == [None] * 5, [r.get("error") for r in by.values()]
    for model, phases in (("llama_dtensor", {"train"}), ("llama_megatron", {"train", "prefill"})):
        ov = by[(model, "overlap")]
        assert ov["rewritten"] > 0 and ov["loss_matches_default"], (model, ov["losses"], by[(model, "default")]["losses"])
        assert {s["template"] for s in ov["sites"] if s["rewritten"]} == {FORCED}
        assert any(s["graph"].startswith("backward") for s in ov["sites"]), "backward graphs have sites too"
        assert {s["phase"] for s in ov["sites"]} == phases  # the plain sweep has no prefill phase
        # forced onto every site, a rewrite can be predicted slower than the site: a negative share
        assert isinstance(ov["train_forecast_hidden"], float) and ov["train_forecast_hidden"] <= 1, ov
        assert ("prefill_forecast_hidden" in ov) == ("prefill" in phases)
        assert ov["losses"][0] != ov["losses"][-1], "AdamW steps must change the loss"
        assert ov["failure_modes"] == [] and ov["recompiles_timed"] == 0, ov["failure_modes"]
        # the common schema's keys, for benchmarks/plot.py
        assert (ov["kind"], ov["method"], ov["mode"], ov["ms"]) == (model, "overlap", "eager", ov["train_ms"])
        # train_ms: steps back to back (a training loop's steady state); one step after a barrier beside it
        assert ov["train_calls"] == 3 and ov["train_cold_ms"] > 0 and "train_cold_speedup" in ov


def test_activation_checkpointing_matches_default_and_fx_cache_hits(results):
    _, _, rows, _ = results
    assert [r.get("error") for r in rows] == [None, None], [r.get("error") for r in rows]
    ov = next(r for r in rows if r["variant"] == "overlap")
    assert ov["ckpt"] and ov["rewritten"] > 0 and ov["loss_matches_default"]
    # a second compile of the rewritten model is served by Inductor's FX graph cache
    assert ov["fxgraph_cache_hit"] > 0
    # --repeat 2: one row per variant, its time the median of the two rounds it ran in
    assert [r["rounds"] for r in rows] == [2, 2]
    for r in rows:
        assert len(r["train_ms_rounds"]) == 2 and r["train_ms"] == pytest.approx(sum(r["train_ms_rounds"]) / 2)


def test_interleaved_variants_run_their_own_code_side_by_side(results):
    _, _, _, rows = results
    assert [r.get("error") for r in rows] == [None] * 3, [r.get("error") for r in rows]
    by = {r["variant"]: r for r in rows}
    for r in rows:
        assert r["interleaved"] == INTERLEAVED
        # one sample per round of every phase, the row's time their median
        for phase in ("train", "train_cold", "prefill"):
            got = r[f"{phase}_ms_rounds"]
            assert len(got) == 3 and r[f"{phase}_ms"] == sorted(got)[1], (phase, got)
    # compiled beside torch.compile's own, each variant ran its own code: the bound replaced the
    # collectives of its graphs, and torch.compile's and overlap's losses (with communication)
    # are the same and differ from the bound's (each rank's shard alone)
    assert sum(v for k, v in by["nocomm"]["nocomm_replaced"].items() if "eager" not in k) > 0
    assert "nocomm_replaced" not in by["default"] and "nocomm_replaced" not in by["overlap"]
    assert by["overlap"]["rewritten"] > 0 and by["overlap"]["loss_matches_default"]
    assert by["nocomm"]["losses"] != pytest.approx(by["default"]["losses"], rel=1e-3)
    assert by["overlap"]["failure_modes"] == [] and by["overlap"]["recompiles_timed"] == 0
    # speedups are the medians of the rounds' own ratios, the gap closed follows from two of them
    d, o, b = (by[v] for v in INTERLEAVED)
    ratio = sorted(x / y for x, y in zip(d["train_ms_rounds"], o["train_ms_rounds"]))[1]
    assert o["train_speedup"] == pytest.approx(ratio)
    s_b = sorted(x / y for x, y in zip(d["train_ms_rounds"], b["train_ms_rounds"]))[1]
    assert o["train_gap_closed"] == pytest.approx((1 - 1 / ratio) / (1 - 1 / s_b))


def test_speedup_takes_ratios_round_by_round_only_for_rows_timed_side_by_side():
    from benchmarks.e2e_report import speedup

    group = ["default", "overlap"]
    d = {"train_ms": 10.0, "train_ms_rounds": [10.0, 20.0, 10.0], "interleaved": group}
    r = {"train_ms": 10.0, "train_ms_rounds": [8.0, 16.0, 10.0], "interleaved": group}
    assert speedup(d, r, "train_ms") == pytest.approx(1.25)  # rounds 1.25, 1.25, 1.0: their median
    # the same samples from rounds that were not side by side (--repeat), or of another group: medians
    for other in ({k: v for k, v in r.items() if k != "interleaved"}, {**r, "interleaved": ["default", "nocomm"]}):
        assert speedup(d, other, "train_ms") == 1.0
    assert speedup(d, {**r, "train_ms_rounds": [8.0, 16.0]}, "train_ms") == 1.0  # rounds that do not pair up


def test_interleaved_timing_reverses_the_order_every_other_round():
    from benchmarks.timing import time_interleaved

    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    got = time_interleaved(fns, iters=4, warmup=1, calls=2)
    assert order[:3] == ["a", "b", "c"]  # the warm-up
    rounds = [order[3 + 6 * i: 3 + 6 * (i + 1)][::2] for i in range(4)]  # each sample: calls=2 back to back
    assert rounds == [["a", "b", "c"], ["c", "b", "a"]] * 2
    assert sorted(got) == ["a", "b", "c"] and all(len(v) == 4 and min(v) >= 0 for v in got.values())
    with pytest.raises(ValueError, match="iters and calls must be >= 1"):
        time_interleaved(fns, iters=0)


def test_interleaved_warm_up_waits_for_a_settled_round():
    """``settle``: warm-up rounds go on until one leaves the state unchanged (op graphs that stop
    capturing), at least ``warmup`` and at most ``max_warmup``, then the timed rounds."""
    from benchmarks.timing import time_interleaved

    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    moving = iter([1, 2, 3])  # the state moves over the first three rounds, then stays
    state = {"v": 0}

    def settle():
        return state["v"]

    def step():  # each call of "a" in the first rounds moves the state
        calls.append("a")
        state["v"] = next(moving, 3)

    fns["a"] = step
    time_interleaved(fns, iters=1, warmup=1, settle=settle)
    assert calls.count("a") == 4 + 1  # rounds 1-3 moved it, round 4 did not: then one timed round
    calls.clear()
    state["v"] = 0
    fns["a"] = lambda: (calls.append("a"), state.__setitem__("v", state["v"] + 1))  # never settles
    time_interleaved(fns, iters=1, warmup=1, settle=settle, max_warmup=5)
    assert calls.count("a") == 5 + 1


def _interleaved_with_a_failing_preparation(args: dict):
    """e2e's worker with the side-by-side preparation of torch.compile's variant failing (as torch
    2.11's CUDA-graph trees did for a Megatron-style block under reduce-overhead)."""
    from benchmarks import e2e as e2e_module

    real = e2e_module.prepare

    def failing(model_name, shape, variant, *rest, **kw):
        if variant == "default":  # the first one, as there: nothing compiled side by side before the fallback
            raise AssertionError("a CUDA-graph trees assertion")
        return real(model_name, shape, variant, *rest, **kw)

    e2e_module.prepare = failing
    try:
        return e2e_module.worker(args)
    finally:
        e2e_module.prepare = real


def test_a_group_that_fails_side_by_side_is_timed_one_at_a_time():
    args = _args(models="llama_megatron", variants="default,nocomm", steps=1, interleave=True)
    rows = run_distributed(_interleaved_with_a_failing_preparation, world_size=2, args=(args,), timeout_s=600)[0]
    assert [r["variant"] for r in rows] == ["default", "nocomm"]
    for r in rows:  # every cell measured, one variant after another, each saying why
        assert "error" not in r and r["train_ms"] > 0 and "interleaved" not in r, e2e.one_line(r)
        assert r["interleave_failed"] == "default: AssertionError: a CUDA-graph trees assertion"


def test_interleave_refuses_isolate_and_repeat():
    for extra in (["--isolate"], ["--repeat", "2"]):
        with pytest.raises(SystemExit, match="--interleave times the variants side by side"):
            e2e.parse(["--dry-run", "--interleave", *extra])


def test_rounds_alternate_the_order_of_the_variants():
    variants = ["default", "overlap", "async_tp", "nocomm"]
    orders = [e2e.round_order(variants, r) for r in range(4)]
    assert orders[0] == orders[2] == variants and orders[1] == orders[3] == variants[::-1]
    # over any two rounds in a row every variant's mean place in its round is the same
    for pair in (orders[:2], orders[1:3]):
        assert {v: sum(o.index(v) for o in pair) for v in variants} == dict.fromkeys(variants, len(variants) - 1)
    assert e2e.round_order(variants, 0) is not variants  # a copy: the caller's list is not reordered


def test_rounds_merge_into_one_row_per_configuration():
    ok = {"variant": "overlap", "train_ms": 10.0, "tokens_per_s": 100.0, "prefill_ms": 4.0,
          "prefill_tokens_per_s": 50.0, "sites": ["s"], "ms": 10.0}
    rounds = [ok, {**ok, "train_ms": 14.0, "prefill_ms": 2.0}, {**ok, "train_ms": 12.0, "prefill_ms": 3.0}]
    row = e2e.merge_rounds(rounds)
    assert (row["train_ms"], row["prefill_ms"], row["ms"], row["rounds"]) == (12.0, 3.0, 12.0, 3)
    assert row["train_ms_rounds"] == [10.0, 14.0, 12.0] and row["sites"] == ["s"]
    assert row["tokens_per_s"] == pytest.approx(100.0 * 10 / 12)
    # a round the time budget skipped does not hide the measured ones; a failed round is the row
    skipped = {"variant": "overlap", "skipped": "time budget"}
    assert e2e.merge_rounds([ok, skipped])["train_ms"] == 10.0
    assert e2e.merge_rounds([skipped, skipped])["skipped"] == "time budget"
    failed = {"variant": "overlap", "error": "OutOfMemoryError", "failure": "oom"}
    assert e2e.merge_rounds([ok, failed])["failure"] == "oom"
    assert e2e.merge_rounds([ok]) == {**ok, "rounds": 1, "train_ms_rounds": [10.0], "prefill_ms_rounds": [4.0]}


def _mixtral_training(args: dict):
    return e2e.worker(args)


@pytest.fixture(scope="module")
def mixtral_rows():
    """The Mixtral-style EP block: the default backend, moe_fused forced, and the nocomm_nopad bound."""
    args = _args(models="mixtral_ep", shapes="tiny-moe", force="moe_fused", variants="default,overlap,nocomm_nopad")
    rows = e2e.compare(run_distributed(_mixtral_training, world_size=2, args=(args,), timeout_s=600)[0], 1e-4)
    assert [r.get("error") for r in rows] == [None, None, None], [r.get("error") for r in rows]
    return {r["variant"]: r for r in rows}


def test_mixtral_training_through_moe_fused_matches_default(mixtral_rows):
    """The Mixtral-style EP block trained 3 AdamW steps with moe_fused forced: its forward MoE
    section is rewritten (the op hands backward what it saves), so is the backward one (by
    moe_fused_backward), and the losses equal the default backend's."""
    ov = mixtral_rows["overlap"]
    assert ov["loss_matches_default"], (ov["losses"], mixtral_rows["default"]["losses"])
    assert ov["losses"][0] != ov["losses"][-1]
    rewritten = [(s["graph"].split("_")[0], s["template"]) for s in ov["sites"] if s["rewritten"]]
    assert sorted(rewritten) == [("backward", "moe_fused"), ("forward", "moe_fused")], ov["sites"]
    assert ov["failure_modes"] == [], ov["failure_modes"]
    # how the ops' host-launched calls went: on CPU the reference pipeline, never through op_graphs
    assert ov["op_graph_calls"] == {k: 0 for k in OP_GRAPH_CALLS}, ov["op_graph_calls"]


def test_mixtral_nopad_bound_drops_the_padding_and_the_collectives(mixtral_rows):
    """nocomm_nopad builds the block with capacity factor 1.0 (the others keep the block's 1.25),
    removes the four all-to-alls of the training step and the eager gradient all-reduce, and its
    losses are not held to the default's."""
    bound, default = mixtral_rows["nocomm_nopad"], mixtral_rows["default"]
    assert (default["capacity_factor"], bound["capacity_factor"]) == (1.25, 1.0)
    replaced = dict(bound["nocomm_replaced"])
    # the replicated weights' gradient sync between backward and the optimizer: once a step, none left
    assert replaced.pop("all_reduce (eager)") >= 3 and replaced == {"all_to_all_single": 4}, bound["nocomm_replaced"]
    assert bound["train_ms"] > 0 and "loss_matches_default" not in bound and len(bound["losses"]) == 3
    assert bound["shape"] == default["shape"] and "train_speedup" in bound  # compared with the block as written
