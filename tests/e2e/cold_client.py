"""What a client and an operator see of a cold model, shared by the scale-to-zero e2e tests: the
cold-model subjects and the root's verbs over NATS (as ``nats sub``/``nats req`` show them), a
/v1/models and /health poller, and 16 concurrent requests through the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import nats

from tests.e2e.conftest import Deployment, http_json, http_text
from tests.helpers import openai_client

N = 16
MAX_TOKENS = 8


class BusLog:
    """The deployment's demand and wake-outcome subjects, as ``nats sub`` shows them."""

    def __init__(self, d: Deployment) -> None:
        self.d = d
        self.demands: list[dict[str, Any]] = []
        self.outcomes: list[dict[str, Any]] = []
        self.nc: nats.NATS | None = None

    async def __aenter__(self) -> BusLog:
        self.nc = await nats.connect(self.d.bus_url)
        ns = self.d.namespace
        await self.nc.subscribe(f"{ns}.wake.demand", cb=self._add(self.demands))
        await self.nc.subscribe(f"{ns}.wake.outcome", cb=self._add(self.outcomes))
        await self.nc.flush()
        return self

    @staticmethod
    def _add(into: list[dict[str, Any]]) -> Any:
        async def cb(msg: Any) -> None:
            into.append(json.loads(msg.data))
        return cb

    async def __aexit__(self, *exc: object) -> None:
        assert self.nc is not None
        await self.nc.drain()

    async def outcome(self, action: str, since: int = 0, timeout: float = 10.0) -> dict[str, Any]:
        """The first outcome of ``action`` among ``outcomes[since:]``, once it has arrived: the waker
        publishes it when the wake_up or spawn answers, which can be a little after the worker
        registered and the held requests were served."""
        end = time.monotonic() + timeout
        while not (mine := [o for o in self.outcomes[since:] if o["action"] == action]):
            assert time.monotonic() < end, f"no {action} outcome in {timeout}s: {self.outcomes}"
            await asyncio.sleep(0.05)
        return mine[0]

    async def until_no_replica(self, timeout: float = 20.0) -> None:
        """Until the root runs no replica of the pool (an idle stop drains, then removes it)."""
        end = time.monotonic() + timeout
        while [c for c in await self.children() if (c.get("meta") or {}).get("pool") == "agg"]:
            assert time.monotonic() < end, await self.children()
            await asyncio.sleep(0.1)

    async def waker(self) -> dict[str, Any]:
        """``nats req <ns>.waker.local.status '{}'``: the root's waker."""
        assert self.nc is not None
        msg = await self.nc.request(f"{self.d.namespace}.waker.local.status", b"{}", timeout=5)
        return json.loads(msg.data)

    async def children(self) -> list[dict[str, Any]]:
        assert self.nc is not None
        msg = await self.nc.request(f"{self.d.namespace}.supervisor.local.children", b"{}", timeout=5)
        return json.loads(msg.data)["children"]


class Watcher:
    """Polls /v1/models and /health every 100 ms from a thread, as a load balancer and a client
    would, and records every answer that is not "listed" and 200."""

    def __init__(self, d: Deployment) -> None:
        self.d = d
        self.bad: list[Any] = []
        self.statuses: set[str] = set()
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                code, models = http_json(f"{self.d.url}/v1/models")
                if code != 200 or "tiny" not in [m["id"] for m in models["data"]]:
                    self.bad.append(("models", code, models))
                code, health = http_json(f"{self.d.url}/health")
                self.statuses.add(health.get("status"))
                if code != 200:
                    self.bad.append(("health", code, health))
                self.polls += 1
            except (OSError, ValueError) as e:
                self.bad.append(("error", repr(e)))
            self._stop.wait(0.1)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def cold_state(d: Deployment) -> str | None:
    code, body = d.health()
    if code == 200 and body["status"] == "cold":
        return "+".join(sorted(set(body["cold"]["pools"].values())))
    return None


async def sixteen(d: Deployment) -> list[dict[str, Any]]:
    """16 requests at once, half streamed, half not, chat and completions: what each got, with the
    time from sending to its first token."""
    client = openai_client(d.url, timeout=60)

    async def one(i: int) -> dict[str, Any]:
        t0 = time.monotonic()
        chat = i % 4 < 2
        if i % 2 == 0:  # streamed
            kw: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "stream": True,
                                  "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
            stream = await (client.chat.completions.create(messages=[{"role": "user", "content": f"hi {i}"}], **kw)
                            if chat else client.completions.create(prompt=f"hi {i}", **kw))
            first, finish, usage = None, None, None
            async for chunk in stream:
                if chunk.choices:
                    c = chunk.choices[0]
                    text = c.delta.content if chat else c.text
                    if text and first is None:
                        first = time.monotonic() - t0
                    finish = c.finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage
            return {"first": first, "finish": finish, "tokens": usage.completion_tokens if usage else None}
        kw = {"model": "tiny", "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
        r = await (client.chat.completions.create(messages=[{"role": "user", "content": f"hi {i}"}], **kw)
                   if chat else client.completions.create(prompt=f"hi {i}", **kw))
        return {"first": time.monotonic() - t0, "finish": r.choices[0].finish_reason,
                "tokens": r.usage.completion_tokens if r.usage else None}

    try:
        return await asyncio.gather(*(one(i) for i in range(N)))
    finally:
        await client.close()


def assert_complete(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["finish"] == "length" and r["tokens"] == MAX_TOKENS, results


def wake_seconds(d: Deployment) -> dict[str, float]:
    """vllm_actors_frontend_wake_seconds_count by its ``cold`` label."""
    out: dict[str, float] = {}
    for line in http_text(f"{d.url}/metrics").splitlines():
        if line.startswith("vllm_actors_frontend_wake_seconds_count{"):
            cold = line.split('cold="', 1)[1].split('"', 1)[0]
            out[cold] = out.get(cold, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
