"""CompletionFlow against a fake link: migration, prefill, the judging of a failed attempt, the wait
for a worker and the probation of suspects, without HTTP or NATS.

The fake workers follow the stream protocol's outcomes as the flow sees them (``bus.stream``): a
chunk per token, ``ResponderGone`` once their process is gone, ``StreamStalled`` when nothing came
back, ``Unavailable`` for a request sent to one whose process is gone, and the liveness verdicts of ``client.WorkerClient``. Their output at prompt position p is
``p``, so a request re-sent with its produced tokens appended continues where the first stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from actors.engines.protocol import SamplingOptions
from actors.frontend.completion_flow import CompletionFlow, FlowDeps, FlowSpec
from actors.frontend.discovery import ModelEntry, Worker, WorkerSet
from actors.frontend.quarantine import PoisonRequest, Quarantine, QuarantinedRequest
from actors.frontend.routing import RoundRobinRouter
from actors.frontend.suspects import Probation
from actors.frontend.worker_link import Liveness
from actors.instances.contract import InstanceRecord, ModelCard
from actors.worker.contract import EncodeReply, EncodeRequest, EngineDead, GenerateChunk, GenerateRequest
from bus.errors import Overloaded, ResponderGone, StreamStalled, Unavailable

MODEL = "m"
POISON = 999  # a prompt holding it kills every worker it reaches (as the mocker's poison_token_id)
PROMPT = [1, 2, 3]

# what a scripted attempt does instead of serving: raise an error before anything came back, or
# answer (a heartbeat: the worker took it) and then raise
Script = Callable[[GenerateRequest], BaseException | tuple[str, BaseException] | None]


class FakeWorker:
    def __init__(self, ws: WorkerSet, instance: str, role: str = "agg", step: float = 0.0) -> None:
        self.ws, self.instance, self.role, self.step = ws, instance, role, step
        self.started_at = 1.0
        self.alive = True
        self.liveness = Liveness.ALIVE
        self.requests: list[GenerateRequest] = []
        self.scripts: list[Script] = []  # one per attempt, in order; then it serves
        self.restart_after: float | None = None  # a killed worker comes back (new incarnation)
        self.register()

    def register(self) -> None:
        self.ws.put_instance(self.instance, InstanceRecord(
            instance=self.instance, kind="engine", role=self.role, model=MODEL, host="h", pid=1,
            pool=self.role, generate_subject=f"ns.{self.role}.generate.{self.instance}",
            started_at=self.started_at))
        self.ws.put_model(f"{MODEL}.{self.role}", ModelCard(
            served_model_name=MODEL, pool=self.role, role=self.role, model_path="/x", tokenizer_path="/x",
            context_length=1000, kv_block_size=16, total_kv_blocks=100))

    def kill(self) -> None:
        """SIGKILL: every stream on it ends, the bus says nobody is there; its supervisor may
        restart it (same id, new ``started_at``, as an engine restarted in place)."""
        if not self.alive:
            return
        self.alive = False
        self.liveness = Liveness.DEAD
        if self.restart_after is not None:
            asyncio.get_running_loop().call_later(self.restart_after, self.restart)

    def restart(self) -> None:
        self.started_at += 1.0
        self.alive = True
        self.liveness = Liveness.ALIVE
        self.register()

    async def serve(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        ids = req.token_ids or []
        if POISON in ids:
            self.kill()
        if self.role == "prefill":
            yield GenerateChunk(token_ids=[len(ids)], finish_reason="length",
                                kv_transfer_params={"remote_engine_id": self.instance})
            return
        for p in range(len(ids), len(ids) + req.sampling.max_tokens):
            await asyncio.sleep(self.step)
            if not self.alive:
                raise ResponderGone(f"{self.instance} gone")
            last = p == len(ids) + req.sampling.max_tokens - 1
            yield GenerateChunk(token_ids=[p], finish_reason="length" if last else None)


class FakeStream:
    def __init__(self, worker: FakeWorker, req: GenerateRequest) -> None:
        self.worker, self.req = worker, req
        self.instance: str | None = None
        self._gen = self._run()

    def __aiter__(self) -> AsyncIterator[GenerateChunk]:
        return self._gen

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def _run(self) -> AsyncIterator[GenerateChunk]:
        w = self.worker
        w.requests.append(self.req)
        if not w.alive:  # its record outlived it: NATS answers "no responders" at once
            raise Unavailable(f"no responders on {w.instance}")
        if w.scripts:
            outcome = w.scripts.pop(0)(self.req)
            if isinstance(outcome, tuple):  # it answered (a heartbeat carries its instance id)
                self.instance = w.instance
                raise outcome[1]
            if outcome is not None:
                raise outcome
        async for chunk in w.serve(self.req):
            self.instance = w.instance
            yield chunk


class FakeLink:
    def __init__(self) -> None:
        self.workers: dict[str, FakeWorker] = {}
        self.probes: list[str] = []

    def stream(self, worker: Worker, req: GenerateRequest, headers: dict[str, str] | None = None) -> FakeStream:
        return FakeStream(self.workers[worker.instance], req)

    async def connected(self) -> bool:
        return True

    async def liveness(self, worker: Worker) -> Liveness:
        self.probes.append(worker.instance)
        return self.workers[worker.instance].liveness

    async def encode(self, worker: Worker, req: EncodeRequest) -> EncodeReply:
        raise AssertionError("no encode pool in these tests")


class Cluster:
    def __init__(self) -> None:
        self.ws = WorkerSet()
        self.link = FakeLink()
        self.deps = FlowDeps(self.ws, RoundRobinRouter(), self.link, Quarantine(ttl=60))

    def worker(self, instance: str, role: str = "agg", step: float = 0.0) -> FakeWorker:
        w = self.link.workers[instance] = FakeWorker(self.ws, instance, role, step)
        return w

    def flow(self, request_id: str = "r", prompt: list[int] | None = None, max_tokens: int = 4,
             **kw: Any) -> CompletionFlow:
        entry: ModelEntry = self.ws.models[MODEL]
        spec = FlowSpec(model=entry, request_id=request_id, token_ids=list(prompt or PROMPT),
                        sampling=SamplingOptions(max_tokens=max_tokens), **kw)
        return CompletionFlow(spec, self.deps)


async def run(flow: CompletionFlow, bound: float = 10.0) -> list[int]:
    """The flow's tokens; ``bound`` only turns a hang into a failure (the fakes take milliseconds)."""
    async def collect() -> list[int]:
        return [t async for c in flow.chunks() for t in c.token_ids]
    return await asyncio.wait_for(collect(), bound)


# --- migration and prefill ---------------------------------------------------------------------------
async def test_a_dead_workers_stream_continues_on_another() -> None:
    c = Cluster()
    a, b = c.worker("a"), c.worker("b")
    a.scripts.append(lambda req: ("answered", EngineDead("engine died")))
    flow = c.flow(max_tokens=4)
    assert await run(flow) == [3, 4, 5, 6]
    assert [len(r.requests) for r in (a, b)] == [1, 1]
    assert flow.state.deaths == ["a"] and flow.state.migrations == 1 and flow.state.worker_instance == "b"


async def test_produced_tokens_are_appended_on_migration() -> None:
    c = Cluster()
    a, b = c.worker("a", step=0.001), c.worker("b")
    flow = c.flow(max_tokens=6)
    got: list[int] = []
    async for chunk in flow.chunks():
        got.extend(chunk.token_ids)
        if len(got) == 2:
            a.kill()
    assert got == [3, 4, 5, 6, 7, 8]
    resent = b.requests[-1]
    assert resent.token_ids == PROMPT + [3, 4] and resent.sampling.max_tokens == 4
    assert resent.request_id == "r-m1"


async def test_prefill_then_decode_and_a_failed_prefill_worker_is_replaced() -> None:
    c = Cluster()
    p1, p2 = c.worker("p1", role="prefill"), c.worker("p2", role="prefill")
    d = c.worker("d", role="decode")
    p1.scripts.append(lambda req: EngineDead("prefill engine died"))
    flow = c.flow(max_tokens=2)
    assert await run(flow) == [3, 4]
    assert len(p1.requests) == 1 and p2.requests[0].sampling.max_tokens == 1
    pr = d.requests[0].prefill_result
    assert pr is not None and pr.prefill_instance == "p2" and pr.kv_transfer_params == {"remote_engine_id": "p2"}


async def test_a_refusal_is_not_a_death_and_moves_on() -> None:
    c = Cluster()
    a, b = c.worker("a"), c.worker("b")
    a.scripts.append(lambda req: Overloaded("queue full"))
    flow = c.flow()
    assert len(await run(flow)) == 4
    assert flow.state.deaths == [] and flow.state.failed == {"a"} and len(b.requests) == 1
    assert c.link.probes == []  # a refusal is a verdict already: no probe


# --- item 1: a request lost in a bus outage -------------------------------------------------------
async def test_a_request_lost_before_any_answer_is_resent_to_the_live_worker() -> None:
    """Nothing came back for a stall timeout (the request went into a connection the bus restart
    cut): the only worker answers the probe, so it gets the request again, with no wait."""
    c = Cluster()
    a = c.worker("a")
    a.scripts.append(lambda req: StreamStalled("nothing for 10s after seq 0"))
    flow = c.flow(migration_wait=60.0)
    assert len(await run(flow, bound=5.0)) == 4
    assert len(a.requests) == 2 and c.link.probes == ["a"]
    assert flow.state.failed == set() and flow.state.deaths == []


async def test_a_lost_request_to_a_worker_that_does_not_answer_the_probe_is_a_503_not_a_wait() -> None:
    c = Cluster()
    a = c.worker("a")
    a.liveness = Liveness.UNKNOWN
    a.scripts.append(lambda req: StreamStalled("nothing for 10s after seq 0"))
    with pytest.raises(Overloaded, match="failed it and still run"):
        await run(c.flow(migration_wait=60.0), bound=5.0)


async def test_the_only_worker_stuck_after_answering_is_a_503_not_a_wait() -> None:
    """A worker that answered, then went silent while its process lives, is excluded; with no
    other worker, none can come: 503 with Retry-After at once, not ``migration_wait``."""
    c = Cluster()
    a = c.worker("a")
    a.scripts.append(lambda req: ("answered", StreamStalled("nothing for 10s after seq 0")))
    with pytest.raises(Overloaded, match="failed it and still run"):
        await run(c.flow(migration_wait=60.0), bound=5.0)
    assert len(a.requests) == 1


async def test_the_only_worker_that_died_is_waited_for() -> None:
    c = Cluster()
    a = c.worker("a")
    a.restart_after = 0.2
    a.scripts.append(lambda req: a.kill() or ResponderGone("a gone"))  # type: ignore[func-returns-value]
    flow = c.flow(migration_wait=60.0)
    assert len(await run(flow)) == 4
    assert flow.state.deaths == ["a"] and len(a.requests) == 2 and a.started_at == 2.0


async def test_the_wait_for_a_dead_worker_is_bounded() -> None:
    c = Cluster()
    a = c.worker("a")
    a.scripts.append(lambda req: a.kill() or ResponderGone("a gone"))  # type: ignore[func-returns-value]
    with pytest.raises(Overloaded, match="no worker came back within 0.3s"):
        await run(c.flow(migration_wait=0.3))


# --- containment -------------------------------------------------------------------------------------
async def test_two_deaths_quarantine_the_request() -> None:
    c = Cluster()
    for i in "ab":
        c.worker(i)
    flow = c.flow(prompt=[POISON, 1])
    with pytest.raises(PoisonRequest):
        await run(flow)
    assert sorted(flow.state.deaths) == ["a", "b"]
    with pytest.raises(QuarantinedRequest):
        await run(c.flow("again", prompt=[POISON, 1]))


async def test_suspects_are_on_probation_one_at_a_time_per_worker() -> None:
    p = Probation()
    a, b = (Worker(instance=i, model=MODEL, pool="agg", role="agg", subject="s", started_at=1.0) for i in "ab")
    p.hold(a, "x")
    assert p.free([a, b]) == [b] and p.on_probation(a) == "x"
    p.release(a, "y")  # not the holder: nothing changes
    assert p.on_probation(a) == "x"
    p.release(a, "x", died=True)
    assert p.free([a, b]) == [a, b]
    assert p.on_probation(a) == "x"  # the death stays its own for those who judge it later
    restarted = Worker(instance="a", model=MODEL, pool="agg", role="agg", subject="s", started_at=2.0)
    assert p.on_probation(restarted) is None


@pytest.mark.parametrize("poison_at", [0, 3, 8])
async def test_bystanders_of_a_request_of_death_are_served(poison_at: int) -> None:
    """Two workers; a request that kills every worker it reaches, sent with 8 ordinary ones. The
    ordinary requests on the first worker it killed are suspects beside it; on probation one at a
    time, none of them is on the second worker beside it, so only it meets a second death."""
    c = Cluster()
    for i in "ab":
        c.worker(i, step=0.005).restart_after = 0.1
    prompts = [[10 + i, 1, 2] for i in range(8)]
    prompts.insert(poison_at, [POISON, 1, 2])
    flows = [c.flow(f"r{i}", prompt=pr, max_tokens=8) for i, pr in enumerate(prompts)]
    results = await asyncio.gather(*(run(f) for f in flows), return_exceptions=True)
    poisoned = results.pop(poison_at)
    assert isinstance(poisoned, PoisonRequest), poisoned
    assert all(isinstance(r, list) and len(r) == 8 for r in results), results
    assert len(c.deps.quarantine) == 1
