"""passes/replay_kept.py: in a host-launched inference graph, the sites the decision kept as
written run as priority_stream's one-chunk op (which op graphs replay on GPUs), with results equal
to eager's and the Report saying so per site; a training step's graphs, the option off, and
sites that are not on a GPU are left as the decision made them. CPU, gloo, world 2: the sites'
GPU check is patched to pass, so the op runs its reference path."""
from __future__ import annotations

import torch

from overlap_compile.testing.multiprocess import run_distributed
from tests.test_dynamic_shapes import _compiled, _mlp_sequence_parallel


def _graphs_with(on_gpu: bool, option: bool) -> dict:
    """Run on every rank: the sequence-parallel MLP (an all-gather -> GEMM and a GEMM ->
    reduce-scatter site) compiled static with every site kept (min_speedup out of reach), once
    for inference (no_grad) and once for a training step; per phase the template ops in the
    compiled graphs, the Report's kept sites noting the replay, and the error against eager."""
    import torch.distributed as dist

    import overlap_compile as oc
    from overlap_compile.passes import replay_kept

    real = replay_kept.on_gpu
    if on_gpu:
        replay_kept.on_gpu = lambda match: True
    group, rank = dist.group.WORLD.group_name, dist.get_rank()
    out = {}
    for phase in ("inference", "train"):
        fn, w1, w2, report = _compiled(_mlp_sequence_parallel, group)
        torch.manual_seed(rank)
        x = torch.randn(6, 16, requires_grad=phase == "train")
        with oc.config.patch(min_speedup=1e6, measure_uncertain=False, replay_written=option):
            if phase == "inference":
                with torch.no_grad():
                    y = fn(x, w1, w2)
                    ref = _mlp_sequence_parallel(x, w1, w2, group)
            else:
                y = fn(x, w1, w2)
                y.sum().backward()
                ref = _mlp_sequence_parallel(x, w1, w2, group)
        out[phase] = {
            "ops": sorted({ln.split("overlap_compile.")[1].split(".")[0] for r in report.records
                           for ln in r.after.splitlines() if "torch.ops.overlap_compile." in ln}),
            "noted": sum(replay_kept.NOTE in s.reason for r in report.records for s in r.sites),
            "kept": sum(s.template == "baseline" for r in report.records for s in r.sites),
            "err": (y - ref).abs().max().item(),
        }
    replay_kept.on_gpu = real
    return out


CONFIGS = ((True, True), (True, False), (False, True))  # (sites taken as on a GPU, option on)


def _all_configs() -> dict:
    """Every configuration in one pair of processes (a spawn costs seconds)."""
    return {c: _graphs_with(*c) for c in CONFIGS}


def test_inference_graph_replays_kept_sites_and_nothing_else():
    for r in run_distributed(_all_configs, world_size=2, timeout_s=400):
        inf, train = r[(True, True)]["inference"], r[(True, True)]["train"]
        assert inf["ops"] == ["priority_stream_allgather_gemm", "priority_stream_gemm_collective"], inf
        assert inf["kept"] == inf["noted"] == 2, inf  # the Report keeps them "baseline", with the note
        assert inf["err"] < 1e-4, inf
        assert train["ops"] == [] and train["noted"] == 0 and train["kept"] == 4, train
        assert train["err"] < 1e-4, train
        for config in ((True, False), (False, True)):  # the option off; sites not on a GPU
            for phase in ("inference", "train"):
                got = r[config][phase]
                assert got["ops"] == [] and got["noted"] == 0, (config, phase, got)
                assert got["err"] < 1e-4, (config, phase, got)
