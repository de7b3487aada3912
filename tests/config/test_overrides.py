"""``--set key.path=value``: a value is a TOML literal (inline tables and arrays included) when it
parses as one, a bare word stays a string, and a broken table, array or quoted string is an error
that says so (not a string the schema then rejects as "expected table, got str")."""

from __future__ import annotations

import pytest

from config.loader import TopologyError, parse_override, topology_from_dict

MODEL = {"name": "m", "path": "tiny"}
POOL = {"role": "agg", "engine": "vllm", "engine_args": {"max_model_len": 1024, "dtype": "bfloat16"}}


def test_an_inline_table_replaces_a_pools_engine_args() -> None:
    t = topology_from_dict({"model": MODEL, "pools": {"agg": POOL}}, "t.toml", [
        'pools.agg.engine_args={ max_model_len = 512, structured_outputs_config = { backend = "xgrammar", '
        'disable_any_whitespace = true }, compilation_config = { cudagraph_capture_sizes = [1, 2, 4] } }'])
    assert t.pools["agg"].engine_args == {
        "max_model_len": 512,
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
        "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]}}


def test_a_nested_key_path_changes_one_engine_arg_and_keeps_the_rest() -> None:
    t = topology_from_dict({"model": MODEL, "pools": {"agg": POOL}}, "t.toml", [
        "pools.agg.engine_args.structured_outputs_config.disable_any_whitespace=true",
        "pools.agg.lora.roots=[\"/a\", \"/b\"]"])
    assert t.pools["agg"].engine_args == {"max_model_len": 1024, "dtype": "bfloat16",
                                          "structured_outputs_config": {"disable_any_whitespace": True}}
    assert t.pools["agg"].lora.roots == ["/a", "/b"]


@pytest.mark.parametrize(("text", "value"), [
    ("tiny", "tiny"), ("0.0.0.0:8080", "0.0.0.0:8080"), ("/srv/models/llama 3", "/srv/models/llama 3"),
    ("nats://a:4222,nats://b:4222", "nats://a:4222,nats://b:4222"), ("1.2.3", "1.2.3"),
])
def test_bare_words_that_are_not_toml_stay_strings(text: str, value: str) -> None:
    assert parse_override(f"k={text}") == (["k"], value)


@pytest.mark.parametrize(("text", "problem"), [
    ('{"backend": "xgrammar"}', "Expected '=' after a key in a key/value pair (at column 11)"),
    ("{a = 1,}", "Invalid initial character for a key part (at column 8)"),
    ("{ a = 1\n, b = 2 }", "Unclosed inline table (at column 8)"),
    ("[1, 2", "Unclosed array (at end of document)"),
    ('"unterminated', "Unterminated string (at end of document)"),
])
def test_a_broken_table_array_or_string_is_an_error_not_a_string(text: str, problem: str) -> None:
    with pytest.raises(TopologyError) as info:
        topology_from_dict({"model": MODEL, "pools": {"agg": POOL}}, "t.toml",
                           [f"pools.agg.engine_args.structured_outputs_config={text}"])
    assert str(info.value) == (
        f"t.toml: --set {'pools.agg.engine_args.structured_outputs_config=' + text!r}: not a TOML value "
        f"({problem}); write a table as {{ key = \"text\", n = 1, inner = {{ k = true }} }} on one line, "
        "an array as [1, 2], a string as \"text\" or a bare word")
