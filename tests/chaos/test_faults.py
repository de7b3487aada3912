"""Faults as an operator meets them, against deployments started with the CLI (mocker engine):
the bus SIGKILLed under 16 streams, a worker SIGKILLed under 32 streams, a request that kills
every worker it reaches, and 500 slow clients. Figures: bench/reliability.py → docs/reliability.md."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.chaos import scenarios as sc
from tests.e2e.conftest import Deployment, boot, shutdown

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "chaos_pair", "mocker-agg.toml", ready={"agg": 2},
             sets=sc.PAIR_SETS)
    yield d
    shutdown(d)


def test_bus_sigkill_under_16_streams(pair: Deployment) -> None:
    r = asyncio.run(sc.bus_kill_under_streams(pair, streams=16))
    for part in ("in_flight", "sent_while_down"):
        s = r[part]
        assert s["hang"] == 0, r  # every stream completes or ends with an error within the stall timeout
        assert s["completed"] == s["streams"], r  # and here, with a live worker, they all complete
        assert s["exact"] == s["streams"], r  # no token lost or repeated across the re-send
    assert r["nats_restarted"] and r["worker_restarts"] == 0, r


def test_worker_sigkill_under_32_streams(pair: Deployment) -> None:
    r = asyncio.run(sc.worker_kill_under_streams(pair, streams=32))
    assert r["streams"]["hang"] == 0 and r["streams"]["completed"] == 32, r
    assert r["streams"]["exact"] == 32, r
    assert r["worker_restarts"] == 1, r


def test_slow_clients_are_closed_within_the_header_timeout(pair: Deployment) -> None:
    sc.raise_nofile(4096)
    r = asyncio.run(sc.slow_clients(pair, connections=500))
    assert r["never_closed"] == 0, r
    assert r["max_closed_after_s"] <= 10.0 + 3.0, r  # the default header_timeout, with slack
    assert r["non_openai_bodies"] == 0, r
    assert r["served_meanwhile"] == 200, r


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "chaos_poison", "mocker-agg.toml", ready={"agg": 2},
             sets=sc.POISON_SETS)
    yield d
    shutdown(d)


def test_request_of_death_costs_at_most_two_restarts(poisoned: Deployment) -> None:
    r: dict[str, Any] = asyncio.run(sc.request_of_death(poisoned, poison=[5, sc.POISON, 6]))
    assert r["first"]["status"] == 500 and "died while serving it" in r["first"]["error"], r
    assert r["again"]["status"] == 400 and "quarantined" in r["again"]["error"], r
    assert 1 <= r["worker_restarts"] <= 2, r
    assert r["deployment_running"] and r["served_after"] == 200, r
    # the ordinary requests beside it are all served: the ones whose worker it killed are suspects,
    # re-sent one at a time per worker, so none of them is beside it when it kills its second one
    assert r["ordinary_statuses"] == [200] * 8, r
