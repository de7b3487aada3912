"""Build an Engine (mocker or vLLM) from a pool's config.

Imports are lazy so a mocker worker never imports vllm (seconds of start-up and a GiB of RSS).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec

from actors.engines.config_error import EngineConfigError
from actors.engines.protocol import NO_KV_EVENT_ROLES, Engine
from actors.models.tiny import resolve_model_path
from bus.addresses import advertised_address, remote_hosts
from bus.embedded import free_port
from config.topology import ModelConfig, PoolConfig, Topology

log = logging.getLogger(__name__)


def _model_token_facts(path: str) -> dict[str, int]:
    """``vocab_size``, ``eos_token_id`` and ``embedding_size`` (the model's ``hidden_size``, what
    vLLM's pooler returns) from a local model's config.json ("tiny" = the locally built tiny
    model), where they are set."""
    path = resolve_model_path(path)
    try:
        with open(f"{path}/config.json") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}  # not a local directory (e.g. a hub id): keep the mocker's defaults
    text = config.get("text_config") or {}  # a vision-language model keeps them in its text config
    facts = {"vocab_size": config.get("vocab_size", text.get("vocab_size")),
             "eos_token_id": config.get("eos_token_id", text.get("eos_token_id")),
             "embedding_size": config.get("hidden_size", text.get("hidden_size"))}
    if isinstance(facts["eos_token_id"], list) and facts["eos_token_id"]:
        facts["eos_token_id"] = facts["eos_token_id"][0]  # the mocker ends on one id: the first EOS
    return {k: v for k, v in facts.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def advertised_host(t: Topology, host: str) -> str | None:
    """The address another host reaches ``host``'s engines at: its ``bus.cluster.servers`` entry;
    on a bus whose servers are elsewhere (``bus.url``), the address detected for reaching them
    (``bus.addresses``); None when the whole deployment shares this machine's loopback bus
    (vLLM's default ``localhost`` is then right)."""
    if t.bus.cluster is not None and host in t.bus.cluster.servers:
        return t.bus.cluster.servers[host]
    peers = remote_hosts(t.bus.url)
    return advertised_address(peers) if peers else None


def engine_env(pool: PoolConfig, replica: int, cpu_slot: int | None,
               advertise: str | None = None) -> dict[str, str]:
    """The pool's env for one replica's vLLM engine.

    * CPU: vLLM binds every engine of a machine to core 0 unless told otherwise, and with
      multiprocessing off it binds nothing (we pin EngineCore ourselves from the same variable):
      give each engine on a host its own core (``cpu_slot``), unless the topology chose one.
      GPU builds ignore the variable.
    * NIXL: every engine on a host needs its own side-channel port: replicas count up from the
      pool's port (8 apart, room for vLLM's own per-rank offsets). Its side-channel host is what
      a decode engine on another host dials: ``advertise`` (``advertised_host``) unless the
      topology set it; vLLM's default, ``localhost``, works only within one machine.
    """
    env = dict(pool.env)
    if advertise and "kv_transfer_config" in pool.engine_args:
        env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", advertise)
    if cpu_slot is not None and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_slot % (os.cpu_count() or 1))
    port = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    if port and port.isdigit() and replica:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(int(port) + 8 * replica)
    return env


def engine_args_for(pool: PoolConfig, model: ModelConfig | None) -> dict[str, Any]:
    """The engine args a worker of ``pool`` builds its engine with: the topology's, and what the
    model and the pool add (an engine's own defaults are its own)."""
    args: dict[str, Any] = dict(pool.engine_args)
    if model is not None and model.context_length is not None:
        args.setdefault("max_model_len", model.context_length)
    if pool.engine == "mocker":
        if model is not None:
            # pseudo-tokens must be ids the model's tokenizer can detokenize: the mocker's default
            # range (32000) is far beyond the tiny model's 2048, which made most output text empty;
            # and its EOS must be the model's, or the frontend would show another token's text
            for key, value in _model_token_facts(model.path).items():
                args.setdefault(key, value)
        if model is not None and (args.get("script") or model.text_mode) and "tokenizer" not in args:
            # a script is text: the mocker encodes its replies and reads prompts with the model's
            # tokenizer; in text mode it is what turns the output into the model's text
            args["tokenizer"] = resolve_model_path(model.tokenizer or model.path)
        return args
    if model is not None:  # the mocker takes no model path: it has no weights
        args.setdefault("model", model.path)
        if model.tokenizer:
            args.setdefault("tokenizer", model.tokenizer)
    if pool.prompt_embeds:
        args.setdefault("enable_prompt_embeds", True)
    if model is not None and model.reasoning_parser:
        # the engine's structured-output manager then starts a grammar only after the thinking
        # (tool calls, response_format) as vllm serve --reasoning-parser does
        args.setdefault("reasoning_parser", model.reasoning_parser)
    return args


def _mocker(args: dict[str, Any], pool: PoolConfig, served: str, seed: int) -> Engine:
    from actors.engines.mocker.engine import MockerEngine

    try:
        return MockerEngine(args, role=pool.role, served_model_name=served, seed=seed)
    except ValueError as e:  # its args, checked as it is built: the same error on every start
        raise EngineConfigError(f"mocker engine args: {e}") from e


def build_engine(pool: PoolConfig, model: ModelConfig | None, *, seed: int = 0, replica: int = 0,
                 cpu_slot: int | None = None, advertise: str | None = None, ec_consumer: bool = False) -> Engine:
    """A fresh, not yet started engine for ``pool``. Decode workers publish no KV events.
    ``seed`` is a mocker's "weights" (a vLLM engine takes none here). ``ec_consumer``: the pool
    has an encode pool beside it (``has_encode_pool``), whose encoder outputs its engine loads.
    Arguments the engine rejects raise EngineConfigError (here for the mocker, at start for vLLM)."""
    served = model.name if model else "model"
    args = engine_args_for(pool, model)
    if pool.engine == "mocker":
        # no port picked here: the mocker binds its publisher and replay sockets to ports the
        # kernel chooses (a port picked free beforehand can be taken by the time it binds, and
        # its replay socket's base+1 was never checked at all)
        return _mocker(args, pool, served, seed)
    from actors.engines.vllm_engine import VllmEngine

    # vLLM takes its KV-event endpoints from its config; decode and encode workers publish none. One DP rank
    # publishes on ipc sockets (no port); several need a tcp base port, because vLLM derives rank
    # r's endpoint as base + r and cannot be told to bind port 0. That port is picked free here and
    # can be taken before vLLM binds it: the engine then fails to start, and its restart picks anew.
    dp = int(args.get("data_parallel_size") or 1)
    kv_events_port = free_port() if pool.role not in NO_KV_EVENT_ROLES and dp > 1 else None
    return VllmEngine(args, role=pool.role, served_model_name=served, kv_events_port=kv_events_port,
                      env=engine_env(pool, replica, cpu_slot, advertise), identity_lora=pool.lora.identity_adapter,
                      ec_consumer=ec_consumer and pool.role in ("agg", "prefill"))


def check_engine_config(t: Topology, pool_name: str) -> None:
    """What a worker of ``pool_name`` would build its engine from, built without the engine:
    vLLM's config (no weights read, nothing started; ``vllm_args.check_config``) or the mocker's
    args. Raises EngineConfigError with what the engine rejects."""
    pool = t.pools[pool_name]
    args = engine_args_for(pool, t.model)
    if pool.engine == "mocker":
        from actors.engines.mocker.config import MockerArgs

        try:
            MockerArgs.from_dict(args)
        except ValueError as e:
            raise EngineConfigError(f"mocker engine args: {e}") from e
        return
    from actors.engines import vllm_args

    # replica 0's env; the NIXL side-channel host (advertise) is no part of vLLM's config
    vllm_args.check_config(args, pool.role, t.model.name if t.model else "model", engine_env(pool, 0, None),
                           ec_consumer=has_encode_pool(t) and pool.role in ("agg", "prefill"))


def with_engine_spans(t: Topology, pool: PoolConfig) -> PoolConfig:
    """``pool`` with vLLM's own request spans on when the topology traces (``tracing.engine_spans``):
    vLLM exports them to the same endpoint, as children of the worker's engine span. vLLM speaks
    OTLP over gRPC unless told otherwise; the topology's endpoint is OTLP/HTTP. What the pool's
    engine args or env set themselves wins."""
    tr = t.tracing
    if pool.engine != "vllm" or tr.endpoint is None or not tr.engine_spans:
        return pool
    args = {"otlp_traces_endpoint": tr.endpoint, **pool.engine_args}
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", **pool.env}
    return msgspec.structs.replace(pool, engine_args=args, env=env)


def has_encode_pool(t: Topology) -> bool:
    """E/P/D: the topology's agg and prefill engines consume an encode pool's outputs."""
    return any(p.role == "encode" for p in t.pools.values())


def factory_for(pool: PoolConfig, model: ModelConfig | None, *, seed: int = 0, replica: int = 0,
                cpu_slot: int | None = None, advertise: str | None = None,
                ec_consumer: bool = False) -> Callable[[], Engine]:
    """A zero-argument builder: each restart of the engine actor gets a fresh engine (and port)."""
    return lambda: build_engine(pool, model, seed=seed, replica=replica, cpu_slot=cpu_slot, advertise=advertise,
                                ec_consumer=ec_consumer)
