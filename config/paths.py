"""Where vllm-actors keeps its files on this machine: built models, downloaded LoRA adapters,
generated identity adapters, and a deployment's run dir (logs, the embedded server's store, the
planner's profiles)."""

from __future__ import annotations

import os
from pathlib import Path

from config.topology import Topology

HOME_ENV = "VLLM_ACTORS_HOME"
DEFAULT_HOME = "~/.cache/vllm-actors"


def vllm_actors_home() -> Path:
    """``$VLLM_ACTORS_HOME``, else ``~/.cache/vllm-actors`` (an empty variable counts as unset)."""
    return Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).expanduser()


def run_dir(t: Topology) -> Path:
    """The deployment's run dir: ``run_dir``, else ``~/.cache/vllm-actors/run/<namespace>``."""
    if t.run_dir:
        return Path(t.run_dir).expanduser()
    # under the default home, not $VLLM_ACTORS_HOME: run state follows the user's HOME (a test or a
    # second user with its own HOME gets its own run dir while sharing one model cache)
    return Path(DEFAULT_HOME).expanduser() / "run" / t.namespace


def nats_store(t: Topology, host: str) -> Path:
    """The JetStream store of ``host``'s embedded nats-server: ``bus.store_dir``, else
    ``<run_dir>/nats-<bus port>`` (a host tells deployments of one namespace apart by their port).
    A cluster member's store is its own (``<store_dir>/<host>``, ``<run_dir>/nats-<host>-<port>``):
    hosts may share a file system, and one store is one server's."""
    cluster = t.bus.cluster is not None
    if t.bus.store_dir:
        base = Path(t.bus.store_dir).expanduser()
        return base / host if cluster else base
    return run_dir(t) / (f"nats-{host}-{t.bus.port}" if cluster else f"nats-{t.bus.port}")


def profile_dir(t: Topology) -> Path:
    """Where the planner's profiles live: ``planner.profile_dir``, else ``<run_dir>/profiles``."""
    if t.planner.profile_dir:
        return Path(t.planner.profile_dir).expanduser()
    return run_dir(t) / "profiles"


def profile_path(t: Topology, pool: str) -> Path:
    """The profile file of ``pool`` that the planner reads and the profiler writes by default:
    ``planner.pools.<pool>.profile``, else ``<profile_dir>/<pool>.json``."""
    pp = t.planner.pools.get(pool)
    if pp is not None and pp.profile:
        return Path(pp.profile).expanduser()
    return profile_dir(t) / f"{pool}.json"
