"""``python -m actors.frontend`` declares no defaults of its own: each is the topology schema's, so a
frontend run alone behaves as one a topology starts with those settings left out."""

from __future__ import annotations

from actors.frontend.__main__ import parser
from config.topology import BusConfig, FrontendConfig, ModelConfig, Topology


def test_the_standalone_frontends_defaults_are_the_topologys() -> None:
    args = parser().parse_args([])
    fe = FrontendConfig()
    assert (args.http, args.router, args.host, args.stall_timeout) == (fe.http, fe.router, fe.host, fe.stall_timeout)
    assert args.namespace == Topology().namespace
    assert args.nats == f"nats://127.0.0.1:{BusConfig().port}"
    assert args.migration_limit == ModelConfig(name="m", path="tiny").migration_limit
    # every router the schema knows is accepted (the kv router runs in the frontend's process)
    assert parser().parse_args(["--router", "kv"]).router == "kv"
