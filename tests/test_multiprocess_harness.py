"""The multi-process harness reports a failing rank at once, even while another rank waits in a
collective the failing rank will never join (it used to run a barrier on the way out and hang
until the backend's timeout)."""
import os
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
    assert run_distributed(_teardown_hangs, world_size=2, timeout_s=120, reuse=False) == [0, 10]
    assert time.monotonic() - start < 60


def _pid_and_state(var: str):
    from overlap_compile.predictor import decision_cache

    seen, cached = os.environ.get(var), dict(decision_cache._entries)
    os.environ[var] = "set by the run"
    decision_cache._entries["left by a run"] = 1
    t = torch.ones(1)
    dist.all_reduce(t)
    return os.getppid(), os.getpid(), seen, cached, int(t.item())


def _fails_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    return os.getppid()


def _dies_on_rank0():
    if dist.get_rank() == 0:
        os._exit(3)
    return os.getppid()


def test_kept_ranks_run_each_run_in_a_fresh_child_and_start_again_after_a_failure():
    var = "OVERLAP_COMPILE_HARNESS_TEST"
    first = run_distributed(_pid_and_state, world_size=2, args=(var,), reuse=True)
    again = run_distributed(_pid_and_state, world_size=2, args=(var,), reuse=True)
    assert [r[0] for r in again] == [r[0] for r in first]  # the same kept ranks
    assert not {r[1] for r in again} & {r[1] for r in first}  # each run a child of its own
    assert all(seen is None and cached == {} and total == 2 for _, _, seen, cached, total in first + again)
    with pytest.raises(DistributedFailure, match="rank 1 fails on purpose"):
        run_distributed(_fails_on_rank1, world_size=2, reuse=True)
    after = run_distributed(_pid_and_state, world_size=2, args=(var,), reuse=True)
    assert not {r[0] for r in after} & {r[0] for r in first}  # fresh kept ranks after the failure
    with pytest.raises(DistributedFailure, match="exited with status"):
        run_distributed(_dies_on_rank0, world_size=2, reuse=True, timeout_s=60)
    assert run_distributed(_pid_and_state, world_size=2, args=(var,), reuse=True)[0][-1] == 2


def test_the_failure_reported_is_the_cause_not_its_echoes():
    from overlap_compile.testing.multiprocess import DIED, _returned

    echo = "RuntimeError: Connection closed by peer"
    # a rank that died is the cause, though its peer's echo came first
    with pytest.raises(DistributedFailure, match=r"failed on rank 1:\n" + DIED + r"[^\n]*\n\(ranks \[0\] failed too\)"):
        _returned("t", {}, {0: echo, 1: f"{DIED} with status 768 before it reported"})
    # else the first failure reported, whatever its rank
    with pytest.raises(DistributedFailure, match=r"failed on rank 1:\nValueError: on purpose"):
        _returned("t", {}, {1: "ValueError: on purpose", 0: echo})
    assert _returned("t", {1: "b", 0: "a"}, {}) == ["a", "b"]
