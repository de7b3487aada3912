"""Several "hosts" on one Linux box: network namespaces joined by veth pairs to a bridge.

``Hosts(("a", "b"))`` creates one namespace per host plus a "switch" namespace that holds a bridge;
each host's ``eth0`` is one end of a veth pair whose other end is a bridge port in the switch. Every
address lives inside those namespaces: nothing is created or changed in the root namespace (no
interface, route or sysctl), so a run cannot disturb the machine or another run.

Names carry the creating pid (``va<pid>-<x>-<y>-<host>``, 10.<x>.<y>.0/24 the hosts' subnet):
concurrent runs pick distinct subnets, and ``sweep_leftovers`` deletes the namespaces of runs whose
pid is gone (a SIGKILLed pytest cannot clean up after itself).

Commands run in a host with ``Host.popen``/``Host.run`` (``ip netns exec``). Python code of the test
process reaches into a host with ``Host.loop()``: an asyncio loop on a thread that ``setns(2)``'d into
the host's namespace, so every socket the loop opens (aiohttp, nats-py) belongs to that host. setns of
a network namespace moves the calling thread only; the rest of the test process stays in the root.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import ctypes
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

IP = shutil.which("ip") or "/usr/sbin/ip"  # /usr/sbin is not on every PATH
PREFIX = "va"
NETNS_DIR = "/run/netns"  # where `ip netns add` bind-mounts a namespace (iproute2's NETNS_RUN_DIR)
HOST_IF = "eth0"  # a host's end of its veth pair; interface names are per namespace, so no clash
BRIDGE = "br0"
_HOST_NAME = re.compile(r"[a-z][a-z0-9]{0,11}")  # "p" + name must fit IFNAMSIZ (15 chars)
_CLONE_NEWNET = 0x40000000
_KILL_WAIT_S = 10.0


def _ip(*args: str, ip: str = IP) -> str:
    """Run ``ip ARGS``; RuntimeError with its stderr when it fails."""
    r = subprocess.run([ip, *args], capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout


def netns_names() -> list[str]:
    """Names of every named network namespace on this machine (``ip netns list``)."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def netns_pids(netns: str) -> list[int]:
    """Processes whose network namespace is ``netns`` (never this process: only threads of it enter)."""
    return [int(p) for p in _ip("netns", "pids", netns).split() if int(p) != os.getpid()]


def _delete(netns: str) -> None:
    """Kill every process in ``netns``, then delete it.

    Processes first: ``ip netns del`` only removes the name, and a namespace lives on, invisible,
    for as long as a process is in it."""
    deadline = time.monotonic() + _KILL_WAIT_S
    while pids := netns_pids(netns):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in {netns} survive SIGKILL")
        time.sleep(0.02)
    _ip("netns", "del", netns)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces ``prefix<pid>-...`` whose pid is gone (runs killed before cleanup);
    returns their names. A live pid's namespaces are left alone: that run may still be using them."""
    removed = []
    for ns in netns_names():
        m = re.match(re.escape(prefix) + r"(\d+)-", ns)
        if m and not _pid_alive(int(m[1])):
            _delete(ns)
            removed.append(ns)
    return removed


def available(ip: str = IP) -> str | None:
    """None when this process can create namespaces, a bridge and veth pairs; else why not."""
    if os.geteuid() != 0:
        return f"network namespaces need root (euid {os.geteuid()})"
    if not (shutil.which(ip) and os.access(ip, os.X_OK)):
        return f"no iproute2 `ip` command at {ip}"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe, ip=ip)
    except RuntimeError as e:
        return f"cannot create a network namespace: {e}"
    try:
        # the kernel may lack the bridge or veth driver (modules off) even where namespaces work
        _ip("-n", probe, "link", "add", BRIDGE, "type", "bridge", ip=ip)
        _ip("-n", probe, "link", "add", HOST_IF, "type", "veth", "peer", "name", "p0", ip=ip)
    except RuntimeError as e:
        return f"cannot create a bridge and a veth pair in a namespace: {e}"
    finally:
        _ip("netns", "del", probe, ip=ip)
    return None


def enter_netns(netns: str) -> None:
    """Move the calling thread (only it) into ``netns``; sockets it creates from now on live there.

    Never call it on a thread that will do anything else afterwards: the thread does not come back."""
    fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, os.CLONE_NEWNET)
        elif ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


class NetnsLoop:
    """An asyncio event loop on its own thread inside a network namespace.

    ``run(coro)`` blocks the caller until the coroutine finishes on that loop; ``await arun(coro)``
    does the same from another event loop (an async test's). Objects made on this loop (aiohttp
    sessions and servers, nats clients) must only be used by coroutines passed to it. Threads the
    loop starts (its default executor: getaddrinfo) are born in the namespace too."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), name=f"netns-{netns}",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _main(self, ready: threading.Event) -> None:
        try:
            enter_netns(self.netns)
            loop = asyncio.new_event_loop()  # made in the namespace, with everything it opens
        except BaseException as e:
            self._error = e
            ready.set()
            return
        asyncio.set_event_loop(loop)
        self._loop = loop
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._loop is None or self._loop.is_closed():
            coro.close()
            raise RuntimeError(f"the loop in {self.netns} is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        fut = self._submit(coro)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(self._submit(coro))

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await loop.shutdown_asyncgens()
        await loop.shutdown_default_executor()

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and join its thread (idempotent)."""
        loop = self._loop
        if loop is None or loop.is_closed() or not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(_KILL_WAIT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(_KILL_WAIT_S)

    def __enter__(self) -> NetnsLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Host:
    """One namespace of a ``Hosts``: its address on the switch and ways to run things in it."""

    def __init__(self, name: str, netns: str, address: str, switch_netns: str) -> None:
        self.name = name
        self.netns = netns
        self.address = address
        self.switch_port = f"p{name}"  # its veth peer, a port of the bridge in the switch namespace
        self._switch_netns = switch_netns
        self._procs: list[subprocess.Popen[Any]] = []
        self._loops: list[NetnsLoop] = []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, netns={self.netns!r}, address={self.address!r})"

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the namespace, in its own session (``os.killpg(p.pid, sig)`` reaches
        everything it forks). ``ip netns exec`` execs the command: ``p.pid`` is the command's pid."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen([IP, "netns", "exec", self.netns, *argv], **kw)
        self._procs.append(p)
        return p

    def run(self, argv: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the namespace to completion; stdout and stderr captured as text."""
        return subprocess.run([IP, "netns", "exec", self.netns, *argv], capture_output=True,
                              text=True, timeout=timeout)

    def loop(self) -> NetnsLoop:
        """A new event loop living in this host's namespace (close it, or leave that to ``Hosts``)."""
        lp = NetnsLoop(self.netns)
        self._loops.append(lp)
        return lp

    def link_down(self) -> None:
        """Cut this host off the switch (its bridge port goes down). Its processes keep running and
        its loopback still works; packets to and from the others are dropped, as on a pulled cable."""
        _ip("-n", self._switch_netns, "link", "set", self.switch_port, "down")

    def link_up(self) -> None:
        _ip("-n", self._switch_netns, "link", "set", self.switch_port, "up")

    def pids(self) -> list[int]:
        return netns_pids(self.netns)

    def kill_all(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process in the namespace; returns the pids signalled."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def _close(self) -> None:
        try:
            for lp in self._loops:
                lp.close()
        finally:  # a loop whose tasks ignore cancellation must not keep the namespace alive
            # Our own children first, by their sessions: one started just before may not have
            # entered the namespace yet (`ip netns exec` joins it after Popen returns), so
            # `ip netns pids` misses it and it would outlive the namespace's name.
            for p in self._procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
            _delete(self.netns)
            for p in self._procs:  # reap our children: no zombie stays
                p.wait(_KILL_WAIT_S)


class Hosts:
    """Context manager: ``with Hosts(("a", "b")) as hosts: hosts["a"].address``.

    Leaving it (normally, by an exception or KeyboardInterrupt) kills every process in the
    namespaces and deletes them; an atexit hook does the same if the ``with`` is never left."""

    def __init__(self, names: Sequence[str] = ("a", "b", "c"), prefix: str = PREFIX) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and at least one: {names!r}")
        for n in names:
            if not _HOST_NAME.fullmatch(n):
                raise ValueError(f"host name {n!r} must match {_HOST_NAME.pattern}")
        if len(names) > 250:
            raise ValueError("at most 250 hosts on one /24")
        self.names = tuple(names)
        self.prefix = prefix
        self.switch = ""
        self.subnet = ipaddress.IPv4Network("10.0.0.0/24")
        self._hosts: dict[str, Host] = {}
        self._created: list[str] = []

    def _pick_subnet(self) -> tuple[int, int]:
        """10.<x>.<y>.0/24, x in 100..250, not used by any namespace of ours alive now."""
        taken = set()
        for ns in netns_names():
            m = re.match(re.escape(self.prefix) + r"\d+-(\d+)-(\d+)", ns)
            if m:
                taken.add((int(m[1]), int(m[2])))
        while True:
            xy = (random.randint(100, 250), random.randint(0, 255))
            if xy not in taken:
                return xy

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")  # servers bind 127.0.0.1 in every host

    def __enter__(self) -> Hosts:
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        x, y = self._pick_subnet()
        self.subnet = ipaddress.IPv4Network(f"10.{x}.{y}.0/24")
        base = f"{self.prefix}{os.getpid()}-{x}-{y}"
        self.switch = base
        self._add_netns(self.switch)
        _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")  # STP off: ports forward at once
        _ip("-n", self.switch, "link", "set", BRIDGE, "up")
        for i, name in enumerate(self.names, start=1):
            host = Host(name, f"{base}-{name}", str(self.subnet[i]), self.switch)
            self._add_netns(host.netns)
            self._hosts[name] = host
            # both ends are born in their namespaces: nothing ever touches the root namespace
            _ip("-n", host.netns, "link", "add", HOST_IF, "type", "veth",
                "peer", "name", host.switch_port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", host.switch_port, "master", BRIDGE, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", HOST_IF)
            _ip("-n", host.netns, "link", "set", HOST_IF, "up")

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in every namespace and delete the namespaces (idempotent)."""
        atexit.unregister(self.close)
        errors: list[str] = []
        for host in list(self._hosts.values()):
            try:
                host._close()
            except Exception as e:  # noqa: BLE001 - clean the other namespaces, then report it
                errors.append(f"{host.name}: {e!r}")
            self._created.remove(host.netns)
        self._hosts.clear()
        for ns in self._created:  # the switch, and a host namespace whose setup failed half way
            try:
                _delete(ns)
            except Exception as e:  # noqa: BLE001 - as above
                errors.append(f"{ns}: {e!r}")
        self._created.clear()
        if errors:
            raise RuntimeError("netns cleanup: " + "; ".join(errors))

    def __getitem__(self, name: str) -> Host:
        return self._hosts[name]

    def __iter__(self) -> Iterator[Host]:
        return iter(self._hosts.values())
