"""Mocker deployments booted with ``python -m actors.supervisor``, driven as a user does: the official
``openai`` client over HTTP and header-less JSON over NATS (what ``nats req`` sends).

One deployment per test class (class-scoped fixture), so each one is stopped before the next boots.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import nats
import pytest
from openai import APIError, AsyncOpenAI, OpenAI

from actors.frontend.responses import SESSION_HEADER
from tests.e2e.conftest import PREFILL_HEADER, WORKER_HEADER, Deployment, boot, http_json, http_text, shutdown
from tests.helpers import openai_client, registry, srv_ping

PROMPT = [{"role": "user", "content": "Tell me a long story about the sea and a lighthouse keeper."}]
NO_EOS = {"ignore_eos": True}


def client(d: Deployment) -> OpenAI:
    return OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=30)


def aclient(d: Deployment) -> AsyncOpenAI:
    return openai_client(d.url, timeout=30)


async def nats_req(nc: nats.NATS, subject: str, body: dict[str, Any], timeout: float = 10) -> dict[str, Any]:
    """Header-less JSON request, exactly what ``nats req SUBJECT '{...}'`` sends."""
    msg = await nc.request(subject, json.dumps(body).encode(), timeout=timeout)
    assert not (msg.headers or {}).get("Nats-Service-Error"), (msg.headers, msg.data)
    return json.loads(msg.data)


def cancellations(d: Deployment, pool: str, replicas: int) -> float:
    """Sum of vllm_actors_worker_cancellations_total over the pool's worker status ports."""
    total = 0.0
    for i in range(replicas):
        text = http_text(f"http://127.0.0.1:{d.status_ports[pool] + i}/metrics")
        for line in text.splitlines():
            if line.startswith("vllm_actors_worker_cancellations_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def pin(d: Deployment) -> dict[str, str]:
    """Send the request to one given worker (the x-worker-instance-id request header pins it)."""
    return {WORKER_HEADER: sorted(d.instances())[0]}


async def cancelled_on(d: Deployment, inst: str, before: float) -> None:
    """The worker counted one more cancellation, and its engine stopped generating: nothing
    running, nothing in flight."""
    d.wait_until(lambda: cancellations(d, "agg", 2) > before, 10, "worker counted the cancellation")
    nc = await nats.connect(d.bus_url)
    try:
        for _ in range(100):
            h = await nats_req(nc, f"{d.namespace}.worker.{inst}.health", {})
            if h["num_running"] == 0 and h["in_flight"] == 0:
                break
            await asyncio.sleep(0.1)
        assert h["num_running"] == 0 and h["in_flight"] == 0, h
    finally:
        await nc.close()


async def start_stream(c: AsyncOpenAI, max_tokens: int) -> tuple[str, Any]:
    raw = await c.chat.completions.with_raw_response.create(
        model="tiny", messages=PROMPT, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS)
    return raw.headers[WORKER_HEADER], raw.parse()


async def kill_serving_worker(d: Deployment, instance: str) -> int:
    nc = await nats.connect(d.bus_url)
    try:
        pid = int((await registry(nc, d.namespace))[instance]["pid"])
    finally:
        await nc.close()
    assert pid != d.proc.pid  # type: ignore[union-attr]  # a worker process, not the root
    os.kill(pid, signal.SIGKILL)
    return pid


def restarted(d: Deployment, killed: str) -> list[str]:
    """Wait until the pool has two ready instances again, the killed one not among them."""
    return d.wait_until(lambda: (lambda i: i if len(i) == 2 and killed not in i else None)(d.instances("agg")),
                        30, "killed worker restarted as a new instance")


# --- mocker-agg: the OpenAI surface, NATS control, LoRA, cancellation, migration ------------------------------------------


# Two workers at a quarter of real speed: a 200-token stream takes a few seconds (long enough to kill
# its worker mid-way), short requests still take well under a second.
# A SIGKILLed worker ends no stream: the frontend's liveness probe notices about one heartbeat later.
SLOW = ["pools.agg.replicas=2", "pools.agg.engine_args.speedup_ratio=0.25", "supervisor.backoff.initial=0.1",
        "frontend.stall_timeout=3"]
LONG = 200


@pytest.fixture(scope="class")
def agg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    loras = tmp_path_factory.mktemp("loras")
    (loras / "a1").mkdir()
    (loras / "a1" / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}))
    d = boot(tmp_path_factory, "agg", "mocker-agg.toml", ready={"agg": 2}, status_pools={"agg": 2},
             sets=[*SLOW, "pools.agg.engine_args.enable_lora=true", f'pools.agg.lora.roots=["{loras}"]'])
    d.loras = loras  # type: ignore[attr-defined]
    yield d
    shutdown(d)


class TestMockerAgg:
    def test_chat_and_completions_with_usage(self, agg: Deployment) -> None:
        c = client(agg)
        raw = c.chat.completions.with_raw_response.create(model="tiny", messages=PROMPT, max_tokens=12,
                                                           extra_body=NO_EOS)
        r = raw.parse()
        assert raw.headers[WORKER_HEADER] in agg.instances()
        assert r.object == "chat.completion" and r.model == "tiny"
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content
        assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 10
        assert r.usage.total_tokens == r.usage.prompt_tokens + 12

        t = c.completions.create(model="tiny", prompt="The lighthouse keeper", max_tokens=9, extra_body=NO_EOS)
        assert t.object == "text_completion" and t.choices[0].text
        assert t.usage.completion_tokens == 9 and t.choices[0].finish_reason == "length"

    def test_streaming_chat_and_completions_with_usage(self, agg: Deployment) -> None:
        c = client(agg)
        chunks = list(c.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=20, stream=True,
                                                stream_options={"include_usage": True}, extra_body=NO_EOS))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert text and finishes == ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
        assert all(ch.usage is None for ch in chunks[:-1])

        # the non-streamed answer at temperature 0 is the streamed one, token for token
        whole = c.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=20, temperature=0,
                                          extra_body=NO_EOS, extra_headers=pin(agg))
        again = c.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=20, temperature=0,
                                          stream=True, extra_body=NO_EOS, extra_headers=pin(agg))
        assert "".join(ch.choices[0].delta.content or "" for ch in again if ch.choices) == \
            whole.choices[0].message.content

        tchunks = list(c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=7, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS))
        assert "".join(ch.choices[0].text for ch in tchunks if ch.choices)
        assert tchunks[-1].usage.completion_tokens == 7

    async def test_srv_ping_lists_every_service(self, agg: Deployment) -> None:
        nc = await nats.connect(agg.bus_url)
        try:
            services = await srv_ping(nc)
        finally:
            await nc.close()
        names = {s["name"] for s in services}
        assert {"frontend", "engine", "kv_publisher", "health", "supervisor"} <= names, names
        engines = [s for s in services if s["name"] == "engine"]
        assert sorted(e["metadata"]["instance"] for e in engines) == sorted(agg.instances())
        assert all(s["metadata"]["namespace"] == agg.namespace for s in services)

    async def test_sleep_and_wake_over_nats(self, agg: Deployment) -> None:
        inst, other = sorted(agg.instances())
        c = aclient(agg)
        nc = await nats.connect(agg.bus_url)
        try:
            subj = f"{agg.namespace}.worker.{inst}"
            assert (await nats_req(nc, f"{subj}.health", {}))["status"] == "healthy"
            assert (await nats_req(nc, f"{subj}.sleep", {"level": 1}))["status"] == "ok"
            try:
                assert (await nats_req(nc, f"{subj}.health", {}))["status"] == "sleeping"
                # the sleeping instance left /health at once, and every request goes to the other one
                assert agg.instances() == [other]
                for _ in range(4):
                    raw = await c.chat.completions.with_raw_response.create(model="tiny", messages=PROMPT,
                                                                            max_tokens=2)
                    assert raw.headers[WORKER_HEADER] == other
            finally:
                assert (await nats_req(nc, f"{subj}.wake_up", {}))["status"] == "ok"
            assert (await nats_req(nc, f"{subj}.health", {}))["status"] == "healthy"
            agg.wait_until(lambda: sorted(agg.instances()) == [inst, other], 10, "instance back after wake_up")
            seen = set()
            for _ in range(4):  # round robin reaches the woken instance again
                raw = await c.chat.completions.with_raw_response.create(model="tiny", messages=PROMPT, max_tokens=2)
                seen.add(raw.headers[WORKER_HEADER])
            assert seen == {inst, other}
        finally:
            await nc.close()

    async def test_lora_load_over_nats_then_adapter_name_as_model(self, agg: Deployment) -> None:
        nc = await nats.connect(agg.bus_url)
        try:
            uri = (agg.loras / "a1").as_uri()  # type: ignore[attr-defined]
            for inst in agg.instances():
                reply = await nats_req(nc, f"{agg.namespace}.worker.{inst}.lora.load",
                                       {"lora_name": "a1", "source": {"uri": uri}}, timeout=30)
                assert reply.get("lora_name", "a1") == "a1", reply
        finally:
            await nc.close()

        def listed() -> bool:
            _, models = http_json(f"{agg.url}/v1/models")
            return any(m["id"] == "a1" and m.get("parent") == "tiny" for m in models["data"])
        agg.wait_until(listed, 10, "/v1/models lists the adapter")

        c = client(agg)
        kw: dict[str, Any] = {"messages": PROMPT, "max_tokens": 16, "temperature": 0, "extra_body": NO_EOS,
                              "extra_headers": pin(agg)}
        base = c.chat.completions.create(model="tiny", **kw)
        lora = c.chat.completions.create(model="a1", **kw)
        lora2 = c.chat.completions.create(model="a1", **kw)
        assert lora.model == "a1" and lora.usage.completion_tokens == 16
        assert lora.choices[0].message.content == lora2.choices[0].message.content  # deterministic
        assert lora.choices[0].message.content != base.choices[0].message.content  # the adapter's own output

        # an unknown adapter name is a 404 from the frontend, not a silent base-model answer
        with pytest.raises(APIError) as ei:
            c.chat.completions.create(model="nope", **kw)
        assert getattr(ei.value, "status_code", None) == 404

    # these two run last: the second one kills a worker
    async def test_client_disconnect_aborts_the_engine_request(self, agg: Deployment) -> None:
        before = cancellations(agg, "agg", 2)
        inst, stream = await start_stream(aclient(agg), 2000)
        got = 0
        async for ch in stream:
            got += bool(ch.choices and ch.choices[0].delta.content)
            if got >= 5:
                break
        await stream.close()  # the client goes away mid-stream
        await cancelled_on(agg, inst, before)

    async def test_a_responses_client_that_leaves_aborts_the_engine_request(self, agg: Deployment) -> None:
        """/v1/responses streams ride the chat pipeline's cancellation: the engine stops too."""
        before = cancellations(agg, "agg", 2)
        raw = await aclient(agg).responses.with_raw_response.create(
            model="tiny", input=PROMPT[0]["content"], max_output_tokens=2000, stream=True, extra_body=NO_EOS)
        inst, stream = raw.headers[WORKER_HEADER], raw.parse()
        got = 0
        async for event in stream:
            got += event.type == "response.output_text.delta"
            if got >= 5:
                break
        await stream.close()
        await cancelled_on(agg, inst, before)

    async def test_sigkill_of_serving_worker_mid_stream_is_migrated(self, agg: Deployment) -> None:
        inst, stream = await start_stream(aclient(agg), LONG)

        async def consume() -> tuple[int, int, Any, str]:
            pieces, killed = 0, 0
            usage = None
            text = []
            async for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    text.append(ch.choices[0].delta.content)
                    pieces += 1
                    if pieces == 20:
                        killed = await kill_serving_worker(agg, inst)
                if ch.usage is not None:
                    usage = ch.usage
            return pieces, killed, usage, "".join(text)

        pieces, killed_pid, usage, text = await asyncio.wait_for(consume(), 60)
        assert killed_pid, "the stream ended before the worker could be killed"
        assert usage is not None and usage.completion_tokens == LONG
        assert pieces <= LONG
        # replicas are the same model: the migrated stream reads exactly like an unbroken one
        unbroken = await aclient(agg).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=LONG,
                                                             extra_body=NO_EOS)
        assert text == unbroken.choices[0].message.content
        now = restarted(agg, inst)
        assert inst not in now
        nc = await nats.connect(agg.bus_url)
        try:
            recs = await registry(nc, agg.namespace)
            assert inst not in recs and killed_pid not in {r["pid"] for r in recs.values()}
        finally:
            await nc.close()
        # the restarted worker serves
        r = await aclient(agg).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=4)
        assert r.usage.completion_tokens >= 1


# --- mocker-disagg ------------------------------------------------------------------------------


@pytest.fixture(scope="class")
def disagg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "disagg", "mocker-disagg.toml", ready={"prefill": 1, "decode": 2})
    yield d
    shutdown(d)


class TestMockerDisagg:
    def test_chat_carries_prefill_and_decode_instances(self, disagg: Deployment) -> None:
        decode, prefill = disagg.instances("decode"), disagg.instances("prefill")
        c = client(disagg)
        for stream in (False, True):
            raw = c.chat.completions.with_raw_response.create(
                model="tiny", messages=PROMPT, max_tokens=8, stream=stream, extra_body=NO_EOS,
                **({"stream_options": {"include_usage": True}} if stream else {}))
            assert raw.headers[PREFILL_HEADER] in prefill
            assert raw.headers[WORKER_HEADER] in decode
            assert raw.headers[PREFILL_HEADER] not in decode
            r = raw.parse()
            usage = list(r)[-1].usage if stream else r.usage
            assert usage.completion_tokens == 8

    def test_a_session_header_keeps_a_session_on_one_decode_worker(self, disagg: Deployment) -> None:
        c = client(disagg)

        def decode_of(i: int, session: str | None) -> str:
            raw = c.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": f"unrelated question {i}: " + f"q{i} " * 60}],
                max_tokens=2, extra_body=NO_EOS, extra_headers={SESSION_HEADER: session} if session else None)
            return raw.headers[WORKER_HEADER]

        # unrelated prompts (no cached prefix to follow): without a session they spread over both
        # decode workers (equal predicted latency, the emptier cache first)
        assert len({decode_of(i, None) for i in range(6)}) == 2
        # with x-dynamo-session-id they stay on the session's worker (it is never overloaded here)
        assert len({decode_of(100 + i, "agent-7") for i in range(6)}) == 1
        assert len({decode_of(200 + i, "agent-8") for i in range(6)}) == 1

    async def test_srv_ping_and_the_frontends_router_endpoints(self, disagg: Deployment) -> None:
        nc = await nats.connect(disagg.bus_url)
        try:
            names = [s["name"] for s in await srv_ping(nc)]
            stats = await nats_req(nc, f"{disagg.namespace}.router.index.stats", {})
        finally:
            await nc.close()
        assert stats["ready"] is True and stats["block_size"] == 16, stats
        # priced by predicted latency, from step lines learned off the decode workers' load reports
        assert stats["cost_model"] == "latency", stats
        assert any(w["steps"] > 0 for w in stats["latency"]["workers"].values()), stats["latency"]
        # the KV router's ns.router.* endpoints are the frontend's: no separate "router" service
        assert {"frontend", "engine", "kv_publisher", "health", "supervisor"} <= set(names), names
        assert "router" not in names
        assert names.count("engine") == 3


# --- migration_limit = 0 --------------------------------------------------------------------------


@pytest.fixture(scope="class")
def nomigration(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "nomig", "mocker-agg.toml", ready={"agg": 2},
             sets=[*SLOW, "model.migration_limit=0"])
    yield d
    shutdown(d)


class TestNoMigration:
    async def test_sigkill_with_migration_limit_0_is_a_clean_error(self, nomigration: Deployment) -> None:
        inst, stream = await start_stream(aclient(nomigration), LONG)

        async def consume() -> tuple[int, Any]:
            pieces = 0
            usage = None
            async for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    pieces += 1
                    if pieces == 20:
                        await kill_serving_worker(nomigration, inst)
                if ch.usage is not None:
                    usage = ch.usage
            return pieces, usage

        with pytest.raises(APIError) as ei:  # the SSE error event; bounded: never a hang
            await asyncio.wait_for(consume(), 60)
        assert re.search(r"(?i)migrat|worker|unavailable|engine|stream", str(ei.value)), str(ei.value)


# --- a single worker whose engine dies and is restarted in place ------------------------------------


@pytest.fixture(scope="class")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    # every engine incarnation dies after 30 generated tokens (mocker fault injection); the worker
    # supervisor restarts it in place, under the same instance id
    d = boot(tmp_path_factory, "single", "mocker-agg.toml", ready={"agg": 1},
             sets=["pools.agg.engine_args.speedup_ratio=0.25", "pools.agg.engine_args.die_after_tokens=30",
                   "pools.agg.supervisor.backoff.initial=0.1", "frontend.stall_timeout=3"])
    yield d
    shutdown(d)


class TestSingleWorkerEngineRestart:
    async def test_stream_outlives_an_in_place_engine_restart(self, single: Deployment) -> None:
        (inst,) = single.instances()
        served, stream = await start_stream(aclient(single), 50)
        assert served == inst

        async def consume() -> Any:
            usage = None
            async for ch in stream:
                if ch.usage is not None:
                    usage = ch.usage
            return usage

        usage = await asyncio.wait_for(consume(), 90)
        assert usage is not None and usage.completion_tokens == 50
        assert single.instances() == [inst]  # the same worker, its engine restarted in place
        metrics = http_text(f"{single.url}/metrics")
        assert re.search(r'vllm_actors_frontend_model_migration_total\{model="tiny"\} [1-9]', metrics), "no migration happened"
