"""The multi-process harness reports a failing rank at once, even while another rank waits in a
collective the failing rank will never join (it used to run a barrier on the way out and hang
until the backend's timeout)."""
import time

import pytest
import torch
import torch.distributed as dist

from overlap_compile.testing.multiprocess import DistributedFailure, run_distributed


def _rank0_fails_while_rank1_waits():
    if dist.get_rank() == 0:
        raise ValueError("rank 0 fails on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)


def test_failing_rank_is_reported_without_waiting_for_the_others():
    start = time.monotonic()
    with pytest.raises(DistributedFailure, match="failed on rank 0(.|\n)*rank 0 fails on purpose"):
        run_distributed(_rank0_fails_while_rank1_waits, world_size=2, timeout_s=120)
    assert time.monotonic() - start < 60


def _teardown_hangs():
    # what destroy_process_group does after NCCL collectives were captured in a CUDA graph
    # (pytorch/pytorch#115388): never returns
    dist.destroy_process_group = lambda *a, **k: time.sleep(3600)
    return dist.get_rank() * 10


def test_results_come_back_when_process_group_teardown_hangs():
    start = time.monotonic()
    assert run_distributed(_teardown_hangs, world_size=2, timeout_s=120) == [0, 10]
    assert time.monotonic() - start < 60
