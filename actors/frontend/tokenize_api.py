"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's request and response shapes (its own
pydantic protocol models), answered by the frontend's ``Preprocessor``: the same chat template
rendering and tokenizer a chat or completion request goes through, so the ids returned are the ids
such a request sends to a worker. No HTTP here: ``app`` reads the body and writes the answer.
"""

from __future__ import annotations

from typing import Any

import msgspec
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

from actors.engines.limits import LimitError, Limits, check_prompt_ids
from bus.errors import BadRequest

from .discovery import ModelEntry, WorkerSet
from .openai_io import check_request_template, validate_json
from .planning import resolve
from .preprocess import ModelPreprocessors, Preprocessor, tool_dicts


class _Form(msgspec.Struct):
    """Only whether a body has ``messages``: which of vLLM's two tokenize requests it is."""

    messages: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_form_decoder = msgspec.json.Decoder(_Form)


def parse_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The chat form when the body has ``messages``, else the prompt form. vLLM lets pydantic pick
    from the union; naming the form by its one required field gives the client that form's errors
    (``prompt: Field required`` for a body with neither) rather than both forms' at once."""
    try:
        chat = _form_decoder.decode(body).messages is not msgspec.UNSET
    except (msgspec.DecodeError, msgspec.ValidationError):
        chat = False  # not a JSON object: pydantic words the error below
    return validate_json(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)


class Tokenization:
    """The two endpoints, for the models this frontend serves (base models and their adapters)."""

    def __init__(self, workers: WorkerSet, preprocessors: ModelPreprocessors, expected: frozenset[str],
                 trust_request_chat_template: bool = False) -> None:
        self.trust_request_chat_template = trust_request_chat_template
        self.workers = workers
        self.preprocessors = preprocessors
        self.expected = expected  # the topology's models: 503 while not servable, as for chat

    async def tokenize(self, body: bytes) -> dict[str, Any]:
        req = parse_tokenize(body)
        if isinstance(req, TokenizeChatRequest):
            check_request_template(req.chat_template, self.trust_request_chat_template)
        entry, pre = await self._model(req.model)
        if isinstance(req, TokenizeChatRequest):
            # what planning does for a chat request with these fields
            text = pre.render_chat(list(req.messages), add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message,
                                   chat_template=req.chat_template, template_kwargs=req.chat_template_kwargs,
                                   tools=tool_dicts(req.tools))
        else:
            text = req.prompt
        ids = pre.encode(text, req.add_special_tokens)
        # vLLM's token_strs are the vocabulary's spellings ("Ġword"), not decoded text
        strs = pre.hf.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=entry.card.context_length, tokens=ids,
                                token_strs=strs).model_dump()

    async def count_chat(self, req: ChatCompletionRequest) -> int:
        """The prompt tokens of a chat request, rendered as planning renders it (images count as
        their placeholder tokens: they are expanded only when the request is planned)."""
        check_request_template(req.chat_template, self.trust_request_chat_template)
        _entry, pre = await self._model(req.model)
        text = pre.render_chat(list(req.messages), add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                               template_kwargs=req.chat_template_kwargs, tools=tool_dicts(req.tools))
        return len(pre.encode(text, req.add_special_tokens))

    async def detokenize(self, body: bytes) -> dict[str, Any]:
        req: DetokenizeRequest = validate_json(DetokenizeRequest, body)
        entry, pre = await self._model(req.model)
        # vLLM's /detokenize drops unknown ids silently; here they are a 400, with the bound vLLM's
        # renderer puts on prompt ids: known to the tokenizer or to the model (a model's embedding
        # table is often padded past the tokenizer's last id)
        bound = max(pre.max_token_id + 1, entry.card.vocab_size or 0)
        try:
            check_prompt_ids(req.tokens, Limits(vocab_size=bound), param="tokens")
        except LimitError as e:
            raise BadRequest(str(e), param=e.param) from None
        # special tokens kept, as vLLM's detokenize does (the tokenizer's decode default)
        return DetokenizeResponse(prompt=pre.decode(req.tokens, skip_special_tokens=False)).model_dump()

    async def _model(self, name: str | None) -> tuple[ModelEntry, Preprocessor]:
        """The named model's entry and tokenizer; the same 404/503 rules as a chat request."""
        entry, _lora, _name = resolve(self.workers, name, self.expected)
        pre = await self.preprocessors.get(entry)
        if pre is None:  # model.text_mode, or no tokenizer loadable here (preprocess)
            raise BadRequest(f"model {entry.name} runs in text mode (its workers tokenize): this frontend has "
                             "no tokenizer for /tokenize and /detokenize (model.text_mode, model.tokenizer)",
                             param="model")
        return entry, pre
