"""Small helpers shared by test modules (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import struct
import time
from collections.abc import Callable
from typing import Any

from openai import AsyncOpenAI


async def eventually(cond: Callable[[], object], timeout: float = 5.0) -> None:
    """Poll ``cond`` until it is true; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


def listening_hosts(port: int) -> set[str]:
    """Addresses with a TCP socket in LISTEN on ``port`` on this machine (/proc/net/tcp{,6}: the
    kernel's view, whatever the server claims)."""
    found: set[str] = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            addr, _, hexport = cols[1].partition(":")
            if cols[3] != "0A" or int(hexport, 16) != port:  # 0A = TCP_LISTEN
                continue
            # the kernel prints each 32-bit word of the address in host byte order
            raw = b"".join(struct.pack("=I", int(addr[i:i + 8], 16)) for i in range(0, len(addr), 8))
            found.add(str(ipaddress.ip_address(raw)))
    return found


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie is dead for our purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def openai_client(base_url: str, **kw: Any) -> AsyncOpenAI:
    """An async OpenAI client on ``base_url`` (the server root) as the tests use it: no retries (a
    test sees the first answer) and a 60 s timeout (a hang fails in a minute, not the library's 10)."""
    kw.setdefault("timeout", 60)
    kw.setdefault("api_key", "none")
    return AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", max_retries=0, **kw)
