"""The semantic checks of a converted topology: what its schema (``config.topology``) cannot say.

Each rule names the key it is about; ``check_topology`` reports the first broken one through the
loader's ``fail``, which raises a ``TopologyError`` (``config.loader``: parsing, ``--set`` and the
schema's own errors). Pure: no file, no I/O but Pillow's and vLLM's registries where a topology names
a format or a parser.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NoReturn

from config.credentials import check_api_key, check_bus, check_cluster_credentials
from config.names import check_token
from config.topology import MediaConfig, ModelConfig, PoolConfig, Topology

# fail(key, problem): raises, naming the key path
Fail = Callable[[str, str], NoReturn]

_BUS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_\-]+$")


def join_keys(keys: list[str]) -> str:
    """A key path as TOML writes it: ``pools."my.pool".replicas``."""
    return ".".join(k if _BARE_KEY.match(k) else f'"{k}"' for k in keys)


def check_topology(t: Topology, fail: Fail) -> None:
    """Every rule a converted topology must meet; ``fail(key, problem)`` reports the first broken
    one and does not return."""

    def token(key: str, value: str, what: str) -> None:
        try:
            check_token(value)
        except ValueError:
            fail(key, f"invalid {what} {value!r}: use letters, digits, '_' and '-' (it becomes a NATS subject token)")

    def port(key: str, value: int | None) -> None:
        if value is not None and not 1 <= value <= 65535:
            fail(key, f"expected a port in 1..65535, got {value}")

    def positive(key: str, value: float | None, *, zero_ok: bool = False) -> None:
        if value is not None and (value < 0 or (value == 0 and not zero_ok)):
            fail(key, f"expected a number {'>= 0' if zero_ok else '> 0'}, got {value}")

    token("namespace", t.namespace, "namespace")

    # bus: either a URL to an existing server or the embedded one on bus.port
    port("bus.port", t.bus.port)
    if t.metrics.root_port:
        port("metrics.root_port", t.metrics.root_port)
    if t.bus.url is not None:
        for url in t.bus.url.split(","):
            if not url.strip().startswith(_BUS_SCHEMES):
                fail("bus.url", f"expected {'|'.join(s[:-3] for s in _BUS_SCHEMES)}://host:port, got {url!r}"
                     " (leave bus.url out to embed a nats-server)")
    check_bus(t.bus, fail)
    _check_cluster(t, fail, token, port)

    _check_supervisor(t.supervisor, "supervisor", fail, positive)
    _check_tracing(t, fail)

    if t.model is not None:
        positive("model.migration_limit", t.model.migration_limit, zero_ok=True)
        positive("model.context_length", t.model.context_length)
        _check_parsers(t.model, fail)

    if t.frontend.enabled:
        token("frontend.host", t.frontend.host, "host name")
        if t.model is None:
            fail("frontend.enabled", "the frontend serves a model: add a [model] table or set frontend.enabled = false")
        host, sep, p = t.frontend.http.rpartition(":")
        if not sep or not host or not p.isdigit():
            fail("frontend.http", f"expected host:port, got {t.frontend.http!r}")
        port("frontend.http", int(p))
        positive("frontend.stall_timeout", t.frontend.stall_timeout)
        positive("frontend.max_body_bytes", t.frontend.max_body_bytes)
        for key in ("header_timeout", "keepalive_timeout", "body_timeout", "max_connections"):
            positive(f"frontend.{key}", getattr(t.frontend, key))
        if not 1 <= t.frontend.processes <= 64:
            fail("frontend.processes", f"expected 1..64 processes, got {t.frontend.processes}")
        if t.frontend.quarantine_ttl < 0:
            fail("frontend.quarantine_ttl", f"expected seconds >= 0, got {t.frontend.quarantine_ttl}")
        if t.frontend.prefill_load_scale is not None and not t.frontend.prefill_load_scale >= 0:
            fail("frontend.prefill_load_scale", f"expected a weight >= 0, got {t.frontend.prefill_load_scale}")
        if t.frontend.session_affinity_ttl < 0:
            fail("frontend.session_affinity_ttl", f"expected seconds >= 0, got {t.frontend.session_affinity_ttl}")
        if t.frontend.busy_threshold is not None and not 0 < t.frontend.busy_threshold <= 1:
            fail("frontend.busy_threshold", f"expected a fraction in (0, 1], got {t.frontend.busy_threshold}")
        check_api_key(t.frontend, fail)
        _check_media(t.frontend.media, fail, positive)
        r = t.frontend.responses
        for key in ("ttl", "max_bytes", "max_entry_bytes"):
            positive(f"frontend.responses.{key}", getattr(r, key))
        if r.ttl < 1:  # JetStream ages entries in whole seconds
            fail("frontend.responses.ttl", f"expected at least 1 second, got {r.ttl}")
        if r.max_entry_bytes > r.max_bytes:
            fail("frontend.responses.max_entry_bytes", f"expected at most max_bytes ({r.max_bytes}), "
                 f"got {r.max_entry_bytes}")
        cold = t.frontend.cold
        for key in ("wake_timeout", "max_held", "keepalive"):
            positive(f"frontend.cold.{key}", getattr(cold, key))

    for name, pool in t.pools.items():
        _check_pool(name, pool, t, fail, token, port, positive)

    roles = {p.role for p in t.pools.values()}
    if "prefill" in roles and "decode" not in roles:
        first = next(n for n, p in t.pools.items() if p.role == "prefill")
        fail(f"pools.{first}.role", "a prefill pool needs a decode pool to hand its KV cache to")
    engines = {p.engine for p in t.pools.values() if p.role in ("prefill", "decode")}
    if len(engines) > 1:
        first = next(n for n, p in t.pools.items() if p.role in ("prefill", "decode") and p.engine != "vllm")
        fail(f"pools.{first}.engine", "prefill and decode pools must use the same engine (KV cannot cross engines)")
    if "encode" in roles:
        _check_encode(t, fail)
    if "embed" in roles and roles != {"embed"}:
        # one model per topology: a pooling engine serves /v1/embeddings and generates nothing, so
        # the model's card says it embeds; generating pools beside it would serve another model
        # under the same name
        first = next(n for n, p in t.pools.items() if p.role == "embed")
        fail(f"pools.{join_keys([first])}.role", "an embed pool serves the model as an embedding model: the "
             "topology's other pools must be embed pools too (agg, prefill, decode and encode pools "
             "serve a generative model; run it as another deployment)")
    if "embed" in roles and t.model is not None and t.model.text_mode:
        fail("model.text_mode", "an embed pool's inputs are tokenized (and truncated) by the frontend, with "
             "the model's tokenizer; model.text_mode keeps it off the frontend")
    if "embed" in roles and t.planner.enabled:
        # its profiles and load model are about prompt and output tokens (TTFT, ITL); an embedding
        # has neither an output nor a first token
        fail("planner.enabled", "the planner does not scale embed pools: turn it off for an embedding model")

    if t.planner.enabled:
        _check_planner(t, fail, token, positive)

    for i, h in enumerate(t.echo_hosts):
        token(f"echo_hosts.{i}", h, "host name")
    if t.echo and not t.echo_hosts:
        fail("echo_hosts", "echo = true needs at least one host")

    s = t.systemd
    for key in ("watchdog_sec", "restart_sec", "start_limit_interval_sec", "start_limit_burst"):
        positive(f"systemd.{key}", getattr(s, key), zero_ok=True)
    positive("systemd.timeout_stop_sec", s.timeout_stop_sec)
    positive("systemd.timeout_start_sec", s.timeout_start_sec)
    for key in ("working_directory", "environment_file", "python"):
        v = getattr(s, key)
        if v is not None and not v.startswith("/"):
            fail(f"systemd.{key}", f"systemd needs an absolute path, got {v!r}")


def _check_media(m: MediaConfig, fail: Any, positive: Any) -> None:
    """``frontend.media``: positive limits, and formats Pillow can open (a misspelt name would
    silently refuse every image of that format). ``allow_urls`` entries follow the LoRA rule, which
    lives above this layer: the frontend logs the malformed ones (``media.malformed_allow_urls``)."""
    for key in ("max_images", "max_image_bytes", "max_total_bytes", "max_pixels", "fetch_timeout",
                "max_concurrent_fetches"):
        positive(f"frontend.media.{key}", getattr(m, key))
    if not m.formats:
        fail("frontend.media.formats", "name at least one image format (e.g. [\"PNG\", \"JPEG\"])")
    try:
        from PIL import Image  # a dependency of vLLM; a host without it serves no frontend
    except ImportError:
        return
    Image.init()
    for i, name in enumerate(m.formats):
        if name.upper() not in Image.OPEN:
            fail(f"frontend.media.formats.{i}", f"Pillow cannot open {name!r} "
                 f"(it opens: {', '.join(sorted(Image.OPEN))})")


def _check_cluster(t: Topology, fail: Any, token: Any, port: Any) -> None:
    """``bus.cluster``: every host of the topology runs a server of it, each reachable at a plain
    address, routes with credentials unless explicitly insecure."""
    b, c = t.bus, t.bus.cluster
    if b.kv_replicas is not None and not 1 <= b.kv_replicas <= 5:
        fail("bus.kv_replicas", f"expected 1..5 (JetStream's limit), got {b.kv_replicas}")
    if c is None:
        return
    if not c.servers:
        fail("bus.cluster.servers", "name each host's server and the address the others reach it at "
             "(e.g. servers = { a = \"10.0.0.1\", b = \"10.0.0.2\", c = \"10.0.0.3\" })")
    for host, address in c.servers.items():
        token(f"bus.cluster.servers.{host}", host, "host name")
        host_port = address.count(":") == 1  # an IPv6 address has several
        if not address or host_port or any(ch in address for ch in " /@,[]"):
            fail(f"bus.cluster.servers.{host}", f"expected an address or host name (no port, no scheme), got {address!r}")
    port("bus.cluster.port", c.port)
    if c.port == b.port:
        fail("bus.cluster.port", f"the route port must differ from bus.port ({b.port})")
    if b.kv_replicas is not None and b.kv_replicas > len(c.servers):
        fail("bus.kv_replicas", f"{b.kv_replicas} replicas need as many servers; the cluster has {len(c.servers)}")
    if c.name is not None:
        token("bus.cluster.name", c.name, "cluster name")
    check_cluster_credentials(c, fail)
    if b.url is None:
        # processes connect to their own host's server: a host without one would have no bus
        missing = [h for h in t.hosts() if h not in c.servers]
        if missing:
            fail("bus.cluster.servers", f"host(s) {', '.join(missing)} of this topology run no server: "
                 "add them (every host connects to its own server on 127.0.0.1)")


def _check_tracing(t: Topology, fail: Any) -> None:
    tr = t.tracing
    if tr.endpoint is not None and not tr.endpoint.startswith(("http://", "https://")):
        fail("tracing.endpoint", f"expected an OTLP/HTTP URL (http[s]://host:port/v1/traces), got {tr.endpoint!r}")
    if not 0.0 <= tr.sample_ratio <= 1.0:
        fail("tracing.sample_ratio", f"expected a share in 0..1, got {tr.sample_ratio}")


def _check_supervisor(s: Any, prefix: str, fail: Any, positive: Any) -> None:
    if s.intensity < 0:
        fail(f"{prefix}.intensity", f"expected int >= 0, got {s.intensity}")
    positive(f"{prefix}.period", s.period)
    positive(f"{prefix}.shutdown_timeout", s.shutdown_timeout)
    positive(f"{prefix}.drain_timeout", s.drain_timeout, zero_ok=True)
    if s.start_concurrency < 1:
        fail(f"{prefix}.start_concurrency", f"expected int >= 1, got {s.start_concurrency}")
    b = s.backoff
    positive(f"{prefix}.backoff.initial", b.initial, zero_ok=True)
    if b.max < b.initial:
        fail(f"{prefix}.backoff.max", f"expected >= backoff.initial ({b.initial}), got {b.max}")
    if b.multiplier < 1:
        fail(f"{prefix}.backoff.multiplier", f"expected a number >= 1, got {b.multiplier}")
    if not 0 <= b.jitter <= 1:
        fail(f"{prefix}.backoff.jitter", f"expected a fraction in [0, 1], got {b.jitter}")


def _check_parsers(model: ModelConfig, fail: Any) -> None:
    """Parser names against vLLM's registries. vLLM is imported only when a parser is named: its
    parser packages take seconds to import, which every other topology is spared."""
    if model.text_mode and (model.tool_call_parser or model.reasoning_parser):
        key = "model.tool_call_parser" if model.tool_call_parser else "model.reasoning_parser"
        fail(key, "parsers read the model's token ids with its tokenizer at the frontend, and "
                  "model.text_mode keeps the tokenizer off the frontend: use one or the other")
    if model.tool_call_parser:
        from vllm.tool_parsers import ToolParserManager

        names = ToolParserManager.list_registered()
        if model.tool_call_parser not in names:
            fail("model.tool_call_parser", f"unknown tool-call parser {model.tool_call_parser!r} "
                                           f"(vLLM's are: {', '.join(sorted(names))})")
    if model.reasoning_parser:
        from vllm.reasoning import ReasoningParserManager

        names = ReasoningParserManager.list_registered()
        if model.reasoning_parser not in names:
            fail("model.reasoning_parser", f"unknown reasoning parser {model.reasoning_parser!r} "
                                           f"(vLLM's are: {', '.join(sorted(names))})")


def _check_pool(name: str, pool: PoolConfig, t: Topology, fail: Any, token: Any, port: Any,
                positive: Any) -> None:
    key = f"pools.{join_keys([name])}"
    token(key, name, "pool name")
    token(f"{key}.host", pool.host, "host name")
    if t.model is None:
        fail(key, "worker pools serve a model: add a [model] table")
    if pool.replicas < 1:
        fail(f"{key}.replicas", f"expected int >= 1, got {pool.replicas}")
    if pool.status_port:  # 0: each worker's status server on a port the kernel picks (logged)
        port(f"{key}.status_port", pool.status_port)
        last = pool.status_port + pool.replicas - 1
        if last > 65535:
            fail(f"{key}.status_port", f"the last replica's port {last} (status_port + replicas - 1) exceeds 65535")
    if pool.max_waiting is not None and pool.max_waiting < 1:
        fail(f"{key}.max_waiting", f"expected int >= 1, got {pool.max_waiting}")
    if pool.prompt_embeds and pool.engine == "mocker":
        fail(f"{key}.prompt_embeds", "the mocker engine has no embedding layer; use engine = \"vllm\"")
    if pool.role == "embed" and pool.prompt_embeds:
        fail(f"{key}.prompt_embeds", "an embed pool takes token and text inputs (/v1/embeddings); prompt "
             "embeddings go to agg or prefill workers")
    if pool.role == "encode":
        if pool.engine != "vllm":
            fail(f"{key}.engine", "an encode pool runs vLLM's vision encoder, which the mocker does not "
                 "have: use engine = \"vllm\"")
        if pool.prompt_embeds:
            fail(f"{key}.prompt_embeds", "an encode worker runs the vision encoder on images; prompt "
                 "embeddings go to agg or prefill workers")
    if pool.sleep.level not in (1, 2):
        fail(f"{key}.sleep.level", f"expected 1 or 2, got {pool.sleep.level}")
    positive(f"{key}.sleep.idle_timeout", pool.sleep.idle_timeout)
    positive(f"{key}.sleep.idle_stop", pool.sleep.idle_stop)
    pl = t.planner
    if pool.sleep.idle_stop is not None and pl.enabled and pl.scales(name, pool):
        pp = pl.pools.get(name)
        lo = pl.min_replicas if pp is None or pp.min_replicas is None else pp.min_replicas
        if lo > 0:
            fail(f"{key}.sleep.idle_stop", f"the planner keeps this pool at {lo} replica(s) or more "
                 f"and would start again what idle_stop removes: set planner.pools.{join_keys([name])}"
                 ".min_replicas = 0 (or planner.min_replicas = 0)")
    positive(f"{key}.health.interval", pool.health.interval)
    positive(f"{key}.health.timeout", pool.health.timeout)
    for env_key in pool.env:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", env_key):
            fail(f"{key}.env.{join_keys([env_key])}", "not a valid environment variable name")
    # engine_args are not checked here: vLLM validates its own AsyncEngineArgs in the worker, and
    # the mocker's arguments are the mocker's business.
    _check_supervisor(pool.supervisor, f"{key}.supervisor", fail, positive)


def _check_encode(t: Topology, fail: Any) -> None:
    """E/P/D: an encode pool runs vLLM's vision encoder, and its outputs are loaded by the vLLM
    engines of the agg or prefill pools beside it (vLLM's EC connector). The mocker has no encoder,
    and the frontend expands image prompts with the model's processor (not in text mode)."""
    first = next(n for n, p in t.pools.items() if p.role == "encode")
    consumers = [n for n, p in t.pools.items() if p.role in ("agg", "prefill")]
    if not consumers:
        fail(f"pools.{join_keys([first])}.role", "an encode pool hands its image encodings to agg or prefill "
             "workers: add an agg or a prefill pool")
    for name in consumers:
        if t.pools[name].engine != "vllm":
            fail(f"pools.{join_keys([name])}.engine", "beside an encode pool, agg and prefill workers load its image "
                 "encodings into vLLM (its EC connector): use engine = \"vllm\"")
    if t.model is not None and t.model.text_mode:
        fail("model.text_mode", "an encode pool serves image prompts, which the frontend expands with the "
             "model's tokenizer and processor; model.text_mode keeps them off the frontend")


def _check_planner(t: Topology, fail: Any, token: Any, positive: Any) -> None:
    pl = t.planner
    token("planner.host", pl.host, "host name")
    if not t.pools:
        fail("planner.enabled", "the planner scales pools, but no [pools.*] are defined")
    positive("planner.interval", pl.interval)
    positive("planner.ttft_target_ms", pl.ttft_target_ms)
    positive("planner.itl_target_ms", pl.itl_target_ms)
    if pl.min_replicas < 0:
        fail("planner.min_replicas", f"expected int >= 0, got {pl.min_replicas}")
    if pl.budget < 1:
        fail("planner.budget", f"expected int >= 1, got {pl.budget}")
    if pl.history < 2:
        fail("planner.history", f"expected int >= 2, got {pl.history}")
    if not 0 < pl.sensitivity <= 1:
        fail("planner.sensitivity", f"expected a fraction in (0, 1], got {pl.sensitivity}")
    for host, n in pl.host_budget.items():
        token(f"planner.host_budget.{host}", host, "host name")
        if n < 0:
            fail(f"planner.host_budget.{host}", f"expected int >= 0, got {n}")
    positive("planner.start_backoff.initial", pl.start_backoff.initial)
    floor = 0
    for name, pp in pl.pools.items():
        if name not in t.pools:
            fail(f"planner.pools.{name}", f"no pool {name!r} in [pools] (pools: {', '.join(t.pools)})")
        lo = pp.min_replicas if pp.min_replicas is not None else pl.min_replicas
        if lo < 0:
            fail(f"planner.pools.{name}.min_replicas", f"expected int >= 0, got {lo}")
        if pp.max_replicas is not None and pp.max_replicas < lo:
            fail(f"planner.pools.{name}.max_replicas", f"expected >= min_replicas ({lo}), got {pp.max_replicas}")
        if pp.engines_per_replica is not None and pp.engines_per_replica < 1:
            fail(f"planner.pools.{name}.engines_per_replica", f"expected int >= 1, got {pp.engines_per_replica}")
    for name in t.pools:
        pp = pl.pools.get(name)
        lo = pl.min_replicas if pp is None or pp.min_replicas is None else pp.min_replicas
        per = pp.engines_per_replica if pp is not None and pp.engines_per_replica else 1
        floor += per * (lo if pl.scales(name, t.pools[name]) else t.pools[name].replicas)
    if floor > pl.budget:
        fail("planner.budget", f"{pl.budget} engines cannot hold every pool's minimum ({floor} engines)")
