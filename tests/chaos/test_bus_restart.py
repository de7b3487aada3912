"""Requests sent the moment the bus is SIGKILLed, against a one-worker deployment started with the
CLI (mocker engine; issue 31 item 1): each is answered within 15 s, never held for a worker that
cannot come. The suite runs a few rounds; the acceptance run is 20 (``BUS_RESTART_ROUNDS=20``)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from tests.chaos import scenarios as sc
from tests.e2e.conftest import Deployment, boot, shutdown

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "chaos_single", "mocker-agg.toml", ready={"agg": 1})
    yield d
    shutdown(d)


def test_requests_sent_as_the_bus_restarts_are_answered_within_15s(single: Deployment) -> None:
    rounds = int(os.environ.get("BUS_RESTART_ROUNDS", "3"))
    r = asyncio.run(sc.requests_as_the_bus_restarts(single, requests=4, rounds=rounds, answer_within=15.0))
    # 200, or 503 with Retry-After, within 15 s: every one of them
    assert r["answered_in_time"] == r["requests"] == 4 * rounds, r
    assert r["worker_restarts"] == 0, r  # the bus restarted; the worker lived on
