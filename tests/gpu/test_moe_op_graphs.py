"""moe_fused's copy-engine path (bmm experts) through runtime.op_graphs: host-launched calls of
torch.ops.overlap_compile.moe_fused with the same buffers are captured on the second call and
replayed after. Every call refills the dispatch buffer in place with new numbers (fp32, TF32 off)
and is compared with reference.run's one-shot pipeline; an inference plan and a training plan
(its saved intermediates are outputs too, compared with the layer's own math), and the backward
section's op (moe_fused_backward, compared with the section as written); world 2 (and 4 where
there are 4 GPUs). The workers turn spec.host_replay on themselves, so the test holds
whatever its default. A call's outputs are released before the next call allocates, or a
training plan's addresses would never repeat."""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2+ CUDA GPUs, found {torch.cuda.device_count()}"),
]

E_LOCAL, CAP, H, F_ = 2, 96, 256, 384
CALLS = 6


def _replays_vs_reference() -> list[str]:
    import torch.distributed as dist
    from overlap_compile.runtime import op_graphs
    from overlap_compile.templates import load_all_ops
    from overlap_compile.templates.plans import MoePlan

    load_all_ops()
    from overlap_compile.templates.moe_fused.spec import SPEC

    SPEC.host_replay = SPEC.backward_host_replay = True  # whatever the defaults, this worker replays
    rank, w = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    group = dist.group.WORLD.group_name
    dev = torch.device("cuda", rank)
    op = torch.ops.overlap_compile.moe_fused
    torch.manual_seed(rank)
    ws = [torch.randn(E_LOCAL, H, F_, device=dev) / 16, torch.randn(E_LOCAL, H, F_, device=dev) / 16,
          torch.randn(E_LOCAL, F_, H, device=dev) / 20]
    one_shot = MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, {"pieces": 1})
    fails = []
    op_graphs.clear()
    for saves in ((), ("tokens", "gate", "up", "act")):
        plan = MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, {"split": "source", "transport": "p2p"}, saves=saves)
        buf = torch.empty(w * E_LOCAL * CAP, H, device=dev)
        before = op_graphs.stats["captured"] + op_graphs.stats["replayed"]
        for call in range(CALLS):
            # one call and its checks in a function of their own: as in a model's steady state,
            # nothing of the last call (outputs, checks' temporaries) is held when the next one
            # allocates its outputs, so the allocator can hand out the same addresses again
            fails += _one_call(op, buf, ws, group, plan, one_shot, rank, call)
        # first sight as written, then captured and replayed; outputs whose addresses alternate
        # between two sets still run from graphs from the third call on
        graphed = op_graphs.stats["captured"] + op_graphs.stats["replayed"] - before
        if graphed < CALLS - 2:
            fails.append(f"rank {rank} saves={saves}: {graphed} of {CALLS} calls ran from graphs "
                         f"({dict(op_graphs.stats)}, failures: {op_graphs.failures()})")
    fails += _backward_replays(group, rank, w, dev)
    torch.cuda.synchronize()
    return fails


def _backward_replays(group: str, rank: int, w: int, dev) -> list[str]:
    """moe_fused_backward's copy-engine path through op_graphs: every call refills the gradient
    slots in place and is compared with the section as written (backward_reference.run_as_written);
    from the third call on the calls run from graphs."""
    from overlap_compile.runtime import op_graphs
    from overlap_compile.templates.moe_fused import backward_op
    from overlap_compile.templates.plans import MoePlan

    plan = MoePlan("moe_fused", w, E_LOCAL, CAP, H, F_, {"split": "source", "transport": "p2p"}, direction="backward")
    shapes = backward_op.operand_shapes(plan)
    # tokens_t and act_t as a training graph hands them over: transposed views of the saved tensors
    operands = [torch.randn(*s[:-2], s[-1], s[-2], device=dev).transpose(-1, -2) / 8 if k in ("tokens_t", "act_t")
                else torch.randn(*s, device=dev) / 8 for k, s in shapes.items()]
    before = op_graphs.stats["captured"] + op_graphs.stats["replayed"]
    fails = []
    for call in range(CALLS):
        fails += _one_backward_call(operands, group, plan, rank, call)
    graphed = op_graphs.stats["captured"] + op_graphs.stats["replayed"] - before
    if graphed < CALLS - 2:
        fails.append(f"rank {rank} backward: {graphed} of {CALLS} calls ran from graphs "
                     f"({dict(op_graphs.stats)}, failures: {op_graphs.failures()})")
    return fails


def _one_backward_call(operands, group: str, plan, rank: int, call: int) -> list[str]:
    from overlap_compile.templates.moe_fused import backward_reference

    operands[0].copy_(torch.randn_like(operands[0]))  # the gradient slots: same address, new numbers
    got = torch.ops.overlap_compile.moe_fused_backward(*operands, group, plan.to_json())
    want = backward_reference.run_as_written(*operands, group, plan)
    fails = []
    for name, have, exact in zip(("d_buf", "dw1", "dw3", "dw2"), got, want):
        err = _rel(have, exact)
        if not err < 1e-5:
            fails.append(f"rank {rank} backward call {call}: {name} rel err {err:.3g}")
    return fails


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def _one_call(op, buf, ws, group, plan, one_shot, rank: int, call: int) -> list[str]:
    """One op call on new numbers in ``buf`` (same address), compared with reference.run's one-shot
    pipeline and, for a training plan, its saved intermediates with the layer's own math."""
    import torch.nn.functional as F

    from overlap_compile.templates.moe_fused import reference

    fails = []
    buf.copy_(torch.randn_like(buf))  # same address, new numbers: a stale replay shows
    got = op(buf, *ws, group, plan.to_json())
    want = reference.run(buf, *ws, group, one_shot)
    err = _rel(got[0], want)
    if not err < 1e-5:
        fails.append(f"rank {rank} saves={plan.saves} call {call}: rel err {err:.3g}")
    if plan.saves:  # the experts' input and activations, expert-major [E, W * C, *]
        tokens = got[1]
        gate, up = torch.bmm(tokens, ws[0]), torch.bmm(tokens, ws[1])
        for name, have, exact in (("gate", got[2], gate), ("up", got[3], up), ("act", got[4], F.silu(gate) * up)):
            e = _rel(have, exact)
            if not e < 1e-5:
                fails.append(f"rank {rank} call {call}: saved {name} rel err {e:.3g}")
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_moe_fused_replays_match_reference(world):
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(_replays_vs_reference, world)
