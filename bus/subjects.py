"""Every NATS subject, KV bucket and header name the project uses is spelled here, and only here.

Subjects are built from the topology's namespace ``ns`` so two deployments can share one NATS.
Nothing else in the code base concatenates subject strings.
"""

from __future__ import annotations

from config.names import check_token

# --- headers ------------------------------------------------------------------------------------
CONTENT_TYPE = "Content-Type"
CT_JSON = "application/json"
CT_MSGPACK = "application/msgpack"
REQUEST_ID = "Request-Id"
SEQ = "Seq"
# Marks stream control messages: "eos" (end of stream), "hb" (heartbeat), "gone" (caller gone).
STREAM_CONTROL = "Stream-Control"
EOS = "eos"
HEARTBEAT = "hb"
# Caller -> responder (on the responder's chunk reply subject): this stream's caller is gone, stop.
GONE = "gone"
# Subject the caller listens on for a worker's cancellation; the worker sends its cancel subject here.
CANCEL_SUBJECT = "Cancel-Subject"
SERVICE_ERROR = "Nats-Service-Error"
SERVICE_ERROR_CODE = "Nats-Service-Error-Code"
ERROR_KIND = "Error-Kind"  # our own: the error's kind, so the caller rebuilds its class (bus.errors)
# Which instance produced a response (for routing visibility).
INSTANCE_ID = "Instance-Id"
# Stall bound the caller will apply; the worker heartbeats at a fraction of it.
STALL_TIMEOUT = "Stall-Timeout"
# On a stream request: "1" = the caller's inbox also takes batches (``bus.stream_batch``), on
# ``<reply prefix>.batch``. On a batch message: how many stream messages it carries.
STREAM_BATCH = "Stream-Batch"
BATCH_TOKEN = "batch"
# On a KV event message (``ns.kv.events.<instance>``): its payload is an array of this many events,
# in event-id order (what one engine step changed); without the header, the payload is one event.
KV_BATCH = "Kv-Batch"
# W3C trace context (bus.tracing): on an HTTP request from a client, and on a NATS request from the
# frontend to a worker, whose spans then join the frontend's trace. Lower case, as the W3C spells them.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


def stream_batch_subject(caller: str) -> str:
    """Where the batches for a caller go: ``caller`` is its inbox prefix (a reply subject without
    its last token, the call's)."""
    return f"{caller}.{BATCH_TOKEN}"

# JetStream's account info request: answered once JetStream is available (a cluster: a meta leader)
JS_API_INFO = "$JS.API.INFO"
# nats-server's auth callout: the server asks here (in the connecting client's account) whether to
# admit a client its own config does not know (bus.auth_callout)
AUTH_CALLOUT = "$SYS.REQ.USER.AUTH"
# micro-service discovery requests ($SRV.PING|INFO|STATS[.<name>[.<id>]]) every service answers
SRV_ALL = "$SRV.>"


def kv_stream(bucket: str) -> str:
    """The JetStream stream behind a KV bucket."""
    return f"KV_{bucket}"


def kv_key(bucket: str, key: str) -> str:
    """Where a put, delete or purge of ``key`` in ``bucket`` is published."""
    return f"$KV.{bucket}.{key}"


def js_stream_info(stream: str) -> str:
    return f"$JS.API.STREAM.INFO.{stream}"


def js_stream_create(stream: str) -> str:
    return f"$JS.API.STREAM.CREATE.{stream}"


def js_direct_get(stream: str) -> str:
    """Direct gets of a stream's messages (``<this>.<subject>``: the last message of a key)."""
    return f"$JS.API.DIRECT.GET.{stream}.>"


def js_msg_get(stream: str) -> str:
    """A message of a stream read from its leader (``STREAM.MSG.GET``)."""
    return f"$JS.API.STREAM.MSG.GET.{stream}"


def js_consumer_create(stream: str) -> list[str]:
    """Creating a consumer on ``stream`` (nats-py names the filter subject after the stream, or not)."""
    return [f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>"]


def queue_permission(subject: str, queue: str) -> str:
    """A subscribe permission that admits ``subject`` only in queue group ``queue``."""
    return f"{subject} {queue}"


class Subjects:
    """Subjects of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.ns = check_token(namespace)

    # generate: queue group for the pool, and a routed subject per instance
    def generate(self, pool: str) -> str:
        return f"{self.ns}.{check_token(pool)}.generate"

    def generate_instance(self, pool: str, instance: str) -> str:
        return f"{self.ns}.{check_token(pool)}.generate.{check_token(instance)}"

    # worker control
    def worker(self, instance: str, verb: str) -> str:
        return f"{self.ns}.worker.{check_token(instance)}.{verb}"

    def worker_cancel(self, instance: str) -> str:
        return self.worker(instance, "cancel")

    # KV events and index
    def kv_events(self, instance: str) -> str:
        return f"{self.ns}.kv.events.{check_token(instance)}"

    def kv_events_all(self) -> str:
        return f"{self.ns}.kv.events.*"

    def kv_index(self, instance: str, verb: str) -> str:
        return f"{self.ns}.kv.index.{check_token(instance)}.{verb}"

    # load reports
    def load(self, instance: str) -> str:
        return f"{self.ns}.load.{check_token(instance)}"

    def load_all(self) -> str:
        return f"{self.ns}.load.*"

    # observations: each frontend's per-interval request statistics (the planner reads them)
    def metrics_frontend(self, instance: str) -> str:
        return f"{self.ns}.metrics.frontend.{check_token(instance)}"

    def metrics_frontend_all(self) -> str:
        return f"{self.ns}.metrics.frontend.*"

    # the planner: its micro-service verbs (status, decisions, profile) ...
    def planner(self, verb: str) -> str:
        return f"{self.ns}.planner.{check_token(verb)}"

    # ... and every decision it takes, as it takes it
    def planner_decision(self) -> str:
        return f"{self.ns}.planner.decision"

    # cold models: a frontend holding requests for a model no worker serves asks for it here (once
    # per cold period); the waker of the pools (or the planner) answers what it did on the outcome
    def wake_demand(self) -> str:
        return f"{self.ns}.wake.demand"

    def wake_outcome(self) -> str:
        return f"{self.ns}.wake.outcome"

    # a root's waker: its micro-service verbs (status)
    def waker(self, host: str, verb: str) -> str:
        return f"{self.ns}.waker.{check_token(host)}.{check_token(verb)}"

    # supervisors
    def supervisor(self, host: str, verb: str) -> str:
        return f"{self.ns}.supervisor.{check_token(host)}.{verb}"

    def supervisor_node(self, host: str, node: str, verb: str) -> str:
        """A nested supervisor (e.g. a worker's own supervisor) under a host."""
        return f"{self.ns}.supervisor.{check_token(host)}.{check_token(node)}.{verb}"

    # router service
    def router(self, verb: str) -> str:
        return f"{self.ns}.router.{verb}"

    # each frontend's routing bookings, which every other frontend applies (actors.router.bookings)
    def router_bookings(self, instance: str) -> str:
        return f"{self.ns}.router.bookings.{check_token(instance)}"

    def router_bookings_all(self) -> str:
        return f"{self.ns}.router.bookings.*"

    # the frontend processes of a deployment: a scrape of /metrics gathers every process's series
    def frontend_scrape(self) -> str:
        return f"{self.ns}.frontend.scrape"

    # any actor's per-instance control subject (e.g. the stream ``cancel`` endpoint)
    def actor(self, kind: str, instance: str, verb: str) -> str:
        """``ns.<kind>.<instance>.<verb>``; for kind "worker" this equals ``worker(instance, verb)``."""
        return f"{self.ns}.{check_token(kind)}.{check_token(instance)}.{verb}"

    # example actor
    def echo(self, verb: str) -> str:
        return f"{self.ns}.echo.{verb}"

    # JetStream KV buckets (bucket names cannot contain dots)
    @property
    def bucket_instances(self) -> str:
        return f"{self.ns}-instances"

    @property
    def bucket_models(self) -> str:
        return f"{self.ns}-models"

    @property
    def bucket_loras(self) -> str:
        return f"{self.ns}-loras"

    @property
    def bucket_quarantine(self) -> str:
        """Fingerprints of requests of death, shared by every frontend (actors.frontend.quarantine)."""
        return f"{self.ns}-quarantine"

    @property
    def bucket_responses(self) -> str:
        """/v1/responses' stored responses, shared by every frontend (actors.frontend.response_store)."""
        return f"{self.ns}-responses"


def inbox_prefix(namespace: str, owner: str | None = None) -> str:
    """Where replies to a process arrive. ``owner``: a process whose bus user may read its own
    replies only (a scoped worker: its instance id), not the whole deployment's."""
    prefix = f"_INBOX.{check_token(namespace)}"
    return f"{prefix}.{check_token(owner)}" if owner is not None else prefix

