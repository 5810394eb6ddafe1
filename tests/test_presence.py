"""runtime.agreement.all_present: before a measurement's collectives, every rank of the group must
be there; a rank that never comes (it loaded the graph from a compile cache) makes the others give
up after a bound instead of waiting forever, and a rank that comes late takes the same verdict.
Two gloo processes."""
import time

from overlap_compile.testing.multiprocess import run_distributed


def presence(scenario: str) -> dict:
    import torch.distributed as dist

    from overlap_compile.runtime.agreement import all_present

    pg, rank = dist.group.WORLD, dist.get_rank()
    out = {}
    t0 = time.monotonic()
    if scenario == "both":
        out["first"] = all_present(pg, "site-a", timeout_s=30)
        out["again"] = all_present(pg, "site-a", timeout_s=30)  # the same tag a second time: a fresh meeting
    elif scenario == "absent":
        if rank == 0:
            out["first"] = all_present(pg, "site-b", timeout_s=1.0)
        dist.barrier()  # rank 1 skipped the meeting (a cache hit); it comes only after rank 0 gave up
        if rank == 1:
            out["late"] = all_present(pg, "site-b", timeout_s=30)
    out["seconds"] = time.monotonic() - t0
    return out


def test_every_rank_present():
    r0, r1 = run_distributed(presence, world_size=2, args=("both",), timeout_s=120)
    assert r0["first"] and r1["first"] and r0["again"] and r1["again"], (r0, r1)


def test_a_rank_that_never_comes_is_given_up_on_and_a_late_one_agrees():
    r0, r1 = run_distributed(presence, world_size=2, args=("absent",), timeout_s=120)
    assert r0["first"] is False, r0
    assert r1["late"] is False and r1["seconds"] < 20, r1  # took the verdict, did not wait out its own 30 s


def absent_measurement() -> object:
    """Rank 0 compiles a site whose measurement needs rank 1, which never comes: the measurement
    is abandoned with a reason, and nothing hangs."""
    import torch.distributed as dist

    from overlap_compile import config
    from overlap_compile.predictor import exhaustive
    from overlap_compile.runtime import agreement
    from overlap_compile.testing.patterns import traced_site

    agreement.PRESENCE_TIMEOUT_S = 1.0
    site = traced_site("gemm_allreduce", 64, 32, 16, 2)
    got = exhaustive.measure_items([("baseline", None)], site, config.current()) if dist.get_rank() == 0 else None
    dist.barrier()
    return got


def test_measurement_without_every_rank_is_abandoned():
    got, _ = run_distributed(absent_measurement, world_size=2, timeout_s=120)
    assert isinstance(got, str) and got.startswith("not measured: not every rank"), got
