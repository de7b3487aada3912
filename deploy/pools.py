"""Worker processes as the root supervisor's children: their command, their child spec, and the
only way to add one at run time (``PoolSpawner``: a pool and a replica index, never a command).

Why no command ever comes from a message: whoever reaches the bus would run what they like as the
deployment's user. A spawn names a pool of the topology; the command is built here from the
topology file this process was started with, exactly as at start-up.

``--set`` overrides travel to the worker in its environment (``config.workers.OVERRIDES_ENV``).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from bus.auth_callout import WorkerAuthority
from bus.errors import BadRequest, Conflict, NotFound
from config.topology import Topology
from config.workers import (
    BUS_PASSWORD_ENV,
    BUS_USER_ENV,
    INSTANCE_ENV,
    MAX_REPLICA,
    new_instance,
    worker_argv,
    worker_child_id,
    worker_env,
)
from deploy.worker_scope import worker_scope
from supervisors.child import Child, ChildSpec


def scoped_env(t: Topology, name: str, replica: int, authority: WorkerAuthority) -> dict[str, str]:
    """A new incarnation's instance id and the bus user issued for it alone (``bus.scoped_workers``):
    what its process gets in its environment. Any earlier grant of this child is revoked."""
    pool = t.pools[name]
    cid = worker_child_id(name, replica)
    instance = new_instance(name, replica)
    scope = worker_scope(t.namespace, name, instance, pool.host, cid, t.model.name if t.model else None)
    secret = authority.issue(cid, instance, scope.publish, scope.subscribe)
    return {INSTANCE_ENV: instance, BUS_USER_ENV: instance, BUS_PASSWORD_ENV: secret}


def worker_spec(t: Topology, name: str, replica: int, topology_path: str | Path,
                overrides: list[str], authority: WorkerAuthority | None = None) -> tuple[ChildSpec, list[str]]:
    """(child spec, argv) of replica ``replica`` of pool ``name``. ``authority``: the root's issuer
    of per-process bus users (``bus.scoped_workers``): every start gets a user of its own."""
    pool = t.pools[name]
    argv = worker_argv(topology_path, name, replica)
    cid = worker_child_id(name, replica)
    env = worker_env(t, pool, overrides)
    # engines load for minutes; the mocker is up in seconds
    ready_timeout = 60.0 if pool.engine == "mocker" else 900.0

    def start() -> Child:
        from supervisors.process import EXIT_DONE, ProcessChild
        full = env if authority is None else {**env, **scoped_env(t, name, replica, authority)}
        return ProcessChild(cid, argv, env=full, ready_timeout=ready_timeout,
                            normal_exit_codes=(0, EXIT_DONE))

    # the worker's own shutdown drains in-flight requests first, then stops its engine
    shutdown = pool.supervisor.shutdown_timeout + pool.sleep.drain_timeout
    # checkpoint pools: a worker whose snapshot was taken exits for good (not restarted)
    restart = "transient" if pool.checkpoint.control_dir else "permanent"
    # workers depend on no sibling worker: their engines load at once (after nats and inproc)
    spec = ChildSpec(cid, start, restart, shutdown, parallel=True,
                     meta={"pool": name, "replica": str(replica), "role": pool.role, "engine": pool.engine})
    return spec, argv


class PoolSpawner:
    """Adds a replica of a pool this root runs: what ``spawn`` on the root's micro service does.

    The request names a pool and (optionally) a replica index; the host is the supervisor's own
    (its subject names it). Everything else comes from the topology."""

    def __init__(self, t: Topology, topology_path: str | Path, overrides: list[str],
                 shares: Collection[str], authority: WorkerAuthority | None = None) -> None:
        self.t = t
        self.topology_path = topology_path
        self.overrides = list(overrides)
        self.shares = set(shares)
        self.authority = authority  # the root's issuer of per-process bus users (bus.scoped_workers)

    def spec(self, pool: str, replica: int | None, taken: Collection[str]) -> ChildSpec:
        """The child spec for the new replica, or a typed error (the pool is unknown, runs on
        another host, or the replica exists already). ``taken``: the supervisor's child ids."""
        cfg = self.t.pools.get(pool)
        if cfg is None:
            raise NotFound(f"spawn: no pool {pool!r} in the topology (pools: {', '.join(self.t.pools) or 'none'})")
        if cfg.host not in self.shares:
            raise BadRequest(f"spawn: pool {pool!r} runs on host {cfg.host!r}; ask that host's supervisor")
        if replica is None:
            replica = next(i for i in range(MAX_REPLICA + 2) if worker_child_id(pool, i) not in taken)
        if not 0 <= replica <= MAX_REPLICA:
            raise BadRequest(f"spawn: replica must be between 0 and {MAX_REPLICA}")
        if cfg.status_port is not None and cfg.status_port + replica > 65535:
            raise BadRequest(f"spawn: replica {replica}'s status port {cfg.status_port + replica} exceeds 65535")
        if worker_child_id(pool, replica) in taken:
            raise Conflict(f"spawn: replica {replica} of pool {pool!r} exists already "
                           f"({worker_child_id(pool, replica)})")
        return worker_spec(self.t, pool, replica, self.topology_path, self.overrides, self.authority)[0]
