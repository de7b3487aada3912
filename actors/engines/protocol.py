"""The engine protocol: what the engine actor needs from an engine, with no NATS in sight.

Two implementations: ``actors.engines.vllm_engine.VllmEngine`` (vLLM v1 AsyncLLM) and
``actors.engines.mocker.MockerEngine`` (a simulated vLLM). The same structs travel on the wire
(msgspec), so the engine actor forwards them without translation.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

import msgspec

from bus.errors import BadRequest

# encode: the vision encoder only (E/P/D); its outputs feed an agg or prefill worker's engine.
# embed: a pooling engine (vLLM's pooling runner): one embedding per prompt, no generation
Role = Literal["agg", "prefill", "decode", "encode", "embed"]
# roles whose engines publish no KV events: a decode worker's blocks are never routed to, an
# encode-only engine has no KV cache, embedding requests are routed by load (a prompt is one step)
NO_KV_EVENT_ROLES = frozenset({"decode", "encode", "embed"})
FinishReason = Literal["stop", "length", "abort", "error"]


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Constrained decoding, mapped onto vLLM's StructuredOutputsParams."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None  # JSON of an xgrammar structural tag (tool-call parsers set it)


class SamplingOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request sampling. One completion per request (the frontend fans out ``n``).

    ``stop`` strings are enforced by the frontend (it detokenizes); engines still accept them for
    text-mode callers. ``extra`` carries any other vLLM SamplingParams field verbatim.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token (0 = only the sampled)
    structured: StructuredOutput | None = None
    # with a reasoning parser: True = the grammar applies from the first token (the prompt already
    # closed the thinking), None = the engine's reasoning parser decides (vLLM's reasoning_ended)
    reasoning_ended: bool | None = None
    detokenize: bool = True
    extra: dict[str, Any] = {}


class TokenLogprob(msgspec.Struct, array_like=True):
    """Logprob of one generated token and its top alternatives [(token_id, logprob), ...]."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class EngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One step of one request: the *new* tokens since the previous output (delta semantics)."""

    token_ids: list[int] = []
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int | None = None
    cached_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None  # final output of a prefill request


# --- prompts ------------------------------------------------------------------------------------
class ImageInput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One image of a multimodal prompt, as the frontend checked it."""

    # sha256 (hex) of ``data``: vLLM's ``multi_modal_uuids`` entry, so the engine's prefix cache, its
    # KV events and the router all name the image by the same content hash
    uuid: str
    data: bytes  # the image file (PNG, JPEG, ...) as the client sent it; the engine decodes it
    # E/P/D: the encode worker's output for this image (a safetensors file, vLLM's EC connector
    # layout); the engine loads it instead of running its vision encoder
    encoder_output: bytes | None = None


class MultiModalInput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The images of a token prompt. ``token_ids`` of the request is the prompt as the engine runs
    it (each image expanded into its placeholder tokens by vLLM's processor at the frontend), so
    lengths, usage, routing and migration work on it as on any prompt; the engine itself is given
    ``source_ids`` (one placeholder per image, what vLLM's processor expands) and the images."""

    images: list[ImageInput]
    source_ids: list[int]  # the rendered prompt before expansion
    prompt_len: int  # length of the expanded prompt: token ids past it are a migrated continuation
    # (offset, length) of each image's placeholder range in the expanded prompt, as vLLM's
    # processor reports it: the KV events' ``(mm_identifier, offset)`` keys derive from these
    placeholders: list[tuple[int, int]]


class TokensPrompt(msgspec.Struct, tag="tokens"):
    token_ids: list[int]
    mm: MultiModalInput | None = None


class TextPrompt(msgspec.Struct, tag="text"):
    text: str


class EmbedsPrompt(msgspec.Struct, tag="embeds"):
    """Prompt embeddings [seq, hidden]; ``tensor`` is a torch.Tensor (never on the wire as is)."""

    tensor: Any
    num_tokens: int = 0


Prompt = TokensPrompt | TextPrompt | EmbedsPrompt


class LoraRef(msgspec.Struct, frozen=True):
    name: str
    int_id: int
    path: str


# --- facts and stats -----------------------------------------------------------------------------
class ModelFacts(msgspec.Struct, kw_only=True):
    served_model_name: str
    model_path: str
    tokenizer_path: str
    max_model_len: int
    block_size: int
    total_kv_blocks: int
    dp_size: int = 1
    hidden_size: int | None = None
    vocab_size: int | None = None
    eos_token_ids: list[int] = []
    input_modalities: list[str] = msgspec.field(default_factory=lambda: ["text"])  # besides tokens: "image"
    max_logprobs: int = 20  # top logprobs a request may ask for (vLLM's --max-logprobs; -1: vocab_size)
    # a pooling (embed) engine: the length of its embeddings, and whether (and to which lengths) a
    # request's ``dimensions`` may shorten them (Matryoshka; vLLM's ModelConfig of the same names)
    embedding_size: int | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None


class EngineStats(msgspec.Struct, kw_only=True):
    """Latest scheduler view, like vLLM's SchedulerStats (one per DP rank)."""

    dp_rank: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction 0..1
    active_kv_blocks: int = 0
    total_kv_blocks: int = 0
    prefix_queries: int = 0  # cumulative tokens queried
    prefix_hits: int = 0  # cumulative tokens hit
    step: int = 0
    ts: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class StepSample(msgspec.Struct, array_like=True):
    """One scheduler step of one DP rank, as the load-mode planner fits step time on it:
    prefill tokens -> step time, decode KV tokens -> step time. Array-like: a load report carries
    hundreds of them per second at high step rates."""

    prefill_tokens: int  # new (uncached) prompt tokens computed in the step
    decode_requests: int  # requests that decoded one token in the step
    kv_tokens: int  # KV tokens in use during the step (active blocks x block size)
    elapsed_ms: float  # the step's wall time
    dp_rank: int = 0


class KvEventSource(msgspec.Struct, kw_only=True):
    """Where one DP rank publishes its KV events (vLLM's ZMQ wire format)."""

    dp_rank: int
    endpoint: str  # tcp://127.0.0.1:PORT to SUBscribe to
    replay_endpoint: str | None
    topic: str = "kv-events"


class EngineDeadError(Exception):
    """Raised by ``check_health``/``generate`` once the engine is dead."""


class EncodeFailed(Exception):
    """An encode engine's run ended without an output for every image (aborted, or none written),
    or an embedding engine's run without an embedding (aborted)."""


class Engine(abc.ABC):
    """An inference engine. All methods are coroutine-safe on one event loop."""

    role: Role
    facts: ModelFacts

    @abc.abstractmethod
    async def start(self) -> None:
        """Build the engine; ``facts`` is valid afterwards."""

    @abc.abstractmethod
    async def shutdown(self) -> None: ...

    @abc.abstractmethod
    def generate(self, prompt: Prompt, sampling: SamplingOptions, request_id: str,
                 lora: LoraRef | None = None,
                 kv_transfer_params: dict[str, Any] | None = None,
                 trace_headers: Mapping[str, str] | None = None) -> AsyncIterator[EngineOutput]:
        """Stream delta outputs; the last one has ``finish_reason``. Raises EngineDeadError.
        ``trace_headers``: the W3C trace context of the worker's engine span when the request is
        traced; an engine that makes spans of its own (vLLM with otlp_traces_endpoint) makes them
        its children."""

    async def encode(self, mm: MultiModalInput, token_ids: list[int], request_id: str, *,
                     cached: bool = True) -> list[tuple[str, bytes]]:
        """E/P/D, role "encode": run the vision encoder on ``mm``'s images (``token_ids``: the
        expanded prompt) and return ``(image id, encoder output)`` per distinct image, in prompt
        order; ``cached=False`` runs the encoder even for images encoded recently. Raises
        EncodeFailed, EngineDeadError; an engine of another role refuses (BadRequest)."""
        raise BadRequest("this worker is not an encode worker")

    async def embed(self, token_ids: list[int], request_id: str, *, dimensions: int | None = None,
                    use_activation: bool | None = None) -> bytes:
        """Role "embed": the prompt's embedding as little-endian float32 bytes (``dimensions``: a
        Matryoshka model's shortened embedding). Raises EngineDeadError, ValueError for a request
        the engine refuses (vLLM's own checks); an engine of another role refuses (BadRequest)."""
        raise BadRequest("this worker is not an embedding worker")

    async def encode_probe(self, request_id: str) -> None:
        """Encode a small built-in image through the engine (readiness and liveness of an encode
        worker, which serves no generate requests)."""
        raise BadRequest("this worker is not an encode worker")

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    async def sleep(self, level: int = 1) -> None: ...

    @abc.abstractmethod
    async def wake_up(self) -> None: ...

    @abc.abstractmethod
    async def is_sleeping(self) -> bool: ...

    @abc.abstractmethod
    async def reset_prefix_cache(self) -> bool: ...

    @abc.abstractmethod
    async def add_lora(self, lora: LoraRef) -> bool: ...

    @abc.abstractmethod
    async def remove_lora(self, lora: LoraRef) -> bool: ...

    @abc.abstractmethod
    async def list_loras(self) -> list[int]: ...

    @abc.abstractmethod
    async def check_health(self) -> None:
        """Raise EngineDeadError if dead (passive, like vLLM's: liveness needs a real probe)."""

    @property
    @abc.abstractmethod
    def dead(self) -> asyncio.Event:
        """Set once the engine has died (the death signal)."""

    @abc.abstractmethod
    def stats(self) -> list[EngineStats]:
        """Latest stats, one per DP rank."""

    def take_steps(self) -> list[StepSample]:
        """Step samples recorded since the last call (bounded: the oldest are dropped when nobody
        takes them). An engine that cannot time its steps returns none."""
        return []

    @abc.abstractmethod
    def kv_event_sources(self) -> list[KvEventSource]:
        """ZMQ KV-event endpoints, one per DP rank (empty when events are off, e.g. decode)."""
