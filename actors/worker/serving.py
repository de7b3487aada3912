"""The engine actor's logic as a plain asyncio class (no NATS): validate, admit, stream, abort.

``EngineActor`` (engine_actor.py) is the transport around it. Keeping this apart lets the tests
drive generate/cancel/sleep against a real engine without a bus, and keeps NATS out of the logic.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.engines.protocol import EncodeFailed, Engine, EngineDeadError, LoraRef
from actors.worker.chat_render import ChatSupport
from actors.worker.contract import (
    DisaggregatedParams,
    EmbedReply,
    EmbedRequest,
    EncodedImage,
    EncodeReply,
    EncodeRequest,
    EngineDead,
    EngineLoraAdd,
    GenerateChunk,
    GenerateRequest,
    HealthReply,
    StatusReply,
    Usage,
    output_to_chunk,
)
from actors.worker.engine_errors import is_request_error, message_of, refusal
from actors.worker.metrics import WorkerMetrics
from actors.worker.token_counter import TokenCounter
from actors.worker.validation import (
    build_prompt,
    check_context,
    check_embed,
    check_encode,
    check_sampling,
    kv_params_for,
    role_sampling,
)
from bus import tracing
from bus.errors import ActorError, BadRequest, Conflict, NotFound, Overloaded, Unavailable
from config.topology import ModelConfig, PoolConfig

log = logging.getLogger(__name__)

GENERATE = "generate"
ENCODE = "encode"
EMBED = "embed"
# Aborts the worker decided on (not the caller): the stream ends with a 503 instead of "abort".
_MIGRATE_REASONS = {"shutdown": "shutting down", "sleep": "going to sleep"}


@dataclass
class _Active:
    request_id: str
    abort_reason: str | None = None  # set by cancel/abort_all before aborting the engine request
    started: float = field(default_factory=time.monotonic)
    # a health or readiness probe: not traffic, so it does not keep the worker from idling (the
    # health monitor probes an idle engine every interval; counting that, it never went idle)
    probe: bool = False


class EngineService:
    """One engine and the requests on it."""

    def __init__(self, engine_factory: Callable[[], Engine], pool: PoolConfig, *,
                 model: ModelConfig | None, metrics: WorkerMetrics, engine: Engine | None = None) -> None:
        """``engine``: one already started (a checkpoint-restored worker built it before the bus
        existed); ``start`` adopts it instead of building one. Later restarts use the factory."""
        self._factory = engine_factory
        self._prebuilt = engine
        self.pool = pool
        self.model_cfg = model
        self.metrics = metrics
        self._engine: Engine | None = None
        self.accepting = False
        self.started_at = time.time()
        self._active: dict[str, _Active] = {}
        self._last_activity = time.monotonic()
        self.last_output = time.monotonic()  # last time the engine produced anything (hang detection)
        self._loras: dict[str, LoraRef] = {}
        self._tokens: TokenCounter | None = None
        self._chat: ChatSupport | None = None  # text mode: the chat template this worker applies
        self.sleeping = False  # mirrored by the SleepController for health replies
        self.stopping = False

    # --- lifecycle ---------------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise Unavailable("engine not started")
        return self._engine

    @property
    def role(self) -> str:
        return self.pool.role

    @property
    def max_model_len(self) -> int:
        facts_len = self.engine.facts.max_model_len
        cfg = self.model_cfg.context_length if self.model_cfg else None
        return min(facts_len, cfg) if cfg else facts_len

    @property
    def dead(self) -> bool:
        return self._engine is not None and self._engine.dead.is_set()

    async def start(self) -> None:
        if self._prebuilt is not None:
            self._engine, self._prebuilt = self._prebuilt, None
        else:
            self._engine = self._factory()
            await self._engine.start()
        self._tokens = TokenCounter(self._engine.facts.tokenizer_path)
        if self._chat is None:  # the model's tokenizer outlives engine restarts
            self._chat = await ChatSupport.load(self.model_cfg, self._engine.facts)
        self.accepting = True
        log.info("engine started: %s role=%s max_model_len=%d block_size=%d", self._engine.facts.served_model_name,
                 self.role, self._engine.facts.max_model_len, self._engine.facts.block_size)

    async def shutdown(self) -> None:
        self.accepting = False
        self.stopping = True
        if self._engine is None:
            return
        if not self.dead:
            await self.abort_all("shutdown")
        try:
            await self._engine.shutdown()
        except Exception as e:  # noqa: BLE001 - shutting down a dead engine may fail; nothing to do
            log.warning("engine shutdown: %s", e)

    # --- counters the sleep controller and load reports read ---------------------------------------
    def in_flight(self) -> int:
        return len(self._active)

    def last_activity(self) -> float:
        return self._last_activity

    def touch(self) -> None:
        """Count now as activity (a woken worker's idle clocks start again)."""
        self._last_activity = time.monotonic()

    def active_ids(self) -> list[str]:
        return list(self._active)

    def stalled_for(self) -> float:
        """Seconds the engine has produced nothing while requests are in flight (0 when idle)."""
        if not self._active:
            return 0.0
        since = max(self.last_output, min(a.started for a in self._active.values()))
        return time.monotonic() - since

    # --- generate ----------------------------------------------------------------------------------
    def _admit(self, req: GenerateRequest) -> tuple[Any, Any, LoraRef | None, int | None]:
        if self.role == "encode":
            raise BadRequest("this is an encode worker: it runs the vision encoder only (verb encode); "
                             "generate requests go to agg or prefill workers")
        if self.role == "embed":
            raise BadRequest("this is an embedding worker: it runs a pooling model (verb embed), "
                             "which generates nothing; generate requests go to agg or decode workers")
        self._check_accepting()
        facts = self.engine.facts
        check_sampling(req.sampling, facts)
        fit_max_tokens = req.chat is not None and req.chat.fit_max_tokens
        if req.chat is not None:
            req = self._chat_as_tokens(req)
        prompt, n_prompt = build_prompt(req, facts, self.pool.prompt_embeds)
        sampling = role_sampling(self.role, req.sampling)
        if n_prompt is None and req.prompt is not None and self._tokens is not None:
            n_prompt = self._tokens.count(req.prompt)
        left = self.max_model_len - (n_prompt or 0)
        if fit_max_tokens and n_prompt is not None and 0 < left < sampling.max_tokens:
            sampling = msgspec.structs.replace(sampling, max_tokens=left)  # vLLM's chat default
        if n_prompt is not None:
            check_context(self.max_model_len, n_prompt, sampling.max_tokens)
        lora = None
        if req.lora_name:
            lora = self._loras.get(req.lora_name)
            if lora is None:
                raise NotFound(f"The model `{req.lora_name}` does not exist (no such LoRA adapter loaded)")
        if self.pool.max_waiting is not None:
            waiting = sum(s.num_waiting for s in self.engine.stats())
            if waiting >= self.pool.max_waiting:
                raise Overloaded(f"overloaded: {waiting} requests waiting (max_waiting={self.pool.max_waiting})")
        return prompt, sampling, lora, n_prompt

    def _check_accepting(self) -> None:
        if self.dead:
            # a refusal, not a death this request coincided with (the frontend counts those to
            # contain requests of death): the engine died before, and is being restarted
            raise Overloaded("engine restarting after its death: not accepting requests")
        if not self.accepting:
            raise Overloaded("worker is asleep or stopping: not accepting requests")

    def _chat_as_tokens(self, req: GenerateRequest) -> GenerateRequest:
        """Text mode: the chat template is applied here, and the engine runs the token ids."""
        if self._chat is None:
            raise Overloaded("engine starting: not accepting chat requests yet")
        return self._chat.token_request(req)

    def engine_request_id(self, req: GenerateRequest, request_id: str | None = None) -> str:
        return req.request_id or request_id or uuid.uuid4().hex

    def generate(self, req: GenerateRequest, request_id: str | None = None,
                 trace: Any = None) -> AsyncIterator[GenerateChunk]:
        """Validate and admit now (raising typed errors before any chunk), then stream chunks; the
        last has finish_reason and usage. The engine request is aborted if the consumer stops early
        (cancel, caller gone, shutdown). ``trace``: the worker span's context, when the request is
        traced (``bus.tracing``): the engine's run gets a span under it."""
        prompt, sampling, lora, n_prompt = self._admit(req)
        act = self._register(self.engine_request_id(req, request_id), probe=req.probe)
        return self._stream(req, act, prompt, sampling, lora, n_prompt, trace)

    def _register(self, rid: str, probe: bool = False) -> _Active:
        """A request in flight under ``rid`` (cancel, abort_all and the hang check see it)."""
        if rid in self._active:
            raise Conflict(f"request id {rid} is already in flight")
        act = self._active[rid] = _Active(rid, probe=probe)
        self._touch(act)
        return act

    def _touch(self, act: _Active) -> None:
        """Traffic started or ended now (what idle sleep and idle stop measure from)."""
        if not act.probe:
            self._last_activity = time.monotonic()

    def mark_abort(self, request_id: str, reason: str) -> bool:
        act = self._active.get(request_id)
        if act is not None:
            act.abort_reason = reason
        return act is not None

    async def _stream(self, req: GenerateRequest, act: _Active, prompt: Any, sampling: Any,
                      lora: LoraRef | None, n_prompt: int | None, trace: Any = None) -> AsyncIterator[GenerateChunk]:
        rid = act.request_id
        kv = kv_params_for(self.role, req)
        engine = self.engine
        finished = False
        completion = 0
        prompt_tokens = n_prompt or 0
        cached = 0
        checked_ctx = n_prompt is not None
        span = tracing.start("engine.generate", trace, attributes={"vllm_actors.engine_request_id": rid}) \
            if trace is not None else None
        try:
            with self.metrics.track(GENERATE):
                async for out in engine.generate(prompt, sampling, rid, lora, kv, tracing.headers(span)):
                    if span is not None and not completion and out.token_ids:
                        span.add_event("first_token")
                    self.last_output = time.monotonic()
                    if out.num_prompt_tokens is not None:
                        prompt_tokens = out.num_prompt_tokens
                        if not checked_ctx:
                            checked_ctx = True
                            check_context(self.max_model_len, prompt_tokens, sampling.max_tokens)
                    if out.cached_tokens is not None:
                        cached = out.cached_tokens
                    completion += len(out.token_ids)
                    chunk = output_to_chunk(out)
                    if out.finish_reason is not None:
                        finished = True
                        chunk.usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                                            cached_tokens=cached)
                        if self.role == "prefill" or out.kv_transfer_params:
                            chunk.disaggregated_params = DisaggregatedParams(
                                kv_transfer_params=out.kv_transfer_params)
                        if out.finish_reason == "abort" and act.abort_reason:
                            self.metrics.cancelled(GENERATE, act.abort_reason)
                            if act.abort_reason in _MIGRATE_REASONS:
                                # not the caller's doing: a typed 503 so the frontend migrates it
                                raise Unavailable(f"request {rid} aborted: worker {_MIGRATE_REASONS[act.abort_reason]}"
                                                  f" after {completion} token(s)")
                    yield chunk
                    if finished:
                        return
        except EngineDeadError as e:
            finished = True  # nothing left to abort
            raise EngineDead(f"engine dead: {e}") from None
        except ActorError:
            raise
        except Exception as e:
            if not is_request_error(e):
                raise
            raise refusal(e, self.max_model_len, sampling.max_tokens) from None
        finally:
            if span is not None:  # ended by what leaves this generator, if anything (GeneratorExit: closed early)
                span.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens,
                                     "gen_ai.usage.output_tokens": completion, "vllm_actors.cached_tokens": cached})
                tracing.end(span, sys.exc_info()[1])
            self._active.pop(rid, None)
            self._touch(act)
            if not finished and not self.dead:
                reason = act.abort_reason or ("shutdown" if self.stopping else "caller_gone")
                self.metrics.cancelled(GENERATE, reason)
                log.info("aborting request %s (%s)", rid, reason)
                try:
                    await engine.abort(rid)
                except Exception as e:  # noqa: BLE001 - the engine may be gone already
                    log.warning("abort of %s failed: %s", rid, e)

    # --- encode (E/P/D) -----------------------------------------------------------------------------
    async def encode(self, req: EncodeRequest) -> EncodeReply:
        """Run the vision encoder on a prompt's images; one output per distinct image, in prompt
        order. Refusals as for generate (Overloaded while dead, asleep or stopping); a death during
        the run is EngineDead and an aborted or incomplete run Unavailable, so the caller can ask
        another encode worker (or let the agg/prefill worker encode the images itself)."""
        if self.role != "encode":
            raise BadRequest("this worker is not an encode worker (its pool's role is "
                             f"{self.role!r}): send encode requests to an encode pool's workers")
        self._check_accepting()
        if not req.probe:
            check_encode(req, self.engine.facts, self.max_model_len)
        act = self._register(req.request_id or uuid.uuid4().hex, probe=req.probe)
        rid = act.request_id
        engine = self.engine
        try:
            with self.metrics.track(ENCODE):
                if req.probe:
                    await engine.encode_probe(rid)
                    outputs: list[tuple[str, bytes]] = []
                else:
                    outputs = await engine.encode(req.mm, list(req.token_ids), rid)
        except EngineDeadError as e:
            raise EngineDead(f"engine dead: {e}") from None
        except EncodeFailed as e:
            if act.abort_reason is not None:
                self.metrics.cancelled(ENCODE, act.abort_reason)
            why = _MIGRATE_REASONS.get(act.abort_reason or "", act.abort_reason)
            raise Unavailable(f"encode {rid}: {e}" + (f" (worker {why})" if why else "")) from None
        except ActorError:
            raise
        except Exception as e:
            if not is_request_error(e):
                raise
            raise BadRequest(message_of(e), param="mm") from None
        finally:
            self._active.pop(rid, None)
            self.last_output = time.monotonic()
            self._touch(act)
        return EncodeReply(outputs=[EncodedImage(uuid=u, encoder_output=data) for u, data in outputs])

    # --- embed (role "embed") ------------------------------------------------------------------------
    async def embed(self, req: EmbedRequest) -> EmbedReply:
        """One prompt's embedding. Refusals as for generate (Overloaded while dead, asleep or
        stopping: the frontend sends it elsewhere); a death during the run is EngineDead, an abort
        the worker decided on (shutdown, sleep) Unavailable, a cancel by the caller Unavailable too
        (nobody waits for it). An embedding is idempotent, so any of these may be re-sent."""
        if self.role != "embed":
            raise BadRequest("this worker is not an embedding worker (its pool's role is "
                             f"{self.role!r}): send embedding requests to an embed pool's workers")
        self._check_accepting()
        check_embed(req, self.engine.facts, self.max_model_len)
        if self.pool.max_waiting is not None:
            waiting = sum(s.num_waiting for s in self.engine.stats())
            if waiting >= self.pool.max_waiting:
                raise Overloaded(f"overloaded: {waiting} requests waiting (max_waiting={self.pool.max_waiting})")
        act = self._register(req.request_id or uuid.uuid4().hex, probe=req.probe)
        rid = act.request_id
        try:
            with self.metrics.track(EMBED):
                data = await self.engine.embed(list(req.token_ids), rid, dimensions=req.dimensions,
                                               use_activation=req.use_activation)
        except EngineDeadError as e:
            raise EngineDead(f"engine dead: {e}") from None
        except EncodeFailed as e:  # the run ended without an embedding: aborted
            data = b""
            if act.abort_reason is None:
                raise Unavailable(f"embedding {rid}: {e}") from None
        except ActorError:
            raise
        except Exception as e:
            if not is_request_error(e):
                raise
            raise BadRequest(message_of(e), param=getattr(e, "parameter", None) or "input") from None
        finally:
            self._active.pop(rid, None)
            self.last_output = time.monotonic()
            self._touch(act)
        if act.abort_reason is not None:  # aborted while it ran: the engine's output is not one
            self.metrics.cancelled(EMBED, act.abort_reason)
            why = _MIGRATE_REASONS.get(act.abort_reason, act.abort_reason)
            raise Unavailable(f"embedding {rid} aborted ({why})")
        return EmbedReply(embedding=data, prompt_tokens=len(req.token_ids))

    async def cancel(self, request_id: str) -> StatusReply:
        act = self._active.get(request_id)
        if act is None:
            raise NotFound(f"no request {request_id} in flight")
        act.abort_reason = "cancel"
        await self.engine.abort(request_id)
        return StatusReply(status="ok", message=f"request {request_id} aborted")

    async def abort_all(self, reason: str) -> int:
        ids = list(self._active)
        for rid in ids:
            act = self._active.get(rid)
            if act is not None:
                act.abort_reason = reason
            try:
                await self.engine.abort(rid)
            except Exception as e:  # noqa: BLE001
                log.warning("abort of %s failed: %s", rid, e)
        # the streams end with finish_reason "abort"; give them a moment to do so
        deadline = time.monotonic() + 2.0
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return len(ids)

    # --- control -----------------------------------------------------------------------------------
    async def health(self, timeout: float) -> HealthReply:
        eng = self._engine
        base: dict[str, Any] = {
            "instance": "", "role": self.role,
            "model": self.model_cfg.name if self.model_cfg else "",
            "uptime": time.time() - self.started_at,
        }
        if eng is None:
            return HealthReply(status="starting", **base)
        stats = eng.stats()
        base.update(num_running=sum(s.num_running for s in stats), num_waiting=sum(s.num_waiting for s in stats),
                    kv_usage=max((s.kv_usage for s in stats), default=0.0), in_flight=self.in_flight(),
                    stalled_for=round(self.stalled_for(), 3))
        try:
            await asyncio.wait_for(eng.check_health(), timeout)
        except TimeoutError:
            return HealthReply(status="unhealthy", message=f"check_health timed out after {timeout}s", **base)
        except Exception as e:  # noqa: BLE001 - EngineDeadError or anything else: unhealthy
            return HealthReply(status="unhealthy", message=f"engine dead: {e}", **base)
        if self.sleeping:
            return HealthReply(status="sleeping", **base)
        return HealthReply(status="healthy", **base)

    async def clear_kv_blocks(self) -> StatusReply:
        if self.dead:
            raise EngineDead("engine dead: cannot reset the prefix cache")
        ok = await self.engine.reset_prefix_cache()
        if ok:
            return StatusReply(status="ok", message="prefix cache cleared")
        return StatusReply(status="error", message="prefix cache not cleared (requests still running?)")

    async def lora_add(self, req: EngineLoraAdd) -> StatusReply:
        ref = LoraRef(name=req.lora_name, int_id=req.lora_id, path=req.path)
        old = self._loras.get(req.lora_name)
        if old == ref:
            return StatusReply(status="ok", message=f"adapter {req.lora_name} already loaded")
        if old is not None:
            raise Conflict(f"adapter {req.lora_name} is loaded with id {old.int_id} from {old.path}")
        try:
            ok = await self.engine.add_lora(ref)
        except ActorError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's refusal is the caller's bad adapter
            raise BadRequest(f"engine refused adapter {req.lora_name}: {e}") from None
        if not ok:
            raise BadRequest(f"engine refused adapter {req.lora_name}")
        self._loras[req.lora_name] = ref
        return StatusReply(status="ok", message=f"adapter {req.lora_name} loaded")

    async def lora_remove(self, name: str) -> StatusReply:
        ref = self._loras.pop(name, None)
        if ref is None:
            raise NotFound(f"adapter {name} not loaded")
        await self.engine.remove_lora(ref)
        return StatusReply(status="ok", message=f"adapter {name} removed")

    def lora_list(self) -> list[EngineLoraAdd]:
        return [EngineLoraAdd(lora_name=r.name, lora_id=r.int_id, path=r.path) for r in self._loras.values()]
