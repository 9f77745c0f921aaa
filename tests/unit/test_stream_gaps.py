"""A token stream that lost deltas (published at most once; a NATS restart drops what was in
flight) resumes after HOLE_WAIT instead of waiting out the stall timeout; a late delta
after a resume does not trigger another one."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from services.router.streams import HOLE_WAIT, MAX_QUEUED, RequestStream
from shared.bus.messages import TokenDelta, encode


@dataclass
class FakeMsg:  # what nats-py hands a subscription callback: only .data and .subject used
    data: bytes
    subject: str = "tandem.tokens.r1"


async def feed(stream: RequestStream, seq: int, finished: bool = False, node: str = "d1") -> None:
    delta = TokenDelta(attempt_id="r1", seq=seq, token_ids=[100 + seq], text=f"<{seq}>",
                       finished=finished, node_id=node)  # fmt: skip
    await stream._on_msg(FakeMsg(encode(delta)))  # type: ignore[arg-type]


async def test_a_gap_resumes_soon_and_the_stream_stays_exact() -> None:
    stream = RequestStream(bus=None, request_id="r1")  # type: ignore[arg-type]
    reasons: list[tuple[str, float]] = []
    started = time.monotonic()

    async def late_and_resumed() -> None:
        await feed(stream, 3)  # the old node's late delta: ahead of the gap again
        await feed(stream, 2, node="d2")  # the resumed attempt (another node) fills it
        await feed(stream, 5)  # another late one from the old node, ahead of d2's stream
        await asyncio.sleep(HOLE_WAIT + 0.5)  # not a loss: d2 is the sender now
        for seq in (3, 4, 5):
            await feed(stream, seq, node="d2")
        await feed(stream, 6, finished=True, node="d2")

    tasks = []

    async def resume(reason: str) -> bool:
        reasons.append((reason, time.monotonic() - started))
        stream.sender = "d2"  # what the failover sets: the node it resumed on
        tasks.append(asyncio.create_task(late_and_resumed()))
        return True

    await feed(stream, 0)
    await feed(stream, 1)
    await feed(stream, 3)  # 2 was lost
    got = [d.seq async for d in stream.deltas(30.0, 30.0, None, resume)]
    assert got == [0, 1, 2, 3, 4, 5, 6]
    assert stream.token_ids == [100, 101, 102, 103, 104, 105, 106]
    assert len(reasons) == 1 and "lost" in reasons[0][0]
    assert HOLE_WAIT <= reasons[0][1] < HOLE_WAIT + 1.0  # not the 30 s stall timeout


async def test_no_resume_without_a_gap() -> None:
    stream = RequestStream(bus=None, request_id="r1")  # type: ignore[arg-type]

    async def resume(reason: str) -> bool:
        raise AssertionError(f"resumed: {reason}")

    for seq in range(3):
        await feed(stream, seq, finished=seq == 2)
    assert [d.seq async for d in stream.deltas(5.0, 5.0, None, resume)] == [0, 1, 2]


async def error(stream: RequestStream, handoff: int | None, node: str = "p1") -> None:
    delta = TokenDelta(attempt_id="r1", error=f"failed in handoff {handoff}", node_id=node,
                       handoff=handoff)  # fmt: skip
    await stream._on_msg(FakeMsg(encode(delta)))  # type: ignore[arg-type]


async def test_an_error_of_a_superseded_handoff_does_not_end_the_request() -> None:
    """A failover's job went on elsewhere while an earlier handoff's job still sat in the
    prefill queue; that one expiring must not fail the live request."""
    stream = RequestStream(bus=None, request_id="r1")  # type: ignore[arg-type]
    await feed(stream, 0)
    stream.handoff = 1  # what the failover sets
    await error(stream, 0)  # the first handoff's job, expired in the queue
    await feed(stream, 1, node="d2")
    await feed(stream, 2, finished=True, node="d2")
    got = [d async for d in stream.deltas(5.0, 5.0)]
    assert [d.seq for d in got] == [0, 1, 2] and all(d.error is None for d in got)
    assert stream.stale_errors == 1


async def test_an_error_of_the_current_handoff_ends_the_request() -> None:
    for handoff in (1, None):  # None: a node that tags no handoff (decode)
        stream = RequestStream(bus=None, request_id="r1")  # type: ignore[arg-type]
        stream.handoff = 1
        await feed(stream, 0)
        await error(stream, handoff)
        got = [d async for d in stream.deltas(5.0, 5.0)]
        assert got[-1].error is not None and stream.stale_errors == 0


async def test_tokens_of_a_superseded_handoff_are_fenced_off() -> None:
    """After a failover the node left behind may still be running the request: its deltas
    (even ahead of the new node's, even with other tokens) are dropped, not delivered."""
    stream = RequestStream(bus=None, request_id="r1")  # type: ignore[arg-type]

    async def send(seq: int, token: int, node: str, handoff: int, done: bool = False) -> None:
        delta = TokenDelta(attempt_id="r1", seq=seq, token_ids=[token], node_id=node,
                           handoff=handoff, finished=done)  # fmt: skip
        await stream._on_msg(FakeMsg(encode(delta)))  # type: ignore[arg-type]

    await send(0, 100, "d1", 0)
    await send(1, 101, "d1", 0)
    stream.handoff = 1  # what the failover sets before it submits handoff 1 elsewhere
    await send(2, 666, "d1", 0)  # the abandoned node, first and wrong
    await send(3, 667, "d1", 0)
    await send(2, 102, "d2", 1)
    await send(3, 103, "d2", 1, done=True)
    assert stream.token_ids == [100, 101, 102, 103]
    assert stream.stale_tokens == 2 and stream.duplicates == 0


async def test_a_client_that_stops_reading_ends_its_stream() -> None:
    """Issue 49: the queue of a stream nobody read grew until max_tokens or the 600 s
    timeout. Past MAX_QUEUED undelivered deltas the stream ends with one error (the relay
    then cancels the request on every node) and queues nothing more."""
    stream = RequestStream(bus=None, request_id="r1")  # type: ignore[arg-type]
    for seq in range(MAX_QUEUED + 50):
        await feed(stream, seq)
    assert stream.queue.qsize() == MAX_QUEUED + 1 and stream.overflowed
    got = [d async for d in stream.deltas(5.0, 5.0)]
    assert [d.seq for d in got[:-1]] == list(range(MAX_QUEUED))
    assert got[-1].error is not None and "did not read its stream" in got[-1].error


async def feed_many(
    stream: RequestStream, first: int, n: int, finished: bool = False, ends: bool = False
) -> None:
    """A delta of `n` tokens, first..first+n-1 (an engine that makes several a step), with
    text `<i>` per token; `ends`: with the text's length after each (it can be cut)."""
    ids = [100 + i for i in range(first, first + n)]
    parts = [f"<{i}>" for i in range(first, first + n)]
    text_ends = [len("".join(parts[: j + 1])) for j in range(n)] if ends else None
    delta = TokenDelta(attempt_id="r1", seq=first + n - 1, token_ids=ids, text="".join(parts),
                       finished=finished, node_id="d1", text_ends=text_ends)  # fmt: skip
    await stream._on_msg(FakeMsg(encode(delta)))  # type: ignore[arg-type]


async def test_deltas_of_several_tokens_are_ordered_by_token_index() -> None:
    stream = RequestStream(bus=None, request_id="r1")  # type: ignore[arg-type]

    async def resume(reason: str) -> bool:
        raise AssertionError(f"resumed: {reason}")

    await feed_many(stream, 0, 1)  # the prefill node's first token
    await feed_many(stream, 4, 2)  # arrives before the delta it follows: held
    await feed_many(stream, 1, 3)
    await feed_many(stream, 1, 3)  # a duplicate
    await feed_many(stream, 3, 3)  # overlaps what was delivered, cannot be cut: dropped
    await feed_many(stream, 5, 3, ends=True)  # overlaps by one token: cut to 6..7
    await feed_many(stream, 8, 1, finished=True)
    got = [d async for d in stream.deltas(5.0, 5.0, None, resume)]
    assert [(d.first_seq, d.seq) for d in got] == [(0, 0), (1, 3), (4, 5), (6, 7), (8, 8)]
    assert "".join(d.text for d in got) == "".join(f"<{i}>" for i in range(9))
    assert stream.token_ids == [100 + i for i in range(9)]
    assert stream.next_seq == 9 and stream.duplicates == 2


async def test_a_lost_delta_of_several_tokens_is_a_gap() -> None:
    stream = RequestStream(bus=None, request_id="r1")  # type: ignore[arg-type]
    reasons: list[str] = []

    async def resume(reason: str) -> bool:
        reasons.append(reason)
        stream.sender = "d1"
        await feed_many(stream, 3, 3)  # the resumed attempt fills the gap
        return True

    await feed_many(stream, 0, 3)
    await feed_many(stream, 6, 1, finished=True)  # 3..5 were lost
    got = [d.seq async for d in stream.deltas(30.0, 30.0, None, resume)]
    assert got == [2, 5, 6] and reasons == ["deltas after #2 were lost"]
