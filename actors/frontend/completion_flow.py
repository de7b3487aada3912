"""One completion from the workers: disaggregation, routing and migration (no HTTP, no NATS).

``CompletionFlow.chunks()`` yields ``GenerateChunk`` deltas as one unbroken stream. Behind it:
- disaggregated models: a prefill worker runs the prompt with max_tokens=1 and returns
  kv_transfer_params; a decode worker then streams with that ``prefill_result``. No prefill worker
  (or a failed prefill) → decode-only when the topology allows it.
- migration: a stream that ends without a finish reason (worker died, stalled, lost chunks, or
  became unreachable) is re-sent with the produced tokens appended to the prompt and max_tokens
  reduced, up to ``migration_limit`` times; after that the error is raised.
- telling a dead worker from a lost stream: after a failed attempt the flow asks whether the
  worker's process is still on the bus (``WorkerLink.liveness``). A worker that answers (the bus
  restarted and lost the stream, or the worker took the caller for gone) stays a valid target;
  one that died, or stalled, or refused, is excluded until it comes back as a new incarnation.
- containment: a request whose serving workers died twice while serving it is not sent again
  (``actors.frontend.quarantine``); a request that saw one death (a suspect) goes to a worker only
  while no other suspect is on probation there (``actors.frontend.suspects``), so that the
  innocent ones are never beside the guilty one when it kills its second worker.
- a stream that stalls before the worker answered anything lost its request (published into a
  connection a bus restart cut: a live worker heartbeats every stall/3 seconds whatever its engine
  does); a worker that answers the probe gets it again.
- waiting for a worker: once every worker has failed the request, the flow waits up to
  ``migration_wait`` only for one that died (its supervisor restarts it) or left the pool; workers
  that failed it but still run (refused, unreachable) are not waited for: 503 + Retry-After.
- a request issued while this process is cut off from the bus waits (at most a stall timeout)
  for the reconnect, then fails with 503 + Retry-After.
Closing the generator closes the worker stream, which publishes the cancel to the worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec

from actors.engines.protocol import MultiModalInput, SamplingOptions
from actors.kv.hashing import mm_spans
from actors.worker.contract import ChatPrompt, EngineDead, GenerateChunk, GenerateRequest, PrefillResult
from bus import tracing
from bus.errors import (
    ActorError,
    Overloaded,
    ResponderGone,
    StreamStalled,
    TransportError,
    Unavailable,
)
from config.topology import MIGRATION_WAIT

from . import request_trace
from .discovery import ModelEntry, Worker, WorkerSet
from .encode_step import encode_images, with_outputs
from .quarantine import DEATHS_TO_QUARANTINE, Quarantine, fingerprint
from .routing import Router
from .suspects import Probation
from .worker_link import Liveness, WorkerLink, WorkerStream

log = logging.getLogger(__name__)

# Errors after which the same request can be re-sent elsewhere (the worker, not the request, failed).
MIGRATABLE = (TransportError, EngineDead, Overloaded)


class MigrationExhausted(ActorError):
    code = 500
    kind = "internal_error"


class NotResumable(ActorError):
    """The worker died part-way through a request whose rest cannot be produced elsewhere: the
    new engine would restart a grammar from its first state (structured output, forced tool calls)
    or has no way to extend an embeddings prompt with the produced tokens. The client retries."""

    code = 503
    kind = "service_unavailable"


class BusUnavailable(Overloaded):
    """This frontend is cut off from the bus (a restart in progress): 503 with Retry-After."""


@dataclass
class FlowDeps:
    """What every flow of one frontend shares."""

    workers: WorkerSet
    router: Router
    link: WorkerLink
    quarantine: Quarantine = field(default_factory=Quarantine)
    probation: Probation = field(default_factory=Probation)


@dataclass
class FlowSpec:
    model: ModelEntry
    request_id: str
    sampling: SamplingOptions
    token_ids: list[int] | None = None
    prompt: str | None = None
    lora: str | None = None
    target: str | None = None  # x-worker-instance-id
    session: str | None = None  # x-dynamo-session-id (soft affinity in the kv router)
    allow_decode_only: bool = True
    migration_limit: int = 3
    migration_wait: float = MIGRATION_WAIT
    prompt_embeds: str | None = None  # base64 torch tensor (a /v1/completions prompt_embeds)
    chat: ChatPrompt | None = None  # text mode: a chat the worker renders with the chat template
    mm: MultiModalInput | None = None  # the images of token_ids (expanded by the frontend's processor)
    trace: Any = None  # the HTTP request's span context when it is traced (bus.tracing): attempts go under it

    def resume_refusal(self) -> str | None:
        """Why this request cannot continue on another worker once tokens were produced, if so."""
        if self.sampling.structured is not None:
            # the engine's grammar state (xgrammar matcher) lives in the dead engine; a new one
            # would match the produced tokens' continuation against the grammar's start
            return "a constrained (structured output or tool call) request cannot resume its grammar"
        if self.prompt_embeds is not None:
            return "a prompt_embeds request cannot be extended with the produced tokens"
        return None


@dataclass
class FlowState:
    worker_instance: str | None = None
    prefill_instance: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    migrations: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    failed: set[str] = field(default_factory=set)
    failed_incarnation: dict[str, float] = field(default_factory=dict)  # instance -> its started_at
    deaths: list[str] = field(default_factory=list)  # workers that died while serving this request
    gone: set[str] = field(default_factory=set)  # failed workers that died (their supervisor restarts them)


class CompletionFlow:
    def __init__(self, spec: FlowSpec, deps: FlowDeps, on_migrate: Callable[[], None] | None = None,
                 on_quarantine: Callable[[], None] | None = None) -> None:
        self.spec = spec
        self.workers = deps.workers
        self.router = deps.router
        self.link = deps.link
        self.quarantine = deps.quarantine
        self.probation = deps.probation
        self.on_migrate = on_migrate
        self.on_quarantine = on_quarantine
        self._fp: str | None = None
        self.state = FlowState(prompt_tokens=len(spec.token_ids) if spec.token_ids else 0)
        # the router hashes an image prompt's blocks with the images' ids, as the engines' KV events do
        self._mm_spans = mm_spans(spec.mm)

    # --- routing helpers ---------------------------------------------------------------------------
    def _pool(self, role: str) -> list[Worker]:
        name = self.spec.model.name
        pool = self.workers.serving_workers(name) if role == "serve" else self.workers.workers(name, role)
        if self.spec.lora and pool:
            have = self.workers.lora_instances(self.spec.lora)
            loaded = [w for w in pool if w.instance in have]
            pool = loaded or pool  # not loaded anywhere yet: any worker (it loads on demand)
        return pool

    async def _prefill(self) -> PrefillResult | None:
        """Run the prompt on a prefill worker. A prefill worker that fails is replaced by another
        (up to the migration limit); when none is left, decode-only if allowed, else the error."""
        spec, st = self.spec, self.state
        failed: set[str] = set()
        while True:
            pool = [w for w in self._pool("prefill") if w.instance not in failed]
            if not pool:
                if spec.allow_decode_only:
                    if failed:
                        log.warning("prefill failed on %s; falling back to decode-only", ", ".join(sorted(failed)))
                    return None
                raise Overloaded(f"no prefill worker left for model {spec.model.name} and decode-only "
                                 f"fallback is off (model.allow_decode_only)")
            att = request_trace.attempt(spec.trace, "prefill", len(failed) + 1, spec.request_id)
            worker = request_trace.choose(att, pool, len(failed), self.router, partial(
                self.router.choose, pool, spec.token_ids, failed, request_id=f"{spec.request_id}-p",
                mm=self._mm_spans))
            try:
                last, call = await self._prefill_on(worker, att)
                break
            except MIGRATABLE as e:
                failed.add(worker.instance)
                if len(failed) > spec.migration_limit:
                    if spec.allow_decode_only:
                        return None
                    raise
                log.warning("prefill on %s failed (%s); trying another prefill worker", worker.instance, e)
        params = None
        if last is not None:
            if last.disaggregated_params is not None:
                params = last.disaggregated_params.kv_transfer_params
            params = params or last.kv_transfer_params
        inst = call.instance or worker.instance
        st.prefill_instance = inst
        usage = last.usage if last is not None else None
        if usage is not None:
            st.cached_tokens = usage.cached_tokens
            st.prompt_tokens = st.prompt_tokens or usage.prompt_tokens
        return PrefillResult(kv_transfer_params=params, prefill_instance=inst,
                             prompt_tokens=usage.prompt_tokens if usage else None,
                             cached_tokens=usage.cached_tokens if usage else None)

    async def _prefill_on(self, worker: Worker, att: Any) -> tuple[GenerateChunk | None, WorkerStream]:
        spec = self.spec
        sampling = msgspec.structs.replace(spec.sampling, max_tokens=1, min_tokens=0, logprobs=None,
                                           stop=[], structured=None)
        req = GenerateRequest(request_id=f"{spec.request_id}-p", token_ids=spec.token_ids,
                              prompt=spec.prompt, prompt_embeds=spec.prompt_embeds, chat=spec.chat,
                              mm=spec.mm, sampling=sampling, lora_name=spec.lora)
        last: GenerateChunk | None = None
        call = request_trace.stream(att, self.link.stream(worker, req, headers=tracing.headers(att)))
        try:
            async for chunk in call:
                last = chunk
        finally:
            self.router.finished(f"{spec.request_id}-p")
            await call.aclose()
        return last, call

    # --- the stream ----------------------------------------------------------------------------------
    async def chunks(self) -> AsyncIterator[GenerateChunk]:
        spec, st = self.spec, self.state
        self._check_quarantine()
        if spec.mm is not None and spec.model.has_encode_pool:
            spec.mm = await encode_images(spec.mm, spec.token_ids or [], model=spec.model,
                                          request_id=spec.request_id, attempts=spec.migration_limit,
                                          workers=self.workers, router=self.router, link=self.link,
                                          retry_on=(*MIGRATABLE, Unavailable))
        prefill = await self._prefill() if spec.model.has_prefill_pool else None
        produced: list[int] = []
        produced_text: list[str] = []
        target = spec.target
        err: ActorError | None = None
        while True:
            if st.migrations:  # an identical request may have been quarantined meanwhile
                self._check_quarantine()
            if not await self.link.connected():
                raise BusUnavailable("this frontend is cut off from the bus (reconnecting); try again")
            pool = self._pool("serve")
            if st.failed:
                self._forgive_restarted(pool)
            if (st.migrations and not isinstance(err, Overloaded)
                    and not any(w.instance not in st.failed for w in pool)):
                # the worker died (not refused): wait for it, or another, to come back
                pool = await self._wait_for_worker()
            suspect = bool(st.deaths)  # its worker died under it: on probation on the next one
            if suspect:
                pool = await self._probation_pool(pool, target)
            req = self._request(prefill, produced, produced_text)
            router = self.router
            att = request_trace.attempt(spec.trace, "decode" if spec.model.has_prefill_pool else "generate",
                                     st.migrations + 1, spec.request_id)
            worker = request_trace.choose(att, pool, len(st.failed), router, partial(
                router.choose, pool, req.token_ids, st.failed, target=target, lora=spec.lora, mm=self._mm_spans,
                request_id=req.request_id, session=spec.session))
            if suspect:
                self.probation.hold(worker, spec.request_id)
            try:
                call = request_trace.stream(att, self.link.stream(worker, req, headers=tracing.headers(att)))
                first = True
                answered = False  # the worker took the request (a chunk, a heartbeat or an error came back)
                try:
                    async for chunk in call:
                        if not answered and suspect:  # the engine took it and ran its prompt
                            self.probation.release(worker, spec.request_id)
                        answered = True
                        st.worker_instance = call.instance or worker.instance
                        self._account(chunk, first_attempt=not produced and st.migrations == 0)
                        produced.extend(chunk.token_ids)
                        if chunk.token_ids:
                            router.tokens(req.request_id, len(chunk.token_ids), first)  # type: ignore[arg-type]
                            first = False
                        if chunk.text:
                            produced_text.append(chunk.text)
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
                    # ended cleanly without a finish reason: the worker lost the request
                    err = TransportError(f"stream from {worker.instance} ended without a finish reason")
                except MIGRATABLE as e:
                    err = e
                finally:
                    router.finished(req.request_id)  # type: ignore[arg-type]
                    await call.aclose()
                answered = answered or call.instance is not None
                await self._judge(worker, err, answered)
            finally:
                if suspect:  # a no-op when its first chunk or its death released it
                    self.probation.release(worker, spec.request_id)
            remaining = spec.sampling.max_tokens - len(produced)
            if st.migrations >= spec.migration_limit:
                if not produced and st.migrations == 0 and isinstance(err, Overloaded):
                    raise err
                raise MigrationExhausted(f"worker {worker.instance} failed ({err}); "
                                         f"migration limit {spec.migration_limit} reached")
            if remaining <= 0:  # everything was produced, only the end marker was lost
                st.finish_reason = "length"
                yield GenerateChunk(finish_reason="length")
                return
            refusal = spec.resume_refusal() if produced else None
            if refusal is not None:
                log.warning("request %s: %s failed after %d tokens (%s); not migrated: %s",
                            spec.request_id, worker.instance, len(produced), err, refusal)
                raise NotResumable(f"worker {worker.instance} failed after {len(produced)} tokens "
                                   f"({err}) and {refusal}; send the request again")
            st.migrations += 1
            target = None if worker.instance in st.failed else target  # a failed pin cannot serve the rest
            prefill = None  # the new worker recomputes the (prompt + produced) prefix itself
            log.warning("request %s: %s after %d tokens from %s (%s), attempt %d/%d", spec.request_id,
                        "migrating" if worker.instance in st.failed else "re-sending", len(produced),
                        worker.instance, err, st.migrations, spec.migration_limit)
            if self.on_migrate is not None:
                self.on_migrate()

    def _fingerprint(self) -> str:
        """The quarantine key, computed only when a quarantine exists or a death happened (hashing
        the prompt is not free, and almost every request meets neither)."""
        if self._fp is None:
            s = self.spec
            # a text-mode chat has neither ids nor text here: its messages stand for the prompt
            prompt = s.prompt if s.chat is None else msgspec.json.encode(s.chat).decode()
            self._fp = fingerprint(s.model.name, s.lora, s.token_ids, prompt, s.sampling)
        return self._fp

    def _check_quarantine(self) -> None:
        if self.quarantine:
            self.quarantine.check(self._fingerprint())

    async def _judge(self, worker: Worker, err: ActorError, answered: bool) -> None:
        """After a failed attempt: exclude the worker from this request unless it is alive and the
        failure was the bus's, and count its death if it died while serving the request. Raises
        PoisonRequest once the request has seen DEATHS_TO_QUARANTINE deaths."""
        st = self.state
        verdict: Liveness | None = None  # asked only when the error leaves it open
        if isinstance(err, EngineDead):
            died = True
        elif isinstance(err, Overloaded):  # refused: busy, draining, asleep; not a death
            died = False
        else:
            verdict = await self.link.liveness(worker)
            # silent for the whole stall timeout after it answered, while its process lives on: a
            # stuck worker. Silent from the start, it never had the request: a live worker beats
            # every stall/3 seconds whatever its engine does, so the request (published into a
            # connection that a bus restart cut) or every answer to it was lost.
            stuck = isinstance(err, StreamStalled) and not isinstance(err, ResponderGone) and answered
            if verdict is Liveness.ALIVE and not stuck:
                # the bus lost the request or the stream (a restart, a gap), or the worker dropped
                # it taking us for gone: it may serve the rest
                return
            # "no responders" to the request itself, before any answer: it never reached a live
            # worker (a record that outlived its process), so no death coincided with it
            died = verdict is Liveness.DEAD and (answered or not isinstance(err, Unavailable))
        st.failed.add(worker.instance)
        st.failed_incarnation[worker.instance] = worker.started_at
        if died or verdict is Liveness.DEAD:
            st.gone.add(worker.instance)
        if not died:
            return
        rid = self.spec.request_id
        culprit = self.probation.on_probation(worker)
        if culprit == rid:
            self.probation.release(worker, rid, died=True)  # the death is this suspect's
        elif culprit is not None and st.deaths:
            # another suspect was on probation there as it died: the death is that one's, not
            # this suspect's, which passed its own probation there
            log.info("request %s: %s died with request %s on probation there; not counted against it",
                     rid, worker.instance, culprit)
            return
        st.deaths.append(worker.instance)
        if len(st.deaths) >= DEATHS_TO_QUARANTINE:
            if self.on_quarantine is not None:
                self.on_quarantine()
            raise self.quarantine.add(self._fingerprint(), self.spec.request_id, st.deaths)

    def _forgive_restarted(self, pool: list[Worker]) -> None:
        """An instance that failed this request but has since restarted (in place, same id, new
        ``started_at``) is a new incarnation and may serve again."""
        st = self.state
        for w in pool:
            if w.instance in st.failed and w.started_at != st.failed_incarnation.get(w.instance):
                st.failed.discard(w.instance)

    async def _wait_for_worker(self) -> list[Worker]:
        """Every worker this request could use has failed it: wait (bounded) for one to come back
        (the only worker's engine restarted in place, or its process restarted under a new id).
        Only a worker that died or left the pool comes back; one that failed the request but still
        runs (it refused it, or never answered the probe) will not be replaced, so nothing is
        waited for then: 503 with Retry-After, at once."""
        spec, st = self.spec, self.state
        loop = asyncio.get_running_loop()
        deadline = loop.time() + spec.migration_wait
        logged = False
        while True:
            pool = self._pool("serve")
            self._forgive_restarted(pool)
            if any(w.instance not in st.failed for w in pool):
                return pool
            present = {w.instance for w in pool}
            if not any(i in st.gone or i not in present for i in st.failed):
                raise Overloaded(f"no worker can take this request now: {', '.join(sorted(st.failed))} "
                                 f"failed it and still run; try again")
            if loop.time() >= deadline:
                raise Overloaded(f"no worker came back within {spec.migration_wait:g}s to continue the stream")
            if not logged:
                log.info("request %s: no worker left to migrate to; waiting up to %.0fs for one to come back",
                         spec.request_id, spec.migration_wait)
                logged = True
            await asyncio.sleep(0.1)

    async def _probation_pool(self, pool: list[Worker], target: str | None) -> list[Worker]:
        """The workers a suspect may go to: those with no other suspect on probation; waits for
        one to be released (each is, at its suspect's first chunk or the end of its attempt)."""
        spec, st = self.spec, self.state
        loop = asyncio.get_running_loop()
        deadline = loop.time() + spec.migration_wait
        while True:
            usable = [w for w in pool if w.instance not in st.failed and (target is None or w.instance == target)]
            free = self.probation.free(usable)
            if free or not usable:  # none usable at all: the router says so (503)
                return free or pool
            if loop.time() >= deadline:
                raise Overloaded(f"request {spec.request_id}: no worker free of another suspect "
                                 f"within {spec.migration_wait:g}s")
            await self.probation.released(0.1)
            pool = self._pool("serve")
            self._forgive_restarted(pool)

    def _request(self, prefill: PrefillResult | None, produced: list[int],
                 produced_text: list[str]) -> GenerateRequest:
        spec = self.spec
        sampling = spec.sampling
        token_ids, prompt, chat = spec.token_ids, spec.prompt, spec.chat
        if produced:
            sampling = msgspec.structs.replace(
                sampling, max_tokens=sampling.max_tokens - len(produced),
                min_tokens=max(0, sampling.min_tokens - len(produced)))
            if token_ids is not None:
                token_ids = token_ids + produced
            elif prompt is not None:
                prompt = prompt + "".join(produced_text)
            elif chat is not None:
                # the next worker renders the same messages and continues from the produced ids:
                # never re-rendered with the output as a message, never re-tokenized from text
                chat = msgspec.structs.replace(chat, continuation=list(produced))
        suffix = f"-m{self.state.migrations}" if self.state.migrations else ""
        mm = spec.mm
        if mm is not None and prefill is not None:
            # the decode worker gets the KV of the images' tokens from the prefill worker: it needs
            # the images only to expand the prompt as the prefill did, not their encoder outputs
            mm = with_outputs(mm, {})
        return GenerateRequest(request_id=spec.request_id + suffix, token_ids=token_ids, prompt=prompt,
                               prompt_embeds=spec.prompt_embeds, chat=chat, mm=mm, sampling=sampling,
                               lora_name=spec.lora, prefill_result=prefill)

    def _account(self, chunk: GenerateChunk, first_attempt: bool) -> None:
        st = self.state
        st.completion_tokens += len(chunk.token_ids)
        if first_attempt:
            if chunk.num_prompt_tokens and not st.prompt_tokens:
                st.prompt_tokens = chunk.num_prompt_tokens
            if chunk.cached_tokens is not None and st.prefill_instance is None:
                st.cached_tokens = chunk.cached_tokens
        if chunk.usage is not None:
            if not st.prompt_tokens:
                st.prompt_tokens = chunk.usage.prompt_tokens
            if st.migrations == 0 and st.prefill_instance is None:
                st.cached_tokens = chunk.usage.cached_tokens
        if chunk.finish_reason is not None:
            st.finish_reason = chunk.finish_reason
            st.stop_reason = chunk.stop_reason
