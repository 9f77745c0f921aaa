"""Self-test of the network-namespace lab: reachability, isolation, a pulled cable, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.netns import LOCK_DIR, Host, NetnsLab, unavailable_reason
from tests.tools import missing_tool

pytestmark = pytest.mark.integration

PORT = 7007

# Threaded echo server bound to the host's lab address; prints "ready" once listening.
SERVER = """
import socket, sys, threading
def serve(conn):
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""

# One connect + echo round trip; exit 0 only if the echo came back within the timeout.
PROBE = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
    s.sendall(b"ping")
    assert s.recv(4) == b"ping"
"""

# A long-lived connection: echoes each stdin line through the server, prints the reply or error.
SESSION = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
s.settimeout(15)
print("connected", flush=True)
for line in sys.stdin:
    try:
        s.sendall(line.encode())
        print("echo", s.recv(4096).decode().strip(), flush=True)
    except OSError as e:
        print("error", repr(e), flush=True)
"""


def probe(client: Host, server: Host, timeout: float) -> bool:
    res = client.run(
        [sys.executable, "-c", PROBE, server.ip, str(PORT), str(timeout)],
        check=False,
        timeout=timeout + 10,
    )
    return res.returncode == 0


def ip_out(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def test_netns_lab() -> None:
    reason = unavailable_reason()
    if reason is not None:
        missing_tool(reason)

    with NetnsLab() as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        namespaces = lab.namespaces
        assert set(namespaces) == {lab.hub_ns, a.ns, b.ns}
        assert a.ip != b.ip and a.ip.startswith("10.213.") and b.ip.startswith("10.213.")

        server = a.popen(
            [sys.executable, "-c", SERVER, a.ip, str(PORT)], stdout=subprocess.PIPE, text=True
        )
        assert server.stdout is not None
        # the session connects at once: only once the server listens (else: refused)
        assert server.stdout.readline().strip() == "ready"
        session = b.popen(
            [sys.executable, "-c", SESSION, a.ip, str(PORT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert session.stdin is not None and session.stdout is not None
        try:
            assert probe(b, a, timeout=5)

            # Nothing of the lab leaks into the root namespace.
            prefix = lab.subnet_base + "."
            assert prefix not in ip_out("-o", "addr")
            assert prefix not in ip_out("route", "show", "table", "all")
            root_links = ip_out("-o", "link")
            assert lab.prefix not in root_links and "v-a" not in root_links

            assert session.stdout.readline().strip() == "connected"
            session.stdin.write("one\n")
            session.stdin.flush()
            assert session.stdout.readline().strip() == "echo one"

            # Pull a's cable: new connects fail, the open connection stalls without a reset.
            a.link_down()
            session.stdin.write("two\n")
            session.stdin.flush()
            start = time.monotonic()
            assert not probe(b, a, timeout=1.5)
            assert time.monotonic() - start < 5
            assert "NO-CARRIER" in a.run(["ip", "link", "show", "eth0"]).stdout
            assert session.poll() is None

            # Plug it back in: the stalled round trip completes on TCP retransmit.
            a.link_up()
            assert session.stdout.readline().strip() == "echo two"
            assert probe(b, a, timeout=5)
        finally:
            session.stdin.close()
            session.stdout.close()
            server.stdout.close()

    assert server.poll() is not None and session.poll() is not None
    left = ip_out("netns", "list")
    assert not any(ns in left.split() for ns in namespaces)
    assert not os.path.exists(os.path.join(LOCK_DIR, f"{lab.prefix}.lock"))
    lab.close()  # idempotent
