"""The HTTP server: aiohttp routes, the API key and error middleware, and the small endpoints
(models, health, live, metrics). A generation request is handed to ``pipeline.CompletionPipeline``,
which reads and serves it; /tokenize and /detokenize to ``tokenize_api.Tokenization``.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from bus.errors import ActorError, BadRequest
from config import secrets
from config.topology import FrontendConfig, ModelConfig

from .discovery import WorkerSet
from .http_guard import json_error, read_body
from .messages_api import PATH as MESSAGES_PATH
from .messages_api import MessagesShape, anthropic_error, count_request, is_messages_path
from .metrics import FrontendMetrics
from .openai_io import RETRY_AFTER_S, encode_json
from .pipeline import CompletionPipeline
from .planning import NotReady, resolve
from .response_store import ResponseStore
from .responses import FRONTEND_HEADER, now
from .responses_api import PATH as RESPONSES_PATH
from .responses_api import ResponsesShape
from .responses_api import not_found as responses_not_found
from .routing import Router
from .tokenize_api import Tokenization
from .worker_link import WorkerLink

log = logging.getLogger(__name__)

_JSON = "application/json"


def _cold_model(health: dict[str, Any]) -> str | None:
    """The model /health reports cold (listed in /v1/models all the same)."""
    return (health.get("cold") or {}).get("model") if health.get("status") == "cold" else None


class Unauthorized(ActorError):
    code = 401
    kind = "authentication_error"


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=encode_json(obj), status=status, content_type=_JSON, headers=headers)


def _error(request: web.Request, err: ActorError) -> web.Response:
    """``err`` in the shape of the API the path belongs to (the anthropic client reads Anthropic's)."""
    return json_error(err, anthropic_error(err) if is_messages_path(request.path) else None)


class FrontendApp:
    def __init__(self, *, workers: WorkerSet, router: Router, link: WorkerLink, config: FrontendConfig,
                 health: Callable[..., Awaitable[tuple[bool, dict[str, Any]]]],
                 model_config: ModelConfig | None = None, metrics: FrontendMetrics | None = None,
                 response_store: ResponseStore | None = None) -> None:
        self.workers = workers
        self.response_store = response_store  # /v1/responses' store: true (None: nothing is stored)
        self._health = health
        self.config = config
        self.metrics = metrics or FrontendMetrics()
        # what /metrics serves when it is more than this process's series (several processes:
        # actors.frontend.metrics_merge); None: this process's own
        self.render_metrics: Callable[[], Awaitable[bytes]] | None = None
        # several frontend processes: each response names the one that served it (FRONTEND_HEADER)
        self.process_name: str | None = None
        self.pipeline = CompletionPipeline(workers=workers, router=router, link=link, config=config,
                                           metrics=self.metrics, model_config=model_config)
        self.tokenization = Tokenization(workers, self.pipeline.preprocessors, self.pipeline.expected,
                                         config.trust_request_chat_template)
        key = secrets.resolve(config.api_key, config.api_key_file, config.api_key_env, "frontend.api_key")
        self._api_key = key.encode() if key else None
        # /health and /live stay open (load balancers, systemd, kubelets probe them without a key);
        # /tokenize and /detokenize are vLLM's paths outside /v1/, and just as closed
        protected = ("/v1/", "/tokenize", "/detokenize")
        self._protected = (*protected, "/metrics") if config.metrics_auth else protected

    # --- app ---------------------------------------------------------------------------------------
    def build(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._errors_mw])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        # /v1/embeddings: embed pools' workers, on the chat pipeline's workers, bus link and quarantine
        from .embeddings import PATH as EMBEDDINGS_PATH
        from .embeddings import EmbeddingService

        p = self.pipeline
        self.embeddings = EmbeddingService(workers=self.workers, link=p.deps.link, config=self.config,  # type: ignore[arg-type]
                                           metrics=self.metrics, preprocessors=p.preprocessors,
                                           quarantine=p.deps.quarantine, expected=p.expected,
                                           model_config=p.model_config)
        self.embeddings.cold = p.cold
        app.router.add_post(EMBEDDINGS_PATH, self.embeddings.handle)
        app.router.add_post(MESSAGES_PATH, self.messages)
        app.router.add_post(MESSAGES_PATH + "/count_tokens", self.count_tokens)
        app.router.add_post(RESPONSES_PATH, self.responses)
        app.router.add_get(RESPONSES_PATH + "/{id}", self.get_response)
        app.router.add_delete(RESPONSES_PATH + "/{id}", self.delete_response)
        app.router.add_get("/v1/models", self.models)
        # ids may hold '/' (HF names such as org/model), sent raw or as %2F (the openai client)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        app.router.add_get("/metrics", self.metrics_handler)
        if self.process_name is not None:
            name = self.process_name

            async def name_process(_request: web.Request, response: web.StreamResponse) -> None:
                response.headers[FRONTEND_HEADER] = name

            app.on_response_prepare.append(name_process)
        return app

    @web.middleware
    async def _errors_mw(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            if self._api_key is not None and request.path.startswith(self._protected):
                # Bearer (OpenAI's clients) or x-api-key (Anthropic's)
                auth = request.headers.get("Authorization", "").removeprefix("Bearer ")
                key = auth or request.headers.get("x-api-key", "")
                if not hmac.compare_digest(key.encode(), self._api_key):
                    raise Unauthorized("invalid or missing API key")
            return await handler(request)
        except ActorError as e:
            return _error(request, e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = ActorError(e.reason or "error", e.status)
            err.kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            resp = _error(request, err)
            if "Allow" in e.headers:  # a 405 must say which methods the route has (RFC 9110)
                resp.headers["Allow"] = e.headers["Allow"]
            return resp
        except Exception as e:
            log.exception("internal error on %s", request.path)
            return _error(request, ActorError(f"internal error: {type(e).__name__}: {e}"))

    # --- info routes --------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        ready, body = await self._health(detail=False)
        if not ready:
            # /health, /v1/models and READY=1 are three views of one fact: while the deployment is
            # not ready, nothing is listed (a request that can be served is still served)
            return _json({"object": "list", "data": []})
        return _json({"object": "list", "data": self._model_objects(_cold_model(body))})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the object /v1/models lists for that id."""
        name = request.match_info["model"]
        ready, body = await self._health(detail=False)
        if ready:
            for obj in self._model_objects(_cold_model(body)):
                if obj["id"] == name:
                    return _json(obj)
        # Not listed. While the deployment is not ready /v1/models lists nothing, and a model of
        # the deployment is then "not ready yet" (503, Retry-After), as chat's resolve answers, not
        # "does not exist": a 404 would tell a client probing at start-up to give up on a model that
        # is about to be served. resolve raises 503 for such a model and 404 for an unknown one.
        resolve(self.workers, name, self.pipeline.expected)
        # servable now, but the deployment as a whole is not ready, so /v1/models does not list it
        raise NotReady(f"model {name} is not ready yet: the deployment is not ready (see /health)")

    def _model_objects(self, cold: str | None = None) -> list[dict[str, Any]]:
        """``cold``: the deployment's model when it is cold (listed: a request for it is held and
        served), with the last card its workers wrote, or the topology's path if none was seen."""
        created = now()
        data: list[dict[str, Any]] = []
        for name, entry in sorted(self.workers.models.items()):
            data.append({"id": name, "object": "model", "created": created, "owned_by": "vllm-actors",
                         "root": entry.card.model_path, "parent": None,
                         "max_model_len": entry.card.context_length})
        if cold is not None and cold not in self.workers.models:
            card = self.workers.last_card(cold)
            mc = self.pipeline.model_config
            data.append({"id": cold, "object": "model", "created": created, "owned_by": "vllm-actors",
                         "root": card.model_path if card else (mc.path if mc else cold), "parent": None,
                         "max_model_len": card.context_length if card else None})
        for name, lora in sorted(self.workers.loras.items()):
            base = lora.get("model") or (next(iter(self.workers.models)) if len(self.workers.models) == 1
                                         else None)
            data.append({"id": name, "object": "model", "created": created, "owned_by": "vllm-actors",
                         "root": name, "parent": base})
        return data

    async def health(self, request: web.Request) -> web.Response:
        """Readiness: 200 only while the deployment can serve (actors.frontend.readiness)."""
        ready, body = await self._health()
        return _json(body, status=200 if ready else 503, headers=None if ready else {"Retry-After": RETRY_AFTER_S})

    async def live(self, request: web.Request) -> web.Response:
        return _json({"status": "live"})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        body = self.metrics.render() if self.render_metrics is None else await self.render_metrics()
        return web.Response(body=body, headers={"Content-Type": self.metrics.content_type})

    # --- generation ---------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.pipeline.serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.pipeline.serve(request, chat=False)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self.pipeline.serve(request, chat=True, shape=MessagesShape())

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's messages.count_tokens: the prompt tokens the same /v1/messages body would send."""
        n = await self.tokenization.count_chat(count_request(await self._body(request)))
        return _json({"input_tokens": n})

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self.pipeline.serve(request, chat=True, shape=ResponsesShape(self.response_store))

    async def get_response(self, request: web.Request) -> web.Response:
        """A stored response (``store: true``), from any frontend process, until its TTL."""
        rid = request.match_info["id"]
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            raise BadRequest("stream is not supported: responses are not run in the background", param="stream")
        stored = await self.response_store.get(rid) if self.response_store is not None else None
        if stored is None:
            raise responses_not_found(rid)
        return _json(stored.response)

    async def delete_response(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        if self.response_store is None or not await self.response_store.delete(rid):
            raise responses_not_found(rid)
        return _json({"id": rid, "object": "response", "deleted": True})

    # --- tokenizer ----------------------------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        return _json(await self.tokenization.tokenize(await self._body(request)))

    async def detokenize(self, request: web.Request) -> web.Response:
        return _json(await self.tokenization.detokenize(await self._body(request)))

    async def _body(self, request: web.Request) -> bytes:
        return await read_body(request, self.config.body_timeout, self.config.max_body_bytes, self.metrics)
