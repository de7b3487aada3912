"""vLLM-CPU disaggregation across two hosts (network namespaces): the prefill engine on host a, the
decode engine on host b, the KV cache pulled over NIXL across the veth. Started as an operator
would: ``topologies/disagg.toml`` unchanged, placed and clustered with ``--set``, one supervisor per
host.

The decode output at temperature 0 must be the aggregated output of ``topologies/agg.toml`` (same
tiny weights; the decode engine continues from the KV the prefill engine computed; the session's
answer of agg.toml, tests/agg_reference.py), and the decode
engine must have pulled that KV rather than recomputed it. A prefill engine advertising vLLM's
default side-channel host (``localhost``) would fail this: host b's localhost is not host a.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import aiohttp
import nats
import pytest

from bus import rpc
from bus.subjects import Subjects
from tests.agg_reference import PROMPT, TOKENS, AggReference
from tests.multihost.deployment import BUS_PORT, ROOT, HostsDeployment, Stream, chat
from tests.multihost.netns import Hosts

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]

BOOT_TIMEOUT = 300.0  # engine starts on a shared 2-core machine; nothing asserts on speed
# the disagg topology as shipped, spread over two hosts (a 2-server cluster: both must be up)
PLACE = ["frontend.host=a", "pools.prefill.host=a", "pools.decode.host=b", "bus.cluster.insecure=true",
         "supervisor.backoff.initial=0.5"]


@pytest.fixture(scope="module")
def hosts(netns_available: type[Hosts]) -> Iterator[Hosts]:
    with netns_available(("a", "b")) as h:
        yield h


def greedy(d: HostsDeployment) -> Stream:
    """The reference request (tests/agg_reference.py) on host a's frontend."""

    async def one() -> Stream:
        async with aiohttp.ClientSession() as s:
            return await chat(s, TOKENS, PROMPT, stream=False, timeout=BOOT_TIMEOUT)

    out = d.loop().run(one(), timeout=BOOT_TIMEOUT + 10)
    assert out.ok and out.tokens == TOKENS, (out, d.logs())
    return out


@pytest.fixture(scope="module")
def reference(agg_reference: AggReference) -> str:
    """The aggregated output: what the session's agg.toml answered (on this machine: the same
    weights and kernels as on host a), or an agg.toml booted for it now, stopped before disagg boots."""
    return agg_reference.get()


@pytest.fixture(scope="module")
def disagg(hosts: Hosts, reference: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostsDeployment]:
    d = HostsDeployment(hosts, ROOT / "topologies" / "disagg.toml", tmp_path_factory.mktemp("vllm-disagg"), PLACE)
    try:
        d.start("a")
        d.start("b")
        d.wait_ready({"prefill": 1, "decode": 1}, timeout=BOOT_TIMEOUT)
        yield d
    finally:
        d.stop()


def test_decode_on_host_b_continues_from_host_as_kv(disagg: HostsDeployment, reference: str) -> None:
    out = greedy(disagg)
    hosts = disagg.hosts_of()
    assert hosts[out.prefill or ""] == "a" and hosts[out.worker or ""] == "b", (out, hosts)
    assert out.text == reference

    async def decode_stats() -> dict[str, object]:
        nc = await nats.connect(f"nats://127.0.0.1:{BUS_PORT}")
        try:
            return await rpc.request(nc, Subjects(disagg.namespace).worker(out.worker or "", "stats"), {},
                                     timeout=10)
        finally:
            await nc.close()

    # the decode engine did not recompute the prompt: its connector pulled the KV from host a
    stats = disagg.loop().run(decode_stats())
    assert isinstance(stats["external_prefix_hits"], int) and stats["external_prefix_hits"] > 0, stats
