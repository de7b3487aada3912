"""The namespace harness itself: hosts reach each other at their addresses and only there, a cut link
cuts, nothing leaks into the root namespace or outlives the test."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from tests.multihost import netns
from tests.multihost.conftest import MakeHosts
from tests.multihost.netns import IP, Hosts, available, netns_names, sweep_leftovers


async def serve(address: str, text: str) -> tuple[web.AppRunner, int]:
    """An aiohttp server answering ``text`` on ``address`` and a port the kernel picks."""
    async def hello(_: web.Request) -> web.Response:
        return web.Response(text=text)
    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, address, 0).start()
    return runner, runner.addresses[0][1]


async def get(url: str, timeout: float = 5.0) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(url) as r:
            return await r.text()


async def thread_netns() -> tuple[str, str]:
    """The network namespace of the loop's thread, and of a thread that loop starts (its executor)."""
    here = os.readlink("/proc/thread-self/ns/net")
    there = await asyncio.get_running_loop().run_in_executor(
        None, os.readlink, "/proc/thread-self/ns/net")
    return here, there


def root_state() -> list[str]:
    return [subprocess.run([IP, *args], capture_output=True, text=True, check=True).stdout
            for args in (["-br", "link"], ["-br", "addr"], ["route"], ["-6", "route"])]


def test_topology(make_hosts: MakeHosts) -> None:
    before = root_state()
    hosts = make_hosts(("a", "b", "c"))
    assert root_state() == before, "the root namespace must not change"
    assert [h.name for h in hosts] == ["a", "b", "c"]
    assert [h.address for h in hosts] == [str(hosts.subnet[i]) for i in (1, 2, 3)]
    names = netns_names()
    assert hosts.switch in names
    for h in hosts:
        assert h.netns in names and h.netns.startswith(f"va{os.getpid()}-")
        addr = h.run(["ip", "-br", "addr", "show", "eth0"]).stdout
        assert f"{h.address}/24" in addr
        assert ",UP," in h.run(["ip", "-br", "link", "show", "lo"]).stdout
    ports = subprocess.run([IP, "-n", hosts.switch, "-br", "link", "show", "master", "br0"],
                           capture_output=True, text=True, check=True).stdout
    assert sorted(line.split("@")[0] for line in ports.splitlines()) == ["pa", "pb", "pc"]
    other = make_hosts(("a",))  # a second set alive at once: its own names and subnet
    assert other.subnet != hosts.subnet and other["a"].netns != hosts["a"].netns


def test_loop_thread_lives_in_the_namespace(make_hosts: MakeHosts) -> None:
    a = make_hosts(("a",))["a"]
    mine = os.readlink("/proc/thread-self/ns/net")
    with a.loop() as la:
        inode = os.stat(os.path.join(netns.NETNS_DIR, a.netns)).st_ino
        assert la.run(thread_netns()) == (f"net:[{inode}]", f"net:[{inode}]") != (mine, mine)
    assert os.readlink("/proc/thread-self/ns/net") == mine, "the test's own thread never moves"
    with pytest.raises(RuntimeError, match="closed"):
        la.run(thread_netns())


def test_hosts_reach_each_other_at_their_addresses_only(make_hosts: MakeHosts) -> None:
    hosts = make_hosts(("a", "b"))
    a, b = hosts["a"], hosts["b"]
    la, lb = a.loop(), b.loop()
    _, port = la.run(serve(a.address, "from a"))
    assert lb.run(get(f"http://{a.address}:{port}/")) == "from a"
    _, lo_port = la.run(serve("127.0.0.1", "a's loopback"))
    assert la.run(get(f"http://127.0.0.1:{lo_port}/")) == "a's loopback"
    with pytest.raises(aiohttp.ClientConnectorError):  # b's 127.0.0.1 is b's own
        lb.run(get(f"http://127.0.0.1:{lo_port}/"))


async def test_arun_from_an_async_test(make_hosts: MakeHosts) -> None:
    hosts = make_hosts(("a", "b"))
    with hosts["a"].loop() as la, hosts["b"].loop() as lb:
        _, port = await la.arun(serve(hosts["a"].address, "async"))
        assert await lb.arun(get(f"http://{hosts['a'].address}:{port}/")) == "async"


def test_link_down_cuts_the_host_off_and_link_up_restores_it(make_hosts: MakeHosts) -> None:
    hosts = make_hosts(("a", "b"))
    a, b = hosts["a"], hosts["b"]
    la, lb = a.loop(), b.loop()
    _, port = la.run(serve(a.address, "a"))
    url = f"http://{a.address}:{port}/"
    assert lb.run(get(url)) == "a"
    sleeper = a.popen(["sleep", "600"])
    a.link_down()
    with pytest.raises((aiohttp.ClientError, TimeoutError)):
        lb.run(get(url, timeout=2.0))
    assert la.run(get(url)) == "a", "a still reaches itself"
    assert sleeper.poll() is None, "a's processes keep running"
    a.link_up()
    deadline = time.monotonic() + 30
    while True:
        try:
            assert lb.run(get(url, timeout=2.0)) == "a"
            break
        except (aiohttp.ClientError, TimeoutError):
            if time.monotonic() > deadline:
                raise


SERVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen()
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.sendall(b"hi"); c.close()
time.sleep(600)
"""


async def read_once(address: str, port: int) -> bytes:
    reader, writer = await asyncio.open_connection(address, port)
    data = await reader.read()
    writer.close()
    return data


def test_popen_run_and_kill_all(make_hosts: MakeHosts) -> None:
    hosts = make_hosts(("a", "b"))
    a, b = hosts["a"], hosts["b"]
    server = a.popen([sys.executable, "-c", SERVER, a.address], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    with b.loop() as lb:
        assert lb.run(read_once(a.address, port)) == b"hi"
    shell = a.popen(["sh", "-c", "sleep 600 & sleep 600"])
    deadline = time.monotonic() + 10
    while len(a.pids()) < 4:  # server, sh and its two sleeps
        assert time.monotonic() < deadline, a.pids()
        time.sleep(0.05)
    assert {server.pid, shell.pid} <= set(a.pids())
    assert b.pids() == []
    # `ip netns exec` leaves the hostname alone (no UTS namespace): every host has the box's name
    assert a.run(["hostname"]).stdout.strip() == socket.gethostname()
    assert set(a.kill_all(signal.SIGKILL)) >= {server.pid, shell.pid}
    assert server.wait(10) == -signal.SIGKILL and shell.wait(10) == -signal.SIGKILL
    while a.pids():  # the orphaned sleep goes too
        assert time.monotonic() < deadline + 10, a.pids()
        time.sleep(0.05)


def test_leaving_by_an_exception_kills_and_deletes_everything(netns_available: type[Hosts]) -> None:
    with pytest.raises(KeyboardInterrupt):
        with netns_available(("a", "b")) as hosts:
            made = [h.netns for h in hosts] + [hosts.switch]
            sleeper = hosts["a"].popen(["sh", "-c", "sleep 600 & sleep 600"])
            lp = hosts["b"].loop()
            raise KeyboardInterrupt
    assert not set(made) & set(netns_names())
    assert sleeper.poll() == -signal.SIGKILL
    with pytest.raises(RuntimeError, match="closed"):
        lp.run(asyncio.sleep(0))


def test_a_setup_that_fails_half_way_leaves_nothing(netns_available: type[Hosts],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    real_ip = netns._ip

    def ip_failing_on_b(*args: str, ip: str = IP) -> str:
        if args[-2:] == ("dev", "eth0") and args[1].endswith("-b"):
            raise RuntimeError("injected: address of b")
        return real_ip(*args, ip=ip)
    monkeypatch.setattr(netns, "_ip", ip_failing_on_b)
    mine = f"{netns.PREFIX}{os.getpid()}-"
    with pytest.raises(RuntimeError, match="injected"):
        netns_available(("a", "b", "c")).__enter__()
    assert not [ns for ns in netns_names() if ns.startswith(mine)]


@pytest.mark.usefixtures("netns_available")
def test_sweep_removes_dead_runs_only() -> None:
    prefix = "vsweep"  # not the harness's prefix: a concurrent run's namespaces stay out of this
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, live = f"{prefix}{gone.pid}-1-2-a", f"{prefix}{os.getpid()}-1-2-a"
    for ns in (dead, live):
        subprocess.run([IP, "netns", "add", ns], check=True)
    orphan = subprocess.Popen([IP, "netns", "exec", dead, "sleep", "600"])
    try:
        while not netns.netns_pids(dead):
            time.sleep(0.02)
        assert sweep_leftovers(prefix) == [dead]
        assert orphan.wait(10) == -signal.SIGKILL
        assert dead not in netns_names() and live in netns_names()
    finally:
        orphan.kill()
        orphan.wait()
        for ns in (dead, live):
            subprocess.run([IP, "netns", "del", ns], capture_output=True)


def test_available_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "/nonexistent/ip" in (available(ip="/nonexistent/ip") or "") or os.geteuid() != 0
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert available() == "network namespaces need root (euid 1000)"


def test_host_names_are_checked() -> None:
    for bad in [("A",), ("a", "a"), ("thisnameistoolong",), ()]:
        with pytest.raises(ValueError):
            Hosts(bad)
