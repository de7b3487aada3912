"""Topology file schema (TOML). The loader is ``config.loader``.

Structs forbid unknown fields so a typo is an error naming the key path, not a silent default.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Strategy = Literal["one_for_one", "one_for_all", "rest_for_one"]


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class BusAuth(_Strict):
    """How a process proves itself to NATS: one kind (token, user/password, nkey seed or creds).
    Secrets are best given by file (``*_file``): a topology file is often world-readable, and a
    ``--set`` value shows in the process list of the process it is given to."""

    token: str | None = None
    token_file: str | None = None  # file holding the token (surrounding whitespace is dropped)
    token_env: str | None = None  # name of an environment variable holding the token
    user: str | None = None
    password: str | None = None
    password_file: str | None = None
    password_env: str | None = None  # e.g. the variable a server_config's users refer to
    nkey_seed: str | None = None  # path to an nkey seed file
    creds: str | None = None  # path to a .creds file (user JWT + seed; needs an operator-mode server)

    def kind(self) -> str | None:
        """"token", "user", "nkey", "creds" or None (anonymous)."""
        if self.token is not None or self.token_file is not None or self.token_env is not None:
            return "token"
        if self.user is not None:
            return "user"
        if self.nkey_seed is not None:
            return "nkey"
        if self.creds is not None:
            return "creds"
        return None


class BusTLS(_Strict):
    ca_file: str | None = None  # CA that signed the server's certificate (and clients', see below)
    cert_file: str | None = None  # client certificate (servers that verify clients)
    key_file: str | None = None
    hostname: str | None = None  # name to verify the server's certificate against
    # the embedded nats-server's own certificate: set both to make it require TLS
    server_cert_file: str | None = None
    server_key_file: str | None = None
    verify_clients: bool = False  # embedded server: require client certificates signed by ca_file


class BusCluster(_Strict):
    """The embedded bus as a NATS cluster: each host of ``servers`` runs its own nats-server (a
    child of that host's root, or its systemd nats unit), joined to the others by routes, with
    JetStream clustered. Processes connect to their own host's server on 127.0.0.1; routes listen
    on each server's ``servers`` address. Every host of the topology must run a server; a host
    with nothing else on it (a bus-only third server, for a JetStream quorum) is allowed."""

    servers: dict[str, str] = {}  # host name -> the address the other servers reach it at
    port: int = 6222  # route port, on every server (open it between the hosts)
    name: str | None = None  # cluster name (default: the namespace)
    # Routes listen on a routable address: whoever reaches the port could join the cluster and read
    # every subject. Each server admits a route only with this user and password.
    user: str = "route"
    password: str | None = None
    password_file: str | None = None
    password_env: str | None = None
    insecure: bool = False  # routes without credentials (a private, trusted network only)


class BusConfig(_Strict):
    """``url`` empty → the root supervisor embeds a nats-server on 127.0.0.1:``port`` (with
    ``cluster``: one per host, joined by routes)."""

    url: str | None = None
    port: int = 4222
    store_dir: str | None = None  # JetStream store of the embedded server (default under run dir)
    auth: BusAuth = msgspec.field(default_factory=BusAuth)
    # what worker processes connect with (per-role users); default: ``auth``
    worker_auth: BusAuth | None = None
    # each worker process connects as a user of its own, issued by its root at every start and
    # allowed only that process's subjects (nats-server's auth callout, answered by the root:
    # bus.auth_callout). Needs the embedded server and a server_config whose authorization block
    # names the callout (topologies/secure/roles.conf); replaces worker_auth.
    scoped_workers: bool = False
    tls: BusTLS | None = None
    # embedded server: a nats-server config file it includes (users and their permissions,
    # accounts, an operator and resolver for creds). With it, the file alone decides who may
    # connect; without it, the embedded server admits exactly ``auth``.
    server_config: str | None = None
    cluster: BusCluster | None = None
    # JetStream replicas of the registry buckets. Default: 3 on an embedded cluster of three or more
    # servers, else 1. An external cluster (``url``): set it (the servers behind a URL are unknown).
    kv_replicas: int | None = None


# model.migration_wait's default, in seconds: also the frontend's when it serves a model the
# topology does not describe (its flows and /v1/embeddings import it, so it is written once)
MIGRATION_WAIT = 60.0


class ModelConfig(_Strict):
    name: str  # served model name
    path: str  # local dir or HF id; "tiny" means the locally built tiny model
    tokenizer: str | None = None  # defaults to path
    chat_template: str | None = None  # file overriding the model's template
    migration_limit: int = 3
    # a stream to migrate waits this long for a worker when none is left (e.g. the only worker's
    # engine is restarting); 0 = fail at once
    migration_wait: float = MIGRATION_WAIT
    context_length: int | None = None  # defaults to the engine's max_model_len
    # disagg: serve with decode workers alone when no prefill worker is ready (or a prefill fails).
    # Off by default: a disaggregated deployment is ready only with both pools, unless allowed here.
    allow_decode_only: bool = False
    # vLLM's tool-call parser (its --tool-call-parser names: hermes, llama3_json, mistral, pythonic,
    # ...): turns the model's text into tool_calls for tool_choice "auto". Unset: "auto" is refused,
    # as vllm serve refuses it without --enable-auto-tool-choice; "required" and named tools work
    # either way (decoding is constrained to the tools' JSON schema).
    tool_call_parser: str | None = None
    # vLLM's reasoning parser (deepseek_r1, qwen3, ...): the model's thinking goes to
    # reasoning_content; vLLM engines also get it, so structured output starts after the thinking
    reasoning_parser: str | None = None
    # the worker tokenizes, applies the chat template and detokenizes; the frontend handles text
    # only (no tokenizer at the frontend: no KV-aware routing, no tool-call or reasoning parsing)
    text_mode: bool = False


class BackoffConfig(_Strict):
    initial: float = 0.5
    max: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.2


class SupervisorConfig(_Strict):
    strategy: Strategy = "one_for_one"
    intensity: int = 5  # restarts allowed ...
    period: float = 60.0  # ... within this many seconds
    backoff: BackoffConfig = msgspec.field(default_factory=BackoffConfig)
    shutdown_timeout: float = 30.0
    drain_timeout: float = 10.0
    start_concurrency: int = 4  # worker processes starting (loading engines) at once


class MediaConfig(_Strict):
    """Images in chat requests (``[frontend.media]``, ``actors.frontend.media``), checked at the
    frontend before any worker sees them. Secure by default: no image URL is fetched until
    ``allow_urls`` names where from; ``data:`` URLs work out of the box."""

    # image parts in one request (vLLM's --limit-mm-per-prompt): each costs a decode and a processor
    # run here, an encoder pass and hundreds of prompt tokens at the engine
    max_images: int = 8
    # bytes of one image file (base64-decoded, or as downloaded). Below max_total_bytes so that one
    # image never takes a request's whole share; a 12-megapixel phone photo (JPEG) fits
    max_image_bytes: int = 4 << 20
    # bytes of all images of one request together: they travel in one generate request, a NATS
    # message, and the embedded server's max_payload is 8 MiB; 6 MiB leaves 2 MiB for the rest (the
    # token ids of a 128k-token prompt take about 0.6 MiB)
    max_total_bytes: int = 6 << 20
    # width x height of one image, read from the file's header before anything is decoded: a 100 KB
    # PNG can declare 10000x10000 (300 MB as RGB). 4096x4096 is 48 MiB of RGB at most, above a
    # 12-megapixel phone photo; vision processors downscale far below it anyway
    max_pixels: int = 4096 * 4096
    # Pillow format names this frontend decodes; a file of another format is refused unopened (each
    # decoder is attack surface; vllm serve accepts dozens). MPO (a phone's JPEG) opens as JPEG.
    formats: list[str] = msgspec.field(default_factory=lambda: ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
    # http(s) image URLs are fetched only from these: a host ("images.example.com",
    # "10.0.0.5:8080") or a URL prefix ("https://cdn.example.com/public/"), the rule of
    # pools.<pool>.lora.allow_urls. Empty: none is fetched (a URL in a request could otherwise make
    # the frontend reach any host its network does, e.g. an internal service or a cloud metadata
    # endpoint). Redirects are never followed: list the final location.
    allow_urls: list[str] = []
    # seconds for one image URL: connecting, the answer's headers and its whole body
    fetch_timeout: float = 10.0
    # image URLs of one request fetched at once (a request of max_images URLs opens no more)
    max_concurrent_fetches: int = 4


class ResponsesConfig(_Strict):
    """/v1/responses' stored responses (``store: true``), in the <ns>-responses KV bucket
    (actors.frontend.response_store)."""

    # seconds a stored response stays retrievable and continuable (previous_response_id)
    ttl: float = 86400.0
    # the bucket's size; once full, new responses are served but not stored (store: false) until
    # older ones age out
    max_bytes: int = 256 << 20
    # one stored response with its conversation; a longer one is served but not stored
    max_entry_bytes: int = 1 << 20


class ColdConfig(_Strict):
    """Requests for a cold model (every replica asleep, or its pools at zero replicas): held at the
    frontend while a waker brings a replica back (actors.frontend.cold)."""

    # seconds a held request waits for the model to serve; then 503 + Retry-After with the reason
    wake_timeout: float = 120.0
    # requests held per model and frontend process at once; more get 503 + Retry-After at once
    max_held: int = 256
    # seconds between SSE comments a held stream gets, so proxies do not cut it. The first one
    # commits the response to 200: a wake that fails after it ends the stream with an error event
    keepalive: float = 10.0


class FrontendConfig(_Strict):
    enabled: bool = True
    http: str = "127.0.0.1:8000"
    router: Literal["round_robin", "random", "direct", "kv"] = "round_robin"
    host: str = "local"
    api_key: str | None = None  # bearer key for /v1/* (prefer api_key_file or api_key_env)
    api_key_file: str | None = None  # file holding the key
    api_key_env: str | None = None  # name of an environment variable holding the key
    metrics_auth: bool = False  # /metrics needs the key too (/health and /live stay open)
    max_body_bytes: int = 8 << 20
    router_temperature: float = 0.0
    # kv router: None = price workers by predicted latency (actors.router.latency, learned from the
    # workers' step samples: nothing to tune); a number = the older weighted cost, prefill blocks ×
    # this + active decode blocks (an override for those who tuned it)
    prefill_load_scale: float | None = None
    # kv router: x-dynamo-session-id keeps a session on its worker while that worker is not
    # overloaded; a binding idle this many seconds is forgotten (0 = ignore the header)
    session_affinity_ttl: float = 300.0
    busy_threshold: float | None = None  # KV usage fraction above which a worker is skipped
    # kv router: false = approximate mode for engines without KV events (the index is fed by the
    # router's own decisions and forgets them after approx_ttl seconds)
    kv_events: bool = True
    approx_ttl: float = 120.0
    stall_timeout: float = 10.0
    # --- HTTP hardening against slow clients (actors.frontend.http_guard) ---
    # seconds for a request line and headers to arrive, from the connection's opening (or a kept-alive
    # connection's next first byte); then 408 and close. A deadline, so a header line every few
    # seconds (slowloris) does not extend it. Real clients send a head in one packet, in
    # milliseconds; 10 s still covers a congested mobile link.
    header_timeout: float = 10.0
    # seconds a kept-alive connection may sit idle between requests; then a silent close. Longer than
    # the 60 s idle timeouts of common proxies (nginx upstream keepalive_timeout, AWS ALB), so a proxy
    # never reuses a connection this end has just closed (for a POST that is a 502). Idle connections
    # cost a socket each and give way to new ones at max_connections, so long is cheap.
    keepalive_timeout: float = 75.0
    # seconds for a request body to arrive once its handler reads it (right after the headers); then
    # 408 and close. The largest body (max_body_bytes) fits at about 2.2 Mbit/s; raise it for slower
    # links with large prompts.
    body_timeout: float = 30.0
    # open HTTP connections; one more gets 503 + Retry-After (an idle keep-alive connection, if any,
    # is closed first to make room). The soft open-files limit is raised to fit when it can be.
    max_connections: int = 2048
    # run a request's own chat_template (Jinja). Off by default, as vllm serve's
    # --trust-request-chat-template: a template is code from the client, and even a sandboxed one
    # can loop for minutes on the frontend's event loop (nested range() loops)
    trust_request_chat_template: bool = False
    # a request whose serving workers died twice while serving it fails and is not retried;
    # identical requests are then refused for this many seconds (0: fail it, refuse nothing)
    quarantine_ttl: float = 300.0
    # seconds per window of request counts, ISL/OSL and TTFT/ITL histograms the frontend publishes
    # on <ns>.metrics.frontend.<instance> (the planner's observations); 0: publish none
    observe_interval: float = 2.0
    # OS processes serving the frontend's HTTP address. 1: the frontend runs in the root process
    # (no extra hop, the planner's series beside its own). N > 1: N supervised child processes that
    # serve the connections the root accepts and hands over, and share their routing bookings,
    # quarantine and /metrics over the bus (deploy.frontends, actors.frontend.process)
    processes: int = 1
    media: MediaConfig = msgspec.field(default_factory=MediaConfig)
    responses: ResponsesConfig = msgspec.field(default_factory=ResponsesConfig)
    cold: ColdConfig = msgspec.field(default_factory=ColdConfig)


class HealthConfig(_Strict):
    interval: float = 2.0
    timeout: float = 30.0
    canary_after_idle: float | None = None  # seconds idle before a one-token canary (off: None)


class SleepConfig(_Strict):
    """Going cold on purpose. Idle: no request in flight and none started or ended (health probes
    do not count). A request for a cold pool wakes it (actors.planner.wake)."""

    idle_timeout: float | None = None  # auto-sleep after this many idle seconds
    # remove a replica once idle this long (asleep or not): the pool can reach 0 replicas, and the
    # first request spawns one again (a planner-managed pool: planner.pools.<p>.min_replicas = 0)
    idle_stop: float | None = None
    level: int = 1
    deeper_after: float | None = None  # escalate to level 2 after this many more seconds
    drain_timeout: float = 10.0


class LoraConfig(_Strict):
    roots: list[str] = []  # file:// adapters must live under one of these
    cache_dir: str | None = None  # where http(s) adapters are downloaded
    # http(s) adapters only from these: a host ("hub.example.com", "10.0.0.5:8080") or a URL
    # prefix ("https://hub.example.com/loras/"). Empty: no http(s) adapter is fetched.
    allow_urls: list[str] = []
    max_download_bytes: int = 4 << 30  # per adapter (all its files together)
    download_timeout: float = 600.0  # seconds for one adapter's whole download
    identity_adapter: bool | None = None  # route base rows through a zero adapter (CPU mixed-batch bug)


class CheckpointConfig(_Strict):
    control_dir: str | None = None
    poll_interval: float = 0.5


class PoolConfig(_Strict):
    # encode (E/P/D): vLLM's vision encoder alone; the frontend sends each image prompt's images to
    # an encode worker first and hands its outputs to the agg or prefill worker with the request.
    # embed: vLLM's pooling runner (/v1/embeddings); the model then embeds and generates nothing
    role: Literal["agg", "prefill", "decode", "encode", "embed"] = "agg"
    engine: Literal["vllm", "mocker"] = "vllm"
    replicas: int = 1
    host: str = "local"
    engine_args: dict[str, Any] = {}  # vLLM AsyncEngineArgs (validated by vLLM) or mocker args
    env: dict[str, str] = {}
    # first worker's /health port; replicas add 1 each (0: a port the kernel picks, in the worker's log)
    status_port: int | None = None
    status_host: str | None = None  # status servers' bind address (default: frontend.http's host)
    max_waiting: int | None = None  # admission guard: reject when the waiting queue reaches this
    prompt_embeds: bool = False
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    sleep: SleepConfig = msgspec.field(default_factory=SleepConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    supervisor: SupervisorConfig = msgspec.field(
        default_factory=lambda: SupervisorConfig(strategy="rest_for_one"))


class PlannerPoolConfig(_Strict):
    """Per-pool planner settings (``[planner.pools.<pool>]``); unset fields take the planner's."""

    managed: bool = True  # false: the planner reports this pool but never scales it
    min_replicas: int | None = None  # default: planner.min_replicas
    max_replicas: int | None = None  # default: as many as the budget allows
    # engines one replica occupies (counted against the budgets); default: the product of the
    # pool's tensor/pipeline/data-parallel sizes in engine_args (the mocker: its dp_size)
    engines_per_replica: int | None = None
    profile: str | None = None  # throughput mode's profile file (default <profile_dir>/<pool>.json)


class PlannerConfig(_Strict):
    """The SLA planner (``actors.planner``): scales pools so that TTFT and ITL targets hold with as
    few engines as possible. Replica counts in ``[pools.*]`` are the start; the planner moves them."""

    enabled: bool = False
    host: str = "local"  # the host whose root runs the planner actor
    # throughput: predict the next interval's demand, size pools from a measured profile;
    # load: fit step time on live per-step timings, add/remove one replica at a time
    mode: Literal["throughput", "load"] = "throughput"
    no_op: bool = False  # decide, publish and log, but never scale
    interval: float | None = None  # seconds between decisions (default 180 throughput, 5 load)
    ttft_target_ms: float = 500.0
    itl_target_ms: float = 50.0
    min_replicas: int = 1  # per pool
    budget: int = 8  # engines over every pool and host together
    host_budget: dict[str, int] = {}  # engines per host (a host not listed: only the total)
    predictor: Literal["constant", "linear", "kalman", "arima"] = "constant"
    history: int = 32  # past intervals a predictor sees
    # load mode: scale down by one when every engine of a pool is under target x this
    sensitivity: float = 0.7
    profile_dir: str | None = None  # default: <run_dir>/profiles
    # a pool whose new replica failed to start is not grown again until this backoff has passed
    start_backoff: BackoffConfig = msgspec.field(
        default_factory=lambda: BackoffConfig(initial=10.0, max=300.0, multiplier=2.0, jitter=0.1))
    pools: dict[str, PlannerPoolConfig] = {}

    def scales(self, name: str, pool: PoolConfig) -> bool:
        """Whether the planner scales pool ``name``: not when ``planner.pools.<name>.managed =
        false``, and never an encode pool. Its load is images, which neither the throughput
        profile (prompt and output tokens) nor the load mode's step fit (TTFT and ITL) measures:
        it stays at its ``replicas``, reported in every decision and counted against the budget."""
        pp = self.pools.get(name)
        return pool.role != "encode" and (pp is None or pp.managed)

    def min_of(self, name: str) -> int:
        """Pool ``name``'s min_replicas (``planner.pools.<name>.min_replicas``, else the default)."""
        pp = self.pools.get(name)
        return pp.min_replicas if pp is not None and pp.min_replicas is not None else self.min_replicas

    def to_zero(self, name: str, pool: PoolConfig) -> bool:
        """Whether this planner may take pool ``name`` to zero replicas (``min_replicas = 0``)."""
        return self.enabled and self.scales(name, pool) and self.min_of(name) == 0

    def effective_interval(self) -> float:
        if self.interval is not None:
            return self.interval
        return 180.0 if self.mode == "throughput" else 5.0


class TracingConfig(_Strict):
    """OpenTelemetry traces of requests (``bus.tracing``). Off unless ``endpoint`` is set; off, no
    span is made and no header is added to a message."""

    # an OTLP/HTTP (protobuf) traces receiver, e.g. an OpenTelemetry Collector's
    # http://127.0.0.1:4318/v1/traces; every process of the deployment exports there
    endpoint: str | None = None
    # the share of the requests this deployment starts a trace for; a request that arrives with a
    # client's traceparent follows the client's sampled flag instead (W3C parent-based sampling)
    sample_ratio: float = 1.0
    # vLLM engines export their own request spans there too (its otlp_traces_endpoint), as children
    # of the worker's engine span
    engine_spans: bool = True


class SystemdConfig(_Strict):
    user: str | None = None
    working_directory: str | None = None
    environment_file: str | None = None
    watchdog_sec: int = 60
    restart_sec: int = 5
    start_limit_interval_sec: int = 300
    start_limit_burst: int = 5
    timeout_stop_sec: int = 90
    timeout_start_sec: int | None = None  # None: no bound (engines load for minutes; STATUS= says why)
    python: str | None = None  # interpreter for ExecStart (default: the one running --emit-systemd)


class MetricsConfig(_Strict):
    """The root's own /metrics (its supervisor's restarts, its bus health, the planner's series
    when the planner runs there): off unless ``root_port`` is set; every host's root listens on it."""

    root_port: int | None = None  # 0: a port the kernel picks (logged)
    root_host: str = "127.0.0.1"  # bind address; a Prometheus on another machine needs a routable one


class Topology(_Strict):
    namespace: str = "dynamo"
    model: ModelConfig | None = None  # none: a bus-only deployment (e.g. the echo example)
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    frontend: FrontendConfig = msgspec.field(default_factory=FrontendConfig)
    pools: dict[str, PoolConfig] = {}
    planner: PlannerConfig = msgspec.field(default_factory=PlannerConfig)
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    systemd: SystemdConfig = msgspec.field(default_factory=SystemdConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    run_dir: str | None = None  # logs, store dir, sockets (default ~/.cache/vllm-actors/run/<ns>)
    echo: bool = False  # start the echo example actor
    # one echo actor per listed host (instance = host name)
    echo_hosts: list[str] = msgspec.field(default_factory=lambda: ["local"])

    def hosts(self) -> list[str]:
        names = {p.host for p in self.pools.values()}
        if self.frontend.enabled:
            names.add(self.frontend.host)
        if self.planner.enabled:
            names.add(self.planner.host)
        if self.echo:
            names.update(self.echo_hosts)
        if self.bus.cluster is not None:
            names.update(self.bus.cluster.servers)  # a bus-only host runs its server
        return sorted(names) or ["local"]
