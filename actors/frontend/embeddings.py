"""POST /v1/embeddings: vLLM's request model, the frontend's tokenizer, one worker request per input
(a text, a token-id list, or a chat rendered with the model's chat template).

The request is validated with vLLM's own ``EmbeddingRequest`` (so fields and 400s match
``vllm serve``); ``dimensions`` is checked with vLLM's ``PoolingParams.verify`` and the inputs are
tokenized, truncated (``truncate_prompt_tokens``, ``truncation_side``) and length-checked with
vLLM's ``TokenizeParams``, both against the facts the model card carries (``_CardModel``). Each
input is then one ``EmbedRequest`` to an embedding worker (``ns.worker.<id>.embed``, unary):
inputs are fanned out over the pool's workers, each to the one with the fewest embeddings this
frontend has in flight on it (no KV routing: a prompt is pooled in one step and nothing of it is
kept), and gathered in input order. An embedding is idempotent, so an input whose worker died,
refused or went silent is sent to another one (``migration_limit``), with the chat pipeline's
liveness question, wait for a worker and quarantine. A client that leaves cancels the inputs'
requests, and each worker still running one is told to abort it.

The response is vLLM's shape (``EmbeddingResponse``): ``float`` lists, or ``base64`` of the
embedding's bytes in ``embed_dtype`` and ``endianness`` (vLLM's ``tensor2binary``); ``bytes`` and
``bytes_only`` are those bytes back to back as the body (``bytes``: a ``metadata`` header says where
each one is). Workers send little-endian float32 bytes, which already are the default payload.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pydantic
from aiohttp import web
from vllm import PoolingParams
from vllm.entrypoints.pooling.embed.protocol import (
    EmbeddingBatchChatRequest,
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    EmbeddingRequest,
)
from vllm.exceptions import VLLMValidationError

from actors.engines.protocol import SamplingOptions
from actors.worker.contract import EmbedReply, EmbedRequest, EngineDead
from bus.errors import ActorError, BadRequest, NotFound, Overloaded, RequestTimeout, Unavailable
from config.topology import MIGRATION_WAIT, FrontendConfig, ModelConfig

from .cold import ColdGate, held_model
from .completion_flow import MIGRATABLE, BusUnavailable, MigrationExhausted
from .discovery import ModelEntry, Worker, WorkerSet
from .http_guard import read_body
from .limits import card_limits, check_prompt
from .media import has_media
from .metrics import FrontendMetrics
from .openai_io import as_bad_request, check_request_template, encode_json, validate_json
from .planning import NotReady, resolve
from .preprocess import ModelPreprocessors, Preprocessor
from .quarantine import DEATHS_TO_QUARANTINE, Quarantine, fingerprint
from .responses import WORKER_HEADER
from .worker_link import Liveness

log = logging.getLogger(__name__)

PATH = "/v1/embeddings"
ENDPOINT = "embeddings"  # the metrics' endpoint label
# inputs of one request in flight at once: a 2048-input batch must not take every worker slot
# from the other clients' requests (the workers' own semaphores bound the rest)
MAX_PARALLEL_INPUTS = 64
# inputs of one request: OpenAI's limit. vllm serve sets none, but an 8 MiB body of one-token
# inputs is two million of them, each a worker request and a vector in one JSON answer
MAX_INPUTS = 2048
# a body this large is tokenized off the event loop (other requests' chunks keep flowing)
_INLINE_BODY = 64 << 10
# vLLM's request model is a union (text/token inputs, or chats); one adapter, built once
_REQUEST = pydantic.TypeAdapter(EmbeddingRequest)
# what the fingerprint of an embedding input holds besides its ids: never a sampling (a constant)
_NO_SAMPLING = SamplingOptions(max_tokens=0)


class EmbedLink(Protocol):
    """The bus side (``actors.frontend.client.WorkerClient``)."""

    async def embed(self, worker: Worker, req: EmbedRequest) -> EmbedReply: ...

    async def cancel(self, worker: Worker, request_id: str) -> None: ...

    async def connected(self) -> bool: ...

    async def liveness(self, worker: Worker) -> Liveness: ...


@dataclass(frozen=True)
class _CardModel:
    """The parts of vLLM's ``ModelConfig`` its pooling checks read (``PoolingParams.verify``,
    ``build_tok_params``), from the model card: the frontend has no engine config."""

    served_model_name: str
    max_model_len: int
    embedding_size: int
    is_matryoshka: bool
    matryoshka_dimensions: list[int] | None
    pooler_config: None = None  # the pooler's defaults are merged again by the engine
    encoder_config: None = None


EmbedInput = EmbeddingCompletionRequest | EmbeddingChatRequest | EmbeddingBatchChatRequest


def parse_embedding(body: bytes) -> EmbedInput:
    """``body`` as vLLM's EmbeddingRequest (text or token inputs; a chat, or a list of chats, in
    ``messages`` or ``input``); a 400 naming the field otherwise."""
    try:
        req = _REQUEST.validate_json(body)
    except (pydantic.ValidationError, ValueError, VLLMValidationError, TypeError, AttributeError) as e:
        # the union's errors name every member it tried; the member the body meant (a chat when
        # it has messages, else text or token inputs) says what it got wrong (validate_json
        # raises that as a 400)
        validate_json(EmbeddingChatRequest if b'"messages"' in body else EmbeddingCompletionRequest, body)
        if isinstance(e, TypeError | AttributeError):
            # one of vLLM's "before" validators read a field before its type was checked (a chat
            # member's messages): the input's fault, as openai_io treats the chat model's
            raise BadRequest(f"invalid request: {e}") from None
        raise as_bad_request(e) from None
    return req  # type: ignore[no-any-return]


@dataclass
class EmbedPlan:
    entry: ModelEntry
    model: str  # as the client named it
    prompts: list[list[int]]
    dimensions: int | None
    use_activation: bool | None
    encoding_format: str
    embed_dtype: str
    endianness: str
    request_id: str = field(default_factory=lambda: f"embd-{uuid.uuid4().hex}")


def plan_embedding(req: EmbedInput, entry: ModelEntry, name: str, pre: Preprocessor | None,
                   trust_request_chat_template: bool = False) -> EmbedPlan:
    """The inputs as token ids, checked as vllm serve checks them (no NATS, no HTTP). A chat is
    rendered with the model's chat template (or the request's own, where the topology trusts
    request templates) and embedded as one prompt."""
    if not entry.embeds:
        raise BadRequest(f"The model does not support Embeddings API (model {entry.name} generates: its "
                         "pools are not embed pools)", param="model")
    if pre is None:
        raise BadRequest(f"model {entry.name} runs in text mode: /v1/embeddings needs the frontend's "
                         "tokenizer (unset model.text_mode)", param="input")
    card = entry.card
    model = _CardModel(served_model_name=entry.name, max_model_len=card.context_length,
                       embedding_size=card.embedding_size or 0, is_matryoshka=card.is_matryoshka,
                       matryoshka_dimensions=card.matryoshka_dimensions)
    try:
        PoolingParams(task="embed", dimensions=req.dimensions,
                      use_activation=req.use_activation).verify(model)  # type: ignore[arg-type]
        tok = req.build_tok_params(model)  # type: ignore[arg-type]
    except (ValueError, VLLMValidationError) as e:
        raise as_bad_request(e) from None
    items: list[str | list[int]]
    if isinstance(req, EmbeddingCompletionRequest):
        raw = req.input
        if isinstance(raw, str):
            items = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [list(raw)]  # type: ignore[arg-type]
        else:
            items = list(raw)  # type: ignore[arg-type]
    else:
        check_request_template(req.chat_template, trust_request_chat_template)
        chats = [req.messages] if isinstance(req, EmbeddingChatRequest) else list(req.messages)
        items = [_render(pre, req, list(chat)) for chat in chats]
    if not items:
        raise BadRequest("You must pass at least one prompt", param="input")
    if len(items) > MAX_INPUTS:
        raise BadRequest(f"input holds {len(items)} inputs; at most {MAX_INPUTS} are embedded in one request",
                         param="input")
    limits = card_limits(card)
    prompts: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            ids = pre.encode(item, tok.add_special_tokens)
        else:
            ids = list(item)
            check_prompt(ids, limits, False)
        try:
            ids = tok.apply_post_tokenization(pre.hf, {"prompt_token_ids": ids})["prompt_token_ids"]
        except (ValueError, VLLMValidationError) as e:
            raise as_bad_request(e) from None
        if not ids:
            raise BadRequest("an input has no tokens: an embedding needs at least one", param="input")
        prompts.append(ids)
    return EmbedPlan(entry=entry, model=name, prompts=prompts, dimensions=req.dimensions,
                     use_activation=req.use_activation, encoding_format=req.encoding_format,
                     embed_dtype=req.embed_dtype, endianness=req.endianness)


def _render(pre: Preprocessor, req: EmbeddingChatRequest | EmbeddingBatchChatRequest,
            messages: list[Any]) -> list[int]:
    """A chat's prompt ids: rendered as a chat completion's prompt is, encoded with the request's
    ``add_special_tokens`` (vLLM's chat default: false, the template writes them)."""
    if has_media(messages):
        raise BadRequest("only text chats are embedded here (no images)", param="messages")
    text = pre.render_chat(messages, add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                           template_kwargs=req.chat_template_kwargs)
    return pre.encode(text, req.add_special_tokens)


def shape_response(plan: EmbedPlan, replies: Sequence[EmbedReply], created: int | None = None) -> dict[str, Any]:
    """vLLM's EmbeddingResponse, as a dict for the JSON encoder."""
    data = [{"index": i, "object": "embedding", "embedding": _encoded(plan, r.embedding)}
            for i, r in enumerate(replies)]
    tokens = sum(r.prompt_tokens for r in replies)
    return {"id": plan.request_id, "object": "list", "created": created or int(time.time()),
            "model": plan.model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


def binary_response(plan: EmbedPlan, replies: Sequence[EmbedReply], created: int | None = None
                    ) -> tuple[bytes, dict[str, str]]:
    """``encoding_format`` "bytes" (the embeddings back to back, what each is in a ``metadata``
    header) or "bytes_only" (no header), as vLLM's ``build_pooling_bytes_streaming_response``."""
    chunks = [_binary(plan, r.embedding) for r in replies]
    if plan.encoding_format == "bytes_only":
        return b"".join(chunks), {}
    items, offset = [], 0
    for i, (chunk, r) in enumerate(zip(chunks, replies, strict=True)):
        items.append({"index": i, "embed_dtype": plan.embed_dtype, "endianness": plan.endianness,
                      "start": offset, "end": offset + len(chunk), "shape": [len(r.embedding) // 4]})
        offset += len(chunk)
    tokens = sum(r.prompt_tokens for r in replies)
    meta = {"id": plan.request_id, "created": created or int(time.time()), "model": plan.model, "data": items,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return b"".join(chunks), {"metadata": encode_json(meta).decode()}


def _binary(plan: EmbedPlan, raw: bytes) -> bytes:
    """One embedding in the request's ``embed_dtype`` and ``endianness`` (vLLM's tensor2binary)."""
    if plan.embed_dtype == "float32" and (plan.endianness == "little"
                                          or (plan.endianness == "native" and sys.byteorder == "little")):
        return raw  # the worker's bytes are this encoding already
    import torch
    from vllm.utils.serial_utils import tensor2binary

    tensor = torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float32))
    return tensor2binary(tensor, plan.embed_dtype, plan.endianness)  # type: ignore[arg-type]


def _encoded(plan: EmbedPlan, raw: bytes) -> list[float] | str:
    if plan.encoding_format == "float":
        return np.frombuffer(raw, dtype="<f4").tolist()
    return base64.b64encode(_binary(plan, raw)).decode()


@dataclass
class _Input:
    """One input's attempts: the workers that failed it, and the deaths it coincided with."""

    index: int
    ids: list[int]
    failed: dict[str, float] = field(default_factory=dict)  # instance -> its started_at when it failed
    gone: set[str] = field(default_factory=set)  # failed workers that died (their supervisor restarts them)
    deaths: list[str] = field(default_factory=list)
    worker: str | None = None  # the instance that answered


class EmbeddingService:
    """Serves /v1/embeddings for one frontend process."""

    def __init__(self, *, workers: WorkerSet, link: EmbedLink, config: FrontendConfig, metrics: FrontendMetrics,
                 preprocessors: ModelPreprocessors, quarantine: Quarantine,
                 expected: frozenset[str] = frozenset(), model_config: ModelConfig | None = None) -> None:
        self.workers = workers
        self.link = link
        self.config = config
        self.metrics = metrics
        self.preprocessors = preprocessors
        self.quarantine = quarantine
        self.expected = expected
        self.model_config = model_config
        self.load: dict[str, int] = {}  # instance -> embeddings this process has in flight on it
        self._turn = 0  # rotates the order among equally loaded workers
        self.cold: ColdGate | None = None  # holds requests for a cold model (the frontend actor sets it)

    # --- HTTP ---------------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        m = self.metrics
        body = await read_body(request, self.config.body_timeout, self.config.max_body_bytes, m)
        model = "unknown"
        status = 500
        try:
            req = parse_embedding(body)
            try:
                entry, lora, name = resolve(self.workers, req.model, self.expected)
            except NotReady:
                # a cold model: held until a replica is back (cold.ColdGate), as chat requests are
                held = held_model(req.model, self.expected)
                if self.cold is None or held is None or not await self.cold.hold(held):
                    raise
                entry, lora, name = resolve(self.workers, req.model, self.expected)
            if lora is not None:  # an embed worker loads no adapters: the base model's vector would be a lie
                raise BadRequest(f"{name} is a LoRA adapter: embeddings come from base models only", param="model")
            model = entry.name
            series = m.model(model)
            pre = await self.preprocessors.get(entry)
            trusted = self.config.trust_request_chat_template
            plan = plan_embedding(req, entry, name, pre, trusted) if len(body) < _INLINE_BODY \
                else await asyncio.to_thread(plan_embedding, req, entry, name, pre, trusted)
            for ids in plan.prompts:
                series.input_tokens.observe(len(ids))
            series.inflight.inc()
            try:
                replies, served = await self.embed_all(plan, target=request.headers.get(WORKER_HEADER),
                                                       on_migrate=series.migrations.inc,
                                                       on_quarantine=series.quarantined.inc)
            finally:
                series.inflight.dec()
            series.duration.observe(time.perf_counter() - t0)
            status = 200
            headers = {WORKER_HEADER: ",".join(dict.fromkeys(served))}
            if plan.encoding_format in ("bytes", "bytes_only"):
                body, meta = binary_response(plan, replies)
                return web.Response(body=body, content_type="application/octet-stream", headers={**headers, **meta})
            return web.Response(body=encode_json(shape_response(plan, replies)), content_type="application/json",
                                headers=headers)
        except ActorError as e:
            status = e.code
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499
            m.disconnects.labels(model).inc()
            m.cancellations.labels(model).inc()
            log.info("client disconnected from an embeddings request; worker requests cancelled")
            raise
        finally:
            m.request_done(ENDPOINT, model, status)

    # --- fan-out ------------------------------------------------------------------------------------
    async def embed_all(self, plan: EmbedPlan, *, target: str | None = None,
                        on_migrate: Callable[[], None] | None = None,
                        on_quarantine: Callable[[], None] | None = None) -> tuple[list[EmbedReply], list[str]]:
        """Every input's embedding, in input order, with the instance that served each. The first
        input that fails for good fails the request, and the others' requests are cancelled."""
        inputs = [_Input(i, ids) for i, ids in enumerate(plan.prompts)]
        if len(inputs) == 1:  # the common case: no task
            reply = await self._embed_one(plan, inputs[0], target, on_migrate, on_quarantine)
            return [reply], [inputs[0].worker or ""]
        replies: list[EmbedReply | None] = [None] * len(inputs)
        todo = iter(inputs)

        async def runner() -> None:  # MAX_PARALLEL_INPUTS of these share the inputs, in order
            for inp in todo:
                replies[inp.index] = await self._embed_one(plan, inp, target, on_migrate, on_quarantine)

        tasks = [asyncio.ensure_future(runner()) for _ in range(min(len(inputs), MAX_PARALLEL_INPUTS))]
        try:
            await asyncio.gather(*tasks)
        finally:
            # a failure (or the client leaving) stops the rest; cancelling a finished task is a no-op
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [r for r in replies if r is not None], [inp.worker or "" for inp in inputs]

    def _settings(self, entry: ModelEntry) -> tuple[int, float]:
        mc = self.model_config if self.model_config and self.model_config.name == entry.name else None
        return (mc.migration_limit if mc is not None else entry.card.migration_limit,
                mc.migration_wait if mc is not None else MIGRATION_WAIT)

    async def _embed_one(self, plan: EmbedPlan, inp: _Input, target: str | None,
                         on_migrate: Callable[[], None] | None,
                         on_quarantine: Callable[[], None] | None) -> EmbedReply:
        limit, wait = self._settings(plan.entry)
        fp: str | None = None
        if self.quarantine:
            fp = fingerprint(plan.entry.name, None, inp.ids, None, _NO_SAMPLING)
            self.quarantine.check(fp)
        attempt = 0
        while True:
            if not await self.link.connected():
                raise BusUnavailable("this frontend is cut off from the bus (reconnecting); try again")
            worker = await self._choose(plan.entry.name, inp, target if attempt == 0 or not inp.failed else None,
                                        wait if attempt else 0.0)
            rid = f"{plan.request_id}-{inp.index}" + (f"-m{attempt}" if attempt else "")
            req = EmbedRequest(request_id=rid, token_ids=inp.ids, dimensions=plan.dimensions,
                               use_activation=plan.use_activation)
            self.load[worker.instance] = self.load.get(worker.instance, 0) + 1
            try:
                reply = await self.link.embed(worker, req)
                inp.worker = worker.instance
                return reply
            except asyncio.CancelledError:
                # the client left (or a sibling input failed): the worker need not finish it
                await asyncio.shield(self.link.cancel(worker, rid))
                raise
            except (*MIGRATABLE, Unavailable) as e:
                err: ActorError = e
            finally:
                left = self.load.get(worker.instance, 1) - 1
                if left > 0:
                    self.load[worker.instance] = left
                else:
                    self.load.pop(worker.instance, None)
            if isinstance(err, RequestTimeout):
                await self.link.cancel(worker, rid)  # no answer in time: do not let it run on
            died = await self._judge(worker, err, inp)
            if died and len(inp.deaths) >= DEATHS_TO_QUARANTINE:
                if on_quarantine is not None:
                    on_quarantine()
                raise self.quarantine.add(fp or fingerprint(plan.entry.name, None, inp.ids, None, _NO_SAMPLING),
                                          rid, inp.deaths)
            attempt += 1
            if attempt > limit:
                if isinstance(err, Overloaded) and not inp.deaths:
                    raise err
                raise MigrationExhausted(f"embedding input {inp.index}: worker {worker.instance} failed ({err}); "
                                         f"migration limit {limit} reached")
            log.warning("embedding %s: %s failed (%s); sending it to another worker, attempt %d/%d",
                        rid, worker.instance, err, attempt, limit)
            if on_migrate is not None:
                on_migrate()

    async def _judge(self, worker: Worker, err: ActorError, inp: _Input) -> bool:
        """After a failed attempt, as a completion's flow judges one: the worker is excluded for
        this input unless it lives and only the bus failed; True when it died while serving it."""
        if isinstance(err, EngineDead):
            died = True
        elif isinstance(err, Overloaded):  # refused (busy, asleep, restarting): not a death
            died = False
        else:
            verdict = await self.link.liveness(worker)
            if verdict is Liveness.ALIVE and not isinstance(err, RequestTimeout):
                return False  # the bus lost the answer: the same worker may serve it again
            # "no responders" before any answer: it never reached a live worker (a record that
            # outlived its process), so no death coincided with it; a silent one that is gone did die
            died = verdict is Liveness.DEAD and not isinstance(err, Unavailable)
            if verdict is Liveness.DEAD:
                inp.gone.add(worker.instance)
        inp.failed[worker.instance] = worker.started_at
        if died:
            inp.gone.add(worker.instance)
            inp.deaths.append(worker.instance)
        return died

    async def _choose(self, model: str, inp: _Input, target: str | None, wait: float) -> Worker:
        """The embedding worker with the fewest embeddings in flight from here (never one that
        failed this input, unless it has restarted since); ``target`` pins one (the
        x-worker-instance-id header). With none left, wait up to ``wait`` seconds for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            pool = self.workers.workers(model, "embed")
            for w in pool:  # an instance that restarted in place is a new incarnation
                if w.instance in inp.failed and w.started_at != inp.failed[w.instance]:
                    del inp.failed[w.instance]
            if target is not None:
                for w in pool:
                    if w.instance == target:
                        if target in inp.failed:
                            raise Overloaded(f"worker {target} failed for this request")
                        return w
                raise NotFound(f"worker instance {target!r} is not serving this model")
            cands = [w for w in pool if w.instance not in inp.failed]
            if cands:
                self._turn += 1
                n = len(cands)
                return min((cands[(self._turn + i) % n] for i in range(n)),
                           key=lambda w: self.load.get(w.instance, 0))
            # only a worker that died or left the pool comes back (restarted); one that failed the
            # input but still runs (refused it, or its answer was lost) is not replaced: 503 at once
            present = {w.instance for w in pool}
            if inp.failed and not any(i in inp.gone or i not in present for i in inp.failed):
                raise Overloaded(f"no embedding worker can take this input now: {', '.join(sorted(inp.failed))} "
                                 f"failed it and still run; try again")
            if loop.time() >= deadline:
                if wait > 0:
                    raise Overloaded(f"no embedding worker came back within {wait:g}s")
                raise Overloaded("no worker available for this model")
            await asyncio.sleep(0.1)
