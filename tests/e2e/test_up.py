"""`tandem up` as users run it (what `make up` runs): ready, streams to curl, Ctrl-C cleans up.
With two CPUs or more it runs with `--isolate-decode`, and checks where every thread runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

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
            *(sys.executable, "-m", "tandem.cli", "up", "--port", str(port), "--split"),
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
        # Nothing to wait for: `tandem up` exits only once it has reaped every child
        # (Stack.stop waits on each service, then on NATS), so one still there was left behind.
        assert [k for k in kids if alive(k)] == []
        assert "[up] stopped" in (tmp_path / "up.log").read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        log.close()


def start_up(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "up", *argv],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def wait_ready(up: subprocess.Popen[bytes], log_path: Path) -> str:
    deadline = time.monotonic() + 300
    while "Tandem is ready" not in (text := log_path.read_text()):
        assert up.poll() is None, text[-3000:]
        assert time.monotonic() < deadline, "stack not ready in time"
        time.sleep(0.5)
    return text


def complete_once(port: int, max_tokens: int) -> dict[str, Any]:
    """One greedy completion of the stack's first served model, its whole response."""
    base = f"http://127.0.0.1:{port}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=30) as r:
        served = json.load(r)["data"][0]["id"]
    body = {"model": served, "prompt": "Hello there", "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"{base}/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        done: dict[str, Any] = json.load(r)
    return done


def stop(up: subprocess.Popen[bytes]) -> None:
    up.send_signal(signal.SIGINT)
    assert up.wait(60) == 0


def test_up_with_no_mode_flag_runs_the_planners_pick(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The first start measures a startup profile (with a progress bar) and caches it, says
    which mode the planner picked, and runs it; the next start reuses the profile."""
    port = free_port()
    argv = ["--model", str(tiny_model_dir), "--port", str(port), "--transport", "tcp"]
    first = tmp_path / "first.log"
    up = start_up(argv, first)
    cached = None
    try:
        text = wait_ready(up, first)
        assert "[up] measuring this machine and model to pick the serving mode" in text
        assert "profile: 100%" in text  # the startup profile's progress bar
        cached = Path(text.split("cached as ", 1)[1].split(")", 1)[0])
        assert cached.exists()
        line = next(ln for ln in text.splitlines() if ln.startswith("[up] mode: "))
        mode = line.removeprefix("[up] mode: ").split(",", 1)[0]
        assert mode in ("colocated", "split", "conditional"), line
        assert "the planner's pick (simulated from this machine's profile" in line
        roles = {role_of(k): k for k in children_of(up.pid)}
        assert ("prefill" in roles) == (mode != "colocated"), (mode, sorted(roles))
        router = Path(f"/proc/{roles['router']}/cmdline").read_bytes().split(b"\0")
        assert (b"--conditional" in router) == (mode == "conditional"), router
        done = complete_once(port, 6)
        assert done["usage"]["completion_tokens"] == 6
        assert done["choices"][0]["finish_reason"] == "length"
        stop(up)
        second = tmp_path / "second.log"
        up = start_up(argv, second)
        again = wait_ready(up, second)
        assert "measuring this machine" not in again  # the cached profile, as it was
        assert line in again.splitlines()
        stop(up)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        if cached is not None:
            cached.unlink(missing_ok=True)
