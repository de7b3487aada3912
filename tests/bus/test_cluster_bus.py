"""A real three-server NATS cluster on loopback, configured by ``deploy.nats_conf`` as each host's
server would be: a host's bus waits for JetStream until a majority is up, registry buckets get the
deployment's replicas, and the registry keeps working with one server of three gone.

The three servers share one route port on three loopback addresses (127.0.0.1-3: Linux routes the
whole of 127.0.0.0/8 to ``lo``), so the product's config, one route port for every server, is
rendered unchanged. Clients connect to each server's own port on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import nats.errors
import nats.js.errors
import pytest

from bus.context import BusContext, open_context
from bus.embedded import EmbeddedNats, free_port
from bus.registry import RegistryEvent, wait_for_jetstream
from config.topology import BusCluster, BusConfig, BusTLS
from deploy import nats_conf

SERVERS = {"a": "127.0.0.1", "b": "127.0.0.2", "c": "127.0.0.3"}
OUTSIDER = "127.0.0.4"  # not a server of the cluster: nobody routes to it
PASSWORD = 'r@ute:p/w "x"'  # the servers admit each other only if it survives URL and config quoting
T = TypeVar("T")
ELECTION_TIMEOUT = 30.0  # generous: a shared 2-core machine; nothing asserts on speed


def _route_port() -> int:
    """A port free on every loopback address used here (the product gives every server the same one)."""
    for _ in range(20):
        port = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for address in [*SERVERS.values(), OUTSIDER]:
                    s = stack.enter_context(socket.socket())
                    s.bind((address, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free on 127.0.0.1-4")


class Cluster:
    def __init__(self, tmp_path: Path) -> None:
        self.namespace = "t" + secrets.token_hex(4)
        self.route_port = _route_port()
        bus = BusConfig(cluster=BusCluster(servers=SERVERS, port=self.route_port, password=PASSWORD))

        def member(host: str) -> EmbeddedNats:
            return EmbeddedNats(port=0, store_dir=str(tmp_path / f"nats-{host}"), name="nats",
                                server_name=f"{self.namespace}-{host}",
                                write_config=lambda path: nats_conf.write(bus, path, host=host,
                                                                          namespace=self.namespace))

        self.servers = {h: member(h) for h in SERVERS}
        self.contexts: list[BusContext] = []

    async def connect(self, host: str, kv_replicas: int = 3) -> BusContext:
        ctx = await open_context(self.servers[host].url, self.namespace, host, f"test-{host}", kv_replicas)
        self.contexts.append(ctx)
        return ctx

    async def close(self) -> None:
        for ctx in self.contexts:
            with contextlib.suppress(Exception):
                await ctx.nc.close()
        for srv in self.servers.values():
            srv.kill_now()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        await c.close()


async def _through_election(read: Callable[[], Awaitable[T]]) -> T:
    """``read()``, asked again while JetStream is still electing after a server's loss: listing keys
    creates a consumer, which needs the meta leader (that server may have been it). The registry's
    own readers retry the same way (``actors.instances.watch.BucketWatch``)."""
    deadline = asyncio.get_running_loop().time() + ELECTION_TIMEOUT
    while True:
        try:
            return await read()
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _jetstream(ctx: BusContext) -> None:
    await asyncio.wait_for(wait_for_jetstream(ctx.nc, lambda _: None, attempt_timeout=1.0), ELECTION_TIMEOUT)


async def test_a_host_waits_for_jetstream_until_a_majority_is_up(cluster: Cluster) -> None:
    await cluster.servers["a"].start()
    ctx = await cluster.connect("a")
    waits: list[str] = []
    waiting = asyncio.create_task(wait_for_jetstream(ctx.nc, waits.append, attempt_timeout=0.5, report_every=1.0))
    # one server of three has no JetStream quorum: the wait goes on, and says what it waits for,
    # again and again (report_every=1s), not once. Until the second report, not for a fixed 3 s:
    # on a loaded box one 0.5 s attempt took 2 s, and 3 s held one report
    async with asyncio.timeout(30):
        while len(waits) < 2 and not waiting.done():
            await asyncio.sleep(0.1)
    assert not waiting.done(), "JetStream answered with one server of three"
    assert len(waits) >= 2 and all("JetStream" in w and "majority" in w for w in waits), waits
    await cluster.servers["b"].start()  # two of three: a meta leader can be elected
    await asyncio.wait_for(waiting, ELECTION_TIMEOUT)
    info = await ctx.js.account_info()  # JetStream answers now
    assert info is not None


async def test_a_replicated_bucket_waits_for_its_servers(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """Two servers of three elect a meta leader, so JetStream answers; a three-replica bucket still
    has nowhere to go ("no suitable peers for placement"). Its creation waits, saying so, and ends
    once the third server is up, instead of failing the actor's start."""
    await asyncio.gather(cluster.servers["a"].start(), cluster.servers["b"].start())
    a = await cluster.connect("a")
    await _jetstream(a)
    bucket = a.subjects.bucket_instances
    caplog.set_level(logging.WARNING, logger="bus.registry")
    creating = asyncio.create_task(a.child().registry(bucket, ttl=30.0).ensure())
    await asyncio.sleep(3.0)
    assert not creating.done(), "a three-replica bucket was created (or failed) with two servers up"
    waits = [r.getMessage() for r in caplog.records if r.name == "bus.registry"]
    assert any(bucket in w and "waiting" in w and "3 JetStream servers" in w for w in waits), waits
    await cluster.servers["c"].start()
    await asyncio.wait_for(creating, ELECTION_TIMEOUT)
    info = await a.js.stream_info(f"KV_{bucket}")
    assert info.config.num_replicas == 3


async def test_registry_buckets_are_replicated_and_survive_losing_their_leader(cluster: Cluster) -> None:
    await asyncio.gather(*(srv.start() for srv in cluster.servers.values()))
    a = await cluster.connect("a")
    await _jetstream(a)
    bucket = a.subjects.bucket_instances
    assert a.child().kv_replicas == 3  # every actor of the process creates buckets alike
    await a.child().registry(bucket, ttl=30.0).ensure()
    info = await a.js.stream_info(f"KV_{bucket}")
    assert info.config.num_replicas == 3
    assert info.cluster is not None and info.cluster.leader is not None
    assert len(info.cluster.replicas or []) == 2  # a leader and two followers
    leader = info.cluster.leader.removeprefix(f"{cluster.namespace}-")
    assert leader in SERVERS, info.cluster.leader
    # the writer and the watcher sit on the two other hosts (another host binds the same bucket)
    w_host, r_host = sorted(h for h in SERVERS if h != leader)
    writer = (await cluster.connect(w_host)).registry(bucket, ttl=30.0)
    reader = (await cluster.connect(r_host)).registry(bucket, ttl=30.0)
    await writer.ensure()
    await reader.ensure()
    events: asyncio.Queue[RegistryEvent] = asyncio.Queue()

    async def consume() -> None:
        async for event in reader.watch():
            await events.put(event)

    watch = asyncio.create_task(consume())
    try:
        await writer.register("w1", b"one")
        assert await asyncio.wait_for(events.get(), ELECTION_TIMEOUT) == RegistryEvent("added", "w1", b"one")

        # the bucket leader's server dies: the two left keep JetStream's quorum and elect a new
        # leader; a registration rides out the election
        cluster.servers[leader].kill_now()
        await writer.register("w2", b"two")
        assert await asyncio.wait_for(events.get(), ELECTION_TIMEOUT) == RegistryEvent("added", "w2", b"two")
        assert await _through_election(writer.items) == {"w1": b"one", "w2": b"two"}
        info = await _through_election(lambda: writer.js.stream_info(f"KV_{bucket}"))
        assert info.cluster is not None and info.cluster.leader != f"{cluster.namespace}-{leader}"
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        await writer.close()


async def test_a_context_without_replicas_creates_single_replica_buckets(tmp_path: Path) -> None:
    """The default (one server, kv_replicas 1) creates R1 buckets: a replicated bucket on one
    server could never elect a leader."""
    single = EmbeddedNats(port=0, store_dir=str(tmp_path / "single"))
    await single.start()
    try:
        ctx = await open_context(single.url, "t" + secrets.token_hex(4), "h", "test-single")
        try:
            assert ctx.kv_replicas == 1
            await ctx.child().registry(ctx.subjects.bucket_instances).ensure()
            info = await ctx.js.stream_info(f"KV_{ctx.subjects.bucket_instances}")
            assert info.config.num_replicas == 1
        finally:
            await ctx.nc.close()
    finally:
        single.kill_now()


async def _hears(listener: BusContext, speaker: BusContext, attempts: int = 20) -> bool:
    """Whether a message published on ``speaker``'s server reaches a subscriber on ``listener``'s."""
    sub = await listener.nc.subscribe("probe.>")
    await listener.nc.flush()
    try:
        for _ in range(attempts):
            await speaker.nc.publish("probe.x", b"hi")
            await speaker.nc.flush()
            with contextlib.suppress(TimeoutError):
                await sub.next_msg(timeout=0.15)
                return True
        return False
    finally:
        await sub.unsubscribe()


@pytest.mark.parametrize("credentials", [True, False], ids=["with-route-password", "without"])
async def test_a_route_without_the_password_is_refused(cluster: Cluster, tmp_path: Path, credentials: bool) -> None:
    """A server that reaches host a's route port joins the cluster (and hears every subject) only
    with the route user and password. It listens on an address no member routes to: one that
    holds a member's address is dialled by the others, credentials and all."""
    await cluster.servers["a"].start()
    cred = f"route:{quote(PASSWORD, safe='')}@" if credentials else ""

    def intruder_config(path: str) -> None:
        with open(path, "w") as f:
            f.write(f'cluster {{\n  name: "{cluster.namespace}"\n  listen: "{OUTSIDER}:{cluster.route_port}"\n'
                    f'  routes: ["nats-route://{cred}127.0.0.1:{cluster.route_port}"]\n}}\n')

    intruder = EmbeddedNats(port=0, store_dir=str(tmp_path / "intruder"), write_config=intruder_config)
    await intruder.start()
    try:
        inside = await cluster.connect("a")
        outside = await open_context(intruder.url, cluster.namespace, "x", "test-intruder")
        cluster.contexts.append(outside)
        assert await _hears(outside, inside) is credentials
    finally:
        intruder.kill_now()


def _route_certs(directory: Path) -> BusTLS:
    """A CA and one server certificate for every member's address. Routes are links both ways, so
    the certificate is also a client's: it must allow client auth (``serverAuth`` alone fails the
    route handshake with "incompatible key usage")."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("route-ca", ca_key, name("route-ca")).add_extension(
        x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256())
    server = (cert("route", key, ca.subject)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                             critical=False)
              .add_extension(x509.SubjectAlternativeName(
                  [x509.IPAddress(ipaddress.ip_address(a)) for a in SERVERS.values()]), critical=False)
              .sign(ca_key, hashes.SHA256()))
    files = {"ca.pem": ca.public_bytes(serialization.Encoding.PEM),
             "server.pem": server.public_bytes(serialization.Encoding.PEM),
             "server.key": key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption())}
    for file, data in files.items():
        (directory / file).write_bytes(data)
    return BusTLS(ca_file=str(directory / "ca.pem"), server_cert_file=str(directory / "server.pem"),
                  server_key_file=str(directory / "server.key"))


async def test_tls_routes_form_the_cluster(tmp_path: Path) -> None:
    """With bus.tls's server certificate, routes are TLS with verification both ways: two of three
    members still elect JetStream's leader over them."""
    tls = _route_certs(tmp_path)
    namespace = "t" + secrets.token_hex(4)
    bus = BusConfig(tls=tls, cluster=BusCluster(servers=SERVERS, port=_route_port(), password=PASSWORD))
    servers = [EmbeddedNats(port=0, store_dir=str(tmp_path / f"nats-{h}"), server_name=f"{namespace}-{h}",
                            write_config=lambda path, h=h: nats_conf.write(bus, path, host=h, namespace=namespace))
               for h in ("a", "b")]
    try:
        await asyncio.gather(*(s.start() for s in servers))
        ctx = await open_context(BusConfig(url=servers[0].url, tls=BusTLS(ca_file=tls.ca_file)), namespace, "a",
                                 "test-tls")
        try:
            await _jetstream(ctx)
            assert (await ctx.js.account_info()) is not None
        finally:
            await ctx.nc.close()
    finally:
        for s in servers:
            s.kill_now()
