"""The root's check of every pool's engine configuration at its start, and ``--check``'s.

A worker builds its engine from the topology; an engine arg the engine rejects fails the same way
on every start. This builds what each worker of this host's share would build, without the engine
(``actors.worker.engine_factory.check_engine_config``: vLLM's config, no weights read, no process
started; the mocker's args), and turns a rejection into a ``TopologyError`` naming the setting, so
the command exits 2. vLLM is imported (seconds, a GiB of memory) in a process of its own that ends
with the check: the root supervisor stays small and never initialises an accelerator. ``--check``
waits for it; a start checks the mocker's pools before anything starts, and vLLM's while its tree
starts (the import takes 10-30 s on a small machine, a delay every start would otherwise pay): a
rejection stops what started and exits 2.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import sys
from collections.abc import Collection, Sequence

from bus.process_exit import exit_process
from config.checks import join_keys
from config.loader import TopologyError
from config.topology import Topology

log = logging.getLogger(__name__)

# vLLM's import and config take 5-20 s; a model id on a slow hub can take longer (its config.json
# is fetched). Past this the workers are left to find out themselves.
CHECK_TIMEOUT_S = 600.0

# (pool, problem, engine args it names) for a rejection; (pool, None, ()) when the check passed;
# (pool, "unchecked: ...", ()) when it could not run (an unreachable hub: not the topology's fault)
Outcome = tuple[str, str | None, tuple[str, ...]]


def check_engines(t: Topology, hosts: Collection[str], file: str, overrides: Sequence[str] = (), *,
                  vllm: bool = True) -> None:
    """Raise TopologyError for the first pool on ``hosts`` whose engine rejects its configuration.
    ``vllm`` False: only the pools checked in this process (the mocker's); a start checks vLLM's
    beside itself (``check_vllm_engines``)."""
    pools, in_vllm = _pools(t, hosts)
    outcomes = [check_pool(t, name) for name in pools if name not in in_vllm]
    if vllm and in_vllm:
        outcomes += asyncio.run(_in_own_process(t, in_vllm))  # --check: no loop runs yet
    _raise_first(t, outcomes, file, overrides)


async def check_vllm_engines(t: Topology, hosts: Collection[str], file: str, overrides: Sequence[str] = ()) -> None:
    """``check_engines`` of the vLLM pools, awaited: the root runs it while its tree starts, since
    vLLM's import alone takes 10-30 s here and would delay every start by as much. Cancelled (the
    root stops first), it kills the check's process."""
    _, in_vllm = _pools(t, hosts)
    if in_vllm:
        _raise_first(t, await _in_own_process(t, in_vllm), file, overrides)


def _pools(t: Topology, hosts: Collection[str]) -> tuple[list[str], list[str]]:
    """(the pools of ``hosts``, those of them with a vLLM engine)."""
    pools = [name for name, p in t.pools.items() if p.host in hosts]
    return pools, [name for name in pools if t.pools[name].engine == "vllm"]


def _raise_first(t: Topology, outcomes: list[Outcome], file: str, overrides: Sequence[str]) -> None:
    for pool, problem, keys in outcomes:
        if problem is None:
            continue
        if problem.startswith("unchecked: "):
            log.warning("pools.%s: engine configuration %s", join_keys([pool]), problem)
            continue
        base = ["pools", pool, "engine_args"]
        keys = tuple(k for k in keys if k in t.pools[pool].engine_args)  # not what a worker adds (model)
        key = join_keys(base + [keys[0]] if len(keys) == 1 else base)
        if any(_overlaps(item.partition("=")[0].strip(), key) for item in overrides):
            problem += " (set by --set)"
        raise TopologyError(file, key, problem)


def check_pool(t: Topology, pool: str) -> Outcome:
    """One pool's check, in this process."""
    from actors.engines.config_error import EngineConfigError
    from actors.worker.engine_factory import check_engine_config

    try:
        check_engine_config(t, pool)
    except EngineConfigError as e:
        return pool, str(e), e.keys
    except Exception as e:  # noqa: BLE001 - not a rejection (a model that cannot be read now)
        return pool, f"unchecked: {type(e).__name__}: {e}", ()
    return pool, None, ()


async def _in_own_process(t: Topology, pools: list[str]) -> list[Outcome]:
    """``check_pool`` of each pool in a fresh interpreter (``python -m deploy.engine_check``): the
    topology goes in on stdin (pickled: it holds what --set gave, secrets included, so never on a
    command line), the outcomes come back as JSON on stdout. vLLM's log lines (a starting engine's
    warnings, of no use here) are shown only when the check itself failed. Its process is killed
    when this is cancelled or times out."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deploy.engine_check", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_env())
    try:
        out, err = await asyncio.wait_for(proc.communicate(pickle.dumps((t, pools))), CHECK_TIMEOUT_S)
    except TimeoutError:
        return [(p, f"unchecked: no answer within {CHECK_TIMEOUT_S:g}s", ()) for p in pools]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return _outcomes(pools, out, err, proc.returncode)


def _env() -> dict[str, str]:
    return {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}


def _outcomes(pools: list[str], out: bytes, err: bytes, code: int | None) -> list[Outcome]:
    try:
        return [(pool, problem, tuple(keys)) for pool, problem, keys in json.loads(out)]
    except (ValueError, TypeError):
        said = err.decode(errors="replace").strip()[-800:]
        return [(p, f"unchecked: the check's process exited with code {code}: {said}", ()) for p in pools]


def main() -> int:
    # stdout carries the answer alone: what vLLM prints there (it does, at import) goes to stderr
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    t, pools = pickle.loads(sys.stdin.buffer.read())
    outcomes = [check_pool(t, pool) for pool in pools]
    with answer:
        answer.write(json.dumps(outcomes))
    return 0


def _overlaps(set_key: str, key: str) -> bool:
    """Whether a --set of ``set_key`` may have made ``key`` what it is (one contains the other)."""
    return set_key == key or key.startswith(set_key + ".") or set_key.startswith(key + ".")


if __name__ == "__main__":
    exit_process(main())
