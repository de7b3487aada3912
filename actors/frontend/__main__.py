"""Run one frontend on an existing bus (benchmarks, or a frontend-only host):

    python -m actors.frontend --nats nats://127.0.0.1:4222 --namespace dynamo \\
        [--http 127.0.0.1:8000] [--router round_robin] [--model tiny --model-path tiny]

The supervisor starts FrontendActor itself from the topology; this entry is for running it alone.
Every default is the topology's (``config.topology``), so a frontend run alone behaves as one a
topology starts with the same settings left out.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import typing
from typing import Any

import msgspec

from bus import event_loop
from bus.context import open_context
from bus.process_exit import exit_process
from config.topology import BusAuth, BusConfig, FrontendConfig, ModelConfig, Topology

from .actor import FrontendActor


async def amain(args: argparse.Namespace) -> None:
    auth = BusAuth(token_file=args.bus_token_file, user=args.bus_user, password_file=args.bus_password_file,
                   nkey_seed=args.bus_nkey_seed, creds=args.bus_creds)
    bus = await open_context(BusConfig(url=args.nats, auth=auth), namespace=args.namespace, host=args.host,
                             name="frontend")
    mc = ModelConfig(name=args.model, path=args.model_path or args.model,
                     migration_limit=args.migration_limit) if args.model else None
    cfg = FrontendConfig(http=args.http, router=args.router, api_key_file=args.api_key_file,
                         api_key_env=args.api_key_env,
                         stall_timeout=args.stall_timeout)
    fe = FrontendActor(bus, config=cfg, model_config=mc)
    await fe.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await fe.stop(5.0)
    await bus.close()


def default(struct: type[msgspec.Struct], name: str) -> Any:
    """A field's default in the topology schema (one place for each default)."""
    for f in msgspec.structs.fields(struct):
        if f.name == name:
            return f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
    raise KeyError(f"{struct.__name__} has no field {name!r}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m actors.frontend")
    p.add_argument("--nats", default=f"nats://127.0.0.1:{default(BusConfig, 'port')}",
                   help="the bus (default: %(default)s, where a topology embeds its server)")
    p.add_argument("--namespace", default=default(Topology, "namespace"))
    p.add_argument("--host", default=default(FrontendConfig, "host"))
    p.add_argument("--http", default=default(FrontendConfig, "http"))
    p.add_argument("--router", default=default(FrontendConfig, "router"),
                   choices=typing.get_args(typing.get_type_hints(FrontendConfig)["router"]))
    p.add_argument("--model", default=None, help="served name whose tokenizer is configured here")
    p.add_argument("--model-path", default=None, help="tokenizer/model dir ('tiny' = the tiny model)")
    p.add_argument("--migration-limit", type=int, default=default(ModelConfig, "migration_limit"))
    # secrets by file or environment, never on this command line (any local user can read it)
    p.add_argument("--api-key-file", default=None, help="file holding the bearer key for /v1/*")
    p.add_argument("--api-key-env", default=None, help="environment variable holding the bearer key")
    p.add_argument("--bus-token-file", default=None)
    p.add_argument("--bus-user", default=None)
    p.add_argument("--bus-password-file", default=None)
    p.add_argument("--bus-nkey-seed", default=None, help="nkey seed file")
    p.add_argument("--bus-creds", default=None, help=".creds file")
    p.add_argument("--stall-timeout", type=float, default=default(FrontendConfig, "stall_timeout"))
    p.add_argument("--log-level", default="INFO")
    return p


def main() -> None:
    args = parser().parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    event_loop.run(amain(args))


if __name__ == "__main__":
    exit_process(main())
