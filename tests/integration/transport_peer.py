"""Child process for data-plane tests: a receiver or a sender on a chosen transport.

`python -m tests.integration.transport_peer receive KIND` prints `{"address": ...}` and then
one JSON line per completed (`digest` of the payload) or failed transfer. A transfer whose
request id is `stall` blocks the receiver's event loop in `allocate`, so the payload is
never read (the parent kills it mid-transfer). `send KIND ADDRESS NBYTES` sends one transfer
of random bytes and prints `{"sent": ...}` when it starts. `cuts KIND ADDRESS N` sends N
transfers cut off by deadlines of a few ms, each followed by a good one (`{"good": id}`).
`announced KIND` receives with the services' admission rules (PendingTransfers): it reads
announcements as JSON lines on stdin (what the control plane would tell it), answers
`{"expecting": id}`, and prints the digest of each announced transfer that arrives and
`{"refused": n}` after each refusal, and after each arrival its listener's connection
table (`{"strangers": n, "peers": n, "evicted": n}`, and on TCP `{"accept_errors": n}`);
`TANDEM_TEST_NOFILE=N` caps its file descriptors at N once it listens. UCX here
learns of arrived messages and completed operations from progress notices alone (no timer
to fall back on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import resource
import sys
import time

import xxhash

from shared.transport.base import BufferHandler, TransferError
from shared.transport.factory import make_transport
from shared.transport.frames import TransferHeader, make_header
from shared.transport.pending import PendingTransfers
from shared.transport.tcp import TcpTransport
from shared.transport.ucx import waits as ucx_waits

MiB = 1 << 20


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


class ReportingHandler(BufferHandler):
    def allocate(self, header: TransferHeader) -> memoryview:
        emit(allocating=header.transfer_id)
        if header.request_id == "stall":
            emit(stalling=header.transfer_id)
            time.sleep(3600)  # blocks the loop: the payload is never read
        return super().allocate(header)

    async def complete(self, header: TransferHeader, payload: memoryview) -> None:
        emit(
            transfer_id=header.transfer_id,
            digest=xxhash.xxh3_128_hexdigest(payload),
            nbytes=header.nbytes,
            dtype=header.dtype,
        )

    def failed(self, header: TransferHeader | None, reason: str) -> None:
        emit(failed=reason, transfer_id=header.transfer_id if header else None)


async def receive(kind: str) -> None:
    transport = make_transport(kind)
    await transport.start(ReportingHandler())
    emit(address=transport.address)
    await asyncio.Event().wait()


class ReportingPending(PendingTransfers):
    def failed(self, header: TransferHeader | None, reason: str) -> None:
        super().failed(header, reason)
        emit(refused=self.refused, reason=reason)


async def announced(kind: str) -> None:
    pending = ReportingPending()
    transport = make_transport(kind)
    await transport.start(pending)
    if nofile := int(os.environ.get("TANDEM_TEST_NOFILE", "0")):
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
    emit(address=transport.address)
    loop = asyncio.get_running_loop()

    async def report(transfer_id: str, arrived: asyncio.Future[bytes]) -> None:
        payload = await arrived
        emit(transfer_id=transfer_id, digest=xxhash.xxh3_128_hexdigest(payload))
        table = transport.connections  # type: ignore[attr-defined]
        emit(strangers=len(table.strangers), peers=len(table.peers), evicted=table.evicted)
        if isinstance(transport, TcpTransport):
            emit(accept_errors=transport.backoff.errors)

    tasks = set()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        ann = json.loads(line)
        arrived = pending.expect(ann["transfer_id"], ann["max_bytes"], 30.0, ann["secret"])
        tasks.add(asyncio.create_task(report(ann["transfer_id"], arrived)))
        emit(expecting=ann["transfer_id"])


async def send(kind: str, address: str, nbytes: int) -> None:
    transport = make_transport(kind)
    await transport.start(BufferHandler())
    payload = memoryview(bytearray(os.urandom(nbytes)))
    header = make_header("doomed", "doomed-1", payload)
    emit(sent=header.transfer_id)
    await transport.send(address, header, payload, timeout=60)


async def cuts(kind: str, address: str, count: int) -> None:
    """Sends cut off by deadlines of a few ms (inside the UCX handshake, or mid-payload),
    each followed by heap churn and a good send: memory UCX still wrote into after the cut
    would crash this process."""
    rng = random.Random(count)
    transport = make_transport(kind)
    await transport.start(BufferHandler())
    big = memoryview(bytearray(64 * MiB))
    for i in range(count):
        with contextlib.suppress(TransferError):
            header = make_header("cut", f"cut-{i}", big)
            await transport.send(address, header, big, timeout=rng.uniform(0.001, 0.03))
        churn = [bytearray(rng.randint(1, 70_000)) for _ in range(200)]
        payload = memoryview(bytearray(rng.randbytes(MiB)))
        await transport.send(address, make_header("good", f"good-{i}", payload), payload, 30)
        emit(good=f"good-{i}", digest=xxhash.xxh3_128_hexdigest(payload), churned=len(churn))
    await transport.close()


if __name__ == "__main__":
    # Idle UCX endpoints learn of a message, and posted operations of their completion,
    # from the worker's progress, not from a timer: with the safety net's rechecks this
    # long, a missed notice fails these tests.
    ucx_waits.IDLE_RECHECK = ucx_waits.REQUEST_RECHECK = 3600.0
    if sys.argv[1] == "receive":
        asyncio.run(receive(sys.argv[2]))
    elif sys.argv[1] == "announced":
        asyncio.run(announced(sys.argv[2]))
    elif sys.argv[1] == "cuts":
        asyncio.run(cuts(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    else:
        asyncio.run(send(sys.argv[2], sys.argv[3], int(sys.argv[4])))
