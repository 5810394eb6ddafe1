"""Where a template op's host time goes, on ONE GPU: the op called on a 1-rank NCCL group
(the collectives are trivial, the Python is the op's own), against the same work written out.

    python benchmarks/op_host_probe.py

Per call, host-bound loop (1024^3 bf16 GEMM): the sequential pattern; a do-nothing custom op
(torch's dispatch alone); the template ops through torch.ops; the same ops' Python bodies
called directly (no custom-op dispatch); and the host cost of the pieces such an op is made of.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def per_call_us(fn, calls=300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return us


def micro(a: torch.Tensor, group: str) -> None:
    """Host cost of the pieces an op's Python is made of."""
    from overlap_compile import config
    from overlap_compile.runtime.comm import resolve_group
    from overlap_compile.templates.priority_stream import kernels

    side = torch.cuda.Stream()
    dev = a.device
    pg = resolve_group(group)
    t = torch.ones(8, device="cuda")

    def ctx():
        with torch.cuda.stream(side):
            pass

    def set_restore():
        prev = torch.cuda.current_stream()
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(prev)

    ev = torch.cuda.Event()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pieces = [("torch.cuda.current_stream(device)", lambda: torch.cuda.current_stream(dev)),
              ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream()),
              ("with torch.cuda.stream(s): pass", ctx),
              ("current_stream() + set_stream x2", set_restore),
              ("stream.wait_stream(other)", lambda: side.wait_stream(torch.cuda.current_stream())),
              ("torch.cuda.Event() + record", lambda: torch.cuda.Event().record()),
              ("event.record()", lambda: ev.record()),
              ("config.current()", config.current),
              ("resolve_group(name)", lambda: resolve_group(group)),
              ("priority_stream usable()", lambda: kernels.usable(group, dev)),
              ("priority_stream comm_stream()", lambda: kernels.comm_stream(dev)),
              ("dist.all_reduce(t, group=pg)", lambda: dist.all_reduce(t, group=pg)),
              ("pg.allreduce([t], opts)", lambda: pg.allreduce([t], opts)),
              ("a.new_empty(1024, 1024)", lambda: a.new_empty(1024, 1024)),
              ("torch.mm 1024^3", lambda: torch.mm(a, a))]
    print()
    for name, fn in pieces:
        print(f"  {name:40s} {per_call_us(fn, 2000):7.2f} us", flush=True)


def main() -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    from overlap_compile import templates
    from overlap_compile.templates.plans import GemmCollectivePlan
    from overlap_compile.testing.patterns import gemm_then_collective

    templates.load_all_ops()
    group = dist.group.WORLD.group_name
    m = n = k = 1024
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    seq = gemm_then_collective("gemm_allreduce", group, 1)

    @torch.library.custom_op("probe::noop", mutates_args=())
    def noop(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, g: str, plan: str) -> torch.Tensor:
        return a.new_empty(a.shape)

    rows = [("sequential (mm + all_reduce)", lambda: seq(a, b)),
            ("custom op doing nothing", lambda: torch.ops.probe.noop.default(a, b, None, group, "{}"))]
    for template, config in (("priority_stream", {"chunks": 2, "block_m": None, "block_n": None, "stages": None}),
                             ("priority_stream", {"chunks": 4, "block_m": None, "block_n": None, "stages": None})):
        plan = GemmCollectivePlan(template, "gemm_allreduce", m, n, k, 1, "sum", 1, m, False, config).to_json()
        op = getattr(torch.ops.overlap_compile, f"{template}_gemm_collective").default
        from overlap_compile.templates.priority_stream import kernels

        p = GemmCollectivePlan.from_json(plan)
        rows.append((f"{template} {config['chunks']} chunks, torch.ops", lambda op=op, plan=plan: op(a, b, None, group, plan)))
        rows.append((f"{template} {config['chunks']} chunks, kernels.run", lambda p=p: kernels.run(a, b, None, group, p)))
    for name, fn in rows:
        print(f"{name:45s} {per_call_us(fn):8.1f} us/call", flush=True)
    micro(a, group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
