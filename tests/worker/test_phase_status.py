"""A worker's STATUS= lines name the phase it is in (the host's root shows them while it starts)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from actors.worker.process import PhaseNotifier, engine_phase


@pytest.mark.parametrize(("line", "phase"), [
    ("worker-a-0: starting 3 children", "starting 3 children"),
    ("worker-a-0: starting engine", "engine loading"),
    ("worker-a-0: starting kv-publisher", "engine up, starting kv-publisher"),
    ("worker-a-0: all 3 children up", "serving"),
    ("worker-a-0: all children up", "serving"),
    ("worker-a-0: restarting engine in 0.5s: boom", "restarting engine in 0.5s: boom"),
])
def test_engine_phase(line: str, phase: str) -> None:
    assert engine_phase("worker-a-0", line) == phase


def test_phase_notifier_sends_phases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    n = PhaseNotifier("worker-a-0")
    try:
        n.status("worker-a-0: starting engine")
        n.ready("worker-a-0: all children up")
        assert sock.recv(4096) == b"STATUS=engine loading"
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving"
    finally:
        n.close()
        sock.close()
