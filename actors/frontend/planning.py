"""Planning one request: from a validated OpenAI request to what its flows need — the model it
names, its prompts as token ids (chat template, tokenizer), max_tokens from the context left, and
the model card's limits. No HTTP, no workers here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from actors.engines.protocol import MultiModalInput, SamplingOptions
from actors.worker.contract import ChatPrompt
from bus.errors import BadRequest, NotFound, Overloaded

from .discovery import ModelEntry, WorkerSet
from .limits import card_limits, check_fan_out, check_prompt, check_sampling
from .media import LoadedImage
from .mm_processor import MmProcessor
from .openai_io import OutputOptions, new_id, requested_max_tokens, to_sampling
from .output_parsing import ModelParsers, RequestParsing
from .preprocess import Preprocessor, tool_dicts
from .prompt_embeds import ClientEmbeds, client_embeds


@dataclass
class Plan:
    chat: bool
    model: str  # as the client named it
    entry: ModelEntry
    lora: str | None
    pre: Preprocessor | None
    prompts: list[tuple[list[int] | None, str | None]]  # (token ids, text) per prompt
    n: int
    sampling: list[SamplingOptions]  # per prompt (max_tokens depends on the prompt length)
    out: OutputOptions
    stream: bool
    include_usage: bool
    request_id: str
    echo_texts: list[str] = field(default_factory=list)
    parsing: RequestParsing | None = None  # tool calls / reasoning in a chat output (output_parsing)
    embeds: list[ClientEmbeds | None] = field(default_factory=list)  # per prompt: its prompt_embeds
    chat_prompt: ChatPrompt | None = None  # text mode: the chat the worker renders (plan_worker_chat)
    mm: MultiModalInput | None = None  # a chat's images (its one prompt is the expanded token ids)

    def prompt_embeds(self, p: int) -> str | None:
        """Prompt ``p``'s embeddings (base64, as the client sent them), or None."""
        e = self.embeds[p] if p < len(self.embeds) else None
        return e.data if e is not None else None


class NotReady(Overloaded):
    """The model is part of this deployment but cannot be served right now (starting, restarting,
    asleep): 503 with Retry-After, never a 404."""


def resolve(workers: WorkerSet, name: str | None, expected: frozenset[str] = frozenset()
            ) -> tuple[ModelEntry, str | None, str]:
    """``expected``: models this deployment serves (the topology's), which answer 503 while no
    worker can serve them instead of 404."""
    if not name:
        if len(workers.models) == 1:
            entry = next(iter(workers.models.values()))
            return entry, None, entry.name
        if not workers.models and expected:
            raise NotReady(f"model {', '.join(sorted(expected))} is not ready yet: no worker can serve it now")
        raise BadRequest("model is required")
    found = workers.resolve_model(name)
    if found is None:
        if name in expected or workers.known_model(name):
            raise NotReady(f"model {name} is not ready yet: no worker can serve it now (see /health)")
        raise NotFound(f"The model `{name}` does not exist.", param="model")
    return found[0], found[1], name


def _max_tokens(requested: int | None, prompt_len: int, ctx: int) -> int:
    left = ctx - prompt_len
    if left <= 0:
        raise BadRequest(f"This model's maximum context length is {ctx} tokens. However, your "
                         f"prompt has {prompt_len} tokens.")
    if requested is None:
        return left
    if requested > left:
        raise BadRequest(f"This model's maximum context length is {ctx} tokens. However, you requested "
                         f"{requested + prompt_len} tokens ({prompt_len} in the messages, {requested} in "
                         f"the completion). Please reduce the length of the messages or completion.")
    return requested


def plan_request(req: ChatCompletionRequest | CompletionRequest, entry: ModelEntry, lora: str | None,
                 name: str, pre: Preprocessor | None, body: bytes = b"",
                 parsers: ModelParsers | None = None, images: list[LoadedImage] | None = None,
                 messages: list[dict[str, Any]] | None = None, mm_proc: MmProcessor | None = None) -> Plan:
    """``parsers``: the model's tool-call/reasoning parsers (chat only; none: plain content).
    ``images``: a chat's loaded images, with ``messages`` (its messages, each image part replaced by
    ``{"type": "image"}``, as actors.frontend.media returns them) and the model's processor."""
    chat = isinstance(req, ChatCompletionRequest)
    card = entry.card
    if card.role == "embed":
        check_generates(entry, chat)
    ctx = card.context_length
    limits = card_limits(card)
    n = req.n if req.n is not None else 1
    prompts: list[tuple[list[int] | None, str | None]] = []
    embeds: list[ClientEmbeds | None] = []
    parsing: RequestParsing | None = None
    mm: MultiModalInput | None = None
    if chat:
        check_fan_out(n, 1)
        if pre is None:
            return plan_worker_chat(req, entry, lora, name, body)
        if parsers is not None:
            parsing = parsers.for_request(req)
            if parsing is not None:
                # before the sampling options are built: it may constrain decoding to the tools
                req = parsing.adjust(req)
        tools = tool_dicts(req.tools)  # as vLLM hands them to the template (nulls kept)
        text = pre.render_chat(messages if messages is not None else list(req.messages),
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               chat_template=req.chat_template, template_kwargs=req.chat_template_kwargs,
                               tools=tools)
        ids = pre.encode(text, req.add_special_tokens)
        if images:
            assert mm_proc is not None  # the pipeline gave one, after check_takes_images
            expanded = mm_proc.expand(ids, images)
            ids, mm = expanded.token_ids, expanded.mm
        prompts.append((ids, None))
    else:
        embeds += client_embeds(req, entry)  # embeddings prompts come first, as in vLLM
        prompts += [(None, None)] * len(embeds)
        p = req.prompt
        if embeds and (p == "" or p == []):
            p = None  # the openai client needs a prompt: "" beside prompt_embeds is none (vLLM's docs)
        items: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p or [])
        if not items and not embeds:
            raise BadRequest("prompt must not be empty")
        check_fan_out(n, len(embeds) + len(items))
        for item in items:
            if isinstance(item, str):
                if pre is None:
                    prompts.append((None, item))  # text mode: the worker tokenizes
                else:
                    prompts.append((pre.encode(item, req.add_special_tokens), None))
            else:
                if not item:
                    raise BadRequest("prompt must not be empty")
                given = list(item)
                check_prompt(given, limits, chat)  # before anything decodes, hashes or sends them
                prompts.append((given, None))
    requested = requested_max_tokens(req, body)
    samplings: list[SamplingOptions] = []
    out: OutputOptions | None = None
    embeds += [None] * (len(prompts) - len(embeds))
    for (ids, _text), emb in zip(prompts, embeds, strict=True):
        plen = len(ids) if ids is not None else emb.rows if emb is not None else 0
        known = ids is not None or emb is not None  # the prompt's length (text mode: the worker's)
        mt = _max_tokens(requested, plen, ctx) if known else (requested or 16)
        # the worker detokenizes (and enforces stop strings) exactly when this frontend has no
        # tokenizer: text, token-id and embeddings prompts alike
        so, out = to_sampling(req, mt, text_mode=pre is None)
        if pre is None:
            check_text_mode_output(entry.name, out)
        if parsing is not None and ids is not None:
            so.reasoning_ended = parsing.reasoning_ended(ids)
        check_sampling(so, out.stop, n, limits, chat)
        samplings.append(so)
    assert out is not None
    stream = bool(req.stream)
    include_usage = bool(stream and req.stream_options and req.stream_options.include_usage)
    echo_texts: list[str] = []
    if out.echo:
        for ids, text in prompts:
            echo_texts.append(text if text is not None else (pre.decode(ids, False) if pre and ids else ""))
    return Plan(chat=chat, model=name, entry=entry, lora=lora, pre=pre, prompts=prompts, n=n,
                sampling=samplings, out=out, stream=stream, include_usage=include_usage,
                request_id=new_id("chatcmpl" if chat else "cmpl"), echo_texts=echo_texts, parsing=parsing,
                embeds=embeds, mm=mm)


def plan_worker_chat(req: ChatCompletionRequest, entry: ModelEntry, lora: str | None, name: str,
                     body: bytes = b"") -> Plan:
    """A chat in text mode (model.text_mode, or no tokenizer loadable here): the worker applies the
    chat template, counts the prompt (usage, the context check) and detokenizes. Tool calls are
    refused: turning the output into ``tool_calls`` (and forcing them) is the frontend's work over
    the model's tokenizer, which text mode keeps away from it; ``tool_choice: "none"`` is served, its
    tools reach the worker's template as vLLM's server passes them."""
    if entry.card.role == "embed":
        check_generates(entry, True)
    if req.tools and req.tool_choice != "none":
        raise BadRequest(f"model {entry.name} runs in text mode: tool calls are not parsed (tool_choice "
                         f"must be \"none\", which still gives the tools to the chat template)",
                         param="tool_choice")
    n = req.n if req.n is not None else 1
    requested = requested_max_tokens(req, body)
    chat = ChatPrompt(messages=list(req.messages),
                      tools=tool_dicts(req.tools),  # as token mode renders them
                      add_generation_prompt=req.add_generation_prompt,
                      continue_final_message=req.continue_final_message,
                      add_special_tokens=req.add_special_tokens, chat_template=req.chat_template,
                      chat_template_kwargs=req.chat_template_kwargs, fit_max_tokens=requested is None)
    # the prompt's length is the worker's to count: without a client limit, max_tokens is the whole
    # context, which the worker lowers to what the prompt leaves (fit_max_tokens)
    so, out = to_sampling(req, requested if requested is not None else entry.card.context_length, text_mode=True)
    check_text_mode_output(entry.name, out)
    check_sampling(so, out.stop, n, card_limits(entry.card), True)
    stream = bool(req.stream)
    return Plan(chat=True, model=name, entry=entry, lora=lora, pre=None, prompts=[(None, None)], n=n,
                sampling=[so], out=out, stream=stream,
                include_usage=bool(stream and req.stream_options and req.stream_options.include_usage),
                request_id=new_id("chatcmpl"), chat_prompt=chat)


def check_generates(entry: ModelEntry, chat: bool) -> None:
    """An embedding model (its card's role is "embed") generates nothing: a chat or completion for
    it is the client's mistake, a 400 in vllm serve's words, not a 503 for want of a worker."""
    if entry.embeds:
        api = "Chat Completions API" if chat else "Completions API"
        raise BadRequest(f"The model does not support {api} (model {entry.name} is an embedding model: "
                         "use /v1/embeddings)", param="model")


def check_takes_images(entry: ModelEntry, pre: Preprocessor | None) -> None:
    """Images need a model that takes them (its card says so) and this frontend's tokenizer (the
    processor expands the rendered prompt's ids; text mode has none)."""
    if "image" not in entry.card.input_modalities:
        raise BadRequest(f"model {entry.name} does not take images (it is a text-only model)", param="messages")
    if pre is None:
        raise BadRequest(f"model {entry.name} runs in text mode: images need the frontend's tokenizer "
                         "(unset model.text_mode)", param="messages")


def check_text_mode_output(model: str, out: OutputOptions) -> None:
    """What text mode cannot give: logprobs name their tokens' text, which needs the tokenizer this
    frontend does not hold (a 400 rather than an answer silently without them)."""
    if out.logprobs is not None:
        raise BadRequest(f"model {model} runs in text mode: logprobs are not returned (they need the "
                         "model's tokenizer at the frontend)", param="logprobs")
