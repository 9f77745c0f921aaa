"""The multi-host test's client, run inside a lab namespace (never from the root one).

python -m tests.e2e.netns_client stream URL   (requests as JSON on stdin)
    streams them all; prints {"events": [...]} as they progress, then
    {"streams": [{"rid", "text", "times"}]} (times: CLOCK_MONOTONIC, machine-wide)
python -m tests.e2e.netns_client ready URL TIMEOUT
    waits for the router's /readyz (exit 1 on timeout)
python -m tests.e2e.netns_client metric PORT NAME
    prints one metric of a node whose metrics port is on this host's loopback
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.chaos import Request, Stream, run_streams


async def stream(url: str) -> None:
    requests = [Request(**r) for r in json.load(sys.stdin)]
    streams = [Stream() for _ in requests]

    async def progress() -> None:
        while True:
            print(json.dumps({"events": [s.events for s in streams]}), flush=True)
            await asyncio.sleep(0.2)

    ticker = asyncio.create_task(progress())
    try:
        await run_streams(url, requests, streams)
    finally:
        ticker.cancel()
    done = [{"rid": s.rid, "text": s.text, "times": s.times} for s in streams]
    print(json.dumps({"streams": done}), flush=True)


def ready(url: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return 0
        except OSError:
            pass
        time.sleep(0.5)
    return 1


def metric(port: str, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for family in text_string_to_metric_families(r.read().decode()):
            for s in family.samples:
                if s.name == name:
                    return float(s.value)
    return 0.0


def main() -> int:
    mode, *args = sys.argv[1:]
    if mode == "stream":
        asyncio.run(stream(args[0]))
        return 0
    if mode == "ready":
        return ready(args[0], float(args[1]))
    if mode == "metric":
        print(metric(args[0], args[1]))
        return 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
