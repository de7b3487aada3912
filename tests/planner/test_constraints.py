"""From desired replicas to targets: min/max, unmanaged pools, host and total budgets."""

from __future__ import annotations

import pytest

from actors.planner.constraints import PoolLimits, constrain, engines_per_replica
from config.topology import PoolConfig


def lim(pool: str, host: str = "local", min_r: int = 1, max_r: int | None = None, epr: int = 1,
        managed: bool = True) -> PoolLimits:
    return PoolLimits(pool=pool, host=host, min_replicas=min_r, max_replicas=max_r, engines_per_replica=epr,
                      managed=managed)


def limits(*ls: PoolLimits) -> dict[str, PoolLimits]:
    return {x.pool: x for x in ls}


def test_within_everything_is_untouched():
    out = constrain({"prefill": 2, "decode": 3}, {"prefill": 1, "decode": 1},
                    limits(lim("prefill"), lim("decode")), 8, {})
    assert out == {"prefill": (2, None), "decode": (3, None)}


def test_min_and_max_replicas():
    out = constrain({"prefill": 0, "decode": 9}, {}, limits(lim("prefill"), lim("decode", max_r=4)), 100, {})
    assert out == {"prefill": (1, "min_replicas 1"), "decode": (4, "max_replicas 4")}
    # min wins over a max below it
    assert constrain({"a": 5}, {}, limits(lim("a", min_r=3, max_r=2)), 100, {}) == {
        "a": (3, "max_replicas 2; min_replicas 3")}


def test_budget_scales_down_proportionally():
    out = constrain({"prefill": 6, "decode": 4}, {"prefill": 2, "decode": 2},
                    limits(lim("prefill"), lim("decode")), 5, {})
    note = "budget 5 engines: scaled decode/prefill down proportionally"
    assert out == {"prefill": (3, note), "decode": (2, note)}
    # 8:2 into 5 -> 4:1, half of each
    out = constrain({"a": 8, "b": 2}, {}, limits(lim("a"), lim("b")), 5, {})
    assert out["a"][0] == 4 and out["b"][0] == 1


def test_budget_counts_engines_per_replica():
    # prefill 4 x 2 + decode 4 x 1 = 12 engines into 8: decode 3, prefill 3 (9 engines), decode 2
    out = constrain({"prefill": 4, "decode": 4}, {}, limits(lim("prefill", epr=2), lim("decode")), 8, {})
    assert out["prefill"][0] == 3 and out["decode"][0] == 2


def test_unmanaged_pools_keep_current_and_use_the_budget():
    out = constrain({"agg": 5, "prefill": 6}, {"agg": 3, "prefill": 1},
                    limits(lim("agg", managed=False), lim("prefill")), 5, {})
    assert out == {"agg": (3, "unmanaged: keeps 3"),
                   "prefill": (2, "budget 5 engines: scaled prefill down proportionally")}
    # an unmanaged pool nobody asked to move says nothing
    assert constrain({}, {"agg": 3}, limits(lim("agg", managed=False)), 5, {}) == {"agg": (3, None)}


def test_never_below_min_even_over_budget():
    out = constrain({"prefill": 5, "decode": 5}, {}, limits(lim("prefill", min_r=2), lim("decode")), 2, {})
    assert out["prefill"][0] == 2 and out["decode"][0] == 1
    assert out["prefill"][1] == ("budget 2 engines: scaled decode/prefill down proportionally; "
                                 "budget 2 engines exceeded by 1 (minimums and unmanaged pools)")


def test_host_budget():
    ls = limits(lim("a", host="gpu-1"), lim("b", host="gpu-1"), lim("c", host="gpu-2"))
    out = constrain({"a": 4, "b": 4, "c": 4}, {}, ls, 100, {"gpu-1": 4, "gpu-3": 1})
    note = "host gpu-1 budget 4: scaled a/b down proportionally"
    assert out == {"a": (2, note), "b": (2, note), "c": (4, None)}
    # then the total: 2 + 2 + 4 into 6 takes from c first (the least reduced)
    out = constrain({"a": 4, "b": 4, "c": 4}, {}, ls, 6, {"gpu-1": 4})
    assert [out[p][0] for p in "abc"] == [2, 2, 2]
    assert out["c"][1] == "budget 6 engines: scaled c down proportionally"


def test_missing_pools_and_unknown_pools():
    # a pool not in desired wants its current replicas; one not in current has none
    out = constrain({}, {"a": 2}, limits(lim("a"), lim("b", min_r=0)), 8, {})
    assert out == {"a": (2, None), "b": (0, None)}
    with pytest.raises(ValueError, match="no limits for pool"):
        constrain({"ghost": 1}, {}, limits(lim("a")), 8, {})


def test_deterministic_whatever_the_order():
    ls = [lim("x"), lim("y"), lim("z")]
    want = {"x": 3, "y": 3, "z": 3}
    first = constrain(want, {}, limits(*ls), 7, {})
    again = constrain(dict(reversed(list(want.items()))), {}, limits(*reversed(ls)), 7, {})
    assert first == again
    assert [first[p][0] for p in "xyz"] == [2, 2, 3]  # ties go to the first names


def test_engines_per_replica():
    assert engines_per_replica(PoolConfig()) == 1
    assert engines_per_replica(PoolConfig(engine_args={"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                                       "data_parallel_size": 2})) == 8
    assert engines_per_replica(PoolConfig(engine="mocker", engine_args={"dp_size": 3})) == 3
    # the mocker has no tensor parallelism: a key it does not read counts for nothing
    assert engines_per_replica(PoolConfig(engine="mocker", engine_args={"tensor_parallel_size": 4})) == 1
    assert engines_per_replica(PoolConfig(engine_args={"tensor_parallel_size": None})) == 1
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        engines_per_replica(PoolConfig(engine_args={"tensor_parallel_size": "2"}))
