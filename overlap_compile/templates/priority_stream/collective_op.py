"""A collective left as written, issued on priority_stream's high-priority communication stream
(passes/prioritize.py puts these where passes/defer_compute.py moved GEMMs under a collective):

    torch.ops.overlap_compile.prioritized_collective(inp, kind, reduce_op, world, group_name) -> out
    torch.ops.overlap_compile.prioritized_join(out)       # the caller's stream waits for ``out``

    compute stream   producer | deferred GEMMs (weight gradients) ........ | join | readers of out
    comm stream               | collective (NCCL, high priority) | event --^

c10d's functional collectives run on the process group's own stream at default priority, where a
GEMM launched beside them may take every SM first (DESIGN.md: "the comm stream must have high
priority"); measured in training steps, it made no difference (README, ``prioritize_deferred``).
Here the same
NCCL collective of the same group is enqueued on the high-priority stream (ProcessGroupNCCL with
``async_op=False`` enqueues on the current stream). ``kind`` is the functional op's name:
all_gather_into_tensor, reduce_scatter_tensor or all_reduce. Without CUDA tensors on an NCCL
group (gloo, CPU) the op runs the functional collective and waits for it, and the join does
nothing. Capturable (the event is a graph edge under capture); import touches no CUDA state.
"""
from __future__ import annotations

import functools
import threading

import torch

from ...runtime import comm
from ..base import LIB
from . import kernels

KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")

# (device index, out's address) -> the event recorded after its collective and the input it reads,
# held until its join (templates/base.py: no record_stream)
_in_flight: dict[tuple[int, int], tuple[torch.cuda.Event, torch.Tensor]] = {}
_lock = threading.Lock()


def out_shape(inp_shape, kind: str, world: int) -> list:
    """The collective's output shape (the functional op's)."""
    if kind not in KINDS:
        raise ValueError(f"prioritized_collective: kind {kind!r} is not supported; allowed: {list(KINDS)}")
    if world < 1:
        raise ValueError(f"prioritized_collective: world size {world} must be >= 1")
    shape = list(inp_shape)
    if kind == "all_gather_into_tensor":
        shape[0] = shape[0] * world
    elif kind == "reduce_scatter_tensor":
        shape[0] = shape[0] // world
    return shape


@functools.lru_cache(maxsize=None)
def _refusal(group_name: str, device: str) -> str | None:
    return kernels.usable(group_name, torch.device(device))


def on_comm_stream(group_name: str, device: torch.device) -> bool:
    """Whether the collective runs on the high-priority stream (CUDA tensors, NCCL group); the
    answer is kept per (group, device)."""
    return _refusal(group_name, str(device)) is None


def _functional(inp: torch.Tensor, kind: str, reduce_op: str, world: int, group_name: str) -> torch.Tensor:
    """The functional collective as the graph had it, waited for (gloo, CPU)."""
    if kind == "all_gather_into_tensor":
        return comm.wait(comm.start_all_gather(inp, world, group_name))
    if kind == "reduce_scatter_tensor":
        return comm.wait(comm.start_reduce_scatter(inp, reduce_op, world, group_name))
    return comm.wait(comm.start_all_reduce(inp, reduce_op, group_name))


@torch.library.custom_op(f"{LIB}::prioritized_collective", mutates_args=())
def prioritized_collective(inp: torch.Tensor, kind: str, reduce_op: str, world: int,
                           group_name: str) -> torch.Tensor:
    """The functional collective ``kind`` of ``inp`` on the high-priority stream (module doc);
    the result is ready in the caller's stream order only after ``prioritized_join``."""
    shape = out_shape(inp.shape, kind, world)
    if not on_comm_stream(group_name, inp.device):
        return _functional(inp, kind, reduce_op, world, group_name)
    import torch.distributed as dist

    pg = comm.resolve_group(group_name)
    inp = inp.contiguous()
    compute, side = torch.cuda.current_stream(inp.device), kernels.comm_stream(inp.device)
    out = inp.new_empty(shape)
    side.wait_stream(compute)  # the input is written and ``out`` exists before the collective
    with torch.cuda.stream(side):
        if kind == "all_gather_into_tensor":
            dist.all_gather_into_tensor(out, inp, group=pg)
        elif kind == "reduce_scatter_tensor":
            dist.reduce_scatter_tensor(out, inp, op=kernels.reduce_op(reduce_op), group=pg)
        else:
            out.copy_(inp)
            dist.all_reduce(out, op=kernels.reduce_op(reduce_op), group=pg)
        done = torch.cuda.Event()
        done.record(side)
    # the compute stream may free ``inp`` right after this call: held until the join, so that its
    # block is handed out again only behind the collective (``out`` is the join's own input)
    with _lock:
        _in_flight[(out.device.index, out.data_ptr())] = (done, inp)
    return out


@prioritized_collective.register_fake
def _(inp, kind, reduce_op, world, group_name):
    return inp.new_empty(out_shape(inp.shape, kind, world))


@torch.library.custom_op(f"{LIB}::prioritized_join", mutates_args=("out",))
def prioritized_join(out: torch.Tensor) -> None:
    """The caller's stream waits for the collective that writes ``out``. Declared as writing
    ``out`` so that Inductor orders every reader of ``out`` after it."""
    if not out.is_cuda:
        return
    with _lock:
        held = _in_flight.pop((out.device.index, out.data_ptr()), None)
    if held is not None:
        torch.cuda.current_stream(out.device).wait_event(held[0])  # then the input may go


@prioritized_join.register_fake
def _(out):
    return None
