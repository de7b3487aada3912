"""Throughput mode's sizing: replicas a pool needs for a predicted demand, from its profile.

- prefill: ``ceil(rate x ISL x (1 - hit) / prefill_rate(ISL x (1 - hit)))``: the uncached prompt
  tokens per second over what one engine prefills per second with TTFT on target at that length.
- decode: ``ceil(rate x OSL / decode_rate(ISL + OSL/2))``: generated tokens per second over what
  one engine generates with ITL on target; a request's context averages its prompt plus half its
  output over its decode.
- agg: one engine does both, taking turns: each request costs ``ISL_eff / prefill_rate`` engine
  seconds of prefill and ``OSL / decode_rate`` of decode, so ``ceil(rate x (ISL_eff / prefill_rate
  + OSL / decode_rate))`` engines are busy. This over-provisions somewhat: vLLM's chunked prefill
  runs prefill chunks inside decode steps, so the two overlap rather than add; adding them is the
  safe side of the TTFT and ITL targets.

No demand needs 0 replicas; ``constraints.constrain`` raises that to the pool's minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from actors.planner.perf_model import PerfModel

PoolRole = Literal["agg", "prefill", "decode"]


@dataclass
class Demand:
    """The next interval's predicted traffic to one pool."""

    request_rate: float  # engine requests per second
    isl: float  # mean prompt tokens
    osl: float  # mean generated tokens
    kv_hit_rate: float  # share of prompt tokens found in the prefix cache (0..1)

    @property
    def isl_eff(self) -> float:
        """Prompt tokens that need computing: the cached share is free."""
        return self.isl * (1.0 - min(1.0, max(0.0, self.kv_hit_rate)))


def _check(demand: Demand) -> None:
    for name in ("request_rate", "isl", "osl", "kv_hit_rate"):
        if not math.isfinite(getattr(demand, name)):
            raise ValueError(f"demand {name} is {getattr(demand, name)}")


def replicas_for(engines: float) -> int:
    # 1e-9: 2.0000000001 engines of float noise is 2, not 3
    return max(0, math.ceil(engines - 1e-9))


def desired_replicas(role: PoolRole, demand: Demand, model: PerfModel, ttft_target_ms: float,
                     itl_target_ms: float) -> tuple[int, str]:
    """Replicas of a ``role`` pool the demand needs, and why in words (numbers included)."""
    engines, why = needed_engines(role, demand, model, ttft_target_ms, itl_target_ms)
    return replicas_for(engines), why


def needed_engines(role: PoolRole, demand: Demand, model: PerfModel, ttft_target_ms: float,
                   itl_target_ms: float) -> tuple[float, str]:
    """Engines (fractional) a ``role`` pool's demand keeps busy at the profile's on-target rates."""
    _check(demand)
    rate = max(0.0, demand.request_rate)
    isl, osl = max(0.0, demand.isl), max(0.0, demand.osl)
    if rate == 0.0 or (isl == 0.0 and osl == 0.0):
        return 0.0, f"no demand ({rate:.2f} req/s)"
    isl_eff = max(0.0, demand.isl_eff)
    hit = f"{isl_eff:.0f} uncached prompt tokens (ISL {isl:.0f}, {100 * (1 - isl_eff / isl) if isl else 0:.0f}% cached)"
    if role == "prefill":
        est = model.prefill_estimate(isl_eff, ttft_target_ms)
        need = rate * isl_eff
        engines = need / est.rate
        return engines, (
            f"prefill: {rate:.2f} req/s x {hit} = {need:.0f} prompt tok/s; "
            f"{est.describe('TTFT')} -> {engines:.2f} engines")
    if role == "decode":
        context = isl + osl / 2
        est = model.decode_estimate(context, itl_target_ms)
        need = rate * osl
        engines = need / est.rate
        return engines, (
            f"decode: {rate:.2f} req/s x OSL {osl:.0f} = {need:.0f} gen tok/s at context {context:.0f}; "
            f"{est.describe('ITL')} -> {engines:.2f} engines")
    if role == "agg":
        pre = model.prefill_estimate(isl_eff, ttft_target_ms)
        dec = model.decode_estimate(isl + osl / 2, itl_target_ms)
        per_request_s = isl_eff / pre.rate + osl / dec.rate
        engines = rate * per_request_s
        return engines, (
            f"agg: {rate:.2f} req/s x ({hit} / {pre.rate:.0f} prefill tok/s + OSL {osl:.0f} / "
            f"{dec.rate:.0f} decode tok/s = {per_request_s * 1000:.1f} engine-ms per request) -> "
            f"{engines:.2f} engines; prefill {pre.describe('TTFT')}; decode {dec.describe('ITL')}")
    raise ValueError(f"unknown pool role {role!r}")
