"""Resident memory of an idle router and kvcache node, and what torch alone would add.

Starts a real nats-server, then `tandem router` and `tandem kvcache` as processes, waits
until the router answers /healthz and both have idled for a few seconds, and prints their
RSS beside that of a bare interpreter that imports torch (what each of them paid before
the wire types stopped importing it).

    .venv/bin/python benchmarks/router_rss.py
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not installed

from shared.bus.server import NatsServer, free_port
from tests.rss import rss_mib

ROOT = Path(__file__).resolve().parents[1]
IDLE = 5.0  # seconds of idling before RSS is read


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def service(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", *argv],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def torch_rss() -> float:
    code = "import torch, pathlib; print(pathlib.Path('/proc/self/status').read_text())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def main() -> None:
    with NatsServer() as nats:
        port = free_port()
        router = service(["router", "--nats", nats.url, "--port", str(port), "--probe-after", "0"])
        kvcache = service(
            ["kvcache", "--nats", nats.url, "--transport", "tcp", "--capacity-mb", "64"]
        )
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz")
            time.sleep(IDLE)
            rows = [("router", rss_mib(router.pid)), ("kvcache", rss_mib(kvcache.pid))]
        finally:
            for proc in (router, kvcache):
                proc.terminate()
                proc.wait(10)
    rows.append(("python -c 'import torch'", torch_rss()))
    print(f"{'process':<28}{'RSS MB':>8}")
    for name, mb in rows:
        print(f"{name:<28}{mb:>8.0f}")


if __name__ == "__main__":
    main()
