"""From the replicas each pool wants to the replicas it gets: per-pool limits, then budgets.

Order (each step names itself in the constraint when it moved a pool):

1. unmanaged pools keep their current replicas (they still occupy the budgets);
2. ``max_replicas``, then ``min_replicas`` (min wins when they disagree);
3. each host's budget (``host_budget``), then the total ``budget``, both in engines (replicas x
   engines_per_replica): while over, one replica comes off the managed pool that is least reduced
   relative to what it wanted (ties: the larger target, then the pool name), never below its
   minimum. That lands every reduced pool near the same share of what it wanted (proportional) and
   is deterministic. When the minimums alone exceed a budget they are kept and the constraint says
   the budget is exceeded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config.topology import PlannerConfig, PoolConfig


@dataclass
class PoolLimits:
    pool: str
    host: str
    min_replicas: int
    max_replicas: int | None  # None: only the budgets bound it
    engines_per_replica: int
    managed: bool


def engines_per_replica(pool: PoolConfig) -> int:
    """Engines (GPUs, or the mocker's simulated ranks) one replica of ``pool`` occupies.

    vLLM: tensor x pipeline x data-parallel size from ``engine_args``. The mocker: its ``dp_size``:
    a mocker worker is one process however many ranks it simulates, but each rank stands for a
    data-parallel engine (its own scheduler and KV pool), so counting them keeps the budgets of a
    mocker deployment what they would be for the vLLM deployment it stands in for.
    """
    args: dict[str, Any] = pool.engine_args
    keys = (("dp_size",) if pool.engine == "mocker"
            else ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
    n = 1
    for key in keys:
        v = args.get(key) or 1
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"engine_args {key} must be a positive integer (got {v!r})")
        n *= v
    return n


def replica_engines(planner: PlannerConfig, name: str, pool: PoolConfig) -> int:
    """What one replica of pool ``name`` counts against the budgets: the topology's
    ``planner.pools.<name>.engines_per_replica``, else ``engines_per_replica(pool)``."""
    pp = planner.pools.get(name)
    return pp.engines_per_replica if pp is not None and pp.engines_per_replica else engines_per_replica(pool)


def _reduce(targets: dict[str, int], wanted: dict[str, int], limits: dict[str, PoolLimits],
            pools: list[str], over: int) -> set[str]:
    """Take replicas off ``pools`` (managed, sorted by name) until ``over`` engines are gone or all
    sit at their minimum; returns the pools reduced."""
    reduced: set[str] = set()
    while over > 0:
        free = [p for p in pools if targets[p] > limits[p].min_replicas]
        if not free:
            break
        # ties: the larger target, then the first pool in name order (-index: max picks it)
        p = max(free, key=lambda q: (targets[q] / wanted[q] if wanted[q] else 0.0, targets[q],
                                     -pools.index(q)))
        targets[p] -= 1
        over -= limits[p].engines_per_replica
        reduced.add(p)
    return reduced


def _engines(targets: dict[str, int], limits: dict[str, PoolLimits], pools: list[str]) -> int:
    return sum(targets[p] * limits[p].engines_per_replica for p in pools)


def constrain(desired: dict[str, int], current: dict[str, int], limits: dict[str, PoolLimits], budget: int,
              host_budget: dict[str, int]) -> dict[str, tuple[int, str | None]]:
    """Every pool of ``limits``: (target replicas, what moved it from ``desired`` or None). A pool
    missing from ``desired`` wants its current replicas; one missing from ``current`` has none."""
    unknown = sorted(set(desired) - set(limits))
    if unknown:
        raise ValueError(f"no limits for pool(s) {', '.join(unknown)}")
    pools = sorted(limits)
    notes: dict[str, list[str]] = {p: [] for p in pools}
    targets: dict[str, int] = {}
    for p in pools:
        lim, cur = limits[p], current.get(p, 0)
        want = max(0, desired.get(p, cur))
        if not lim.managed:
            targets[p] = cur
            if want != cur:
                notes[p].append(f"unmanaged: keeps {cur}")
            continue
        t = want
        if lim.max_replicas is not None and t > lim.max_replicas:
            t = lim.max_replicas
            notes[p].append(f"max_replicas {lim.max_replicas}")
        if t < lim.min_replicas:
            t = lim.min_replicas
            notes[p].append(f"min_replicas {lim.min_replicas}")
        targets[p] = t
    wanted = dict(targets)  # the proportions budgets keep
    managed = [p for p in pools if limits[p].managed]

    def apply(cap: int, on: list[str], label: str) -> None:
        over = _engines(targets, limits, on) - cap
        if over <= 0:
            return
        reduced = _reduce(targets, wanted, limits, [p for p in on if p in managed], over)
        still = _engines(targets, limits, on) - cap
        if reduced:
            note = f"{label}: scaled {'/'.join(sorted(reduced))} down proportionally"
            for p in reduced:
                notes[p].append(note)
        if still > 0:
            for p in on:
                if limits[p].managed:
                    notes[p].append(f"{label} exceeded by {still} (minimums and unmanaged pools)")

    for host in sorted(host_budget):
        on_host = [p for p in pools if limits[p].host == host]
        apply(host_budget[host], on_host, f"host {host} budget {host_budget[host]}")
    apply(budget, pools, f"budget {budget} engines")
    return {p: (targets[p], "; ".join(notes[p]) or None) for p in pools}
