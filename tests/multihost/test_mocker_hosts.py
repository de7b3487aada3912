"""A mocker deployment over three hosts (network namespaces joined by a switch), started as an
operator starts one: ``topologies/mocker-multihost.toml``, one supervisor per host with ``--host``.

    a: nats-server, frontend (kv router), prefill    b: nats-server, decode    c: nats-server, decode_c

The three servers form a NATS cluster (routes over the veths, JetStream R3), so a host may die or
be cut off while JetStream keeps its majority. A client in host a checks what it sees: requests
served across hosts, streams that survive host b's death or isolation with none failed, and host
b's workers serving again once it is back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import nats
import pytest

from tests.helpers import registry, srv_ping
from tests.multihost.deployment import BUS_PORT, ROOT, HostsDeployment, Stream
from tests.multihost.netns import Hosts

TOPOLOGY = ROOT / "topologies" / "mocker-multihost.toml"
# decode at half the mocker's real speed: a 120-token stream lasts seconds, long enough to kill its
# host mid-way; a dead or cut-off worker's stream stalls, and the frontend asks after 3 s
SETS = ["pools.decode.engine_args.speedup_ratio=0.5", "pools.decode_c.engine_args.speedup_ratio=0.5",
        "frontend.stall_timeout=3", "supervisor.backoff.initial=0.1"]
READY = {"prefill": 1, "decode": 1, "decode_c": 1}
LONG = 120


@pytest.fixture(scope="module")
def world(netns_available: type[Hosts], tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostsDeployment]:
    tmp = tmp_path_factory.mktemp("mocker-hosts")
    with netns_available(("a", "b", "c")) as hosts:
        d = HostsDeployment(hosts, TOPOLOGY, tmp, SETS, env={"VLLM_ACTORS_ROUTE_PASSWORD": "route-secret"})
        try:
            for name in ("a", "b", "c"):  # one after another, as an operator would: a waits for quorum
                d.start(name)
            d.wait_ready(READY)
            yield d
        finally:
            d.stop()


def assert_all_served(streams: list[Stream], d: HostsDeployment) -> None:
    failed = [s for s in streams if not (s.ok and s.usage and s.usage["completion_tokens"] == LONG)]
    assert not failed, f"{len(failed)} of {len(streams)} streams failed: {failed[:3]}\n{d.logs()}"


def served_by(d: HostsDeployment, host: str, timeout: float = 45.0) -> list[Stream]:
    """Send batches of short chats until one is served by a worker of ``host``; every one must
    succeed meanwhile. A worker that just (re)registered is routed to once the frontend has
    confirmed it on the bus, and a dead one's record is dropped once it stops answering: seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        hosts = d.hosts_of()
        batch = d.chats(8, 4, prompt=f"after {time.monotonic()}")
        assert all(s.ok for s in batch), batch
        on_host = [s for s in batch if hosts.get(s.worker or "") == host]
        if on_host:
            return on_host
        time.sleep(1.0)
    raise AssertionError(f"no request reached host {host}'s workers within {timeout:g}s\n{d.logs()}")


def test_requests_cross_hosts(world: HostsDeployment) -> None:
    streams = world.chats(8, 8) + world.chats(4, 8, stream=False)
    assert all(s.ok for s in streams), streams
    hosts = world.hosts_of()
    assert {hosts[s.prefill or ""] for s in streams} == {"a"}  # the prefill worker on host a...
    decoders = {hosts[s.worker or ""] for s in streams}
    assert decoders <= {"b", "c"} and decoders, decoders  # ...handed each prompt to another host
    served_by(world, "b")


def test_the_bus_from_host_a_lists_every_hosts_actors(world: HostsDeployment) -> None:
    """What `nats micro ls` and `nats kv ls` show from host a's server: actors of all three hosts."""

    async def look() -> tuple[list[dict[str, object]], dict[str, dict[str, object]]]:
        nc = await nats.connect(f"nats://127.0.0.1:{BUS_PORT}")
        try:
            return await srv_ping(nc), await registry(nc, world.namespace)
        finally:
            await nc.close()

    pings, records = world.loop().run(look())
    mine = [p for p in pings if (p.get("metadata") or {}).get("namespace") == world.namespace]
    roots = {p["metadata"]["host"] for p in mine if p["name"] == "supervisor" and "node" not in p["metadata"]}
    assert roots == {"a", "b", "c"}, mine
    engines = {p["metadata"]["host"] for p in mine if p["name"] == "engine"}
    assert engines == {"a", "b", "c"}, mine
    assert {r["host"] for r in records.values() if r["kind"] == "engine"} == {"a", "b", "c"}, records


def cut_on(streams: list[Stream], before: dict[str, str], host: str) -> list[Stream]:
    """The streams that were running on ``host`` when the action came (mid-stream, not done)."""
    cut = [s for s in streams if before.get(s.worker or "") == host and (s.tokens_at_action or 0) < LONG]
    assert cut, f"no stream was running on host {host}: {[(s.worker, s.tokens_at_action) for s in streams]}"
    return cut


def test_sigkill_of_host_b_migrates_its_streams(world: HostsDeployment) -> None:
    before = world.hosts_of()
    streams = world.chats_during(12, LONG, lambda: world.kill("b"))
    cut_on(streams, before, "b")
    assert_all_served(streams, world)

    # host b comes back (its operator, or systemd, restarts it): new workers register and serve
    world.start("b")
    world.wait_ready(READY)
    served_by(world, "b")


def test_cutting_host_bs_link_migrates_its_streams_and_it_serves_again(world: HostsDeployment) -> None:
    before = world.hosts_of()
    b_workers = {i for i, h in before.items() if h == "b"}
    try:
        streams = world.chats_during(12, LONG, world.hosts["b"].link_down)
    finally:
        world.hosts["b"].link_up()
    cut_on(streams, before, "b")
    assert_all_served(streams, world)

    # b's processes lived on behind the cut: the same workers re-register and receive traffic
    world.wait_ready(READY)
    on_b = served_by(world, "b")
    assert {s.worker for s in on_b} <= b_workers, (on_b, b_workers)
    assert world.procs["b"].poll() is None, "host b's supervisor died while cut off"
