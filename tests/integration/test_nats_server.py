"""The embedded nats-server (`tandem up`, tests) keeps serving however much it logs: its
log goes to a file it rotates, not to a pipe that fills when nobody reads it."""

from __future__ import annotations

import socket

import nats
import pytest
from nats.aio.msg import Msg

from shared.bus.server import NatsServer
from shared.errors import TandemError

pytestmark = pytest.mark.integration


async def test_serves_after_more_log_than_a_pipe_holds() -> None:
    with NatsServer() as server:
        for _ in range(1500):  # ~140 bytes of "[ERR] ... parser ERROR" each: ~200 KiB
            with socket.create_connection((server.host, server.port)) as c:
                c.recv(4096)
                c.sendall(b"GARBAGE\r\n")
        nc = await nats.connect(server.url, connect_timeout=3, max_reconnect_attempts=0)
        try:

            async def echo(msg: Msg) -> None:
                await msg.respond(msg.data)

            sub = await nc.subscribe("echo", cb=echo)
            await nc.flush()
            assert (await nc.request("echo", b"still here", timeout=3)).data == b"still here"
            await sub.unsubscribe()
        finally:
            await nc.close()
        pass


def test_a_server_that_cannot_start_says_why() -> None:
    server = NatsServer(extra_config="this is not valid config {{{\n")
    try:
        with pytest.raises(TandemError, match=r"exited at start: \S"):
            server.start(timeout=5)
    finally:
        server.cleanup()
