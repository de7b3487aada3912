"""``topologies/agg.toml``'s greedy answer, shared by the session's disaggregated vLLM tests.

Every disaggregated vLLM test (one host, several hosts) checks that its decode engine, continuing
from KV it pulled, writes exactly what the aggregated deployment writes. The answer is the same on
every deployment of agg.toml on this machine (same tiny weights, temperature 0), so it is computed
once per session: the first agg.toml deployment a test boots records it (``record``), and a test
that needs it before any did (a ``-k`` selection) gets an agg.toml deployment booted for it alone
and stopped before it returns (``get``), so two vLLM deployments never run at once for it.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

PROMPT = "Write a short poem about a lighthouse on a stormy night."
TOKENS = 16
BOOT_TIMEOUT = 300.0  # an engine start on a shared 2-core machine; nothing asserts on speed


def request() -> dict[str, object]:
    """The chat body of the reference: greedy, exactly TOKENS tokens."""
    return {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS,
            "temperature": 0, "extra_body": {"ignore_eos": True}}


class AggReference:
    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self.answer: str | None = None

    def record(self, answer: str) -> None:
        """What an agg.toml deployment answered to ``request()``; one answer per session."""
        assert answer, "an empty reference would make every comparison with it meaningless"
        assert self.answer in (None, answer), (self.answer, answer)  # greedy: the same every time
        self.answer = answer

    def get(self) -> str:
        if self.answer is None:
            from tests.e2e.conftest import boot, shutdown

            d = boot(self._tmp, "aggref", "agg.toml", ready={"agg": 1}, timeout=BOOT_TIMEOUT)
            try:
                c = OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=120)
                self.record(c.chat.completions.create(**request()).choices[0].message.content or "")  # type: ignore[call-overload]
            finally:
                shutdown(d)
        assert self.answer is not None
        return self.answer
