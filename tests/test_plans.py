"""Plans are parsed from the JSON string the rewritten graph carries, on every call of an op:
once per distinct text (cached), equal to the plan that was written, and a malformed text still
fails with its message every time (errors are not cached)."""
import pytest

from overlap_compile.templates.plans import AllGatherGemmPlan, GemmCollectivePlan, plan_digest


def _plans():
    g = GemmCollectivePlan(template="p2p_ring", kind="gemm_reducescatter", m=64, n=32, k=16, world=2,
                           reduce_op="sum", outer=1, chunk=32, has_bias=False, config={"slices": 1})
    a = AllGatherGemmPlan(template="p2p_ring", m=64, k=16, ns=(32, 8), world=2, outer=1, chunk=32,
                          has_bias=(True, False), config={"slices": 1})
    return g, a


@pytest.mark.parametrize("i", [0, 1])
def test_parse_round_trip_is_cached_per_text(i):
    plan = _plans()[i]
    text = plan.to_json()
    first = type(plan).from_json(text)
    assert first == plan and type(plan).from_json(text) is first
    other = type(plan).from_json(text.replace('"world":2', '"world":4'))
    assert other.world == 4 and first.world == 2
    assert plan_digest(text) == plan_digest(str(text)) != plan_digest(other.to_json())


def test_malformed_text_fails_every_time():
    for _ in range(2):
        with pytest.raises(ValueError, match="malformed GemmCollectivePlan"):
            GemmCollectivePlan.from_json("{not json")
