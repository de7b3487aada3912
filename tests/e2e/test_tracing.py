"""OpenTelemetry traces across the bus, as an operator sees them in a collector: a disaggregated
mocker deployment started with the CLI and ``tracing.endpoint`` pointed at an OTLP/HTTP receiver
(tests/otlp_receiver.py decodes every export with opentelemetry-proto), driven with the official
openai client.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest
from openai import OpenAI

from tests.e2e.conftest import Deployment, boot, shutdown
from tests.otlp_receiver import OtlpReceiver, Span

# every decode engine incarnation dies once it has generated this many tokens (the mocker's fault
# injection): a long enough request is migrated mid-stream (its worker's supervisor restarts the engine)
DIE_AFTER = 200
PROMPT = [{"role": "user", "content": "Tell me a long story about the sea and a lighthouse keeper."}]

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def disagg(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Deployment]:
    d = boot(tmp_path_factory, "tracing", "mocker-disagg.toml", ready={"prefill": 1, "decode": 2},
             sets=[f"tracing.endpoint={receiver.endpoint}",
                   f"pools.decode.engine_args.die_after_tokens={DIE_AFTER}",
                   "pools.decode.supervisor.backoff.initial=0.1"])
    yield d
    shutdown(d)


def client(d: Deployment, traceparent: str | None = None) -> OpenAI:
    headers = {"traceparent": traceparent} if traceparent else None
    return OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=60, default_headers=headers)


def client_parent(sampled: bool = True) -> tuple[str, str, str]:
    """A client's own trace context: (trace id, span id, traceparent)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def whole(receiver: OtlpReceiver, trace_id: str, http: str, workers: int) -> list[Span]:
    """The trace once every process has exported its part: each process exports its own batches,
    and a span ends after its children (the HTTP span after the frontend's others, worker.generate
    after engine.generate), so the HTTP span and ``workers`` worker spans mean all is in."""
    def done(_spans: list[Span]) -> list[Span] | None:
        spans = receiver.trace(trace_id)
        names = [s.name for s in spans]
        return spans if http in names and names.count("worker.generate") >= workers else None

    return receiver.wait_for(done, 15, f"the whole trace {trace_id}")


def one(spans: list[Span], name: str, **where: object) -> Span:
    found = [s for s in spans if s.name == name and all(s.attributes.get(k) == v for k, v in where.items())]
    assert len(found) == 1, (name, where, [(s.name, s.attributes) for s in spans])
    return found[0]


def children(spans: list[Span], parent: Span, name: str | None = None) -> list[Span]:
    return sorted((s for s in spans if s.parent_id == parent.span_id and (name is None or s.name == name)),
                  key=lambda s: s.start_ns)


def check_hop(spans: list[Span], attempt: Span, pool: str) -> Span:
    """An attempt's route decision and the worker's side of it: route and worker.generate are the
    attempt's children, engine.generate the worker span's; each names the pool's worker that served."""
    (route,) = children(spans, attempt, "route")
    worker_id = route.attributes["vllm_actors.worker_id"]
    assert route.attributes["vllm_actors.pool"] == pool, route.attributes
    assert route.attributes["vllm_actors.router"] == "kv", route.attributes
    assert attempt.attributes["vllm_actors.worker_id"] == worker_id
    (worker,) = children(spans, attempt, "worker.generate")
    assert worker.service == "vllm-actors-worker" and attempt.service == "vllm-actors-frontend"
    assert worker.attributes["vllm_actors.worker_id"] == worker_id
    assert worker.attributes["vllm_actors.pool"] == pool
    (engine,) = children(spans, worker, "engine.generate")
    assert engine.service == "vllm-actors-worker"
    return engine


def test_a_disaggregated_chat_is_one_trace_under_the_clients_span(disagg: Deployment,
                                                                   receiver: OtlpReceiver) -> None:
    trace_id, parent_id, traceparent = client_parent()
    reply = client(disagg, traceparent).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=4)
    assert reply.choices[0].message.content is not None

    spans = whole(receiver, trace_id, "POST /v1/chat/completions", workers=2)
    http = one(spans, "POST /v1/chat/completions")
    # the client's traceparent is the root: our first span is its child, in its trace
    assert http.parent_id == parent_id and http.service == "vllm-actors-frontend"
    assert http.attributes["http.response.status_code"] == 200
    assert http.attributes["gen_ai.request.model"] == "tiny"
    assert [s.name for s in children(spans, http)] == ["plan", "prefill", "decode"]
    prefill, decode = children(spans, http, "prefill")[0], children(spans, http, "decode")[0]
    assert prefill.attributes["vllm_actors.attempt"] == 1 and decode.attributes["vllm_actors.attempt"] == 1
    assert not any(s.failed for s in spans), [(s.name, s.attributes) for s in spans if s.failed]
    prefill_engine = check_hop(spans, prefill, "prefill")
    decode_engine = check_hop(spans, decode, "decode")
    assert decode_engine.attributes["gen_ai.usage.output_tokens"] == 4
    assert prefill_engine.attributes["gen_ai.usage.input_tokens"] > 0
    # every span of the trace hangs under the client's span: no orphan, no second root
    ids = {s.span_id for s in spans} | {parent_id}
    assert all(s.parent_id in ids for s in spans), [(s.name, s.parent_id) for s in spans if s.parent_id not in ids]


def test_a_request_without_a_traceparent_starts_its_own_trace(disagg: Deployment, receiver: OtlpReceiver) -> None:
    c = client(disagg)
    t0 = time.time_ns()  # the deployment's start-up sent completions too: this one starts after them
    text = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="a tiny trace",
                                                                        max_tokens=3, stream=True) if ch.choices)
    assert text is not None
    roots = receiver.wait_for(lambda spans: [s for s in spans if s.name == "POST /v1/completions"
                                             and s.start_ns >= t0], 15, "the completion's HTTP span")
    (root,) = roots
    assert root.parent_id == ""  # a new trace
    spans = whole(receiver, root.trace_id, "POST /v1/completions", workers=2)
    assert [s.name for s in children(spans, root)] == ["plan", "prefill", "decode"]


def test_a_migrated_request_shows_one_attempt_per_worker(disagg: Deployment, receiver: OtlpReceiver) -> None:
    trace_id, _, traceparent = client_parent()
    stream = client(disagg, traceparent).chat.completions.create(
        model="tiny", messages=PROMPT, max_tokens=DIE_AFTER + 100, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = None
    for ch in stream:
        usage = ch.usage or usage
    # the decode engine died under it (at DIE_AFTER tokens at most) and the stream went on elsewhere
    assert usage is not None and usage.completion_tokens == DIE_AFTER + 100

    def migrated(_spans: list[Span]) -> list[Span] | None:
        spans = receiver.trace(trace_id)
        http = [s for s in spans if s.name == "POST /v1/chat/completions"]
        workers = [s for s in spans if s.name == "worker.generate"]
        attempts = [s for s in spans if s.name == "decode"]
        # the prefill's worker span and every attempt's have arrived (an engine died, never a worker
        # process: every worker span is exported)
        return spans if http and len(attempts) >= 2 and len(workers) >= len(attempts) + 1 else None

    spans = receiver.wait_for(migrated, 20, "the migrated request's trace")
    http = one(spans, "POST /v1/chat/completions")
    attempts = children(spans, http, "decode")
    assert [a.attributes["vllm_actors.attempt"] for a in attempts] == list(range(1, len(attempts) + 1))
    # every attempt but the last ended with its worker's failure; the last one finished the stream
    assert all(a.failed for a in attempts[:-1]) and not attempts[-1].failed, [(a.failed, a.attributes) for a in attempts]
    assert sum(a.attributes["vllm_actors.tokens"] for a in attempts) == DIE_AFTER + 100
    for a in attempts:
        check_hop(spans, a, "decode")
    assert not http.failed and http.attributes["http.response.status_code"] == 200


def test_a_clients_unsampled_trace_is_recorded_nowhere(disagg: Deployment, receiver: OtlpReceiver) -> None:
    unsampled, _, traceparent = client_parent(sampled=False)
    client(disagg, traceparent).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=2)
    # a sampled request after it: once its worker spans are in, the unsampled one's would be too
    sampled, _, traceparent = client_parent()
    client(disagg, traceparent).chat.completions.create(model="tiny", messages=PROMPT, max_tokens=2)
    whole(receiver, sampled, "POST /v1/chat/completions", workers=2)
    assert receiver.trace(unsampled) == []
