"""Checkpoint/restore as a lifecycle, through the CLI (``python -m actors.supervisor TOPOLOGY --set
pools.agg.checkpoint.control_dir=DIR``) with a simulated snapshotter writing the marker files.

Before the snapshot the worker holds no connection to the bus (its engine is built and asleep, the
frontend has no model); ``restore-complete`` makes it connect and serve; ``snapshot-complete`` ends
it for good: the root does not restart it and reports why it stopped.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from actors.worker.checkpoint import READY, RESTORE_DONE, SNAPSHOT_DONE
from tests.chaos import scenarios
from tests.e2e.conftest import Deployment, http_json, private_home, shutdown

BOOT_TIMEOUT_MOCKER = 60.0
BOOT_TIMEOUT_VLLM = 300.0  # engine start on a shared 2-core machine; nothing asserts on speed
PROMPT = [{"role": "user", "content": "Write a short poem about a lighthouse on a stormy night."}]


def deploy(tmp: Path, name: str, topology: str) -> tuple[Deployment, Path]:
    """A deployment whose agg pool runs in checkpoint mode, with a private HOME (default run dir)."""
    control = tmp / "snap"
    d = Deployment(topology, tmp, namespace=f"ckpt{name}{os.getpid()}", status_pools={"agg": 1},
                   sets=[f"pools.agg.checkpoint.control_dir={control}", "pools.agg.checkpoint.poll_interval=0.1"],
                   env=private_home(tmp))
    d.start()
    return d, control


def root_children(d: Deployment) -> dict[str, dict[str, Any]]:
    """The root supervisor's children view by child id, as ``nats req <ns>.supervisor.local.children '{}'``."""
    return {c["id"]: c for c in asyncio.run(scenarios.root_children(d.bus_url, d.namespace))}


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in os.listdir(f"/proc/{p}/task"):
            try:
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
            except OSError:
                continue
    return out


def tcp_remote_ports(pid: int) -> set[int]:
    """Remote ports of the TCP sockets ``pid`` holds: its socket inodes matched in /proc/net/tcp{,6}."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[9] in inodes:
                    ports.add(int(cols[2].rsplit(":", 1)[1], 16))
    return ports


def bus_connections(d: Deployment, pid: int) -> int:
    return sum(d.bus_port in tcp_remote_ports(p) for p in descendants(pid))


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_for_snapshot_point(d: Deployment, control: Path, timeout: float) -> int:
    """Until the worker wrote ready-for-snapshot; its pid from the root's children view."""
    d.wait_until(lambda: (control / READY).exists() or d.proc.poll() is not None, timeout, "ready-for-snapshot")
    assert d.proc.poll() is None, d.output()
    worker = d.wait_until(lambda: root_children(d)["worker-agg-0"], 20, "children view")
    assert worker["state"] == "running" and worker["restart"] == "transient", worker
    return int(worker["pid"])


def assert_not_on_the_bus(d: Deployment, pid: int) -> None:
    """No TCP connection to the bus, no status server, and the frontend has no usable model."""
    time.sleep(1.0)  # anything that would wrongly connect or register has had time to do it
    assert bus_connections(d, pid) == 0, tcp_remote_ports(pid)
    status, body = d.health()
    assert status == 503 and body["instances"] == [], body
    _, models = http_json(f"{d.url}/v1/models")
    assert models["data"] == [], models
    with pytest.raises(OSError):  # the worker's status server does not exist yet
        http_json(f"http://127.0.0.1:{d.status_ports['agg']}/health", timeout=2)


def restore_and_chat(d: Deployment, control: Path, pid: int, timeout: float) -> None:
    (control / RESTORE_DONE).write_text("ok")
    d.wait_ready({"agg": 1}, timeout)
    c = OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content and r.usage.completion_tokens == 8
    # the same process serves (it was restored, not replaced) and now holds its bus connection
    worker = root_children(d)["worker-agg-0"]
    assert worker["pid"] == pid and worker["restarts"] == 0, worker
    assert bus_connections(d, pid) >= 1
    assert not (control / READY).exists()  # a restored worker never asks for a snapshot again


@pytest.mark.slow
def test_mocker_restore_connects_and_serves(tmp_path: Path) -> None:
    d, control = deploy(tmp_path, "restore", "mocker-agg.toml")
    try:
        pid = wait_for_snapshot_point(d, control, BOOT_TIMEOUT_MOCKER)
        assert_not_on_the_bus(d, pid)
        restore_and_chat(d, control, pid, BOOT_TIMEOUT_MOCKER)
    finally:
        shutdown(d)


@pytest.mark.slow
def test_mocker_snapshot_complete_ends_the_worker_for_good(tmp_path: Path) -> None:
    d, control = deploy(tmp_path, "snapshot", "mocker-agg.toml")
    try:
        pid = wait_for_snapshot_point(d, control, BOOT_TIMEOUT_MOCKER)
        (control / SNAPSHOT_DONE).write_text("ok")
        d.wait_until(lambda: not alive(pid), 20, "the snapshotted worker exits")
        end = time.monotonic() + 5.0
        while time.monotonic() < end:  # not restarted: no new process asks for a snapshot
            assert not (control / READY).exists(), d.output()
            assert d.proc.poll() is None, d.output()  # the CLI supervisor keeps running
            time.sleep(0.2)
        worker = root_children(d)["worker-agg-0"]
        assert worker["state"] == "stopped" and worker["pid"] is None and worker["restarts"] == 0, worker
        assert "snapshot complete" in worker["last_exit_reason"], worker
        assert list(control.iterdir()) == []
        assert d.health()[0] == 503  # nothing serves: the image is what lives on
    finally:
        shutdown(d)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_vllm_restore_connects_and_serves(tmp_path: Path) -> None:
    d, control = deploy(tmp_path, "vllm", "agg.toml")
    try:
        pid = wait_for_snapshot_point(d, control, BOOT_TIMEOUT_VLLM)
        assert_not_on_the_bus(d, pid)
        restore_and_chat(d, control, pid, BOOT_TIMEOUT_VLLM)
    finally:
        shutdown(d)

