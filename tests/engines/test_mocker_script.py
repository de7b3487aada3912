"""The mocker's tokenizer and scripted replies: exact tokens one per step, then EOS; max_tokens cuts;
text prompts; a migrated request goes on; the args' validation; topologies/mocker-tools.toml."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from actors.engines.mocker.engine import MockerEngine
from actors.engines.mocker.text_codec import IncrementalDetokenizer, TextCodec
from actors.engines.mocker.tokens import predict_output
from actors.engines.protocol import EngineOutput, SamplingOptions, TextPrompt, TokensPrompt
from actors.models.tiny import ensure_tiny_model
from actors.worker.engine_factory import build_engine
from config.loader import load_topology

ROOT = Path(__file__).resolve().parents[2]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK = "<think>some reasoning</think>The answer."
SCRIPT = [{"when": "weather", "text": CALL}, {"when": "think", "text": THINK},
          {"when": "", "text": "plain words, é€ included"}]
EOS = 1  # the tiny model's <|end_of_text|>


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def codec(tiny_dir: str) -> TextCodec:
    return TextCodec(tiny_dir)


def args(tiny_dir: str, **kw: Any) -> dict[str, Any]:
    # speedup 1000: every step sleeps (briefly), so a waiting consumer takes each token on its own
    return {"speedup_ratio": 1000, "block_size": 4, "num_gpu_blocks": 512, "max_model_len": 1024,
            "vocab_size": 2048, "eos_token_id": EOS, "tokenizer": tiny_dir, "script": SCRIPT, **kw}


@pytest.fixture
async def engine(tiny_dir: str) -> AsyncIterator[MockerEngine]:
    e = MockerEngine(args(tiny_dir))
    await e.start()
    yield e
    await e.shutdown()


async def run(e: MockerEngine, prompt: Any, rid: str, **kw: Any) -> list[EngineOutput]:
    return [o async for o in e.generate(prompt, SamplingOptions(**kw), rid)]


def ids_of(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def chat(codec: TextCodec, user: str) -> TokensPrompt:
    return TokensPrompt(codec.encode(f"<|begin_of_text|><|im_start|>user\n{user}<|im_end|>\n"
                                     "<|im_start|>assistant\n", add_special_tokens=False))


async def test_reply_is_the_scripts_tokens_one_per_step_then_eos(engine: MockerEngine, codec: TextCodec) -> None:
    outs = await run(engine, chat(codec, "What is the weather in Paris?"), "w", max_tokens=200)
    reply = codec.encode(CALL, add_special_tokens=False)
    assert ids_of(outs) == reply + [EOS]
    assert [len(o.token_ids) for o in outs] == [1] * (len(reply) + 1)  # streamed, not in one piece
    assert outs[-1].finish_reason == "stop" and all(o.finish_reason is None for o in outs[:-1])
    assert "".join(o.text or "" for o in outs) == CALL  # the tags are ordinary tokens: kept
    assert codec.decode(ids_of(outs), skip_special_tokens=True) == CALL
    # the frontend's way: token ids only
    quiet = await run(engine, chat(codec, "weather?"), "q", max_tokens=200, detokenize=False)
    assert ids_of(quiet) == reply + [EOS] and all(o.text is None for o in quiet)


async def test_first_matching_entry_wins_and_no_match_is_pseudo_tokens(tiny_dir: str, codec: TextCodec) -> None:
    e = MockerEngine(args(tiny_dir, script=SCRIPT[:2]))  # no catch-all
    await e.start()
    try:
        both = await run(e, chat(codec, "think about the weather"), "b", max_tokens=200)
        assert codec.decode(ids_of(both), skip_special_tokens=True) == CALL  # "weather" is listed first
        think = await run(e, chat(codec, "think first"), "t", max_tokens=200)
        assert "".join(o.text or "" for o in think) == THINK
        prompt = chat(codec, "hello")
        other = await run(e, prompt, "o", max_tokens=6)
        assert ids_of(other) == predict_output(prompt.token_ids, 6, 2048, eos_token_id=EOS)
    finally:
        await e.shutdown()
    catch_all = MockerEngine(args(tiny_dir))
    await catch_all.start()
    try:
        outs = await run(catch_all, chat(codec, "hello"), "c", max_tokens=200)
        # é€ are byte-level pieces across tokens: the text comes out whole, never a U+FFFD
        assert "".join(o.text or "" for o in outs) == SCRIPT[2]["text"]
    finally:
        await catch_all.shutdown()


async def test_max_tokens_cuts_and_eos_is_not_optional(engine: MockerEngine, codec: TextCodec) -> None:
    reply = codec.encode(THINK, add_special_tokens=False)
    cut = await run(engine, chat(codec, "think"), "a", max_tokens=3)
    assert ids_of(cut) == reply[:3] and cut[-1].finish_reason == "length"
    exact = await run(engine, chat(codec, "think"), "b", max_tokens=len(reply))
    assert ids_of(exact) == reply and exact[-1].finish_reason == "length"  # EOS would be one more
    # the script is the whole output: ignore_eos and min_tokens do not extend it
    forced = await run(engine, chat(codec, "think"), "c", max_tokens=200, ignore_eos=True, min_tokens=100)
    assert ids_of(forced) == reply + [EOS] and forced[-1].finish_reason == "stop"


async def test_text_prompt_matches_its_text_and_gets_text(engine: MockerEngine, codec: TextCodec) -> None:
    text = "Let me think."
    outs = await run(engine, TextPrompt(text), "t", max_tokens=200)
    assert "".join(o.text or "" for o in outs) == THINK
    assert outs[-1].num_prompt_tokens == len(codec.encode(text, add_special_tokens=True))


async def test_migrated_request_continues_the_reply(engine: MockerEngine, codec: TextCodec) -> None:
    prompt = chat(codec, "weather?")
    reply = codec.encode(CALL, add_special_tokens=False)
    # a migration resends the prompt with the tokens already streamed, asking for the rest
    resumed = await run(engine, TokensPrompt(prompt.token_ids + reply[:5]), "r", max_tokens=200)
    assert ids_of(resumed) == reply[5:] + [EOS]
    done = await run(engine, TokensPrompt(prompt.token_ids + reply), "d", max_tokens=200)
    assert ids_of(done) == [EOS]


async def test_prefix_cache_is_unchanged_by_scripts(engine: MockerEngine, codec: TextCodec) -> None:
    prompt = chat(codec, "think")
    first = await run(engine, prompt, "1", max_tokens=200)
    second = await run(engine, prompt, "2", max_tokens=200)
    assert first[-1].cached_tokens == 0
    assert second[-1].cached_tokens == (len(prompt.token_ids) - 1) // 4 * 4


def test_incremental_detokenizer_holds_partial_characters(codec: TextCodec) -> None:
    ids = codec.encode("aé€b", add_special_tokens=False)
    assert len(ids) > 4  # é and € are split over byte tokens
    detok = IncrementalDetokenizer(codec)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == "aé€b" and not any("\ufffd" in p for p in pieces)
    # bytes that never form a character (pseudo-tokens can draw them) are let through, not held forever
    lone = codec.encode("é", add_special_tokens=False)[-1]  # a continuation byte on its own
    stuck = IncrementalDetokenizer(codec)
    assert "".join(stuck.push([lone]) for _ in range(8))


@pytest.mark.parametrize(("bad", "message"), [
    ({"script": "weather"}, "script must be a list"),
    ({"script": ["weather"]}, r"script\[0\] must be a table"),
    ({"script": [{"when": "a", "text": "b", "then": "c"}]}, r"script\[0\]: unknown key 'then'"),
    ({"script": [{"when": "a"}]}, r"script\[0\]\.text is required"),
    ({"script": [{"text": "ok"}, {"when": 3, "text": "b"}]}, r"script\[1\]\.when must be a string"),
    ({"script": [{"text": ["b"]}]}, r"script\[0\]\.text must be a string"),
    ({"tokenizer": None}, "script needs a tokenizer"),
    ({"tokenizer": 7}, "tokenizer must be a path"),
    ({"tokenizer": "/nonexistent/tok"}, "tokenizer: cannot load"),
    ({"vocab_size": 100, "eos_token_id": 1}, r"script\[0\]\.text encodes to token id \d+, outside vocab_size 100"),
])
def test_bad_args_name_the_key(tiny_dir: str, bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MockerEngine(args(tiny_dir, **bad))


async def test_tokenizer_alone_makes_text_real(tiny_dir: str, codec: TextCodec) -> None:
    e = MockerEngine({**args(tiny_dir), "script": []})
    await e.start()
    try:
        outs = await run(e, TextPrompt("hello world"), "t", max_tokens=8, ignore_eos=True)
        prompt = codec.encode("hello world", add_special_tokens=True)
        assert ids_of(outs) == predict_output(prompt, 8, 2048, eos_token_id=EOS, ignore_eos=True)
        assert "".join(o.text or "" for o in outs) == codec.decode(ids_of(outs), skip_special_tokens=True)
    finally:
        await e.shutdown()


# --- topologies/mocker-tools.toml ---------------------------------------------------------------
TOPOLOGY = ROOT / "topologies" / "mocker-tools.toml"
WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
SEARCH_TOOL = [{"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
# what the topology documents: (tools, user message, reasoning, content, tool calls as (name, args))
CASES = [
    (WEATHER_TOOL, "What is the weather in Paris?", None, None, [("get_weather", {"city": "Paris"})]),
    (WEATHER_TOOL, "Weather in two cities, please", None, None,
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})]),
    (None, "think it over", "some reasoning", "The answer.", []),
    (WEATHER_TOOL, "think and call", "The user wants the weather, so I call the tool.", None,
     [("get_weather", {"city": "Paris"})]),
    (SEARCH_TOOL, "Say hello", None, "Hello! How can I help you today?", []),
]


async def test_mocker_tools_topology_replies_parse_as_documented(codec: TextCodec) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    t = load_topology(TOPOLOGY)
    engine = build_engine(t.pools["agg"], t.model)  # the worker's own way: the model's tokenizer added
    assert isinstance(engine, MockerEngine) and engine.args.tokenizer == str(ensure_tiny_model())
    assert build_engine(load_topology(ROOT / "topologies" / "mocker-agg.toml").pools["agg"],
                        t.model).args.tokenizer is None  # no script: the mocker stays tokenizer-free
    hf = transformers.AutoTokenizer.from_pretrained(engine.args.tokenizer)
    parser_cls = ParserManager.get_parser(tool_parser_name=t.model.tool_call_parser,
                                          reasoning_parser_name=t.model.reasoning_parser,
                                          enable_auto_tools=True, tokenizer=hf)
    await engine.start()
    try:
        for i, (tools, user, reasoning, content, calls) in enumerate(CASES):
            messages = [{"role": "user", "content": user}]
            prompt = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            outs = await run(engine, TokensPrompt(codec.encode(prompt, add_special_tokens=False)), f"c{i}",
                             max_tokens=500, detokenize=False)
            assert outs[-1].finish_reason == "stop"
            text = hf.decode(ids_of(outs), skip_special_tokens=True)
            req = ChatCompletionRequest(model="tiny", messages=messages, tools=tools,
                                        tool_choice="auto" if tools else None)
            got = parser_cls(hf, req.tools).parse(text, req, enable_auto_tools=True)
            assert (got[0], got[1]) == (reasoning, content), user
            assert [(c.name, json.loads(c.arguments)) for c in got[2] or []] == calls, user
        # an agent's second turn: the tool's result is in the prompt
        turn2 = [{"role": "user", "content": "What is the weather in Paris?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "a", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                 {"role": "tool", "tool_call_id": "a", "content": "sunny"}]
        prompt = hf.apply_chat_template(turn2, tools=WEATHER_TOOL, add_generation_prompt=True, tokenize=False)
        outs = await run(engine, TextPrompt(prompt), "turn2", max_tokens=500)
        assert "".join(o.text or "" for o in outs).endswith("It is sunny in Paris and raining in London.")
    finally:
        await engine.shutdown()
