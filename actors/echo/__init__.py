"""Example actor proving the bus path end to end: unary echo, a test stream, and a crash switch
(``actors.echo.actor.EchoActor``)."""
