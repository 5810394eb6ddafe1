"""moe_fused with ``"experts": "packed"`` (templates/moe_fused/packed.py) on GPUs, bf16 (where
torch._grouped_mm runs: sm90+), both directions, over the copy engine (kernels.py,
backward_p2p.py) and over NCCL (kernels_nccl.py, backward_nccl.py), against the same transport
with cuBLAS bmm on every slot: slots with routed rows then zeros, new sizes every call (0 and C
among them: a size left from the last call, or read before its rows landed, would drop or
keep the wrong rows), 10 eager calls and one CUDA graph replayed on new slots (the sizes stay
on the device, so the call is capturable). bf16 bound 2e-2, as tests/gpu/test_moe_gpu.py: the
grouped GEMMs sum in another order than bmm. World 2 is the test that matters (the exchange);
world 1 runs on one GPU over NCCL (the own piece, the weight gradients grouped over K, the
capture; the copy engine needs a peer). Host-launched, the packed forward op replays from
runtime.op_graphs (default mode offers it there): new slot sizes every call, world 2, copy engine."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]

E_LOCAL, CAP, H, F_ = 3, 64, 256, 384


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def _rank_and_weights(bmm: dict) -> tuple[int, int, str, torch.device, list[torch.Tensor], str | None]:
    """(rank, world, group name, device, [w1, w3, w2] bf16 drawn with the rank's seed, why the
    copy engine cannot run here where ``bmm`` asks for it, else None), on this rank's GPU."""
    import torch.distributed as dist

    from overlap_compile.templates.moe_fused import kernels
    from overlap_compile.templates.plans import MoePlan

    rank, w = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    group, dev, dt = dist.group.WORLD.group_name, torch.device("cuda", rank), torch.bfloat16
    why = None
    if bmm.get("transport") == "p2p":
        why = kernels.usable(group, dev, MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, bmm))
    torch.manual_seed(rank)
    ws = [torch.randn(E_LOCAL, H, F_, device=dev, dtype=dt) / 16, torch.randn(E_LOCAL, H, F_, device=dev, dtype=dt) / 16,
          torch.randn(E_LOCAL, F_, H, device=dev, dtype=dt) / 20]
    return rank, w, group, dev, ws, why


def _packed_vs_bmm(transport: str) -> list[str]:
    from overlap_compile.templates.moe_fused import backward_nccl, backward_p2p, kernels, kernels_nccl
    from overlap_compile.templates.plans import MoePlan
    from tests.gpu.moe_slots import zero_tails

    bmm = {"split": "source", "transport": transport} if transport == "p2p" else {"split": "source"}
    packed = {**bmm, "experts": "packed"}
    forward_run, backward_run = (kernels.run, backward_p2p.run) if transport == "p2p" else (kernels_nccl.run,
                                                                                         backward_nccl.run)
    rank, w, group, dev, ws, why = _rank_and_weights(bmm)
    if why is not None:
        return [f"rank {rank}: the copy-engine path cannot run here: {why}"]
    dt = ws[0].dtype
    saves = ("tokens", "gate", "up", "act")
    plans = {name: (MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, cfg, saves=saves),
                    MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, cfg, direction="backward"))
             for name, cfg in (("bmm", bmm), ("packed", packed))}
    wts = [t.transpose(1, 2) for t in ws]
    fails: list[str] = []

    def routed(call: int) -> torch.Tensor:
        """[W * E * C, H] slots: routed rows then zeros, sizes new each call (tests/gpu/moe_slots.py)."""
        buf = torch.randn(w * E_LOCAL * CAP, H, device=dev, dtype=dt)
        zero_tails(buf.view(w, E_LOCAL, CAP, H), call * 8 + rank)
        return buf

    def step(name: str, buf: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
        fwd, bwd = plans[name]
        out, tokens, gate, up, act = forward_run(buf, *ws, group, fwd)
        back = backward_run(grad, tokens.transpose(1, 2), gate, up, act.transpose(1, 2), *wts, group, bwd)
        return [out, tokens, gate, up, act, *back]

    names = ("out", "tokens", "gate", "up", "act", "d_buf", "dw1", "dw3", "dw2")

    def compare(what: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
        for name, g, t in zip(names, got, want):
            err = _rel(g, t)
            if not err < 2e-2:
                fails.append(f"rank {rank} {what} {name}: rel err {err:.3g}")

    for call in range(10):
        buf, grad = routed(call), routed(100 + call)
        compare(f"eager call {call}", step("packed", buf, grad), step("bmm", buf, grad))
    buf, grad = routed(50), routed(150)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step("packed", buf, grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step("packed", buf, grad)
    buf.copy_(routed(51))
    grad.copy_(routed(151))
    graph.replay()
    compare("CUDA graph", captured, step("bmm", buf, grad))
    torch.cuda.synchronize()
    if transport == "p2p":
        kernels.check_errors(dev)
    return fails


@pytest.mark.parametrize("world, transport", [(1, "nccl"), pytest.param(2, "nccl", marks=pytest.mark.multigpu),
                                              pytest.param(2, "p2p", marks=pytest.mark.multigpu)])
def test_packed_experts_match_bmm_on_every_slot(world, transport):
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(_packed_vs_bmm, world, args=(transport,))


CALLS = 6


def _packed_forward_replays() -> list[str]:
    """torch.ops.overlap_compile.moe_fused with packed experts, host-launched on one dispatch
    buffer refilled with new routed rows (new sizes) every call, against kernels.run with bmm
    experts on the same slots: from the third call on the op runs from its captured graph, and a
    replay that kept the capture's sizes or index maps would drop or keep the wrong rows."""
    from overlap_compile.runtime import op_graphs
    from overlap_compile.templates import load_all_ops
    from overlap_compile.templates.moe_fused import kernels
    from overlap_compile.templates.moe_fused.spec import SPEC
    from overlap_compile.templates.plans import MoePlan

    load_all_ops()
    SPEC.host_replay = True  # whatever the default, this worker replays
    bmm = {"split": "source", "transport": "p2p"}
    rank, w, group, dev, ws, why = _rank_and_weights(bmm)
    if why is not None:
        return [f"rank {rank}: the copy-engine path cannot run here: {why}"]
    saves = ("tokens", "gate", "up", "act")
    packed = MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, {**bmm, "experts": "packed"}, saves=saves)
    as_bmm = MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, bmm, saves=saves)
    buf = torch.empty(w * E_LOCAL * CAP, H, device=dev, dtype=ws[0].dtype)
    op_graphs.clear()
    fails: list[str] = []
    for call in range(CALLS):
        fails += _one_packed_call(buf, ws, group, packed, as_bmm, rank, w, call)
    graphed = op_graphs.stats["captured"] + op_graphs.stats["replayed"]
    if graphed < CALLS - 2:
        fails.append(f"rank {rank}: {graphed} of {CALLS} calls ran from graphs ({dict(op_graphs.stats)}, "
                     f"failures: {op_graphs.failures()})")
    torch.cuda.synchronize()
    kernels.check_errors(dev)
    return fails


def _one_packed_call(buf, ws, group, packed, as_bmm, rank: int, w: int, call: int) -> list[str]:
    """One call on new slots (same address); nothing of it is held when the next one allocates,
    so the allocator can hand out the same output addresses again (as in a model's steady state)."""
    from overlap_compile.templates.moe_fused import kernels
    from tests.gpu.moe_slots import zero_tails

    buf.copy_(torch.randn_like(buf))
    zero_tails(buf.view(w, E_LOCAL, CAP, H), 200 + call * 8 + rank)
    got = torch.ops.overlap_compile.moe_fused(buf, *ws, group, packed.to_json())
    want = kernels.run(buf, *ws, group, as_bmm)
    fails = []
    for name, g, t in zip(("out", "tokens", "gate", "up", "act"), got, want):
        err = _rel(g, t)
        if not err < 2e-2:
            fails.append(f"rank {rank} host call {call} {name}: rel err {err:.3g}")
    return fails


@pytest.mark.multigpu
def test_packed_forward_replays_from_op_graphs_with_new_sizes():
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(_packed_forward_replays, 2)
