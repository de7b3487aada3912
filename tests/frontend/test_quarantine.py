"""The quarantine store and request fingerprints (no bus)."""

from __future__ import annotations

import time

import pytest

from actors.engines.protocol import SamplingOptions
from actors.frontend.quarantine import PoisonRequest, Quarantine, QuarantinedRequest, fingerprint
from config.loader import TopologyError, topology_from_dict


def fp(**kw: object) -> str:
    args: dict = {"model": "tiny", "lora": None, "token_ids": [1, 2, 3], "prompt": None,
                  "sampling": SamplingOptions(max_tokens=8)}
    args.update(kw)
    return fingerprint(**args)  # type: ignore[arg-type]


def test_fingerprint_is_the_request_without_its_seed() -> None:
    assert fp() == fp()
    assert fp(sampling=SamplingOptions(max_tokens=8, seed=1)) == fp(sampling=SamplingOptions(max_tokens=8, seed=2))
    for other in (fp(model="x"), fp(lora="a"), fp(token_ids=[1, 2, 4]), fp(token_ids=None, prompt="1 2 3"),
                  fp(sampling=SamplingOptions(max_tokens=9)), fp(sampling=SamplingOptions(max_tokens=8, logprobs=2))):
        assert other != fp()


def test_quarantine_refuses_until_the_ttl_passes() -> None:
    q = Quarantine(ttl=0.2)
    q.check("a")  # nothing quarantined yet
    err = q.add("a", "req-1", ["w1", "w2"])
    assert isinstance(err, PoisonRequest) and err.code == 500 and "w1, w2" in err.message
    with pytest.raises(QuarantinedRequest) as ei:
        q.check("a")
    assert ei.value.code == 400
    q.check("b")
    time.sleep(0.25)
    q.check("a")
    assert q.total == 1


def test_ttl_zero_fails_but_refuses_nothing() -> None:
    q = Quarantine(ttl=0)
    q.add("a", "req-1", ["w1", "w2"])
    q.check("a")


def test_quarantine_is_bounded() -> None:
    q = Quarantine(ttl=60, max_entries=3)
    for k in "abcd":
        q.add(k, "r", ["w"])
    with pytest.raises(QuarantinedRequest):
        q.check("d")
    q.check("a")  # the oldest entry made room


def test_quarantine_ttl_is_checked_at_load() -> None:
    raw = {"model": {"name": "m", "path": "tiny"}, "frontend": {"quarantine_ttl": -1}}
    with pytest.raises(TopologyError, match="frontend.quarantine_ttl"):
        topology_from_dict(raw)
    assert topology_from_dict({**raw, "frontend": {"quarantine_ttl": 0}}).frontend.quarantine_ttl == 0
