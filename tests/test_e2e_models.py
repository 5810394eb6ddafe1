"""The end-to-end benchmark's models and training loop on CPU over gloo (world 2): the
Megatron-style block equals the DTensor block for the same weights, and training with the overlap
backend (a template forced: on CPU the predictor rightly keeps the baseline) gives the default
backend's losses, with and without activation checkpointing."""
import argparse

from benchmarks import e2e
from overlap_compile.testing.multiprocess import run_distributed


def _sweep(models: str, ckpt: str, check_cache: bool = False) -> list[dict]:
    args = argparse.Namespace(dry_run=True, models=models, shapes="", variants="default,overlap", modes="default",
                              ckpt=ckpt, steps=3, iters=2, force="signal_reorder", time_budget=0.0, fresh_caches=False,
                              check_cache=check_cache)
    rows = run_distributed(e2e.worker, world_size=2, args=(vars(args),), timeout_s=600)[0]
    return e2e.compare(rows, loss_rtol=1e-4)


def test_training_matches_default_and_models_agree():
    rows = _sweep("llama_dtensor,llama_megatron", "off")
    assert [r.get("error") for r in rows] == [None] * 4, [r.get("error") for r in rows]
    by = {(r["model"], r["variant"]): r for r in rows}
    for model in ("llama_dtensor", "llama_megatron"):
        ov = by[(model, "overlap")]
        assert ov["rewritten"] > 0 and ov["loss_matches_default"], (model, ov["losses"], by[(model, "default")]["losses"])
        assert {s["template"] for s in ov["sites"] if s["rewritten"]} == {"signal_reorder"}
        assert any(s["graph"].startswith("backward") for s in ov["sites"]), "backward graphs have sites too"
        assert ov["losses"][0] != ov["losses"][-1], "AdamW steps must change the loss"
    # same full weights, same data: the two parallel forms compute the same thing
    for a, b in zip(by[("llama_dtensor", "default")]["losses"], by[("llama_megatron", "default")]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_activation_checkpointing_matches_default_and_fx_cache_hits():
    rows = _sweep("llama_megatron", "on", check_cache=True)
    assert [r.get("error") for r in rows] == [None, None], [r.get("error") for r in rows]
    ov = next(r for r in rows if r["variant"] == "overlap")
    assert ov["ckpt"] and ov["rewritten"] > 0 and ov["loss_matches_default"]
    # a second compile of the rewritten model is served by Inductor's FX graph cache
    assert ov["fxgraph_cache_hit"] > 0
