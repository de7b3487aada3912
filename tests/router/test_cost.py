"""The weighted cost (the ``prefill_load_scale`` override) and what both cost models share:
lowest cost, tie-breaks, softmax, busy exclusion, block-size mismatch. The latency model's own
tests are in test_latency.py."""

import logging
import random
from collections import Counter

import pytest

from actors.router.cost import CostSelector, RouterConfig
from actors.router.load import LoadTracker
from actors.router.metrics import RouterMetrics
from actors.worker.contract import LoadReport
from bus.errors import Overloaded

BS = 16
A, B, C = ("a", 0), ("b", 0), ("c", 0)


class View:
    def __init__(self, blocks=None, sizes=None):
        self.blocks = blocks or {}
        self.sizes = sizes or {}

    def worker_blocks(self, w):
        return self.blocks.get(w, 0)

    def worker_block_size(self, w):
        return self.sizes.get(w)


def _sel(**kw):
    kw.setdefault("prefill_load_scale", 1.0)  # the weighted cost these tests are about
    return CostSelector(RouterConfig(block_size=BS, **kw), metrics=RouterMetrics(), rng=random.Random(0))


def test_lowest_cost_wins_and_decision_fields():
    load = LoadTracker(BS)
    d = _sel().select([A, B, C], 10 * BS, {B: 6, C: 2}, load, View())
    assert d.worker == B and d.overlap_blocks == 6 and d.request_blocks == 10
    assert d.cost == pytest.approx(4.0)
    assert {(c.instance, c.cost) for c in d.costs} == {("a", 10.0), ("b", 4.0), ("c", 8.0)}
    assert d.to_dict()["instance"] == "b"


def test_load_terms():
    load = LoadTracker(BS)
    load.add_request("r1", B, 8 * BS)  # B: 8 prefill blocks queued, 8 decode blocks
    d = _sel().select([A, B], 4 * BS, {B: 4}, load, View())
    # B: 1.0*(4-4+8) + 8 = 16; A: 4 + 0 = 4
    assert d.worker == A
    costs = {c.instance: c for c in d.costs}
    assert costs["b"].new_prefill_blocks == 8 and costs["b"].decode_blocks == 8
    load.first_token("r1")
    d = _sel(prefill_load_scale=2.0).select([A, B], 4 * BS, {B: 4}, load, View())
    assert {c.instance: c.cost for c in d.costs} == {"a": 8.0, "b": 8.0}


def test_ties_prefer_smaller_index_then_random():
    load = LoadTracker(BS)
    view = View(blocks={A: 100, B: 5, C: 5})
    sel = _sel()
    picks = Counter(sel.select([A, B, C], 4 * BS, {}, load, view).worker for _ in range(200))
    assert set(picks) == {B, C} and min(picks.values()) > 50


def test_temperature_samples_softmax():
    load = LoadTracker(BS)
    overlaps = {A: 8}
    sel = _sel(temperature=0.5)
    picks = Counter(sel.select([A, B, C], 8 * BS, overlaps, load, View()).worker for _ in range(2000))
    # normalised costs: A 0, B/C 1 → weights 1 : e^-2 : e^-2
    assert picks[A] / 2000 == pytest.approx(1 / (1 + 2 * 2.718281828 ** -2), abs=0.05)
    assert picks[B] > 0 and picks[C] > 0
    cold = _sel(temperature=0.01)
    assert {cold.select([A, B, C], 8 * BS, overlaps, load, View()).worker for _ in range(100)} == {A}


def test_busy_threshold_excludes_and_all_busy_refuses():
    now = [0.0]
    load = LoadTracker(BS, clock=lambda: now[0], report_ttl=5)
    load.reconcile(LoadReport(instance="a", num_running=1, num_waiting=0, kv_usage=0.97,
                              active_kv_blocks=90, total_kv_blocks=100))
    sel = _sel(busy_threshold=0.9)
    d = sel.select([A, B], 8 * BS, {A: 8}, load, View())
    assert d.worker == B and d.excluded_busy == ["a/0"]
    load.reconcile(LoadReport(instance="b", num_running=1, num_waiting=0, kv_usage=0.95,
                              active_kv_blocks=95, total_kv_blocks=100))
    with pytest.raises(Overloaded):
        sel.select([A, B], 8 * BS, {}, load, View())
    now[0] = 10.0  # stale reports no longer exclude
    assert sel.select([A, B], 8 * BS, {A: 8}, load, View()).worker == A
    with pytest.raises(Overloaded):
        sel.select([], 8, {}, load, View())


def test_block_size_mismatch_routes_without_overlap_and_warns_once(caplog):
    load = LoadTracker(BS)
    sel = _sel()
    view = View(sizes={A: 32})
    with caplog.at_level(logging.WARNING):
        d1 = sel.select([A, B], 8 * BS, {A: 8}, load, view)
        d2 = sel.select([A, B], 8 * BS, {A: 8}, load, view)
    costs = {c.instance: c for c in d1.costs}
    assert costs["a"].overlap_blocks == 0 and costs["a"].block_size_mismatch
    assert d1.overlap_blocks == 0 and d2.overlap_blocks == 0
    assert sum("MISMATCH" in r.getMessage() for r in caplog.records) == 1
    assert sel.metrics.block_size_mismatch.labels("a", "routing")._value.get() == 2
    # a registry-provided block size counts too
    d3 = sel.select([A, B], 8 * BS, {B: 8}, load, View(), block_sizes={B: 64})
    assert d3.overlap_blocks == 0
