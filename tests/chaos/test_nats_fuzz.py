"""Chaos: malformed payloads on every NATS subject of a deployment started with the CLI.

Each case boots a mocker deployment (``python -m actors.supervisor``), runs
``tests.chaos.nats_fuzz.run_nats_fuzz`` against its bus, and checks issue 11's acceptance: no reply
with a code of 500 or more, every request answered, no actor restarted, and a chat completion still
served afterwards.

No reply is expected only on the KV event and load subjects (``ns.kv.events.<id>``,
``ns.load.<id>``): workers publish there fire-and-forget and the frontend's KV feed never replies,
so the fuzz publishes to them without a reply subject. With the kv router the feed's own counters
show that the garbage reached it.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

from tests.chaos.nats_fuzz import run_nats_fuzz
from tests.e2e.conftest import boot, chat_body, post, shutdown

MODEL = "tiny"
SEED = int(os.environ.get("NATS_FUZZ_SEED", "11"))

# (case, --set overrides, endpoints that must have been found: "<service>.<endpoint>")
CASES = [
    ("agg", ["pools.agg.engine_args.enable_lora=true"],
     {"supervisor.children", "supervisor.restart", "supervisor.spawn", "supervisor.stop", "supervisor.escalate",
      "engine.generate", "engine.generate_instance", "engine.sleep", "engine.wake_up", "engine.clear_kv_blocks",
      "engine.health", "engine.stats", "engine.lora_add", "engine.lora_remove", "engine.lora_list",
      "engine.kv_sources", "engine.cancel", "lora.lora_load", "lora.lora_unload", "lora.lora_list",
      "health.liveness", "kv_publisher.kv_dump", "kv_publisher.kv_range", "frontend.status"}),
    # the planner too (load mode: no profile needed), so its verbs are fuzzed beside the router's
    ("kv", ["frontend.router=kv", "planner.enabled=true", "planner.mode=load", "planner.interval=1"],
     {"frontend.route", "frontend.finish", "frontend.index_stats", "frontend.index_dump", "engine.generate",
      "planner.status", "planner.decisions", "planner.profile"}),
]


def _sources(figures: dict[str, Any]) -> set[str]:
    """Where the fuzz found its subjects: "srv:<service>.<endpoint>", "registry:...", ..."""
    return {src for s in figures["subjects"] for src in s.rsplit(" (", 1)[1].rstrip(")").split("+")}


def _found(figures: dict[str, Any]) -> set[str]:
    """``<service>.<endpoint>`` of every micro-service subject the fuzz covered."""
    return {src.removeprefix("srv:") for src in _sources(figures) if src.startswith("srv:")}


@pytest.mark.slow
@pytest.mark.parametrize("case,sets,expected", CASES, ids=[c[0] for c in CASES])
def test_malformed_payloads_on_every_subject(case: str, sets: list[str], expected: set[str],
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    d = boot(tmp_path_factory, f"fuzz{case}", "mocker-agg.toml", ready={"agg": 1}, sets=sets)
    try:
        fig = asyncio.run(run_nats_fuzz(d.bus_url, d.namespace, seed=SEED, per_subject=8))
        report = json.dumps({k: v for k, v in fig.items() if k != "subjects"}, indent=1)
        print(report)
        # every supervised actor was up before the fuzz (/health is 200 once an engine serves, while
        # the actors started after it may still be starting)
        assert fig["unsettled_at_start"] == [], report
        assert expected <= _found(fig), f"endpoints not found: {expected - _found(fig)}"
        assert {"registry:generate_subject", "registry:kv_events", "registry:load", "srv-control",
                "bus:wake_demand", "bus:wake_outcome"} <= _sources(fig)
        assert not fig["unclassified"], f"endpoints nats_battery.VERBS does not know: {fig['unclassified']}"
        assert fig["payloads_sent"] > 2000
        assert fig["server_errors"] == 0, report
        assert fig["timeouts"] == 0 and fig["no_responders"] == 0 and fig["streams_cut"] == 0, report
        assert fig["restarts"] == {"restarts": 0, "children_changed": [], "registry_changed": [],
                                   "services_gone": []}, report
        assert fig["published_no_reply"] > 0
        if case == "kv":  # the published garbage reached the KV feed, which counted it as such
            assert fig["feed_decode_errors"] > 0, report
        code, _, text = post(f"{d.url}/v1/chat/completions", chat_body(MODEL))
        assert code == 200, text
    finally:
        shutdown(d)
