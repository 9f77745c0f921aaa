"""`tandem up` as users run it (what `make up` runs): ready, streams to curl, Ctrl-C cleans up.
With two CPUs or more it runs with `--isolate-decode`, and checks where every thread runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.bus.server import free_port
from shared.procs import BACKGROUND_NICE, thread_cpus

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


CPUS = sorted(os.sched_getaffinity(0))
ISOLATE = len(CPUS) >= 2  # the decode engine thread on the last CPU, the rest on the others


def role_of(pid: int) -> str:
    """A child's role: its `tandem.cli` sub-command, or nats."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return "nats" if b"nats-server" in cmdline[0] else cmdline[3].decode()


def assert_isolated(kids: list[int]) -> None:
    """Only the decode node's engine thread on the last CPU; every other thread, of every
    service and of NATS, on the others."""
    rest, last = set(CPUS[:-1]), {CPUS[-1]}
    seen = {}
    for pid in kids:
        seen[role_of(pid)] = thread_cpus(pid)
    assert sorted(seen) == ["decode", "kvcache", "nats", "prefill", "router"]
    for role, threads in seen.items():
        if role == "decode":
            assert threads.count(last) == 1, threads  # the engine thread
            assert all(cpus == rest for cpus in threads if cpus != last), threads
        else:
            assert all(cpus == rest for cpus in threads), (role, threads)


def assert_niceness(kids: list[int]) -> None:
    """The prefill and kvcache nodes at the default --background-nice above ours; the
    decode node, the router and NATS at ours."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = {}
    for pid in kids:
        seen[role_of(pid)] = os.getpriority(os.PRIO_PROCESS, pid) - base
    want = min(19 - base, BACKGROUND_NICE)  # the kernel caps it at 19
    assert seen == {"decode": 0, "kvcache": want, "nats": 0, "prefill": want, "router": 0}


def test_up_streams_to_curl_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "up.log").open("w+")
    if not ISOLATE:
        print(f"one CPU ({CPUS}): tandem up without --isolate-decode")
    up = subprocess.Popen(
        [
            *(sys.executable, "-m", "tandem.cli", "up", "--port", str(port)),
            *(["--isolate-decode"] if ISOLATE else []),
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while "Tandem is ready" not in (tmp_path / "up.log").read_text():
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "stack not ready in time"
            time.sleep(0.5)
        kids = children_of(up.pid)
        assert len(kids) >= 5  # nats-server, kvcache, prefill, decode, router
        if ISOLATE:
            assert_isolated(kids)
        assert_niceness(kids)
        body = (
            '{"model": "smollm2-135m-instruct", "prompt": "The capital of France is",'
            ' "max_tokens": 8, "temperature": 0, "stream": true}'
        )
        curl = subprocess.run(
            ["curl", "-sN", f"http://127.0.0.1:{port}/v1/completions",
             "-H", "Content-Type: application/json", "-d", body],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        events = [line for line in curl.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert len(events) >= 3 and "Paris" in curl.stdout
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        time.sleep(0.5)
        assert [k for k in kids if alive(k)] == []
        assert "[up] stopped" in (tmp_path / "up.log").read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        log.close()
