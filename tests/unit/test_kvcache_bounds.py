"""The kvcache node's promises are bounded: announced puts expire and are capped, a get
naming a block twice is refused, and gets beyond the bytes being sent get no hits (the
asker recomputes) instead of another copy of their blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.kvcache import worker as kv
from services.kvcache.store import BlockStore
from shared.bus.client import Bus
from shared.bus.messages import KVGet, KVGetReply, KVPut, Reply, decode, encode
from shared.transport.tcp import TcpTransport

BLOCK = 1024


@dataclass
class RequestMsg:  # what nats-py hands a responder: data, subject, respond()
    data: bytes
    subject: str = "tandem.kvcache.kv-1.x"
    headers: dict[str, str] | None = None
    replies: list[bytes] = field(default_factory=list)

    async def respond(self, data: bytes) -> None:
        self.replies.append(data)


def worker() -> kv.KVCacheWorker:
    store = BlockStore(memory_bytes=64 * BLOCK)
    return kv.KVCacheWorker(store, Bus("nats://127.0.0.1:1", "test"), TcpTransport(), "kv-1")


async def put(w: kv.KVCacheWorker, transfer_id: str) -> Reply:
    msg = RequestMsg(encode(KVPut(transfer_id=transfer_id, block_hashes=[b"h" * 16],
                                  block_bytes=BLOCK, transfer_secret="s")))  # fmt: skip
    await w.on_put(msg)  # type: ignore[arg-type]
    return decode(msg.replies[0], Reply)


async def test_announced_puts_are_capped_and_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv, "MAX_PENDING_PUTS", 3)
    now = [100.0]
    monkeypatch.setattr(kv.time, "monotonic", lambda: now[0])
    w = worker()
    for i in range(3):
        assert (await put(w, f"p{i}")).accepted
    full = await put(w, "p3")
    assert not full.accepted and "pending" in full.reason and "p3" not in w.puts
    now[0] += kv.PUT_TIMEOUT + 1  # none of them came: all expired
    assert (await put(w, "p4")).accepted
    assert list(w.puts) == ["p4"]


async def test_a_get_naming_a_block_twice_is_refused() -> None:
    w = worker()
    msg = RequestMsg(encode(KVGet(transfer_id="g", block_hashes=[b"a" * 16] * 4096,
                                  reply_address="tcp://127.0.0.1:9")))  # fmt: skip
    await w.on_get(msg)  # type: ignore[arg-type]
    reply = decode(msg.replies[0], KVGetReply)
    assert "twice" in reply.error and reply.hits == 0 and not w._sends


async def test_gets_beyond_the_bytes_being_sent_get_no_hits() -> None:
    w = worker()
    w.store.put(b"a" * 16, memoryview(bytearray(BLOCK)))
    w._sending_bytes = kv.MAX_SENDING_BYTES  # as if gets were in flight
    msg = RequestMsg(encode(KVGet(transfer_id="g", block_hashes=[b"a" * 16],
                                  reply_address="tcp://127.0.0.1:9")))  # fmt: skip
    await w.on_get(msg)  # type: ignore[arg-type]
    assert decode(msg.replies[0], KVGetReply).hits == 0 and not w._sends
