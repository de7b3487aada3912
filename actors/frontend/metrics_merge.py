"""/metrics of a frontend that runs as several processes: one scrape shows every process.

The processes accept from one socket, so a scrape reaches one of them at random. That process asks
the others for their series over the bus (``<ns>.frontend.scrape``, every process answers) and
serves them all, each series labelled ``frontend="<instance>"``: each process's counters stay
monotonic (a restarted process's series start again at 0, which ``rate()`` reads as a reset), and
``sum without (frontend) (...)`` gives the whole frontend. A process that does not answer within
``GATHER_TIMEOUT`` is missing from that scrape, and ``vllm_actors_frontend_scrape_missing`` says how many are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import msgspec
from nats.aio.client import Client
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

LABEL = "frontend"
GATHER_TIMEOUT = 3.0  # a busy process answers late; Prometheus waits 10 s for a scrape by default
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(tuple[str, bytes])


def encode_part(instance: str, exposition: bytes) -> bytes:
    return _enc.encode((instance, exposition))


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge(parts: Sequence[tuple[str, bytes]], missing: int = 0) -> bytes:
    """One exposition of several processes' expositions (instance, text), each series labelled with
    its process's instance."""
    merged: dict[tuple[str, str], Metric] = {}
    for instance, text in parts:
        for fam in text_string_to_metric_families(text.decode()):
            key = (fam.name, fam.type)
            out = merged.get(key)
            if out is None:
                out = merged[key] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples += [s._replace(labels={**s.labels, LABEL: instance}) for s in fam.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))  # type: ignore[arg-type]
    own = CollectorRegistry()
    Gauge("vllm_actors_frontend_scrape_missing", "Frontend processes that did not answer this scrape in time",
          registry=own).set(missing)
    return generate_latest(registry) + generate_latest(own)


async def gather(nc: Client, subject: str, instance: str, own: bytes, expected: int,
                 timeout: float = GATHER_TIMEOUT) -> bytes:
    """This process's exposition and those of the ``expected`` other processes, merged. Waits for
    all of them, at most ``timeout``."""
    parts: list[tuple[str, bytes]] = [(instance, own)]
    if expected <= 0:
        return merge(parts)
    done = asyncio.get_running_loop().create_future()
    seen: set[str] = {instance}

    async def on_reply(msg: Any) -> None:
        try:
            who, text = _dec.decode(msg.data)
        except Exception as e:  # noqa: BLE001 - a bad part is left out, the scrape goes on
            log.debug("scrape: malformed part: %s", e)
            return
        if who in seen:
            return
        seen.add(who)
        parts.append((who, text))
        if len(parts) > expected and not done.done():
            done.set_result(None)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, b"", reply=inbox)
        try:
            await asyncio.wait_for(done, timeout)
        except TimeoutError:
            pass
    finally:
        await sub.unsubscribe()
    return merge(parts, missing=max(0, expected + 1 - len(parts)))
