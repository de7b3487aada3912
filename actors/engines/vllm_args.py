"""Turn a topology's engine-args dict into a validated vLLM ``VllmConfig``, with our defaults.

vLLM's own ``AsyncEngineArgs`` is the schema, so any vLLM option works from the topology; we only
add defaults (like Dynamo's) and turn vLLM's assorted exceptions into one ``EngineConfigError``
(a ValueError). ``check_config`` builds the config alone (no weights, no engine): the root runs it
before any worker starts, and ``--check`` too.
Imports of vLLM happen inside functions: importing this module must stay cheap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from actors.engines.config_error import EngineConfigError
from actors.engines.protocol import NO_KV_EVENT_ROLES, Role
from actors.models.tiny import resolve_model_path

logger = logging.getLogger(__name__)

TOPIC = "kv-events"
# vLLM-CPU needs a block size that is a multiple of 32 (its default, 128, wastes the tiny cache).
CPU_BLOCK_SIZE = 32

# Engine args that vLLM types as config objects but does not build from a dict itself.
_DICT_CONFIGS = {
    "kv_transfer_config": "KVTransferConfig",
    "ec_transfer_config": "ECTransferConfig",
    "kv_events_config": "KVEventsConfig",
    "structured_outputs_config": "StructuredOutputsConfig",
}

# os.environ is process-wide; engines built in one process take turns applying theirs.
_ENV_LOCK = threading.Lock()


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def sleep_mode_available() -> bool:
    """Whether vLLM can free an engine's memory when it sleeps (its CuMem allocator: CUDA, ROCm, XPU)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def default_env(cpu: bool) -> dict[str, str]:
    """Environment for a fast-starting engine on CPU (measured on vLLM-CPU 0.32: the fastest start): no separate Worker process, and
    one OMP thread per engine, since with the uni executor OMP threads spin against each other."""
    if not cpu:
        return {}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def applied_env(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in os.environ while an engine is built (its processes inherit it at spawn),
    then restore, so engines built later in the same process do not inherit each other's ports."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update({k: str(v) for k, v in env.items()})
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _ipc_dir() -> str:
    """A directory only this user can enter, for the engines' ZMQ ipc sockets (short: ipc paths are
    limited to ~107 bytes) and their encoder-output directories (E/P/D: ``ec_transfer_config``)."""
    d = os.path.join(tempfile.gettempdir(), f"vllm-actors-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)  # an older dir may have been made with a wider mode
    return d


def kv_events_config(port: int | None, dp_size: int = 1) -> Any:
    """ZMQ KV events for this worker's KV publisher actor, the sockets' only subscriber.

    One DP rank: ipc sockets in a directory of this user's (``_ipc_dir``): no network listener at all.
    vLLM binds an endpoint only when it holds ``*``, ``::`` or is ipc/inproc (anything else it
    *connects*), so a loopback tcp address is not possible; ``tcp://*`` listens on every interface.
    Several DP ranks: vLLM derives rank r's endpoint by adding r to a tcp port (ipc has no such rule),
    so those stay on ``tcp://*``: rank r publishes on ``port + r``, the replay socket on
    ``port + 1000 + r`` when those are free now, else on an OS-picked port (vLLM then binds the
    node's IP)."""
    from vllm.config import KVEventsConfig

    if dp_size == 1:
        base = os.path.join(_ipc_dir(), f"kv-{os.getpid()}-{secrets.token_hex(4)}")
        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{base}.pub",
                              replay_endpoint=f"ipc://{base}.replay", topic=TOPIC)
    pub = f"tcp://*:{port}" if port is not None else "tcp://*:0"
    replay = "tcp://*:0"
    if port is not None and all(_port_free(port + 1000 + r) for r in range(dp_size)):
        replay = f"tcp://*:{port + 1000}"
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=pub,
                          replay_endpoint=replay, topic=TOPIC)


# vLLM's file-based EC connector: the one whose files the worker hands over (actors.engines.ec_staging)
EC_FILE_CONNECTOR = "ECExampleConnector"


def ec_transfer_config(role: Role, consumer: bool, engine_args: Mapping[str, Any]) -> tuple[dict[str, Any] | None, Path | None, bool]:
    """E/P/D: (the engine's ``ec_transfer_config``, its connector directory, whether that directory
    is ours to remove). An encode engine produces (vLLM's ``ec_producer``: the encoder only), an
    agg or prefill engine beside an encode pool (``consumer``) consumes; each gets a private
    directory of its own. A topology's own ``ec_transfer_config`` wins: with the file connector
    and no ``shared_storage_path`` it gets our directory; with another connector (which carries
    the outputs itself) no directory is staged at all, and an encode engine is refused, since
    its worker hands over the files. (None, None, False) for an engine with no part in E/P/D."""
    given = engine_args.get("ec_transfer_config")
    if given is None:
        ec_role = "ec_producer" if role == "encode" else "ec_consumer" if consumer and role in ("agg", "prefill") else None
        if ec_role is None:
            return None, None, False
        root = _private_subdir("ec")
        return ({"ec_connector": EC_FILE_CONNECTOR, "ec_role": ec_role,
                 "ec_connector_extra_config": {"shared_storage_path": str(root)}}, root, True)
    cfg = dict(given) if isinstance(given, Mapping) else dataclasses.asdict(given)
    if cfg.get("ec_connector") != EC_FILE_CONNECTOR:
        if role == "encode":
            raise EngineConfigError(f"an encode worker hands its encoder outputs over as {EC_FILE_CONNECTOR} files; "
                                    f"ec_transfer_config names {cfg.get('ec_connector')!r}", ("ec_transfer_config",))
        return cfg, None, False
    if role == "encode" and cfg.get("ec_role") != "ec_producer":
        raise EngineConfigError(f"an encode worker's ec_transfer_config needs ec_role = \"ec_producer\", "
                                f"not {cfg.get('ec_role')!r}", ("ec_transfer_config",))
    extra = dict(cfg.get("ec_connector_extra_config") or {})
    if extra.get("shared_storage_path"):
        root = Path(str(extra["shared_storage_path"])).expanduser()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        return cfg, root, False
    root = _private_subdir("ec")
    cfg["ec_connector_extra_config"] = {**extra, "shared_storage_path": str(root)}
    return cfg, root, True


def _private_subdir(prefix: str) -> Path:
    """A fresh directory only this user can enter, in ``_ipc_dir`` (one per engine: an engine
    restarted in the same process gets a new one)."""
    path = Path(_ipc_dir()) / f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    return path


def _port_free(port: int) -> bool:
    if not 0 < port < 65536:
        return False
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class _DropIterationLines(logging.Filter):
    """Drops vLLM's per-iteration line (``LoggingStatLogger._log_iteration_details``), one per
    engine step, from the logger that emits it; its periodic throughput lines stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and "Iteration(%d)" in record.msg)


_ITERATION_FILTER = _DropIterationLines()


def quiet_iteration_lines() -> None:
    """Keep the step details we turn on out of vLLM's log (idempotent: one filter per process)."""
    logging.getLogger("vllm.v1.metrics.loggers").addFilter(_ITERATION_FILTER)


def engine_arg_names() -> set[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def build_engine_args(engine_args: Mapping[str, Any], role: Role = "agg",
                      served_model_name: str | None = None,
                      kv_events_port: int | None = None) -> Any:
    """The topology's args plus our defaults, as a vLLM ``AsyncEngineArgs``.

    Raises ValueError naming any key vLLM does not know, or the reason vLLM rejected a value.
    """
    from vllm import config as vcfg
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = dict(engine_args)
    unknown = sorted(set(args) - engine_arg_names())
    if unknown:
        raise EngineConfigError(f"unknown vLLM engine arg(s): {', '.join(unknown)} "
                                "(see `vllm serve --help` for the valid names, with '-' as '_')", tuple(unknown))
    if "model" not in args:
        raise EngineConfigError("engine args need a 'model' (a path, a hub id, or 'tiny')", ("model",))
    args["model"] = resolve_model_path(str(args["model"]))
    if args.get("tokenizer") == "tiny":
        args["tokenizer"] = args["model"]
    if served_model_name and "served_model_name" not in args:
        args["served_model_name"] = served_model_name
    cpu = is_cpu_platform()
    args.setdefault("enable_prefix_caching", True)
    # Our stat logger feeds stats(); vLLM's periodic log lines would only add noise.
    args.setdefault("disable_log_stats", True)
    # Per-step timings for the load-mode planner (StatsSink's step samples). vLLM's own
    # LoggingStatLogger logs each iteration's details at INFO; it only exists when a topology
    # turns vLLM's log stats back on, and then the per-step lines are dropped unless the topology
    # asked for them itself.
    if "enable_logging_iteration_details" not in args:
        args["enable_logging_iteration_details"] = True
        if not args["disable_log_stats"]:
            quiet_iteration_lines()
    if cpu:
        args.setdefault("block_size", CPU_BLOCK_SIZE)
        args.setdefault("enforce_eager", True)  # CPU: compile costs ~20 s at start and decodes slower
    elif sleep_mode_available():
        # a sleeping GPU engine frees its memory (level 1: weights offloaded to host memory, KV
        # cache dropped; level 2: both dropped) only when it started with vLLM's sleep mode;
        # without it, sleep merely pauses scheduling. vLLM-CPU refuses the flag (and frees nothing)
        args.setdefault("enable_sleep_mode", True)
    if role == "encode":
        # an encode worker names each image of a run uniquely (its outputs must be written anew
        # every time: actors.engines.ec_staging), so vLLM's processor cache would never hit
        args.setdefault("mm_processor_cache_gb", 0)
    if role == "embed":
        # vLLM's pooling runner: a generative checkpoint (the tiny Llama) is converted to an
        # embedding model (last-token pooling, normalized), as `vllm serve --runner pooling` does
        args.setdefault("runner", "pooling")
    if "kv_events_config" not in args and role not in NO_KV_EVENT_ROLES:
        args["kv_events_config"] = kv_events_config(kv_events_port,
                                                    int(args.get("data_parallel_size") or 1))
    for key, cls_name in _DICT_CONFIGS.items():
        if isinstance(args.get(key), dict):
            try:
                args[key] = getattr(vcfg, cls_name)(**args[key])
            except (TypeError, ValueError) as e:
                raise EngineConfigError(f"bad {key}: {plain(str(e))}", (key,)) from e
    try:
        return AsyncEngineArgs(**args)
    except TypeError as e:  # kept for safety: the name check above should catch these first
        raise EngineConfigError(f"bad vLLM engine args: {e}") from e


def create_vllm_config(args: Any, given: Mapping[str, Any] | None = None) -> Any:
    """Run vLLM's own validation; its pydantic/Value errors become one EngineConfigError, naming
    the args of ``given`` (the topology's) that vLLM's message names."""
    from vllm.usage.usage_lib import UsageContext

    try:
        return args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        raise EngineConfigError(f"vLLM rejected the engine args: {plain(str(e))}", _named(str(e), given or {})) from e


def plain(message: str) -> str:
    """pydantic's message on one line, without its trailers: ``[type=..., input_value=<every
    arg>, ...]`` (the whole args again) and "For further information visit <url>"."""
    message = re.sub(r"\s*\[type=.*?input_type=[\w.]+\]", "", message, flags=re.S)
    message = re.sub(r"\s*For further information visit \S+", "", message)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0] + (": " + "; ".join(lines[1:]) if len(lines) > 1 else "") if lines else ""


def _named(message: str, given: Mapping[str, Any]) -> tuple[str, ...]:
    """The given args a vLLM error is about: pydantic puts a field's name at the start of a line
    ("dtype.literal[...]", "max_num_seqs"), a validator writes it in its sentence ("User-specified
    max_model_len (...)"); only names in ``given`` count, so a default is never blamed."""
    return tuple(k for k in given if re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", message))


def check_config(engine_args: Mapping[str, Any], role: Role = "agg", served_model_name: str | None = None,
                 env: Mapping[str, str] | None = None, ec_consumer: bool = False) -> None:
    """Build the engine's ``VllmConfig`` as ``VllmEngine`` will, with its env, and no engine: no
    weights are read (vLLM reads the model's config.json, and its tokenizer's config files where
    the arguments ask for them), no process starts. Raises EngineConfigError for what vLLM rejects."""
    import vllm.envs

    args = dict(engine_args)
    ec, root, owned = ec_transfer_config(role, ec_consumer, args)
    try:
        if ec is not None:
            args["ec_transfer_config"] = ec
        built = build_engine_args(args, role, served_model_name)
        cpu = is_cpu_platform()
        full = {k: v for k, v in default_env(cpu).items() if k not in os.environ}
        full.update(env or {})
        vllm.envs.disable_envs_cache()  # the config reads this env, as the engine's build does
        with applied_env(full):
            create_vllm_config(built, engine_args)
    finally:
        if owned and root is not None:
            shutil.rmtree(root, ignore_errors=True)
