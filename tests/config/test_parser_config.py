"""``model.tool_call_parser`` / ``model.reasoning_parser`` / ``model.text_mode`` in a topology: names
checked against vLLM's own parser registries at load time, the file and key in the error, the way a
user meets it (``python -m actors.supervisor ... --check``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from config.loader import TopologyError, topology_from_dict

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "topologies" / "mocker-tools.toml"


def model(**kw: object) -> dict[str, object]:
    return {"model": {"name": "m", "path": "tiny", **kw}}


def test_known_names_load() -> None:
    t = topology_from_dict(model(tool_call_parser="llama3_json", reasoning_parser="deepseek_r1"))
    assert t.model is not None and (t.model.tool_call_parser, t.model.reasoning_parser) == ("llama3_json", "deepseek_r1")


@pytest.mark.parametrize(("key", "value", "words"), [
    ("tool_call_parser", "hermess", "unknown tool-call parser 'hermess' (vLLM's are: "),
    ("reasoning_parser", "deepseek", "unknown reasoning parser 'deepseek' (vLLM's are: "),
])
def test_unknown_parser_names_the_key_and_the_choices(key: str, value: str, words: str) -> None:
    with pytest.raises(TopologyError) as ei:
        topology_from_dict(model(**{key: value}), file="t.toml")
    msg = str(ei.value)
    assert msg.startswith(f"t.toml: model.{key}: {words}")
    assert "hermes" in msg or "deepseek_r1" in msg  # the real names are listed


def test_text_mode_refuses_parsers() -> None:
    with pytest.raises(TopologyError, match="model.tool_call_parser: parsers read the model's token ids"):
        topology_from_dict(model(text_mode=True, tool_call_parser="hermes"))
    with pytest.raises(TopologyError, match="model.reasoning_parser: "):
        topology_from_dict(model(text_mode=True, reasoning_parser="qwen3"))


def test_cli_check_refuses_an_unknown_parser_with_file_and_key() -> None:
    r = subprocess.run([sys.executable, "-m", "actors.supervisor", str(TOOLS), "--check",
                        "--set", "model.tool_call_parser=nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout
    # the last line: importing vLLM's parser registry may log its platform notes (Triton) first
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {TOOLS}: model.tool_call_parser: unknown tool-call parser 'nope' "), r.stderr
    assert last.endswith("(set by --set)") and r.stdout == ""
    ok = subprocess.run([sys.executable, "-m", "actors.supervisor", str(TOOLS), "--check"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
