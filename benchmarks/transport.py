"""Data-plane benchmark: GB/s between two processes for 1, 16 and 128 MiB transfers.

Rows: each Tandem transport (UCX, the asyncio TCP fallback), KV pushed through NATS in
≤1 MiB chunks (the slow baseline bulk data must never take), `ucx_perftest` (UCX's own C
tool from the libucx wheel) on the same transports, and a one-process memcpy ceiling.
Configurations run once per round, order rotating between rounds; medians are shown.

    python benchmarks/transport.py [--sizes 1,16,128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from shared.bus.server import NatsServer, free_port
from shared.transport.base import BufferHandler, ReceiveHandler, ReusedBuffers
from shared.transport.factory import TRANSPORTS, make_transport
from shared.transport.frames import make_header

MiB = 1 << 20
WINDOW = 16  # chunks in flight before the NATS baseline waits for its receiver


def ucx_env() -> dict[str, str]:
    import libucx  # type: ignore[import-not-found]

    root = Path(libucx.__file__).parent
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{root / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
    env["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    env["PERFTEST"] = str(root / "bin" / "ucx_perftest")
    return env


# (UCX_* settings, extra perftest flags): Tandem's own configuration (error handling on, so
# TCP only, with 1 MiB segments), and UCX's fastest here (shared memory, no error handling).
PERFTEST_CONFIGS = {
    "tandem": (
        {"UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "1M", "UCX_TCP_RX_SEG_SIZE": "1M"},
        ["-e"],
    ),
    "fastest": ({"UCX_TLS": "tcp,cma"}, []),
}


def perftest(nbytes: int, iters: int, config: str) -> float:
    """GB/s of `ucx_perftest -t tag_bw` between two processes."""
    env = ucx_env()
    settings, flags = PERFTEST_CONFIGS[config]
    env.update(settings)
    port = str(free_port())
    server = subprocess.Popen(
        [env["PERFTEST"], "-p", port, *flags],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.3)
        out = subprocess.run(
            [
                env["PERFTEST"],
                "127.0.0.1",
                "-p",
                port,
                "-t",
                "tag_bw",
                "-s",
                str(nbytes),
                "-n",
                str(iters),
                *flags,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    finally:
        server.kill()
        server.wait()
    final = next(line for line in out.splitlines() if line.startswith("Final:"))
    mb_per_s = float(final.split()[5])  # bandwidth average, in MiB/s
    return mb_per_s * MiB / 1e9


def memcpy(nbytes: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = time.perf_counter()
    for _ in range(5):
        np.copyto(dst, src)
    return 5 * nbytes / (time.perf_counter() - t) / 1e9


async def serve(kind: str) -> None:
    transport = make_transport(kind)
    handler: ReceiveHandler = ReusedBuffers()
    await transport.start(handler)
    print(json.dumps({"address": transport.address}), flush=True)
    await asyncio.Event().wait()


async def serve_nats(url: str) -> None:
    import nats

    nc = await nats.connect(url)
    parts: dict[str, list[bytes]] = defaultdict(list)

    async def on_chunk(msg) -> None:  # type: ignore[no-untyped-def]
        tid = msg.headers["tid"]
        parts[tid].append(msg.data)
        if int(msg.headers["last"]):
            bytes(b"".join(parts.pop(tid)))  # reassemble, as a receiver must
            await nc.publish(msg.headers["reply"], b"ok")
        elif msg.reply:  # window credit: without it the server drops us as a slow consumer
            await nc.publish(msg.reply, b"more")

    await nc.subscribe("bench.kv", cb=on_chunk, pending_bytes_limit=1 << 30)
    print(json.dumps({"address": url}), flush=True)
    await asyncio.Event().wait()


class Child:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.address = json.loads(self.proc.stdout.readline())["address"]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


async def transport_rate(kind: str, address: str, nbytes: int, iters: int) -> float:
    transport = make_transport(kind)
    await transport.start(BufferHandler())
    payload = memoryview(bytearray(os.urandom(nbytes)))
    header = make_header("bench", "warm", payload, chunk_bytes=MiB)
    await transport.send(address, header, payload, timeout=60)
    times = []
    for i in range(iters):
        h = make_header("bench", f"t{i}", payload, chunk_bytes=MiB)  # checksums: outside timing
        t = time.perf_counter()
        await transport.send(address, h, payload, timeout=60)
        times.append(time.perf_counter() - t)
    await transport.close()
    return nbytes / statistics.median(times) / 1e9


async def nats_rate(url: str, nbytes: int, iters: int) -> float:
    import nats

    nc = await nats.connect(url)
    payload = os.urandom(nbytes)
    chunk = MiB - 64 * 1024  # max_payload counts headers: stay under 1 MiB with them
    times = []
    for i in range(iters + 1):
        reply = nc.new_inbox()
        sub = await nc.subscribe(reply, max_msgs=1)
        t = time.perf_counter()
        for n, off in enumerate(range(0, nbytes, chunk)):
            last = "1" if off + chunk >= nbytes else "0"
            headers = {"tid": f"n{i}", "last": last, "reply": reply}
            data = payload[off : off + chunk]
            if last == "0" and n % WINDOW == WINDOW - 1:
                await nc.request("bench.kv", data, headers=headers, timeout=60)
            else:
                await nc.publish("bench.kv", data, headers=headers)
        await sub.next_msg(timeout=120)
        if i:
            times.append(time.perf_counter() - t)
    await nc.close()
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1,16,128", help="MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5, help="transfers per measurement")
    args = parser.parse_args()
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    nats_server = NatsServer().start()
    children = {kind: Child("--serve", kind) for kind in TRANSPORTS}
    children["nats"] = Child("--serve-nats", nats_server.url)
    cases: dict[str, object] = {
        **{f"Tandem {kind}": kind for kind in TRANSPORTS},
        "NATS, ≤1 MiB chunks": "nats",
        "ucx_perftest, Tandem's UCX config (tcp, error handling, 1M segments)": "perftest:tandem",
        "ucx_perftest, tcp,cma without error handling": "perftest:fastest",
        "memcpy, one process": "memcpy",
    }
    results: dict[tuple[str, int], list[float]] = defaultdict(list)
    names = list(cases)
    try:
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                for size in sizes:
                    kind = cases[name]
                    iters = args.iters if size < 64 * MiB else 2
                    if str(kind).startswith("perftest"):
                        rate = perftest(size, max(iters, 10), str(kind).split(":")[1])
                    elif kind == "memcpy":
                        rate = memcpy(size)
                    elif kind == "nats":
                        rate = asyncio.run(nats_rate(nats_server.url, size, iters))
                    else:
                        rate = asyncio.run(
                            transport_rate(str(kind), children[str(kind)].address, size, iters)
                        )
                    results[(name, size)].append(rate)
                    print(f"  round {r + 1} {name} {size // MiB} MiB: {rate:.2f} GB/s", flush=True)
    finally:
        for child in children.values():
            child.close()
        nats_server.cleanup()
    med = {k: statistics.median(v) for k, v in results.items()}
    tcp = {s: med[("Tandem tcp", s)] for s in sizes}
    same = "ucx_perftest, Tandem's UCX config (tcp, error handling, 1M segments)"
    perf = {s: med[(same, s)] for s in sizes}
    print()
    header = " | ".join(f"{s // MiB} MiB GB/s | ×TCP | ×perftest" for s in sizes)
    print(f"| path | {header} |")
    print("|---|" + "---:|---:|---:|" * len(sizes))
    for name in names:
        cells = []
        for s in sizes:
            v = med[(name, s)]
            cells.append(f"{v:.2f} | {v / tcp[s]:.2f} | {v / perf[s]:.2f}")
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        asyncio.run(serve(sys.argv[2]))
    elif len(sys.argv) > 2 and sys.argv[1] == "--serve-nats":
        asyncio.run(serve_nats(sys.argv[2]))
    else:
        main()
