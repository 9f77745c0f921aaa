"""Multi-host failover: every service in its own network namespace, one decode host's link
cut (a pulled cable: no RST, no FIN) instead of a kill.

Hosts: nats, kvcache, prefill, two decode nodes, the router and the client, each a netns
on a private bridge (tests/netns.py; nothing is ever sent to the lab subnet from the root
namespace: the client runs inside the lab). 8 greedy streams of 200 tokens; once each has
20 tokens, d1's link goes down. Its streams fail over (the router's probes go
unanswered), every text equals the uninterrupted reference, and d1 — alive, cut off —
drops its sequences once its lease on NATS lapses: its blocks, and every other node's,
return to zero.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from shared.bus.server import nats_server_binary
from tests.e2e.chaos import Request, Stream, failed_over, recomputed_tokens, report
from tests.netns import Host, NetnsLab, unavailable_reason
from tests.polling import wait_until_sync
from tests.tools import missing_tool

pytestmark = pytest.mark.e2e

STREAMS = 8
MAX_TOKENS = 200
# The decode nodes' lease, short so that d1's streams (180 tokens after the cut, ~4 of them
# at 25-60 ms a step) outlast it by a wide margin however fast the engine gets: a node that
# finishes its streams before its lease lapses has nothing to give up. Above the heartbeat
# TTL's period (2/3 s), so a busy but connected node never loses it.
LEASE = 3.0
CUT_AFTER = 20
NATS_PORT = 4222
ROUTER_PORT = 8000


# Run in the client's namespace: the decode nodes the router lists, from its /readyz body.
ROUTER_DECODE_NODES = """
import json, sys, urllib.error, urllib.request
try:
    reply = urllib.request.urlopen(sys.argv[1] + "/readyz", timeout=5)
except urllib.error.HTTPError as refused:  # 503 while a role has no node: the same body
    reply = refused
print(json.load(reply)["decode"])
"""


class Services:
    """The lab's processes, their logs and metrics ports (on each host's own loopback)."""

    def __init__(self, lab: NetnsLab, logs: Path) -> None:
        self.lab = lab
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []
        self.files: list[object] = []
        self.metrics: dict[str, int] = {}

    def start(self, host: Host, argv: list[str]) -> None:
        out = (self.logs / f"{host.name}.log").open("wb")
        self.files.append(out)
        self.procs.append(host.popen(argv, stdout=out, stderr=subprocess.STDOUT))

    def tandem(self, host: Host, role: str, *extra: str) -> None:
        nats = f"nats://{self.lab.hosts['nats'].ip}:{NATS_PORT}"
        argv = [sys.executable, "-m", "tandem.cli", role, "--nats", nats, "--node-id", host.name]
        if role != "router":
            self.metrics[host.name] = 9100
            argv += ["--metrics-port", "9100", "--heartbeat-ttl", "2"]
            argv += ["--transport", "ucx", "--data-host", host.ip]
        self.start(host, [*argv, *extra])

    def metric(self, host: str, name: str) -> float:
        out = self.lab.hosts["client" if host == "client" else host].run(
            [
                sys.executable,
                "-m",
                "tests.e2e.netns_client",
                "metric",
                str(self.metrics[host]),
                name,
            ]
        )
        return float(out.stdout.strip())

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=10)
        for f in self.files:
            f.close()  # type: ignore[attr-defined]


@pytest.fixture
def lab() -> Iterator[NetnsLab]:
    reason = unavailable_reason()
    if reason is not None:
        print(f"SKIPPED multi-host failover: {reason}")
        missing_tool(reason)
    with NetnsLab() as lab:
        for name in ("nats", "kvcache", "prefill", "d1", "d2", "router", "client"):
            lab.add_host(name)
        yield lab


def test_decode_host_cut_off_streams_resume_and_blocks_return(
    lab: NetnsLab, tmp_path: Path, chaos_reference: tuple[list[Request], list[list[str]]]
) -> None:
    requests, pieces = chaos_reference  # their first MAX_TOKENS tokens
    requests = [Request(r.prompt_ids, MAX_TOKENS) for r in requests[:STREAMS]]
    expected = ["".join(p[:MAX_TOKENS]) for p in pieces[:STREAMS]]
    hosts = lab.hosts
    conf = tmp_path / "nats.conf"
    conf.write_text(
        f'listen: "0.0.0.0:{NATS_PORT}"\nmax_payload: 8MB\n'
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
    )
    svc = Services(lab, tmp_path)
    try:
        svc.start(hosts["nats"], [nats_server_binary(), "-c", str(conf)])
        svc.tandem(hosts["kvcache"], "kvcache", "--capacity-mb", "256")
        model = ["--threads", "1", "--kv-cache-mb", "256"]
        svc.tandem(hosts["prefill"], "prefill", *model)
        svc.tandem(hosts["d1"], "decode", *model, "--lease", str(LEASE))
        svc.tandem(hosts["d2"], "decode", *model, "--lease", str(LEASE))
        # open on purpose: the lab's network is the test's own namespaces
        svc.tandem(
            hosts["router"], "router", "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
            "--allow-open",
        )  # fmt: skip
        url = f"http://{hosts['router'].ip}:{ROUTER_PORT}"
        client = [sys.executable, "-m", "tests.e2e.netns_client"]
        hosts["client"].run([*client, "ready", url, "300"], timeout=320)
        for name in ("d1", "d2"):  # both decode nodes registered, so both take streams
            deadline = time.monotonic() + 120
            while svc.metric(name, "tandem_kv_blocks_free") == 0:
                assert time.monotonic() < deadline, f"{name} never came up"
                time.sleep(0.5)

        def router_sees_both() -> bool:
            out = hosts["client"].run([sys.executable, "-c", ROUTER_DECODE_NODES, url])
            return int(out.stdout) == 2

        wait_until_sync("the router to list both decode nodes", router_sees_both, 60, 0.5)

        proc = hosts["client"].popen(
            [*client, "stream", url], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps([asdict(r) for r in requests]).encode())
        proc.stdin.close()
        cut_at = 0.0
        result = None
        for line in proc.stdout:
            msg = json.loads(line)
            if "events" in msg and not cut_at and min(msg["events"]) >= CUT_AFTER:
                hosts["d1"].link_down()
                cut_at = time.monotonic()
            if "streams" in msg:
                result = msg["streams"]
        proc.stdout.close()
        assert proc.wait(timeout=60) == 0 and result is not None, "the client failed"
        assert cut_at, "the streams never reached the cut"

        assert [s["text"] for s in result] == expected  # no gap, no repeat, same tokens
        moved = failed_over(tmp_path / "router.log")
        assert moved, "d1 served none of the streams?"
        streams = [Stream(rid=s["rid"], times=s["times"]) for s in result]
        recoveries = [
            gap for s in streams if s.rid in moved and (gap := s.gap_around(cut_at)) is not None
        ]
        print(
            report(
                f"multi-host: {STREAMS} streams, d1's link cut, {len(moved)} failed over",
                recoveries,
                recomputed_tokens(tmp_path / "prefill.log"),
            )
        )
        # d1 is alive but cut off: past its lease it drops its sequences; nothing leaks
        deadline = time.monotonic() + 20
        while True:
            held = {n: svc.metric(n, "tandem_kv_blocks_used") for n in ("d1", "d2", "prefill")}
            if not any(held.values()):
                break
            assert time.monotonic() < deadline, f"blocks still held: {held}"
            time.sleep(0.5)
        assert svc.metric("d1", "tandem_lease_lost_total") >= 1
        hosts["d1"].link_up()
    finally:
        svc.close()
