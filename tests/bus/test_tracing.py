"""bus.tracing: off costs nothing and makes nothing; on, the W3C context survives a NATS header
round trip and spans reach an OTLP/HTTP receiver."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from bus import tracing
from config.topology import TracingConfig
from tests.otlp_receiver import OtlpReceiver


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture
def traced(receiver: OtlpReceiver) -> Iterator[OtlpReceiver]:
    assert tracing.configure(TracingConfig(endpoint=receiver.endpoint), service="svc", namespace="ns",
                             instance="i-1")
    try:
        yield receiver
    finally:
        tracing.shutdown()  # the process's tracer is global: leave none behind for other tests


def test_off_makes_no_span_and_no_header() -> None:
    assert not tracing.configure(TracingConfig(), service="svc", namespace="ns", instance="i")
    assert not tracing.enabled()
    assert tracing.start("x") is None
    assert tracing.headers(None) is None and tracing.context_of(None) is None
    assert tracing.extract({"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}) is None
    tracing.end(None)  # a no-op, as every hook is without a span


def test_a_span_context_crosses_a_header_round_trip(traced: OtlpReceiver) -> None:
    parent = tracing.start("frontend", kind="client")
    hdrs = tracing.headers(parent)
    assert hdrs is not None and set(hdrs) == {"traceparent"}
    version, trace_id, span_id, flags = hdrs["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled (ratio 1.0); bit 2 may say "random id"
    child = tracing.start("worker", tracing.extract(hdrs), kind="server")
    assert child is not None
    tracing.end(child)
    tracing.end(parent, RuntimeError("boom"))
    tracing.shutdown()  # flushes the batch
    spans = {s.name: s for s in traced.spans}
    assert spans["worker"].trace_id == trace_id and spans["worker"].parent_id == span_id
    assert spans["frontend"].span_id == span_id and spans["frontend"].failed and spans["frontend"].service == "svc"
    assert not spans["worker"].failed


def test_a_cancellation_is_not_a_failure(traced: OtlpReceiver) -> None:
    span = tracing.start("attempt")
    tracing.end(span, GeneratorExit())
    tracing.shutdown()
    (got,) = traced.spans
    assert not got.failed and got.attributes["vllm_actors.cancelled"] is True


@pytest.mark.parametrize("value", ["", "garbage", "00-xyz-abc-01", f"00-{'0' * 32}-{'1' * 16}-01",
                                   f"00-{'1' * 32}-{'0' * 16}-01", f"ff-{'1' * 32}-{'2' * 16}-01"])
def test_a_malformed_traceparent_starts_a_new_trace(traced: OtlpReceiver, value: str) -> None:
    assert tracing.extract({"traceparent": value}) is None


def test_an_unsampled_parent_is_followed(traced: OtlpReceiver) -> None:
    trace_id = secrets.token_hex(16)
    ctx = tracing.extract({"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-00"})
    span = tracing.start("x", ctx)
    assert span is not None and not span.is_recording()
    assert not int(tracing.headers(span)["traceparent"][-2:], 16) & 1  # type: ignore[index]
