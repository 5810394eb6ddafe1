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


def everything(plain: dict, ckpt: dict):
    """On every rank: the eager model check, then the two training sweeps."""
    import torch

    from benchmarks.models.equivalence import megatron_vs_dtensor

    check = megatron_vs_dtensor(e2e.CPU_SHAPES["tiny"], "cpu", torch.float32)
    return check, e2e.worker(plain), e2e.worker(ckpt)


@pytest.fixture(scope="module")
def results():
    plain = _args(models="llama_dtensor,llama_megatron")
    ckpt = _args(models="llama_megatron", ckpt="on", check_cache="first", repeat=2)  # two rounds of variants
    per_rank = run_distributed(everything, world_size=2, args=(plain, ckpt), timeout_s=600)
    _, rows, ckpt_rows = per_rank[0]
    return [c for c, _, _ in per_rank], e2e.compare(rows, 1e-4), e2e.compare(ckpt_rows, 1e-4)


def test_megatron_block_equals_dtensor_block(results):
    checks, rows, _ = results
    for check in checks:  # output, input gradient and every weight gradient (norms after finalize_grads)
        assert check["max_rel"] <= 1e-5, check
    by = {(r["model"], r["variant"]): r for r in rows}
    # same full weights, same data, same optimizer: the two parallel forms train the same way
    for a, b in zip(by[("llama_dtensor", "default")]["losses"], by[("llama_megatron", "default")]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_training_with_overlap_matches_default(results):
    _, rows, _ = results
    assert [r.get("error") for r in rows] == [None] * 4, [r.get("error") for r in rows]
    by = {(r["model"], r["variant"]): r for r in rows}
    for model in ("llama_dtensor", "llama_megatron"):
        ov = by[(model, "overlap")]
        assert ov["rewritten"] > 0 and ov["loss_matches_default"], (model, ov["losses"], by[(model, "default")]["losses"])
        assert {s["template"] for s in ov["sites"] if s["rewritten"]} == {FORCED}
        assert any(s["graph"].startswith("backward") for s in ov["sites"]), "backward graphs have sites too"
        assert {s["phase"] for s in ov["sites"]} == {"train"}  # no prefill phase in this sweep
        # forced onto every site, a rewrite can be predicted slower than the site: a negative share
        assert isinstance(ov["train_forecast_hidden"], float) and ov["train_forecast_hidden"] <= 1, ov
        assert "prefill_forecast_hidden" not in ov
        assert ov["losses"][0] != ov["losses"][-1], "AdamW steps must change the loss"
        assert ov["failure_modes"] == [] and ov["recompiles_timed"] == 0, ov["failure_modes"]
        # the common schema's keys, for benchmarks/plot.py
        assert (ov["kind"], ov["method"], ov["mode"], ov["ms"]) == (model, "overlap", "eager", ov["train_ms"])
        # train_ms: steps back to back (a training loop's steady state); one step after a barrier beside it
        assert ov["train_calls"] == 3 and ov["train_cold_ms"] > 0 and "train_cold_speedup" in ov


def test_activation_checkpointing_matches_default_and_fx_cache_hits(results):
    _, _, rows = results
    assert [r.get("error") for r in rows] == [None, None], [r.get("error") for r in rows]
    ov = next(r for r in rows if r["variant"] == "overlap")
    assert ov["ckpt"] and ov["rewritten"] > 0 and ov["loss_matches_default"]
    # a second compile of the rewritten model is served by Inductor's FX graph cache
    assert ov["fxgraph_cache_hit"] > 0
    # --repeat 2: one row per variant, its time the median of the two rounds it ran in
    assert [r["rounds"] for r in rows] == [2, 2]
    for r in rows:
        assert len(r["train_ms_rounds"]) == 2 and r["train_ms"] == pytest.approx(sum(r["train_ms_rounds"]) / 2)


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
