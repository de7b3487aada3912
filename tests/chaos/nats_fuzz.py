"""Chaos: malformed payloads on every NATS subject a running deployment serves (pytest-free).

``run_nats_fuzz(bus_url, namespace, seed=..., per_subject=...)`` finds the subjects itself:

* every endpoint of every micro service of the namespace (``$SRV.INFO``: supervisors, engine actors,
  LoRA managers, health monitors, KV publishers, the frontend's status and ``router.*`` endpoints),
  and each service's own ``$SRV.PING|INFO|STATS.<name>.<id>``;
* the registry (``<ns>-instances``): each record's ``generate_subject``, and for each engine its KV
  event and load subjects, which are published to (fire-and-forget, no reply by design).

Each subject gets the battery of ``tests.chaos.nats_battery`` (generic malformed input, cases built
from the verb's request type, seeded mutations; garbage protocol headers for streaming verbs). A
request is answered once: an ADR-32 error (``Nats-Service-Error-Code``), a reply, or for a stream
its chunks up to end-of-stream or an error message. The figures say what came back, and whether any
actor restarted meanwhile (the supervisors' ``children`` views and the registry's ``started_at``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client

from actors.instances.contract import WORKER_KIND
from bus import subjects as S
from bus.subjects import Subjects
from bus.wire import NO_RESPONDERS, STATUS
from tests.chaos.nats_battery import (
    DEMAND_VERB,
    KV_EVENT_VERB,
    LOAD_VERB,
    SRV_VERB,
    UNKNOWN_VERB,
    VERBS,
    WAKE_OUTCOME_VERB,
    Case,
    Verb,
    field_cases,
    generic_cases,
    header_cases,
    is_valid_command,
    mutated_cases,
    valid_empty_object,
    verb_for,
)
from tests.helpers import registry

_GENERATE = VERBS[("engine", "generate")]


@dataclass(frozen=True)
class Target:
    subject: str
    verb: Verb
    source: str  # where it was found: "srv:<service>.<endpoint>", "srv-control", "registry:...", or two
    # of them joined by "+"
    reply: bool = True  # False: published without a reply subject (events: no reply by design)


# --- discovery ---------------------------------------------------------------------------------------
async def services(nc: Client, namespace: str, quiet: float = 1.0) -> list[dict[str, Any]]:
    """``$SRV.INFO`` replies of the namespace's micro services (collected until ``quiet`` s pass
    without a new one)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    out = []
    try:
        await nc.publish("$SRV.INFO", b"", reply=inbox)
        while True:
            try:
                msg = await sub.next_msg(timeout=quiet)
            except nats.errors.TimeoutError:
                break
            info = json.loads(msg.data)
            if info.get("metadata", {}).get("namespace") == namespace:
                out.append(info)
    finally:
        await sub.unsubscribe()
    return sorted(out, key=lambda i: (i["name"], i["id"]))


def discover(infos: list[dict[str, Any]], records: dict[str, Any],
             namespace: str) -> tuple[list[Target], list[str]]:
    """Every subject to fuzz, from the micro services' INFO replies and the registry's records, and
    the endpoints ``VERBS`` does not know (fuzzed with garbage only)."""
    targets: dict[str, Target] = {}
    unknown = []
    for info in infos:
        for ep in info["endpoints"]:
            verb = verb_for(info["name"], ep["name"])
            if verb is None:
                unknown.append(f"{info['name']}.{ep['name']} ({ep['subject']})")
                verb = UNKNOWN_VERB
            targets.setdefault(ep["subject"], Target(ep["subject"], verb, f"srv:{info['name']}.{ep['name']}"))
        for control in ("PING", "INFO", "STATS"):
            subject = f"$SRV.{control}.{info['name']}.{info['id']}"
            targets[subject] = Target(subject, SRV_VERB, "srv-control")
    sj = Subjects(namespace)
    for instance, rec in records.items():
        gen = rec.get("generate_subject")
        if gen in targets:  # served and registered: one target, both sources named
            targets[gen] = replace(targets[gen], source=f"{targets[gen].source}+registry:generate_subject")
        elif gen:
            targets[gen] = Target(gen, _GENERATE, "registry:generate_subject")
        if rec.get("kind") == WORKER_KIND:
            for subject, verb, what in ((sj.kv_events(instance), KV_EVENT_VERB, "kv_events"),
                                        (sj.load(instance), LOAD_VERB, "load")):
                targets.setdefault(subject, Target(subject, verb, f"registry:{what}", reply=False))
    # a deployment's cold-model subjects (plain subscriptions of the frontends and the waker)
    for subject, verb, what in ((sj.wake_demand(), DEMAND_VERB, "wake_demand"),
                                (sj.wake_outcome(), WAKE_OUTCOME_VERB, "wake_outcome")):
        targets.setdefault(subject, Target(subject, verb, f"bus:{what}", reply=False))
    return sorted(targets.values(), key=lambda t: t.subject), unknown


class Battery:
    """The cases for each target; what every subject shares is built once (near-max payloads are
    megabytes each)."""

    def __init__(self, seed: int, max_payload: int, per_subject: int) -> None:
        self.rng = random.Random(seed)
        self.max_payload = max_payload
        self.per_subject = per_subject
        self.generic = generic_cases(self.rng, max_payload)
        self._typed: dict[int, list[Case]] = {}

    def cases(self, target: Target) -> tuple[list[Case], list[Case]]:
        """(cases to send, cases skipped because the verb could obey them)."""
        v = target.verb
        typed = self._typed.get(id(v))
        if typed is None:
            typed = self._typed[id(v)] = field_cases(v, self.max_payload) + header_cases(v)
        seed_body = json.dumps(v.skeleton).encode() if v.skeleton else b'{"fuzz": [1, "a", {"b": null}]}'
        cases = self.generic + typed + mutated_cases(self.rng, seed_body, self.per_subject)
        if not v.mutating:
            return cases, []
        send: list[Case] = []
        skip: list[Case] = []
        for c in cases:
            (skip if is_valid_command(v, c) else send).append(c)
        return send, skip


# --- sending ---------------------------------------------------------------------------------------
async def ask(nc: Client, target: Target, case: Case, timeout: float) -> tuple[str, str]:
    """Send one case; (outcome, detail). Outcome: an HTTP-like code ("200" for a plain reply or a
    stream that ended), "timeout", "no_responders", "stream_open" (chunks still flowing at the
    deadline), or "published" (no reply asked)."""
    if not target.reply:
        await nc.publish(target.subject, case.data, headers=case.headers)
        return "published", ""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    streamed = 0
    try:
        await nc.publish(target.subject, case.data, reply=inbox, headers=case.headers)
        while True:
            try:
                msg = await sub.next_msg(timeout=max(0.01, deadline - loop.time()))
            except nats.errors.TimeoutError:
                return ("stream_open", f"{streamed} chunks") if streamed else ("timeout", "")
            h = msg.headers or {}
            if h.get(STATUS) == NO_RESPONDERS:
                return "no_responders", ""
            if S.SERVICE_ERROR_CODE in h or S.SERVICE_ERROR in h:
                return h.get(S.SERVICE_ERROR_CODE, "500"), h.get(S.SERVICE_ERROR, "")
            if not target.verb.streaming:
                return "200", msg.data[:120].decode(errors="replace")
            ctl = h.get(S.STREAM_CONTROL)
            if ctl == S.EOS:
                return "200", f"stream of {streamed} chunks"
            if ctl is None:
                streamed += 1
    finally:
        await sub.unsubscribe()


# --- restarts --------------------------------------------------------------------------------------
async def deployment_state(nc: Client, namespace: str) -> tuple[dict[str, Any], list[dict[str, Any]],
                                                                  dict[str, Any]]:
    """What a restart changes: each supervised child's restart count and start time (every
    supervisor service's ``children`` view, nested supervisors flattened), the registry's
    ``started_at`` per instance, and the micro services' ids; with the services' INFO replies and
    the registry records it read (what ``discover`` needs)."""
    infos = await services(nc, namespace)
    records = await registry(nc, namespace)
    children: dict[str, tuple[int, float | None]] = {}
    unsettled: list[str] = []
    for info in infos:
        if info["name"] != "supervisor":
            continue
        subject = next(e["subject"] for e in info["endpoints"] if e["name"] == "children")
        view = json.loads((await nc.request(subject, b"", timeout=5)).data)
        _flatten(f"{view['host']}/{view['supervisor']}", view["children"], children, unsettled)
    state = {"children": children, "unsettled": sorted(unsettled),
             "registry": {k: r.get("started_at") for k, r in records.items()},
             "services": sorted(f"{i['name']}/{i['id']}" for i in infos),
             "feed": await _feed_counters(nc, infos)}
    return state, infos, records


async def settled_state(nc: Client, namespace: str, timeout: float) -> tuple[dict[str, Any], list[dict[str, Any]],
                                                                              dict[str, Any]]:
    """``deployment_state`` once no supervised child is starting or restarting and two discoveries
    in a row found the same micro services (or after ``timeout`` s, as it then is: the figures show
    what was still starting). A deployment is served once an engine registers, before the actors
    its supervisor starts after the engine (LoRA manager, KV publisher, health monitor) are up; and
    on a loaded machine a service's INFO reply can come later than ``services``' quiet time. The
    fuzz wants every actor's subjects, and a child that starts during the run would read as changed."""
    end = time.monotonic() + timeout
    seen: list[str] | None = None
    while True:
        state, infos, records = await deployment_state(nc, namespace)
        if (not state["unsettled"] and state["services"] == seen) or time.monotonic() >= end:
            return state, infos, records
        seen = state["services"]
        await asyncio.sleep(0.25)


async def _feed_counters(nc: Client, infos: list[dict[str, Any]]) -> dict[str, int]:
    """The KV router feeds' counters summed (``router.index.stats`` of kv-routing frontends): the
    only sign that a published event or load report reached its subscriber, which never replies."""
    total: Counter[str] = Counter()
    for info in infos:
        for ep in info["endpoints"]:
            if info["name"] == "frontend" and ep["name"] == "index_stats":
                feed = json.loads((await nc.request(ep["subject"], b"", timeout=5)).data).get("feed") or {}
                total.update({k: v for k, v in feed.items() if isinstance(v, int)})
    return dict(total)


def _flatten(prefix: str, kids: list[dict[str, Any]], out: dict[str, tuple[int, float | None]],
             unsettled: list[str]) -> None:
    for c in kids:
        path = f"{prefix}/{c['id']}"
        out[path] = (c["restarts"], c.get("started_at"))
        if c["state"] in ("starting", "restarting"):
            unsettled.append(f"{path} ({c['state']})")
        _flatten(path, c.get("children") or [], out, unsettled)


def restarts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Differences that mean an actor restarted (or vanished) between two ``deployment_state``s."""
    b, a = before["children"], after["children"]
    counted = sum(a[k][0] - b[k][0] for k in b if k in a)
    return {
        "restarts": counted,
        "children_changed": sorted(k for k in b if a.get(k) != b[k]),
        "registry_changed": sorted(k for k, v in before["registry"].items() if after["registry"].get(k) != v),
        "services_gone": sorted(set(before["services"]) - set(after["services"])),
    }


# --- the run ---------------------------------------------------------------------------------------
async def run_nats_fuzz(bus_url: str, namespace: str, *, seed: int = 0, per_subject: int = 8,
                        timeout: float = 5.0, concurrency: int = 8, settle: float = 1.0,
                        connect: dict[str, Any] | None = None, start_timeout: float = 30.0) -> dict[str, Any]:
    """Fuzz every subject of ``namespace``; the figures (see the module docstring).

    ``per_subject``: seeded random mutations per subject, on top of the fixed battery. ``settle``:
    seconds to wait before looking for restarts (a crash is restarted with a backoff).
    ``start_timeout``: how long to wait for actors still starting (see ``settled_state``)."""
    nc = await nats.connect(bus_url, name="nats-fuzz", **(connect or {}))
    try:
        before, infos, records = await settled_state(nc, namespace, start_timeout)
        t0 = time.monotonic()
        targets, unknown = discover(infos, records, namespace)
        sem = asyncio.Semaphore(concurrency)
        outcomes: Counter[str] = Counter()
        examples: dict[str, list[str]] = {}
        skipped: list[str] = []

        async def one(t: Target, c: Case) -> None:
            async with sem:
                outcome, detail = await ask(nc, t, c, timeout)
            outcomes[outcome] += 1
            ex = examples.setdefault(outcome, [])
            if len(ex) < 5:
                ex.append(f"{t.subject} [{c.name}] {detail[:160]}")

        cases = Battery(seed, nc.max_payload, per_subject)
        plan: list[tuple[Target, Case]] = []
        for t in targets:
            send, skip = cases.cases(t)
            skipped += [f"{t.subject} [{c.name}]" for c in skip]
            plan += [(t, c) for c in send]
        # interleaved: each actor gets garbage from many angles at once
        random.Random(seed).shuffle(plan)
        await asyncio.gather(*(one(t, c) for t, c in plan))
        fuzz_seconds = time.monotonic() - t0
        await asyncio.sleep(settle)
        after = (await deployment_state(nc, namespace))[0]
    finally:
        await nc.close()
    codes = {k: v for k, v in outcomes.items() if k.isdigit()}
    return {
        "namespace": namespace, "seed": seed, "per_subject": per_subject,
        "subjects": [f"{t.subject} ({t.source})" for t in targets],
        "subjects_covered": len(targets),
        "unsettled_at_start": before["unsettled"],
        "payloads_sent": sum(outcomes.values()),
        "codes": dict(sorted(codes.items())),
        "server_errors": sum(v for k, v in codes.items() if int(k) >= 500) + outcomes["no_responders"],
        "timeouts": outcomes["timeout"],
        "no_responders": outcomes["no_responders"],
        "streams_cut": outcomes["stream_open"],
        "published_no_reply": outcomes["published"],
        "skipped_valid_commands": len(skipped),
        "skipped_examples": skipped[:10],
        "valid_empty_object": sorted({t.source for t in targets if t.verb.mutating and valid_empty_object(t.verb)}),
        "unclassified": unknown,
        "examples": examples,
        "restarts": restarts(before, after),
        # published garbage the KV feed counted as undecodable; fewer than published_no_reply (with
        # a feed running) means some escaped its handler into nats-py's error callback
        "feed_decode_errors": after["feed"].get("decode_errors", 0) - before["feed"].get("decode_errors", 0),
        "seconds": round(fuzz_seconds, 2),
    }


if __name__ == "__main__":  # python -m tests.chaos.nats_fuzz nats://127.0.0.1:4222 dynamo
    import sys

    print(json.dumps(asyncio.run(run_nats_fuzz(sys.argv[1], sys.argv[2])), indent=2))
