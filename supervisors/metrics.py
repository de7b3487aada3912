"""The OTP runtime's Prometheus series: restarts by reason, and children by state.

They live on one registry per process (``REGISTRY``), which every /metrics of the process renders
(the frontend's, a worker's status port, the root's metrics listener). A process-level registry
rather than one passed down: supervisors are built in four places (a host's root, its nested
trees, a worker process, a frontend process), each belongs to the process it runs in, and threading
a registry through every constructor would change their signatures for nothing a test needs; tests
read differences of the counters, which other supervisors of a test process do not disturb.

``reason`` is a short, bounded label (never an error's text, which holds pids and paths):
``exit <code>``, ``signal <NAME>``, ``escalated`` (a child's escalate over the bus: the health
monitor's), ``gave up`` (a nested supervisor exceeded its intensity), ``misconfigured``, an
exception's class name (``EngineDeadError``, ``TimeoutError``: the set of classes is bounded), the
strategy's name for siblings restarted with the crashed child (``one_for_all``, ``rest_for_one``),
and ``requested`` (an operator's restart).
"""

from __future__ import annotations

import signal
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from supervisors.child import Escalation, Misconfigured

REGISTRY = CollectorRegistry(auto_describe=True)

RESTARTS = Counter("vllm_actors_supervisor_restarts", "Children restarted, by supervisor, child and reason",
                   ["supervisor", "child", "reason"], registry=REGISTRY)

_STATES = ("starting", "running", "restarting", "stopped")


class Supervised(Protocol):
    name: str

    def children(self) -> list[dict[str, Any]]: ...


# the live supervisors of this process (weak: a stopped and dropped tree leaves the scrape)
_live: weakref.WeakSet[Any] = weakref.WeakSet()


def track(sup: Supervised) -> None:
    _live.add(sup)


def restarted(supervisor: str, child: str, reason: str) -> None:
    RESTARTS.labels(supervisor, child, reason).inc()


def reason_label(exc: BaseException | None) -> str:
    """The bounded ``reason`` of a crash (see the module's docstring)."""
    if exc is None:
        return "exit 0"
    if isinstance(exc, Misconfigured):
        return "misconfigured"
    if isinstance(exc, Escalation):
        return "gave up"
    rc = getattr(exc, "returncode", None)  # supervisors.process.ProcessExited
    if isinstance(rc, int):
        if rc < 0:
            try:
                return f"signal {signal.Signals(-rc).name}"
            except ValueError:
                return f"signal {-rc}"
        return f"exit {rc}"
    return type(exc).__name__


class _Children(Collector):
    """Children by state, read from the live supervisors at scrape time (no bookkeeping per
    change). Supervisors of one name (tests build several) are summed, so no series repeats."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts: dict[tuple[str, str], int] = {}
        for sup in list(_live):
            for state in _STATES:
                counts.setdefault((sup.name, state), 0)
            for child in sup.children():
                key = (sup.name, str(child.get("state")))
                counts[key] = counts.get(key, 0) + 1
        fam = GaugeMetricFamily("vllm_actors_supervisor_children", "Children of each supervisor by state",
                                labels=["supervisor", "state"])
        for (name, state), n in sorted(counts.items()):
            fam.add_metric([name, state], n)
        yield fam

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("vllm_actors_supervisor_children", "Children of each supervisor by state",
                                labels=["supervisor", "state"])


REGISTRY.register(_Children())
