"""Wire contract of a worker (engine actor and its control endpoints).

Requests arrive as JSON (``nats req``, no headers) or msgpack (the frontend); both decode into the
same Structs. Stream chunks are ``EngineOutput`` (actors.engines.protocol) plus usage on the last.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from actors.engines.protocol import EngineOutput, KvEventSource, MultiModalInput, SamplingOptions, StepSample
from bus.errors import FatalError


class EngineDead(FatalError, wire=True):
    """The worker's engine died (vLLM EngineDeadError or an injected fault); its supervisor restarts
    it. Declared for the wire: a caller that imports this contract gets EngineDead back, not a 503."""

    code = 503
    kind = "engine_dead"


class PrefillResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the prefill worker returned; the decode worker merges its kv_transfer_params."""

    kv_transfer_params: dict[str, Any] | None = None
    prefill_instance: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


class ChatPrompt(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A chat request whose prompt the worker renders with the model's chat template (text mode:
    the frontend has no tokenizer). The fields are the OpenAI/vLLM request's own, as the frontend's
    template rendering takes them."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's chat default: the template writes the special tokens
    chat_template: str | None = None  # the request's own template (Jinja), instead of the model's
    chat_template_kwargs: dict[str, Any] | None = None
    # token ids already produced for this chat (a migrated request): appended to the rendered
    # prompt's ids, so the next worker continues exactly where the failed one stopped
    continuation: list[int] = []
    # the client gave no max_tokens, and the frontend cannot count the prompt: sampling.max_tokens
    # is only a bound, lowered to what the context leaves after the rendered prompt (vLLM's
    # default for chat)
    fit_max_tokens: bool = False


class GenerateRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One completion. Exactly one of token_ids (token mode), prompt (text mode), prompt_embeds,
    chat (text mode: the worker applies the chat template)."""

    request_id: str | None = None
    token_ids: list[int] | None = None
    prompt: str | None = None
    prompt_embeds: str | None = None  # base64 of a torch.save'd 2-D tensor [seq, hidden]
    chat: ChatPrompt | None = None
    mm: MultiModalInput | None = None  # the images of a token_ids prompt (token_ids is expanded)
    sampling: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    lora_name: str | None = None
    prefill_result: PrefillResult | None = None  # decode role
    kv_transfer_params: dict[str, Any] | None = None  # raw override (advanced)
    probe: bool = False  # a health/readiness probe: not traffic (idle sleep and idle stop ignore it)


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class DisaggregatedParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    kv_transfer_params: dict[str, Any] | None = None


class GenerateChunk(EngineOutput, kw_only=True, omit_defaults=True):
    """A stream chunk: an engine output, with usage (and disagg params) on the final one."""

    index: int = 0
    usage: Usage | None = None
    disaggregated_params: DisaggregatedParams | None = None


class ControlRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of the requests of verbs that change state: unknown fields are refused (a typo such as
    ``{"levle": 2}`` is a 400, not the defaults), and their endpoints refuse an empty payload
    (``Endpoint(allow_empty=False)``): send ``{}`` for the defaults."""


class CancelRequest(ControlRequest, kw_only=True):
    request_id: str


class SleepRequest(ControlRequest, kw_only=True, omit_defaults=True):
    level: int = 1
    mode: Literal["drain", "abort"] = "drain"
    drain_timeout: float | None = None


class WakeUpRequest(ControlRequest, kw_only=True):
    """Request of wake_up: no fields (``{}``)."""


class ClearKvBlocksRequest(ControlRequest, kw_only=True):
    """Request of clear_kv_blocks: no fields (``{}``)."""


class StatusReply(msgspec.Struct, kw_only=True):
    """Reply of sleep / wake_up / clear_kv_blocks: ``status`` is "ok" or "error"."""

    status: Literal["ok", "error"]
    message: str


class HealthReply(msgspec.Struct, kw_only=True):
    status: Literal["healthy", "sleeping", "unhealthy", "starting"]
    instance: str
    role: str
    model: str
    uptime: float
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    message: str = ""
    in_flight: int = 0  # generate requests in the engine actor
    stalled_for: float = 0.0  # seconds without any engine output while requests are in flight


class LoraSource(ControlRequest, kw_only=True):
    uri: str


class LoraLoadRequest(ControlRequest, kw_only=True):
    lora_name: str
    source: LoraSource


class LoraUnloadRequest(ControlRequest, kw_only=True):
    lora_name: str


class LoraInfo(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_id: int
    path: str
    uri: str


class EngineLoraAdd(ControlRequest, kw_only=True):
    """LoRA manager → engine actor (verb ENGINE_LORA_ADD): put an adapter into the engine."""

    lora_name: str
    lora_id: int
    path: str


class EngineLoraRemove(ControlRequest, kw_only=True):
    """LoRA manager → engine actor (verb ENGINE_LORA_REMOVE)."""

    lora_name: str


class EngineLoraList(msgspec.Struct, kw_only=True):
    """Reply of ENGINE_LORA_LIST: adapters the engine actor resolves ``lora_name`` against."""

    adapters: list[EngineLoraAdd] = []


class EncodeRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Frontend → encode worker (verb VERB_ENCODE): run the vision encoder on a prompt's images."""

    request_id: str
    token_ids: list[int]  # the expanded prompt (as GenerateRequest.token_ids)
    mm: MultiModalInput  # images without encoder outputs
    # readiness/liveness: encode the worker's own built-in image instead (token_ids and mm are not
    # read: give [] and no images); the reply has no outputs
    probe: bool = False


class EncodedImage(msgspec.Struct, kw_only=True):
    uuid: str
    encoder_output: bytes  # safetensors file of the image's encoder output (vLLM's EC layout)


class EncodeReply(msgspec.Struct, kw_only=True):
    outputs: list[EncodedImage]


class EmbedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Frontend → embedding worker (verb VERB_EMBED): one prompt's embedding. The frontend has
    tokenized and truncated the input (vLLM's rules, ``truncate_prompt_tokens``), so ``token_ids``
    is what the engine runs."""

    request_id: str
    token_ids: list[int]
    dimensions: int | None = None  # a Matryoshka model's shortened embedding (vLLM's PoolingParams)
    use_activation: bool | None = None  # None: the pooler's default (normalize, for most models)
    probe: bool = False  # a health/readiness probe: not traffic (idle sleep and idle stop ignore it)


class EmbedReply(msgspec.Struct, kw_only=True):
    """The embedding as little-endian float32 bytes (4 bytes a dimension): on the wire as msgpack
    bin, and exactly what OpenAI's ``encoding_format: base64`` encodes."""

    embedding: bytes
    prompt_tokens: int


# Control verbs of the engine actor, for ``Subjects.worker(instance, verb)``.
VERB_SLEEP = "sleep"
VERB_WAKE_UP = "wake_up"
VERB_CLEAR_KV_BLOCKS = "clear_kv_blocks"
VERB_HEALTH = "health"
VERB_CANCEL = "cancel"
VERB_STATS = "stats"
VERB_ENCODE = "encode"  # encode workers (E/P/D): EncodeRequest -> EncodeReply
VERB_EMBED = "embed"  # embedding workers (role "embed"): EmbedRequest -> EmbedReply
# Engine-side adapter endpoints used by the LoRA manager (the user-facing verbs are lora.load|unload|list).
ENGINE_LORA_ADD = "engine.lora_add"
ENGINE_LORA_REMOVE = "engine.lora_remove"
ENGINE_LORA_LIST = "engine.lora_list"
# Engine facts the KV publisher needs (ZMQ endpoints per DP rank and the engine's block size).
ENGINE_KV_SOURCES = "engine.kv_sources"
# Health monitor: its verdict (liveness probe results) for the status server.
VERB_LIVENESS = "liveness"


class EngineKvSources(msgspec.Struct, kw_only=True):
    """Reply of ENGINE_KV_SOURCES (empty ``sources`` for decode workers / events off)."""

    block_size: int
    sources: list[KvEventSource] = []


class LivenessReply(msgspec.Struct, kw_only=True):
    """The health monitor's verdict on its engine (readiness for /health)."""

    status: Literal["ok", "failing", "starting"]
    last_ok: float = 0.0  # wall-clock time of the last passing check + probe
    failures: int = 0
    message: str = ""


class LoadReport(msgspec.Struct, kw_only=True):
    """Published on ns.load.<instance> for the router and planner (msgpack)."""

    instance: str
    dp_rank: int = 0
    num_running: int
    num_waiting: int
    kv_usage: float
    active_kv_blocks: int
    total_kv_blocks: int
    prefix_hit_rate: float = 0.0
    ts: float = 0.0
    # scheduler steps of this rank since the previous report (the load-mode planner's samples)
    steps: list[StepSample] = []
    # seconds since the worker last started or ended a request (health probes not counted); None
    # while one is in flight. A waker removes the replica once this passes its pool's idle_stop
    idle_s: float | None = None


def output_to_chunk(out: EngineOutput, index: int = 0) -> GenerateChunk:
    return GenerateChunk(token_ids=out.token_ids, text=out.text, logprobs=out.logprobs,
                         finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                         num_prompt_tokens=out.num_prompt_tokens, cached_tokens=out.cached_tokens,
                         kv_transfer_params=out.kv_transfer_params, index=index)


class LoraRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Value in ns-loras, key ``<worker instance>.<lora_name>``: an adapter and where it is loaded."""

    lora_name: str
    lora_id: int
    path: str
    uri: str
    instance: str  # the worker (engine actor) instance that serves it
    model: str  # base model's served name
    pool: str = ""
    host: str = ""
