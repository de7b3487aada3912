"""How a worker process is named, started and configured: facts the spawner (``deploy.pools``), the
profiler (``actors.planner.profile``), the worker process itself (``actors.worker.process``) and the
frontend's readiness all derive from the topology.

``--set`` overrides travel to the worker in the environment (``OVERRIDES_ENV``), not on its
command line: they may carry secrets (``bus.auth.password=...``), and any local user can read
another process's command line, while its environment is readable by its owner alone.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path

import msgspec

from config.names import check_token
from config.topology import BusAuth, BusConfig, PoolConfig, Topology

OVERRIDES_ENV = "VLLM_ACTORS_SET"  # JSON list of "key.path=value" overrides for a worker process
# a frontend process (frontend.processes > 1): the descriptor number of its end of the connection
# hand-over with the root (deploy.frontends, actors.frontend.handoff)
HANDOFF_FD_ENV = "VLLM_ACTORS_HANDOFF_FD"
MAX_REPLICA = 1023  # replica indices a spawn may ask for (ports and names are derived from them)
# bus.scoped_workers: what the root hands a worker process at each start, in its environment (read
# by its owner alone): the instance id its credentials are scoped to, and its bus user and secret
INSTANCE_ENV = "VLLM_ACTORS_INSTANCE"
BUS_USER_ENV = "VLLM_ACTORS_BUS_USER"
BUS_PASSWORD_ENV = "VLLM_ACTORS_BUS_PASSWORD"


def embeds_nats(t: Topology) -> bool:
    return t.bus.url is None


def bus_url(t: Topology) -> str:
    return t.bus.url or f"nats://127.0.0.1:{t.bus.port}"


def kv_replicas(t: Topology) -> int:
    """JetStream replicas of the registry buckets: ``bus.kv_replicas``, else 3 on an embedded
    cluster of three or more servers (one server may then be lost), else 1. A cluster of two
    gets 1: a replicated stream needs a majority, so R2 would stop with either server."""
    if t.bus.kv_replicas is not None:
        return t.bus.kv_replicas
    servers = len(t.bus.cluster.servers) if t.bus.cluster is not None else 1
    return 3 if servers >= 3 else 1


def server_name(t: Topology, host: str) -> str:
    """The nats-server name of ``host``'s embedded server in a cluster: JetStream knows its peers
    by name, so it must stay the same across restarts (a new name would be a new peer)."""
    return f"{t.namespace}-{host}"


def worker_bus(t: Topology, env: Mapping[str, str] | None = None) -> BusConfig:
    """What a worker process connects with: the user its root issued it (``bus.scoped_workers``,
    handed over in ``env``), else ``bus.worker_auth`` when the topology gives workers a user of
    their own (per-role permissions), else the deployment's ``bus.auth``."""
    env = os.environ if env is None else env
    user = env.get(BUS_USER_ENV)
    if user:
        return msgspec.structs.replace(t.bus, auth=BusAuth(user=user, password_env=BUS_PASSWORD_ENV))
    if t.bus.worker_auth is None:
        return t.bus
    return msgspec.structs.replace(t.bus, auth=t.bus.worker_auth)


def new_instance(pool: str, replica: int) -> str:
    """A worker process's instance id: new at every start of the process (a restarted process is a
    new incarnation), stable across its engine's restarts."""
    return f"{pool}-{replica}-{secrets.token_hex(3)}"


def given_instance(pool: str, replica: int, env: Mapping[str, str] | None = None) -> str:
    """The instance id the root chose for this process (``INSTANCE_ENV``: its bus credentials are
    scoped to it), else a new one. A malformed one is an error naming the variable."""
    raw = (os.environ if env is None else env).get(INSTANCE_ENV)
    if not raw:
        return new_instance(pool, replica)
    try:
        return check_token(raw)
    except ValueError as e:
        raise ValueError(f"{INSTANCE_ENV}: {e}") from None


def worker_child_id(pool: str, replica: int) -> str:
    """The root's child id of a worker process (also the worker supervisor's name, and what the
    frontend's readiness looks up in the children views)."""
    return f"worker-{pool}-{replica}"


def frontend_child_id(index: int) -> str:
    """The root's child id of frontend process ``index`` (``frontend.processes`` > 1; also the name
    of that process's own supervisor)."""
    return f"frontend-{index}"


def frontend_instance(host: str, index: int) -> str:
    """Frontend process ``index``'s actor instance (its registry key, its /metrics label)."""
    return f"frontend-{host}-{index}"


def worker_argv(topology_path: str | Path, pool: str, replica: int) -> list[str]:
    """The command of a worker process: no override on it (they travel in ``worker_env``)."""
    return [sys.executable, "-m", "actors.worker.process", "--topology", str(Path(topology_path).resolve()),
            "--pool", pool, "--replica", str(replica)]


def worker_overrides(t: Topology, overrides: list[str]) -> list[str]:
    if embeds_nats(t):
        # the worker joins this host's embedded server instead of embedding its own
        return [*overrides, f"bus.url={bus_url(t)}"]
    return list(overrides)


def worker_env(t: Topology, pool: PoolConfig, overrides: list[str]) -> dict[str, str]:
    """What a worker process gets on top of its parent's environment: the pool's ``env`` and the
    overrides (``OVERRIDES_ENV``)."""
    return {**pool.env, OVERRIDES_ENV: json.dumps(worker_overrides(t, overrides))}


def overrides_from_env(env: dict[str, str] | None = None) -> list[str]:
    """The overrides a worker was given by its supervisor (empty when started by hand)."""
    raw = (env if env is not None else os.environ).get(OVERRIDES_ENV)
    if not raw:
        return []
    value = json.loads(raw)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{OVERRIDES_ENV} must be a JSON list of strings")
    return value
