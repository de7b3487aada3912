"""A deployment started with the CLI is closed the way the topology says, tried as an attacker on the
same host would: bus auth enforced by the embedded nats-server for each auth kind (anonymous and
wrong credentials refused, the frontend and a worker still serve), no secret in the process list or
the logs, no command runnable through any supervisor's ``spawn``, and per-role users (the shipped
topologies/mocker-secure.toml) that let an observer look but not act, and a worker act on nothing
but itself."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import nats
import pytest

from config.topology import BusAuth, BusTLS
from tests.e2e.conftest import Deployment, chat_body, http_json, post
from tests.helpers import bus_admits, listening_hosts, make_certs, make_nkey, make_operator, registry

MODEL = "tiny"


def _process_list() -> str:
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout


def _wait_health(d: Deployment, agg: int, timeout: float = 90.0) -> dict[str, Any]:
    """/health stays open without the API key; wait for ``agg`` ready workers."""
    def ready() -> dict[str, Any] | None:
        status, body = d.health()
        return body if status == 200 and sum(i["role"] == "agg" for i in body["instances"]) >= agg else None
    return d.wait_until(ready, timeout, f"/health 200 with {agg} agg worker(s)")


@pytest.fixture
def started() -> Iterator[list[Deployment]]:
    ds: list[Deployment] = []
    yield ds
    for d in ds:
        if d.proc is not None:
            code = d.stop(30)
            assert code == 0, d.output()


class Kind(NamedTuple):
    sets: list[str]  # --set overrides
    secret: str  # must show in no process's command line and no log
    good: BusAuth  # what a client of the deployment connects with
    wrong: list[BusAuth]
    tls: BusTLS | None  # client TLS


def _kinds(tmp: Path) -> dict[str, Kind]:
    token = "tok-" + secrets.token_hex(8)
    (tmp / "token").write_text(token + "\n")
    password = "pw-" + secrets.token_hex(8)
    (tmp / "password").write_text(password + "\n")
    make_nkey(tmp / "user.nk")
    make_nkey(tmp / "other.nk")
    seed = (tmp / "user.nk").read_text().strip()
    c = make_certs(str(tmp))
    op = make_operator(str(tmp))
    creds_seed = next(line for line in Path(op["creds"]).read_text().splitlines() if line.startswith("SU"))
    return {
        "token": Kind([f"bus.auth.token_file={tmp / 'token'}"], token, BusAuth(token_file=str(tmp / "token")),
                      [BusAuth(token="tok-wrong")], None),
        "user": Kind(["bus.auth.user=alice", f"bus.auth.password_file={tmp / 'password'}"], password,
                     BusAuth(user="alice", password_file=str(tmp / "password")),
                     [BusAuth(user="alice", password="nope"), BusAuth(user="bob", password=password)], None),
        # nkey over TLS: the embedded server requires TLS with its own certificate
        "nkey_tls": Kind([f"bus.auth.nkey_seed={tmp / 'user.nk'}", f"bus.tls.ca_file={c['ca']}",
                          f"bus.tls.server_cert_file={c['server_cert']}",
                          f"bus.tls.server_key_file={c['server_key']}"], seed,
                         BusAuth(nkey_seed=str(tmp / "user.nk")), [BusAuth(nkey_seed=str(tmp / "other.nk"))],
                         BusTLS(ca_file=c["ca"])),
        # creds: the embedded server includes an operator-mode config (operator, accounts)
        "creds": Kind([f"bus.server_config={op['server_conf']}", f"bus.auth.creds={op['creds']}"], creds_seed,
                      BusAuth(creds=op["creds"]), [BusAuth(creds=op["stranger"]), BusAuth(creds=op["forged"])],
                      None),
    }


@pytest.mark.parametrize("kind", ["token", "user", "nkey_tls", "creds"])
def test_bus_auth_is_enforced_and_secrets_stay_hidden(kind: str, tmp_path: Path,
                                                      started: list[Deployment]) -> None:
    sets, secret, good, wrong, tls = _kinds(tmp_path)[kind]
    d = Deployment("mocker-agg.toml", tmp_path, f"sec{kind.replace('_', '')}{os.getpid()}", sets=sets,
                   status_pools={"agg": 1})
    started.append(d)
    d.start()
    d.wait_ready({"agg": 1}, 90)
    code, _, text = post(d.url + "/v1/chat/completions", chat_body(MODEL))
    assert code == 200, text  # the frontend and the worker both connected with the credentials

    async def probe() -> None:
        assert await bus_admits(d.bus_url, good, tls)
        assert not await bus_admits(d.bus_url, BusAuth(), tls), "anonymous client admitted"
        for w in wrong:
            assert not await bus_admits(d.bus_url, w, tls), f"wrong credentials admitted: {w}"
        if tls is not None:
            assert not await bus_admits(d.bus_url, good, None), "client without the CA admitted"
    asyncio.run(probe())

    assert secret not in _process_list()
    assert secret not in d.log.read_text(errors="replace")
    # the shipped agg pools' status servers stay on loopback
    assert listening_hosts(d.status_ports["agg"]) == {"127.0.0.1"}


def test_no_supervisor_runs_a_command_from_the_bus(tmp_path: Path, started: list[Deployment]) -> None:
    """The issue's payload against a worker process's own supervisor, and against the root: both
    refused, no file created; scaling names the pool and the host instead, and the new replica serves."""
    d = Deployment("mocker-agg.toml", tmp_path, f"secspawn{os.getpid()}")
    started.append(d)
    d.start()
    d.wait_ready({"agg": 1}, 90)
    marker = tmp_path / "pwned"
    old = json.dumps({"id": "p", "argv": ["/usr/bin/touch", str(marker)], "restart": "temporary",
                      "ready": "spawn"}).encode()
    ns = d.namespace

    async def run() -> None:
        nc = await nats.connect(d.bus_url)
        try:
            for subject in (f"{ns}.supervisor.local.worker-agg-0.spawn", f"{ns}.supervisor.local.spawn"):
                msg = await nc.request(subject, old, timeout=10)
                assert msg.headers and msg.headers.get("Nats-Service-Error-Code") == "400", (subject, msg.headers)
            msg = await nc.request(f"{ns}.supervisor.local.worker-agg-0.spawn", b'{"pool": "agg"}', timeout=10)
            assert msg.headers and "fixed set of children" in msg.headers.get("Nats-Service-Error", "")
            msg = await nc.request(f"{ns}.supervisor.local.spawn", b'{"pool": "agg"}', timeout=90)
            assert not (msg.headers or {}).get("Nats-Service-Error"), msg.headers
            reply = json.loads(msg.data)
            assert reply["status"] == "ok" and reply["child"]["id"] == "worker-agg-1", reply
        finally:
            await nc.close()
    asyncio.run(run())
    time.sleep(0.5)
    assert not marker.exists()
    body = _wait_health(d, agg=2)
    assert len({i["instance"] for i in body["instances"]}) == 2
    code, _, text = post(d.url + "/v1/chat/completions", chat_body(MODEL))
    assert code == 200, text


class Refusals:
    """A client connection that keeps what the server told it: a refusal here is a permissions
    violation the server reported for that very subject, never a request that merely went
    unanswered (a timeout would also be what a slow or absent responder looks like)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: Any = None

    async def connect(self, url: str, **auth: Any) -> Refusals:
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e))
        self.nc = await nats.connect(url, error_cb=on_error, max_reconnect_attempts=1, allow_reconnect=False,
                                     **auth)
        return self

    def violated(self, kind: str, subject: str) -> bool:
        # nats-py reports the server's -ERR in lower case
        return f'permissions violation for {kind} to "{subject.lower()}"' in [e.lower().removeprefix("nats: ")
                                                                          for e in self.errors]

    async def refused(self, subject: str, payload: bytes) -> bool:
        """Publishing ``subject`` (as a request) is refused with a permissions violation."""
        try:
            await self.nc.request(subject, payload, timeout=2)
        except nats.errors.TimeoutError:
            pass  # the server dropped the request; whether for permissions is asked below
        else:
            return False
        await self.nc.flush()
        return self.violated("publish", subject)

    async def refused_sub(self, subject: str, queue: str = "") -> bool:
        """Subscribing to ``subject`` (in ``queue``) is refused with a permissions violation."""
        await self.nc.subscribe(subject, queue=queue)
        await self.nc.flush()
        await asyncio.sleep(0.2)  # the -ERR follows the PONG that ended the flush
        return self.violated("subscription", subject)

    async def close(self) -> None:
        await self.nc.close()


def _environ(pid: int) -> dict[str, str]:
    """A process's environment, as any process of the same user (a compromised worker) reads it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)


def test_per_role_users_of_the_shipped_secure_topology(tmp_path: Path, started: list[Deployment]) -> None:
    """topologies/mocker-secure.toml with topologies/secure/roles.conf: the deployment serves with
    a user per worker process (bus.scoped_workers); an observer can list services but not sleep a
    worker or load a LoRA; a worker's user (taken from its process, as a compromised worker would)
    cannot call another worker's verbs, any supervisor's, JetStream's stream administration, nor
    read another worker's requests or the deployment's replies: each refused with a permissions
    violation. A restarted worker and a spawned one get working users of their own, and the
    restarted one's old user is refused. Anonymous clients are refused."""
    pw = {role: f"{role}-{secrets.token_hex(6)}" for role in ("supervisor", "operator", "observer")}
    env = {f"VLLM_ACTORS_{r.upper()}_PASSWORD": p for r, p in pw.items()}
    env["VLLM_ACTORS_API_KEY"] = api_key = "key-" + secrets.token_hex(6)
    d = Deployment("mocker-secure.toml", tmp_path, "dynamo", env=env, status_pools={"agg": 3},
                   sets=["pools.agg.replicas=2"])
    started.append(d)
    d.start()
    body = _wait_health(d, agg=2)
    instances = sorted(i["instance"] for i in body["instances"])
    instance, other = instances  # agg-0-..., agg-1-...
    status, _ = http_json(d.url + "/v1/models")
    assert status == 401  # the key comes from VLLM_ACTORS_API_KEY
    auth = {"Authorization": f"Bearer {api_key}"}
    code, _, text = post(d.url + "/v1/chat/completions", chat_body(MODEL), headers=auth)
    assert code == 200, text
    # /v1/responses (its store is a KV bucket the frontend's user creates) and /v1/messages, whose
    # clients send the key as x-api-key and read Anthropic's error shape
    code, _, text = post(d.url + "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4}, headers=auth)
    assert code == 200 and json.loads(text)["store"] is True, text
    msg = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    code, _, text = post(d.url + "/v1/messages", msg, headers={"x-api-key": api_key})
    assert code == 200, text
    code, _, text = post(d.url + "/v1/messages", msg, headers={"x-api-key": "wrong"})
    assert code == 401 and json.loads(text)["error"]["type"] == "authentication_error", text

    async def as_user(user: str) -> Refusals:
        return await Refusals().connect(d.bus_url, user=user, password=pw[user])

    async def children(c: Refusals) -> dict[str, Any]:
        kids = await c.nc.request("dynamo.supervisor.local.children", b"", timeout=5)
        return {k["id"]: k for k in json.loads(kids.data)["children"]}

    async def as_worker(pid: int) -> tuple[Refusals, dict[str, str]]:
        e = _environ(pid)
        c = await Refusals().connect(d.bus_url, user=e["VLLM_ACTORS_BUS_USER"], password=e["VLLM_ACTORS_BUS_PASSWORD"],
                                     inbox_prefix=f"_INBOX.dynamo.{e['VLLM_ACTORS_INSTANCE']}")
        return c, e

    lora = b'{"lora_name": "x", "source": {"uri": "file:///tmp/x"}}'

    async def run() -> dict[str, str]:
        assert not await bus_admits(d.bus_url, BusAuth())
        assert not await bus_admits(d.bus_url, BusAuth(user="observer", password="wrong"))
        assert not await bus_admits(d.bus_url, BusAuth(user="worker", password="anything"))  # no such role now
        obs = await as_user("observer")
        try:
            info = await obs.nc.request("$SRV.INFO", b"", timeout=5)
            assert json.loads(info.data)["name"]
            kids = await children(obs)
            assert {"worker-agg-0", "worker-agg-1"} <= set(kids)
            assert await obs.refused(f"dynamo.worker.{instance}.sleep", b"{}")
            assert await obs.refused(f"dynamo.worker.{instance}.lora.load", lora)
            assert await obs.refused("dynamo.supervisor.local.spawn", b'{"pool": "agg"}')
            # `nats kv ls/get` of the registry: reads through JetStream's API. A listing consumer
            # delivers the instance's key (read until it comes: where nats-py's keys() would end
            # is not reliable, see bus.registry.live_entries), and so do the stream's state and its
            # messages, direct or from the leader
            kv = await obs.nc.jetstream().key_value("dynamo-instances")
            watcher = await kv.watchall(meta_only=True)
            try:
                listed: set[str] = set()
                while instance not in listed:
                    entry = await watcher.updates(timeout=10)
                    if entry is not None:
                        listed.add(entry.key)
            finally:
                await watcher.stop()
            assert instance in await registry(obs.nc, "dynamo")
            assert json.loads((await kv.get(instance)).value)["instance"] == instance
        finally:
            await obs.close()

        wk, handed = await as_worker(kids["worker-agg-0"]["pid"])
        try:
            assert handed["VLLM_ACTORS_INSTANCE"] == instance
            # its own verbs answer (the grant is not empty)
            h = await wk.nc.request(f"dynamo.worker.{instance}.health", b"", timeout=5)
            assert json.loads(h.data)["status"] == "healthy"
            # another worker's control verbs
            for verb, payload in (("sleep", b"{}"), ("wake_up", b"{}"), ("clear_kv_blocks", b"{}"),
                                  ("lora.load", lora)):
                assert await wk.refused(f"dynamo.worker.{other}.{verb}", payload), (verb, wk.errors)
            # any supervisor's verbs: the root's, and the other worker's own supervisor
            assert await wk.refused("dynamo.supervisor.local.spawn", b'{"pool": "agg"}'), wk.errors
            assert await wk.refused("dynamo.supervisor.local.worker-agg-1.stop", b'{"id": "engine"}'), wk.errors
            # the registry's streams: no delete, no purge, no other worker's record
            for api in ("STREAM.DELETE", "STREAM.PURGE"):
                assert await wk.refused(f"$JS.API.{api}.KV_dynamo-instances", b""), (api, wk.errors)
            assert await wk.refused(f"$KV.dynamo-instances.{other}", b""), wk.errors
            # another worker's requests, the pool's requests outside the queue group, the replies
            # of the whole deployment (every token stream)
            assert await wk.refused_sub(f"dynamo.agg.generate.{other}"), wk.errors
            assert await wk.refused_sub("dynamo.agg.generate"), wk.errors
            assert await wk.refused_sub("_INBOX.dynamo.>"), wk.errors
        finally:
            await wk.close()
        return handed

    handed = asyncio.run(run())

    # the refused calls changed nothing: both workers are awake and serving
    body = _wait_health(d, agg=2, timeout=5)
    assert sorted(i["instance"] for i in body["instances"]) == instances
    code, _, text = post(d.url + "/v1/chat/completions", chat_body(MODEL), headers=auth)
    assert code == 200, text

    # a restarted worker is a new incarnation with a new user; the old one is refused
    os.kill(_child_pid(d, "worker-agg-0", pw), signal.SIGKILL)

    def replaced() -> dict[str, Any] | None:
        status, b = d.health()
        now = {i["instance"] for i in b["instances"]} if status == 200 else set()
        return b if len(now) == 2 and instance not in now else None
    d.wait_until(replaced, 90, "worker-agg-0 restarted under a new instance")

    async def after_restart() -> None:
        old = BusAuth(user=handed["VLLM_ACTORS_BUS_USER"], password=handed["VLLM_ACTORS_BUS_PASSWORD"])
        assert not await bus_admits(d.bus_url, old), "a dead incarnation's user admitted"
        op = await as_user("operator")
        try:  # an operator may act: a spawn, whose worker gets a user of its own too
            msg = await op.nc.request("dynamo.supervisor.local.spawn", b'{"pool": "agg"}', timeout=90)
            assert not (msg.headers or {}).get("Nats-Service-Error"), msg.headers
            kids = await children(op)
        finally:
            await op.close()
        for cid in ("worker-agg-0", "worker-agg-2"):
            e = _environ(kids[cid]["pid"])
            assert e["VLLM_ACTORS_BUS_USER"] == e["VLLM_ACTORS_INSTANCE"] != handed["VLLM_ACTORS_INSTANCE"]
    asyncio.run(after_restart())
    body = _wait_health(d, agg=3)
    code, _, text = post(d.url + "/v1/chat/completions", chat_body(MODEL), headers=auth)
    assert code == 200, text
    listing = _process_list()
    assert not any(p in listing for p in pw.values()) and api_key not in listing
    # every worker did its work within its grant: none was told of a violation
    assert "permissions violation" not in d.log.read_text(errors="replace").lower()


def _child_pid(d: Deployment, child: str, pw: dict[str, str]) -> int:
    async def ask() -> int:
        nc = await nats.connect(d.bus_url, user="observer", password=pw["observer"])
        try:
            kids = await nc.request("dynamo.supervisor.local.children", b"", timeout=5)
            return int(next(k["pid"] for k in json.loads(kids.data)["children"] if k["id"] == child))
        finally:
            await nc.close()
    return asyncio.run(ask())
