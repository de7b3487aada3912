"""Example actor proving the bus path end to end: unary echo, a test stream, and a crash switch."""

from actors.echo.actor import EchoActor

__all__ = ["EchoActor"]
