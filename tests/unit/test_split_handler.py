"""One listener, two kinds of transfers: a decode node's kvcache replies go to the transfers
it asked for, everything else to its assignment receiver."""

from __future__ import annotations

import pytest

from shared.transport.base import TransferHeader, TransferRejected
from shared.transport.frames import make_header
from shared.transport.pending import PendingTransfers, SplitHandler


class Receiver:
    """Stands in for the decode node's KVReceiver (tested with real transfers in e2e)."""

    def __init__(self) -> None:
        self.got: list[str] = []
        self.failures: list[str] = []

    def allocate(self, header: TransferHeader) -> memoryview:
        if header.transfer_id != "assigned":
            raise TransferRejected("unexpected transfer", transfer_id=header.transfer_id)
        return memoryview(bytearray(header.nbytes))

    async def complete(self, header: TransferHeader, payload: memoryview) -> None:
        self.got.append(header.transfer_id)

    def failed(self, header: TransferHeader | None, reason: str) -> None:
        self.failures.append(header.transfer_id if header else "")


async def test_announced_gets_go_to_pending_the_rest_to_the_receiver() -> None:
    pending, receiver = PendingTransfers(), Receiver()
    split = SplitHandler(pending, receiver)
    data = memoryview(b"abcd" * 8)
    future = pending.expect("kv-get-1", 64, 5.0, secret="s3")
    asked = make_header("r", "kv-get-1", data, secret="s3")
    buf = split.allocate(asked)
    buf[:] = data
    await split.complete(asked, buf)
    assert future.done() and future.result() == bytes(data)
    assigned = make_header("r", "assigned", data)
    buf = split.allocate(assigned)
    await split.complete(assigned, buf)
    assert receiver.got == ["assigned"]
    with pytest.raises(TransferRejected):  # neither asked for nor assigned
        split.allocate(make_header("r", "stranger", data))
    failing = pending.expect("kv-get-2", 64, 5.0, secret="s4")
    split.failed(make_header("r", "kv-get-2", data, secret="s4"), "peer died")
    assert isinstance(failing.exception(), ConnectionError)
    assert receiver.failures == []
