"""moe_fused's copy-engine path (bmm experts) through runtime.op_graphs: host-launched calls of
torch.ops.overlap_compile.moe_fused with the same buffers are captured on the second call and
replayed after. Every call refills the dispatch buffer in place with new numbers (fp32, TF32 off)
and is compared with reference.run's one-shot pipeline; an inference plan and a training plan
(its saved intermediates are outputs too, compared with the layer's own math); world 2 (and 4
where there are 4 GPUs). The replay is off by default (spec.host_replay): the workers turn it on.
Written on a CPU-only machine: not yet run."""
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
    import torch.nn.functional as F

    from overlap_compile.runtime import op_graphs
    from overlap_compile.templates import load_all_ops
    from overlap_compile.templates.moe_fused import reference
    from overlap_compile.templates.plans import MoePlan

    load_all_ops()
    from overlap_compile.templates.moe_fused.spec import SPEC

    SPEC.host_replay = True  # off by default until this test has passed (op.py); this worker only
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
        for call in range(CALLS):
            buf.copy_(torch.randn_like(buf))  # same address, new numbers: a stale replay shows
            got = op(buf, *ws, group, plan.to_json())
            want = reference.run(buf, *ws, group, one_shot)
            err = ((got[0] - want).norm() / want.norm()).item()
            if not err < 1e-5:
                fails.append(f"rank {rank} saves={saves} call {call}: rel err {err:.3g}")
            if saves:  # the experts' input and activations, expert-major [E, W * C, *]
                tokens = got[1]
                gate, up = torch.bmm(tokens, ws[0]), torch.bmm(tokens, ws[1])
                for name, have, exact in (("gate", got[2], gate), ("up", got[3], up),
                                          ("act", got[4], F.silu(gate) * up)):
                    e = ((have - exact).norm() / exact.norm()).item()
                    if not e < 1e-5:
                        fails.append(f"rank {rank} call {call}: saved {name} rel err {e:.3g}")
            del got, want  # as in a model's steady state: the last call's outputs are gone
    torch.cuda.synchronize()
    # each plan's calls: first sight as written, then captured and replayed; outputs whose
    # addresses alternate between two sets still run from graphs from the third call on
    if op_graphs.stats["captured"] + op_graphs.stats["replayed"] < 2 * (CALLS - 2):
        fails.append(f"rank {rank}: {dict(op_graphs.stats)}: the calls were not replayed from graphs "
                     f"(failures: {op_graphs.failures()})")
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_moe_fused_replays_match_reference(world):
    from overlap_compile.testing.multiprocess import assert_no_gpu_failures

    assert_no_gpu_failures(_replays_vs_reference, world)
