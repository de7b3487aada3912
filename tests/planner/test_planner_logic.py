"""The planner's decision logic without NATS: actions, backoff, pending changes, no-op mode, and the
observer's intervals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from actors.engines.protocol import StepSample
from actors.planner.constraints import PoolLimits
from actors.planner.contract import Action, FrontendWindow, Observed, PrefillPoint, Profile
from actors.planner.observer import REPORT_STALE_S, Observer
from actors.planner.planner import Planner, PoolState, PoolView, replica_of
from actors.worker.contract import LoadReport
from config.topology import PlannerConfig


def child(pool: str, i: int, state: str = "running") -> dict[str, Any]:
    return {"id": f"worker-{pool}-{i}", "state": state, "meta": {"pool": pool, "replica": str(i)}}


def prefill_profile(path: Path, rate: float = 1000.0) -> Path:
    p = Profile(pool="prefill", role="prefill", engine="mocker", model="m", made_by="test", made_at=0.0,
                kv_capacity_tokens=1 << 20, max_num_seqs=256,
                prefill=[PrefillPoint(isl=isl, concurrency=1, ttft_ms=isl / rate * 1000, tokens_per_s=rate)
                         for isl in (100, 1000, 10000)])
    path.write_bytes(msgspec.json.encode(p))
    return path


def planner(tmp_path: Path, **cfg: Any) -> Planner:
    config = PlannerConfig(enabled=True, interval=1.0, budget=6, **cfg)
    st = PoolState(limits=PoolLimits("prefill", "local", 1, None, 1, True), role="prefill", engine="mocker",
                   profile_path=prefill_profile(tmp_path / "prefill.json"))
    st.load_model()
    assert st.model is not None, st.profile_error
    return Planner(config, {"prefill": st})


def view(n: int, **kw: Any) -> dict[str, PoolView]:
    return {"prefill": PoolView("prefill", "prefill", "local", "mocker",
                                children=[child("prefill", i) for i in range(n)], **kw)}


def demand(rate: float, isl: float = 500.0) -> Observed:
    return Observed(windows=2, request_rate=rate, isl=isl, osl=10.0, kv_hit_rate=0.0)


def test_throughput_decision_spawns_the_lowest_free_replicas(tmp_path: Path) -> None:
    p = planner(tmp_path)
    # 5 req/s x 500 tokens over 1000 tokens/s per engine: 3 engines; replica 1 is taken by a
    # child an operator spawned, so the new ones are 2 and 3
    views = {"prefill": PoolView("prefill", "prefill", "local", "mocker",
                                 children=[child("prefill", 0), child("prefill", 1)])}
    d = p.decide(views, demand(5.0), {}, now=100.0)
    pool = d.pools[0]
    assert (pool.current, pool.desired, pool.target) == (2, 3, 3)
    assert "5.00 req/s" in pool.reason and "2500 prompt tok/s" in pool.reason
    assert [(a.kind, a.child) for a in d.actions] == [("spawn", "worker-prefill-2")]
    # budget 6 and no demand: back to the minimum, the newest stopped first, a starting one before it
    views = {"prefill": PoolView("prefill", "prefill", "local", "mocker",
                                 children=[child("prefill", 0), child("prefill", 3), child("prefill", 1, "starting"),
                                           child("prefill", 2)])}
    d = p.decide(views, Observed(windows=2, request_rate=0.0), {}, now=101.0)
    assert d.pools[0].target == 1 and d.pools[0].constraint == "min_replicas 1"
    assert [a.child for a in d.actions] == ["worker-prefill-1", "worker-prefill-3", "worker-prefill-2"]


def test_budget_and_max_replicas_bound_the_target(tmp_path: Path) -> None:
    p = planner(tmp_path)
    d = p.decide(view(1), demand(50.0), {}, now=1.0)  # 25 engines wanted, 6 in the budget
    assert d.pools[0].desired == 25 and d.pools[0].target == 6 and "budget" in (d.pools[0].constraint or "")
    p.pools["prefill"].limits.max_replicas = 2
    assert p.decide(view(1), demand(50.0), {}, now=2.0).pools[0].target == 2


def test_a_failed_start_backs_the_pool_off_and_a_good_one_resets_it(tmp_path: Path) -> None:
    p = planner(tmp_path, start_backoff={"initial": 10.0, "max": 40.0, "multiplier": 2.0, "jitter": 0.0})
    d = p.decide(view(1), demand(5.0), {}, now=0.0)
    assert [a.kind for a in d.actions] == ["spawn", "spawn"]
    failed = Action(kind="spawn", pool="prefill", child="worker-prefill-1", host="local", outcome="failed",
                    error="exited with code 1")
    p.outcome(failed, now=0.0)
    held = p.decide(view(1), demand(5.0), {}, now=5.0)
    assert held.pools[0].target == 1 and held.actions == []
    assert (held.pools[0].constraint or "").startswith("start backoff after 1 failed start(s)")
    assert p.decide(view(1), demand(5.0), {}, now=11.0).actions  # the backoff has passed
    p.outcome(failed, now=11.0)  # a second failure doubles it: until 31
    assert not p.decide(view(1), demand(5.0), {}, now=30.0).actions
    p.outcome(msgspec.structs.replace(failed, outcome="ok"), now=31.0)
    assert p.pools["prefill"].failures == 0
    # shrinking is never held back by a failed start
    p.outcome(failed, now=40.0)
    assert [a.kind for a in p.decide(view(4), demand(1.0), {}, now=41.0).actions] == ["stop", "stop", "stop"]


def test_a_pool_with_a_change_in_progress_is_left_alone(tmp_path: Path) -> None:
    p = planner(tmp_path)
    p.pools["prefill"].pending = "spawn worker-prefill-1"
    d = p.decide(view(1), demand(5.0), {}, now=0.0)
    assert d.actions == [] and d.pools[0].constraint == "change in progress: spawn worker-prefill-1"


def test_no_op_mode_decides_the_same(tmp_path: Path) -> None:
    acting, noop = planner(tmp_path), planner(tmp_path, no_op=True)
    for rate in (1.0, 5.0, 9.0, 0.0):
        a = acting.decide(view(2), demand(rate), {}, now=rate)
        b = noop.decide(view(2), demand(rate), {}, now=rate)
        assert b.no_op and not a.no_op
        assert msgspec.to_builtins(a.pools) == msgspec.to_builtins(b.pools)
        assert msgspec.to_builtins(a.actions) == msgspec.to_builtins(b.actions)


def test_unknown_counts_and_missing_profiles_keep_the_replicas(tmp_path: Path) -> None:
    p = planner(tmp_path)
    d = p.decide(view(2, known=False), demand(9.0), {}, now=0.0)
    assert d.pools[0].target == 2 and d.actions == [] and "did not answer" in d.pools[0].reason
    p.pools["prefill"].profile_path = tmp_path / "missing.json"
    p.pools["prefill"].load_model()
    d = p.decide(view(2), demand(9.0), {}, now=1.0)
    assert d.pools[0].target == 2 and "no profile" in d.pools[0].reason and "missing.json" in d.pools[0].reason


def test_an_interval_without_frontend_windows_holds(tmp_path: Path) -> None:
    """No window at all is not zero traffic (observe_interval 0, the bus down): nothing shrinks."""
    d = planner(tmp_path).decide(view(3), Observed(windows=0), {}, now=0.0)
    assert d.pools[0].target == 3 and d.actions == [] and "no frontend window" in d.pools[0].reason


def test_replica_of() -> None:
    assert replica_of("worker-prefill-12", "prefill") == 12
    assert replica_of("worker-prefill-x", "prefill") is None
    assert replica_of("worker-pre-fill-1", "prefill") is None


def test_observer_sums_windows_into_an_interval() -> None:
    obs = Observer(model="m")
    obs.take_interval(now=100.0)
    for i in range(4):
        w = FrontendWindow(instance=f"fe{i % 2}", model="m", start=100.0 + i, end=101.0 + i, requests=5,
                           finished=4, isl_tokens=4000, osl_tokens=400, cached_tokens=1000)
        for ms in (90.0, 110.0):
            w.ttft.observe(ms)
        w.itl.observe(20.0)
        obs.add_window(w, now=w.end)
    obs.add_window(FrontendWindow(instance="x", model="other", start=100, end=101, requests=99), now=101.0)
    o = obs.take_interval(now=110.0)
    # each frontend's rate over the seconds its windows cover (10 requests in 2 s), summed
    assert o.windows == 4 and o.request_rate == 10.0 and o.isl == 1000.0 and o.osl == 100.0
    assert o.kv_hit_rate == 0.25 and o.ttft_ms == 100.0 and o.itl_ms == 20.0
    # their latest windows arrived 8 and 7 s ago, more than two of their 1 s lengths: gone quiet
    assert obs.take_interval(now=111.0).request_rate == 0.0


def test_observer_rate_does_not_depend_on_how_windows_fall_into_intervals() -> None:
    """A frontend's 2 s windows and the planner's 2 s intervals run out of phase: a late window
    makes one interval get none and the next two. Each interval reads the rate the frontend saw
    (16 requests per 2 s window: 8 req/s), not 0 and then 16."""
    obs = Observer()
    obs.take_interval(now=0.5)
    events: list[tuple[float, float | None]] = [(end + 0.01, end) for end in (2.0, 4.0, 6.0, 10.0, 12.0)]
    events += [(8.6, 8.0)]  # the window that ends at 8 arrives after the interval that ends at 8.5
    events += [(t + 0.5, None) for t in (2.0, 4.0, 6.0, 8.0, 10.0, 12.0)]  # the planner's decisions
    got = []
    for at, end in sorted(events):
        if end is None:
            got.append(obs.take_interval(now=at))
        else:
            obs.add_window(FrontendWindow(instance="fe", start=end - 2.0, end=end, requests=16), now=at)
    assert [o.windows for o in got] == [1, 1, 1, 0, 2, 1]
    assert [o.request_rate for o in got] == [8.0] * 6


def test_observer_counts_a_frontend_without_a_window_in_the_interval_until_it_goes_quiet() -> None:
    """Two frontends at 8 req/s each: an interval without fe1's window (late) still has its share
    of the demand, from fe1's latest window. A frontend that stopped publishing counts no more
    once its latest window arrived two window lengths ago."""
    obs = Observer()
    obs.take_interval(now=0.0)
    for fe in ("fe0", "fe1"):
        obs.add_window(FrontendWindow(instance=fe, start=0.0, end=2.0, requests=16), now=2.0)
    assert obs.take_interval(now=2.5).request_rate == 16.0
    obs.add_window(FrontendWindow(instance="fe0", start=2.0, end=4.0, requests=16), now=4.0)
    assert obs.take_interval(now=4.5).request_rate == 16.0  # fe1 at its latest window's rate
    obs.add_window(FrontendWindow(instance="fe0", start=4.0, end=6.0, requests=16), now=6.0)
    assert obs.take_interval(now=6.5).request_rate == 8.0  # fe1's latest window arrived 4.5 s ago
    # a window of no length (anyone can publish on the subject) says nothing about a rate
    obs.add_window(FrontendWindow(instance="bad", start=7.0, end=7.0, requests=1000), now=7.0)
    obs.add_window(FrontendWindow(instance="fe0", start=6.0, end=8.0, requests=16), now=8.0)
    assert obs.take_interval(now=8.5).request_rate == 8.0
    # a window that claims to cover hours counts for REPORT_STALE_S at most
    obs.add_window(FrontendWindow(instance="long", start=8.0 - 7200.0, end=8.0, requests=7200 * 100), now=8.6)
    assert obs.take_interval(now=9.0).request_rate == 108.0  # and fe0 at its latest window's 8
    assert obs.take_interval(now=8.5 + REPORT_STALE_S).request_rate == 100.0  # fe0 went quiet
    assert obs.take_interval(now=8.6 + REPORT_STALE_S).request_rate == 0.0


def test_observer_keeps_fresh_reports_and_hands_steps_over_once() -> None:
    obs = Observer()
    obs.take_busy(now=0.0)
    steps = [StepSample(prefill_tokens=100, decode_requests=0, kv_tokens=0, elapsed_ms=250.0)] * 2
    obs.add_load(LoadReport(instance="a", num_running=1, num_waiting=2, kv_usage=0.1, active_kv_blocks=3,
                            total_kv_blocks=30, steps=steps), "prefill", now=0.0)
    assert [r.instance for r in obs.reports({"a"}, now=5.0)] == ["a"]
    assert obs.reports({"a"}, now=60.0) == []  # stale: the worker stopped reporting
    assert obs.take_busy(now=1.0) == {"a": 0.5}
    assert len(obs.take_steps("prefill")) == 2 and obs.take_steps("prefill") == []
    obs.forget("a")
    assert obs.reports({"a"}, now=1.0) == []


def test_throughput_mode_shrinks_only_to_a_count_the_demand_fills_to_sensitivity(tmp_path: Path) -> None:
    p = planner(tmp_path)  # 1000 prompt tokens/s per engine, sensitivity 0.7
    # 1.0 engines of demand: growing from 1 gives 1, but a pool of 2 keeps 2 (1.0 / 0.7 = 1.4)
    d = p.decide(view(2), demand(2.0), {}, now=0.0)
    assert d.pools[0].target == 2 and "shrinking keeps 2" in d.pools[0].reason
    assert p.decide(view(2), demand(1.2), {}, now=1.0).pools[0].target == 1  # 0.6 / 0.7 < 1
    assert p.decide(view(1), demand(2.2), {}, now=2.0).pools[0].target == 2  # growing: plain ceil


def test_load_mode_heeds_the_latency_clients_got(tmp_path: Path) -> None:
    from actors.planner.load_model import EngineLoad

    p = planner(tmp_path, mode="load")
    reg = p.pools["prefill"].regression
    reg.fit([StepSample(prefill_tokens=t, decode_requests=0, kv_tokens=0, elapsed_ms=5 + 0.02 * t)
             for t in range(100, 2100, 100)])
    idle = {"prefill": [EngineLoad(f"e{i}", 0, 0, 0, 0) for i in range(2)]}

    def got(ttft: float | None) -> Observed:
        return Observed(windows=2, request_rate=1.0, isl=1000.0, osl=10.0, ttft_ms=ttft)

    assert p.decide(view(2), got(100.0), idle, now=0.0).pools[0].target == 1  # idle and fast: shrink
    held = p.decide(view(2), got(400.0), idle, now=1.0).pools[0]  # 400 is not under 500 x 0.7
    assert held.target == 2 and "observed mean TTFT 400 ms not under target x 0.7: hold" in held.reason
    grown = p.decide(view(2), got(650.0), idle, now=2.0).pools[0]
    assert grown.target == 3 and "observed mean TTFT 650 ms over target 500: +1" in grown.reason


def test_an_encode_pool_is_reported_and_held_never_scaled(tmp_path: Path) -> None:
    """The E/P/D topology with the planner on, as an operator would enable it: the encode pool is
    held at its replicas in both modes (its load is images, which no planner model measures), the
    others are planned, and the loader counts the encode pool's replicas against the budget."""
    from actors.planner.actor import pool_states
    from actors.planner.load_model import EngineLoad
    from config.loader import load_topology

    root = Path(__file__).resolve().parents[2]
    for mode in ("throughput", "load"):
        t = load_topology(root / "topologies/multimodal-epd.toml",
                          ["planner.enabled=true", f"planner.mode={mode!r}", "planner.budget=4"])
        states = pool_states(t.planner, t.pools, {}, {})
        assert {n: s.limits.managed for n, s in states.items()} == {"encode": False, "prefill": True, "decode": True}
        p = Planner(t.planner, states)
        views = {n: PoolView(n, pool.role, "local", pool.engine, children=[child(n, i) for i in range(2)])
                 for n, pool in t.pools.items()}
        loads = {n: [EngineLoad(f"{n}-{i}", 9, 9, 900, 9000, busy=1.0) for i in range(2)] for n in t.pools}
        d = p.decide(views, Observed(windows=2, request_rate=50.0, isl=1000.0, osl=100.0), loads, now=0.0)
        enc = next(x for x in d.pools if x.pool == "encode")
        assert (enc.current, enc.desired, enc.target) == (2, 2, 2), enc
        assert "encode pool: not scaled" in enc.reason
        assert not [a for a in d.actions if a.child.startswith("worker-encode")]
    # 1 encode replica held + prefill and decode at min 1 each: a budget of 2 cannot hold them
    try:
        load_topology(root / "topologies/multimodal-epd.toml", ["planner.enabled=true", "planner.budget=2"])
    except Exception as e:  # noqa: BLE001 - the loader's own error type is what is checked
        assert "3 engines" in str(e), e
    else:
        raise AssertionError("a budget below the encode pool's replicas plus the minimums was accepted")


# --- scale to zero and back ----------------------------------------------------------------------------
def zero_planner(tmp_path: Path, **cfg: Any) -> Planner:
    p = planner(tmp_path, **cfg)
    p.pools["prefill"].limits.min_replicas = 0
    return p


def idle_engines(n: int, running: int = 0, waiting: int = 0) -> dict[str, list[Any]]:
    from actors.planner.load_model import EngineLoad

    return {"prefill": [EngineLoad(f"e{i}", waiting if i == 0 else 0, running if i == 0 else 0, 0, 0)
                        for i in range(n)]}


def test_held_requests_grow_a_pool_at_zero_in_both_modes(tmp_path: Path) -> None:
    """Requests held for a cold model are load no engine reports: at zero replicas, load mode sees no
    engine and throughput mode no started request, yet the pool gets one."""
    for mode in ("throughput", "load"):
        p = zero_planner(tmp_path, mode=mode)
        quiet = Observed(windows=2, request_rate=0.0)
        stays = p.decide(view(0), quiet, {}, now=0.0)
        assert stays.pools[0].target == 0 and stays.actions == [], (mode, stays)
        d = p.decide(view(0), Observed(windows=2, request_rate=0.0, held=3), {}, now=1.0)
        pool = d.pools[0]
        assert (pool.current, pool.target) == (0, 1), (mode, pool)
        assert "3 request(s) held for the cold model: 1" in pool.reason, pool.reason
        assert [(a.kind, a.child) for a in d.actions] == [("spawn", "worker-prefill-0")]
        # a wake in progress (the keeper's) holds the pool: the planner does not spawn beside it
        p.pools["prefill"].pending = "wake (waker)"
        held = p.decide(view(0), Observed(windows=2, held=3), {}, now=2.0)
        assert held.actions == [] and held.pools[0].constraint == "change in progress: wake (waker)"


def test_throughput_mode_goes_to_zero_only_when_nothing_is_in_the_pool(tmp_path: Path) -> None:
    p = zero_planner(tmp_path)
    none = Observed(request_rate=0.0)  # the forecast: no requests next interval
    d = p.decide(view(1), Observed(windows=2, request_rate=0.0), idle_engines(1), predicted=none, now=0.0)
    assert d.pools[0].target == 0 and d.pools[0].reason == "no requests predicted"
    assert [(a.kind, a.child) for a in d.actions] == [("stop", "worker-prefill-0")]
    # requests started in the interval, requests held, or requests on the engines: one replica stays
    for obs, loads, why in ((Observed(windows=2, request_rate=0.5), idle_engines(1), "0.50 req/s in the interval"),
                            (Observed(windows=2, held=2), idle_engines(1), "2 request(s) held"),
                            (Observed(windows=2), idle_engines(2, running=1, waiting=2),
                             "3 request(s) running or waiting on its engines")):
        d = p.decide(view(2), obs, loads, predicted=none, now=1.0)
        pool = d.pools[0]
        assert pool.target == 1 and f"{why}: not to zero, keeps 1" in pool.reason, pool
    # min_replicas 1 keeps its floor as before
    p.pools["prefill"].limits.min_replicas = 1
    d = p.decide(view(1), Observed(windows=2), idle_engines(1), predicted=none, now=2.0)
    assert d.pools[0].target == 1 and d.actions == []


def test_load_mode_takes_an_idle_pool_to_zero_without_a_step_fit(tmp_path: Path) -> None:
    """An idle pool makes no steps, so its fit is never ready: an idle interval removes a replica."""
    p = zero_planner(tmp_path, mode="load")
    assert not p.pools["prefill"].regression.prefill_ready
    quiet = Observed(windows=2, request_rate=0.0)
    d = p.decide(view(2), quiet, idle_engines(2), now=0.0)
    assert d.pools[0].target == 1 and "interval was idle" in d.pools[0].reason, d.pools[0]
    d = p.decide(view(1), quiet, idle_engines(1), now=1.0)
    assert d.pools[0].target == 0 and [a.kind for a in d.actions] == ["stop"]
    # not while anything is there or on its way, nor with no engine reporting (starting up), nor
    # with no frontend reporting (demand unknown)
    for obs, loads in ((Observed(windows=2, request_rate=0.2), idle_engines(1)),
                       (Observed(windows=2, held=1), idle_engines(1)),
                       (quiet, idle_engines(1, waiting=1)),
                       (quiet, {}),
                       (Observed(windows=0), idle_engines(1))):
        d = p.decide(view(1), obs, loads, now=2.0)
        assert d.pools[0].target == 1 and d.actions == [], (obs, loads, d.pools[0])


def test_observer_counts_each_frontends_latest_held_requests() -> None:
    """Held requests are a level: two windows of one frontend are not twice its held requests."""
    obs = Observer(model="m")
    obs.take_interval(now=100.0)
    for i, held in enumerate((4, 2)):
        obs.add_window(FrontendWindow(instance="fe0", model="m", start=100.0 + i, end=101.0 + i, held=held))
    obs.add_window(FrontendWindow(instance="fe1", model="m", start=100.0, end=101.0, held=3))
    o = obs.take_interval(now=102.0)
    assert o.held == 5 and o.windows == 3
    assert obs.take_interval(now=103.0).held == 0  # nothing reported: nothing held
    w = FrontendWindow(instance="fe0", start=0.0, end=1.0, held=2)
    w.add(FrontendWindow(instance="fe1", start=0.0, end=1.0, held=3))
    assert w.held == 5  # windows of several frontends merge by adding
