"""The kvcache node's promises are bounded: announced puts expire and are capped, a get
naming a block twice is refused, and gets beyond the bytes being sent get no hits (the
asker recomputes) instead of another copy of their blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.kvcache import pins
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


def stored_worker(blocks: int) -> tuple[kv.KVCacheWorker, list[bytes]]:
    w = worker()
    hashes = [i.to_bytes(16, "little") for i in range(blocks)]
    for h in hashes:
        w.store.put(h, memoryview(bytearray(BLOCK)))
    return w, hashes


def test_checkpoint_pins_are_per_node_until_the_request_ends() -> None:
    w, hs = stored_worker(4)
    w.pins.pin("cmpl-a", "decode-1", hs[:2])
    w.pins.pin("cmpl-a", "decode-2", hs[1:3])  # a failover's next node pins what it loads
    assert w.store.pins == {hs[0]: 1, hs[1]: 2, hs[2]: 1}
    w.pins.unpin("cmpl-a", "decode-1", over=False)  # it left decode-1: decode-2's stay
    assert w.store.pins == {hs[1]: 1, hs[2]: 1}
    w.pins.unpin("cmpl-a", "decode-2", over=True)  # it ended: everything of it goes
    assert w.store.pins == {} and w.pins.held == {}
    w.pins.pin("cmpl-a", "decode-2", hs)  # a pin that overtook its unpin: ignored
    assert w.store.pins == {}


def test_pinned_blocks_survive_eviction_and_leases_run_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(pins.time, "monotonic", lambda: now[0])
    w, hs = stored_worker(4)
    w.pins.pin("cmpl-b", "decode-1", hs[:1])
    for i in range(100):  # 64 blocks fit: the rest push the unpinned ones out
        w.store.put((1000 + i).to_bytes(16, "little"), memoryview(bytearray(BLOCK)))
    assert hs[0] in w.store and hs[1] not in w.store
    now[0] += pins.PIN_LEASE + 1  # its node died and nobody took the request over
    w.info()  # every heartbeat
    assert w.store.pins == {} and w.pins.held == {}


def test_at_most_a_share_of_memory_is_pinned() -> None:
    w, hs = stored_worker(64)
    w.pins.pin("cmpl-c", "decode-1", hs[:32])  # half of 64 slabs
    w.pins.pin("cmpl-d", "decode-1", hs[32:33])
    assert len(w.store.pins) == 32 and w.pins.refused == 1
