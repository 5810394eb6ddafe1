"""e2e.py's (model, shape) plan: llama70_dtensor is llama_dtensor on the Llama-3-70B block, runs that
shape whatever --shapes says when named, and every 70B llama_dtensor row carries its name."""
import pytest

from benchmarks import e2e

L8, L70, MOE = "Llama-3-8B block, TP+SP", "Llama-3-70B block, TP+SP", "Mixtral-8x7B block, EP"


def _plan(models: str, shapes: str, dry: bool = False) -> list[tuple[str, str]]:
    return [(m, s["name"]) for m, s in e2e.plan(models, shapes, dry)]


def test_70b_shape_is_shapes_json_70b_block():
    (s,) = e2e.load_shapes("70b", dry=False)
    assert (s["hidden"], s["intermediate"], s["heads"], s["kv_heads"], s["seq"]) == (8192, 28672, 64, 8, 8192)


def test_each_llama_dtensor_form_runs_its_own_shape():
    assert _plan("llama_dtensor,llama70_dtensor", "8b") == [("llama_dtensor", L8), ("llama70_dtensor", L70)]
    assert _plan("llama70_dtensor", "moe") == [("llama70_dtensor", L70)]


def test_70b_rows_of_llama_dtensor_carry_the_70b_name():
    assert _plan("llama_dtensor", "70b") == [("llama70_dtensor", L70)]
    # asked both ways: one run, not two
    assert _plan("llama_dtensor,llama70_dtensor", "8b,70b") == [("llama_dtensor", L8), ("llama70_dtensor", L70)]
    # another model on the 70B shape keeps its own name
    assert ("llama_megatron", L70) in _plan("llama_megatron", "70b")


def test_all_models_add_the_70b_run_only_when_its_shape_is_asked():
    assert all(m != "llama70_dtensor" for m, _ in _plan("all", "8b,moe"))
    plan = _plan("all", "8b,70b,moe")
    assert ("llama70_dtensor", L70) in plan and ("llama_dtensor", L8) in plan and ("llama_dtensor", L70) not in plan


def test_dry_run_stand_in_and_unknown_shapes():
    assert _plan("llama70_dtensor", "tiny", dry=True) == [("llama70_dtensor", e2e.CPU_SHAPES["tiny-70b"]["name"])]
    with pytest.raises(SystemExit, match="70b"):
        e2e.plan("llama_dtensor", "70b", dry=True)


def test_isolate_runs_each_variant_in_processes_of_its_own(monkeypatch):
    """--isolate: one process group per variant, every variant's rows compared in one table."""
    import overlap_compile.testing.multiprocess as mp

    calls, finished = [], []

    def fake_run(fn, world_size, args, backend, timeout_s):
        calls.append(args[0]["variants"])
        return [[{"benchmark": "e2e", "variant": args[0]["variants"]}]] * world_size

    monkeypatch.setattr(mp, "run_distributed", fake_run)
    monkeypatch.setattr(e2e, "finish", lambda rows, a: finished.append(rows) or 0)
    e2e.main(["--dry-run", "--isolate", "--models", "megatron_fused_8b", "--variants", "default,overlap,nocomm"])
    assert calls == ["default", "overlap", "nocomm"]
    assert [r["variant"] for r in finished[0]] == ["default", "overlap", "nocomm"]
    e2e.main(["--dry-run", "--models", "megatron_fused_8b", "--variants", "default,overlap"])
    assert calls[-1] == "default,overlap"
