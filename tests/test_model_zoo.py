"""The model zoo of the end-to-end benchmark (benchmarks/models) on CPU over gloo, world 2: each form
builds at its pinned names and runs forward and backward; the Megatron-style form trains under the
overlap backend (a template forced: on CPU the predictor keeps the sites as written) with the
default backend's losses and its sites rewritten. torchtitan's form needs the package (``.[bench]``) on a torch it
supports (0.2.2: torch 2.11; its compile fails on 2.13), so it runs where that holds."""
import pytest
import torch

from benchmarks import e2e
from overlap_compile.testing.multiprocess import run_distributed

FORMS = ("megatron_fused_8b", "dtensor_gqa_8b")


def _on_every_rank(train_args: dict):
    from benchmarks.models import build

    shapes = {}
    for name in FORMS:
        built = build(name, dict(e2e.CPU_SHAPES["tiny"]), "cpu", torch.float32)
        y = built.to_local(built.model(built.x))
        y.float().pow(2).mean().backward()
        grads = [p.grad for p in built.model.parameters()]
        shapes[name] = (tuple(y.shape), all(g is not None and torch.isfinite(g).all() for g in grads))
    return shapes, e2e.worker(train_args)


@pytest.fixture(scope="module")
def zoo():
    # trained: the Megatron-style form (gathers on dim 0, fused QKV and gate/up are its own graphs);
    # the DTensor form's graphs are those of llama_dtensor's, trained in test_e2e_models
    a = e2e.parse(["--dry-run", "--models", "megatron_fused_8b", "--shapes", "tiny", "--variants", "default,overlap",
                   "--phases", "train", "--steps", "2", "--iters", "1", "--force", "signal_reorder",
                   "--check-cache", "off", "--no-check-models"])
    a.out = None
    shapes, rows = run_distributed(_on_every_rank, world_size=2, args=(vars(a),), timeout_s=600)[0]
    return shapes, e2e.compare(rows, 1e-4)


def test_each_form_runs_forward_and_backward_on_its_shard(zoo):
    shapes, _ = zoo
    tiny = e2e.CPU_SHAPES["tiny"]
    # Megatron-style: [seq / W, batch, hidden]; DTensor: [batch, seq / W, hidden] (the local shard)
    assert shapes["megatron_fused_8b"] == ((tiny["seq"] // 2, tiny["batch"], tiny["hidden"]), True)
    assert shapes["dtensor_gqa_8b"] == ((tiny["batch"], tiny["seq"] // 2, tiny["hidden"]), True)


def test_megatron_form_trains_through_the_overlap_backend_with_default_losses(zoo):
    _, rows = zoo
    overlap = {r["model"]: r for r in rows if r.get("variant") == "overlap"}
    assert set(overlap) == {"megatron_fused_8b"}
    for name, row in overlap.items():
        assert "error" not in row, row.get("error")
        assert row["loss_matches_default"], (name, row.get("loss_max_rel_diff"))
        assert row["rewritten"] >= 4, (name, [(s["kind"], s["template"], s["reason"]) for s in row["sites"]])


def test_zoo_names_pin_their_shapes():
    from benchmarks.models import FAMILY, MISSING, MODELS, PINNED_SHAPE

    for form in ("megatron_fused", "dtensor_gqa"):
        assert PINNED_SHAPE[f"{form}_8b"] == (form, "8b", "tiny")
        assert PINNED_SHAPE[f"{form}_70b"] == (form, "70b", "tiny-70b")
        assert PINNED_SHAPE[f"{form}_8b_16k"] == (form, "8b-16k", "tiny-long")
    for name in ("titan_llama3_8b", "titan_llama3_70b", "titan_llama3_8b_16k"):
        assert FAMILY[name] == "llama"
        assert name in MODELS or "torchtitan" in MISSING[name]  # missing: the reason says why
    (long,) = e2e.load_shapes("8b-16k", dry=False)
    assert long["seq"] == 16384 and long["hidden"] == 4096 and long["kv_heads"] == 8
