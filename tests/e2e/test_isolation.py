"""Deployments on one host do not share state: each ``python -m actors.supervisor`` embeds its
nats-server with a JetStream store of its own (``<run_dir>/nats-<bus port>``), a second deployment
on a store in use is refused naming the owner, and worker status ports stay on loopback.

``run_dir`` is left at its default here (that default is what is under test), so HOME points at a
tmp dir: nothing touches the real ~/.cache. VLLM_ACTORS_HOME keeps the locally built tiny model.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.e2e.conftest import Deployment, shutdown
from tests.helpers import listening_hosts

PROMPT = [{"role": "user", "content": "Say something about lighthouses."}]


def deployment(tmp: Path, namespace: str, env: dict[str, str], bus_port: int | None = None) -> Deployment:
    """A mocker-agg deployment with the default run_dir (conftest's Deployment pins one)."""
    tmp.mkdir()
    d = Deployment("mocker-agg.toml", tmp, namespace, status_pools={"agg": 1}, env=env)
    i = d.args.index(f"run_dir={tmp / 'run'}")
    del d.args[i - 1:i + 1]
    if bus_port is not None:
        d.args[d.args.index(f"bus.port={d.bus_port}")] = f"bus.port={bus_port}"
        d.bus_port = bus_port
    return d


def store_of(d: Deployment, env: dict[str, str]) -> Path:
    return Path(env["HOME"]) / ".cache" / "vllm-actors" / "run" / d.namespace / f"nats-{d.bus_port}"


def chat(d: Deployment) -> str:
    c = OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=30)
    r = c.chat.completions.create(model=d.model, messages=PROMPT, max_tokens=8)  # type: ignore[arg-type]
    assert r.choices[0].message.content
    return r.choices[0].message.content


@pytest.fixture
def started() -> Iterator[list[Deployment]]:
    """Deployments a test started; whatever is still running at the end is stopped and reaped."""
    ds: list[Deployment] = []
    yield ds
    for d in reversed(ds):
        if d.proc is not None and d.proc.poll() is None:
            d.stop(30)
        elif d.proc is not None:
            d.stop(1)  # reap what its group left


def test_same_namespace_and_bus_port_is_refused(tmp_path: Path, home: dict[str, str],
                                                started: list[Deployment]) -> None:
    ns = f"iso{os.getpid()}"
    first = deployment(tmp_path / "first", ns, home)
    started.append(first)
    first.start()
    first.wait_ready({"agg": 1}, 60)
    assert (store_of(first, home) / "owner.lock").exists()

    second = deployment(tmp_path / "second", ns, home, bus_port=first.bus_port)
    started.append(second)
    second.start()
    assert second.proc is not None
    try:
        # a permanent configuration error: the root gives up after its restart intensity
        rc = second.proc.wait(180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the second deployment kept running:\n{second.output()}")
    out = second.output(20000)
    assert rc != 0, out
    assert f"JetStream store {store_of(first, home)} is in use by pid {first.proc.pid} " in out, out  # type: ignore[union-attr]
    assert "set bus.store_dir or bus.port to run another deployment" in out
    second.stop(5)
    assert not second.leftovers, out

    chat(first)  # the owner serves on, unharmed
    shutdown(first)


def test_two_deployments_on_different_ports_both_serve(tmp_path: Path, home: dict[str, str],
                                                       started: list[Deployment]) -> None:
    ns = f"iso{os.getpid()}"
    a = deployment(tmp_path / "a", ns, home)
    b = deployment(tmp_path / "b", ns, home)
    started += [a, b]
    a.start()
    b.start()
    a.wait_ready({"agg": 1}, 90)
    b.wait_ready({"agg": 1}, 90)
    chat(a)
    chat(b)
    # each sees only its own worker: the registries live in different stores
    assert len(a.instances()) == 1 and len(b.instances()) == 1
    assert a.instances() != b.instances()
    assert store_of(a, home) != store_of(b, home)
    assert (store_of(a, home) / "owner.lock").exists() and (store_of(b, home) / "owner.lock").exists()
    for d in (a, b):
        assert listening_hosts(d.status_ports["agg"]) == {"127.0.0.1"}, d.output()
    shutdown(b)
    shutdown(a)
