"""OpenTelemetry traces across the bus: one process's tracer, and W3C trace context in NATS headers.

Off unless the topology's ``[tracing]`` names an OTLP endpoint: then :func:`configure` builds this
process's tracer, and the callers (the frontend's pipeline and flows, the worker's engine actor)
make spans with :func:`start`. Off, :func:`start` returns None before doing anything else, no
OpenTelemetry module is even imported, and no header is added to any message: tracing costs a
global read per hook.

The provider is this module's own, never OpenTelemetry's global one: a vLLM engine in the same
process installs its own global provider for its spans (``otlp_traces_endpoint``), and the two
must not fight over it. Spans are made with an explicit parent :class:`Context`, never "current":
our spans live across ``yield``s of async generators, where attaching a context in one step and
detaching it in another fails.

The context crosses a process in the W3C ``traceparent`` (and ``tracestate``) header, on HTTP from
a client and on NATS from the frontend to a worker, so a worker's spans join the frontend's trace.
Sampling is decided once, at the frontend (``sample_ratio``, or the client's sampled flag): a
request not sampled makes no span past that decision and carries no ``traceparent`` to a worker,
and a worker traces only requests that carry one, so an unsampled request costs one sampling
decision.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bus.subjects import TRACEPARENT, TRACESTATE

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from config.topology import TracingConfig

log = logging.getLogger(__name__)

# an OTLP batch leaves at most this long after its first span ends (the SDK's default is 5 s)
EXPORT_DELAY_MS = 1000

_tracer: Tracer | None = None
_provider: TracerProvider | None = None
# what the hooks use, imported once by configure (a deferred import per span is a dict lookup and a
# lock): SpanKind by name, set_span_in_context, the W3C propagator, get_current_span
_api: dict[str, Any] = {}


def configure(cfg: TracingConfig, *, service: str, namespace: str, instance: str) -> bool:
    """Build this process's tracer when ``cfg`` names an endpoint; True when tracing is on.
    ``service``: the OpenTelemetry service name of the process's spans (``vllm-actors-frontend``,
    ``vllm-actors-worker``); ``instance``: which one of them."""
    global _tracer, _provider
    if cfg.endpoint is None or _tracer is not None:
        return _tracer is not None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({"service.name": service, "service.namespace": namespace,
                                "service.instance.id": instance, "host.name": socket.gethostname(),
                                "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.endpoint),
                                                   schedule_delay_millis=EXPORT_DELAY_MS))
    from opentelemetry.trace import SpanKind, get_current_span, set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _api.update(kinds={k.name.lower(): k for k in SpanKind}, in_context=set_span_in_context,
                propagator=TraceContextTextMapPropagator(), current=get_current_span)
    _provider, _tracer = provider, provider.get_tracer("vllm_actors")
    log.info("tracing: %s spans of %s to %s (sampling %g of new traces)", service, instance, cfg.endpoint,
             cfg.sample_ratio)
    return True


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Export what is buffered and stop (a process's last act; the SDK's atexit hook does it too,
    but a worker process may leave by ``os._exit``)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def start(name: str, parent: Context | None = None, *, kind: str = "internal",
          attributes: Mapping[str, Any] | None = None, start_time: int | None = None) -> Span | None:
    """A new span under ``parent`` (None: a new trace), or None when tracing is off. ``kind``:
    "internal", "server" (a request received), "client" (a request sent). The caller ends it."""
    tracer = _tracer
    if tracer is None:
        return None
    return tracer.start_span(name, context=parent, kind=_api["kinds"][kind], attributes=attributes,
                             start_time=start_time)


def context_of(span: Span | None) -> Context | None:
    """The context whose spans are ``span``'s children (None for None)."""
    if span is None or _tracer is None:
        return None
    return _api["in_context"](span)


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The remote parent a request's ``traceparent`` names (HTTP or NATS headers), or None when it
    carries none, carries a malformed one, or tracing is off."""
    if _tracer is None or not headers:
        return None
    value = headers.get(TRACEPARENT)
    if value is None:
        return None
    carrier = {TRACEPARENT: value}
    state = headers.get(TRACESTATE)
    if state is not None:
        carrier[TRACESTATE] = state
    ctx = _api["propagator"].extract(carrier)
    # a malformed traceparent extracts to an empty context: a new trace, as the W3C spec says
    return ctx if _api["current"](ctx).get_span_context().is_valid else None


def headers(span: Span | None) -> dict[str, str] | None:
    """``traceparent`` (and ``tracestate``) naming ``span`` as the parent of what a message starts;
    None without a span. A span not sampled still propagates, with its sampled flag off."""
    if span is None or _tracer is None:
        return None
    carrier: dict[str, str] = {}
    _api["propagator"].inject(carrier, context=_api["in_context"](span))
    return carrier


def end(span: Span | None, error: BaseException | None = None) -> None:
    """End ``span``: failed with ``error`` when one is given, except a cancellation (the caller
    went away, or closed the stream early), which is not a failure of ours."""
    if span is None:
        return
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
        span.set_attribute("vllm_actors.cancelled", True)
    elif error is not None:
        fail(span, error)
    span.end()


def fail(span: Span | None, error: BaseException | str) -> None:
    """Mark ``span`` failed with ``error`` (recorded as its status and an exception event)."""
    if span is None or not span.is_recording():
        return
    from opentelemetry.trace import Status, StatusCode

    if isinstance(error, BaseException):
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        code = getattr(error, "code", None)  # an ActorError's HTTP-like code (bus.errors)
        if isinstance(code, int):
            span.set_attribute("vllm_actors.error_code", code)
    else:
        span.set_status(Status(StatusCode.ERROR, error))
