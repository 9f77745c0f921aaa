"""Checkpoint cadence: a decode engine hands a sequence's filled blocks over every N blocks
(and at its end), with a point saying how far the handed-over KV reaches; the uploader calls
back once a hand-over is stored, never when part of it failed; puts are cut to a size and
paced to a rate."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from shared.engine.engine import Engine, EngineConfig
from shared.kvclient.uploader import BlockUploader
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def step_and_take(engine: Engine) -> list[tuple[int, list[int], int]]:
    """Step to the end; per step that handed blocks over: (blocks, point tokens, outputs)."""
    seen = []
    while engine.has_unfinished():
        engine.step()
        hashes, blocks = engine.exchange.take_filled_blocks()
        points = engine.exchange.take_checkpoint_points()
        assert len(hashes) == len(blocks)
        if hashes:
            seen.append((len(hashes), [p.num_tokens for p in points], len(engine.requests)))
    return seen


def test_every_block_by_default_then_every_second(tiny_model: LoadedModel) -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(3, 49152) for _ in range(20)]  # 20 + 40 = 60 tokens: 3 full blocks
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    engine.exchange.collect_filled = True
    rid = engine.add_request(prompt, GREEDY)
    got = step_and_take(engine)
    # 59 tokens' KV computed (never the last one's): 3 full blocks, each handed over as it
    # filled, while the sequence ran
    assert got == [(1, [16], 1), (1, [32], 1), (1, [48], 1)]
    assert rid not in engine.requests

    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    engine.exchange.collect_filled = True
    engine.exchange.checkpoint_every = 2
    rid = engine.add_request(prompt, GREEDY)
    seen = []
    while engine.has_unfinished():
        engine.step()
        hashes, _ = engine.exchange.take_filled_blocks()
        points = engine.exchange.take_checkpoint_points()
        if hashes:
            seen.append((len(hashes), [(p.request_id, p.num_tokens) for p in points]))
            if points:  # the point's output is the sequence's at hand-over time
                assert len(points[0].output_ids) >= points[0].num_tokens - len(prompt)
                assert len(points[0].block_hashes) == points[0].num_tokens // 16
    # blocks 1-2 together (a point), block 3 at the end (no point: the sequence is done)
    assert seen == [(2, [(rid, 32)]), (1, [])]


def test_an_aborted_sequence_hands_nothing_over(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    engine.exchange.collect_filled = True
    engine.exchange.checkpoint_every = 4
    rid = engine.add_request(list(range(100, 140)), GREEDY)  # 40 prompt tokens: 2 blocks
    engine.step()
    assert engine.exchange.take_filled_blocks() == ([], [])  # 2 < 4: pending
    engine.abort(rid)
    engine.step() if engine.has_unfinished() else None
    assert engine.exchange.take_filled_blocks() == ([], [])  # dropped: its blocks may be reused
    assert engine.exchange.take_checkpoint_points() == []


class FlakyStore:
    """A KV store client (the real one: shared/kvclient/client.py, tested against kvcache nodes)
    whose second put fails."""

    def __init__(self) -> None:
        self.puts = 0

    async def store(self, hashes: list[bytes], blocks: list[bytes]) -> int:
        self.puts += 1
        return 0 if self.puts == 2 else len(hashes)


async def test_uploader_calls_back_only_for_hand_overs_wholly_stored() -> None:
    client = FlakyStore()
    uploader = BlockUploader(client, max_pending_bytes=1 << 20)  # type: ignore[arg-type]
    called: list[str] = []
    uploader.start()
    for name in ("a", "b", "c"):
        uploader.submit([name.encode()], [b"x" * 10], on_stored=lambda n=name: called.append(n))
        assert await uploader.drain(2.0)
    uploader.submit([b"d"] * 3, [b"y" * 10] * 3, on_stored=lambda: called.append("d"))
    assert await uploader.drain(2.0)
    too_big = uploader.submit(
        [b"e", b"f"], [b"z" * (1 << 20), b"z"], on_stored=lambda: called.append("e")
    )
    assert too_big == 1  # one block dropped (pending bytes bound)
    assert await uploader.drain(2.0)
    await uploader.close()
    assert called == ["a", "c", "d"]  # b's put failed; e lost a block
    await asyncio.sleep(0)


def test_every_checkpoint_span_links_the_requests_with_blocks_in_it() -> None:
    """A submission split over two puts (more than 256 blocks) is linked from both spans."""
    from opentelemetry.trace import SpanContext, TraceFlags

    def ctx(n: int) -> SpanContext:
        return SpanContext(trace_id=n, span_id=n, is_remote=False, trace_flags=TraceFlags(1))

    uploader = BlockUploader(FlakyStore(), max_pending_bytes=1 << 20)  # type: ignore[arg-type]
    uploader.submit([b"a"] * 300, [b"x"] * 300, [ctx(1)])
    uploader.submit([b"b"] * 10, [b"y"] * 10, [ctx(2)])
    first = {link.context.trace_id for link in uploader._batch_links(0, 256)}
    second = {link.context.trace_id for link in uploader._batch_links(256, 310)}
    assert (first, second) == ({1}, {1, 2})
    assert not uploader._links  # both submissions done with: nothing kept


class TimedStore:
    """A KV store client (the real one: shared/kvclient/client.py) noting each put's size
    and start time."""

    def __init__(self) -> None:
        self.puts: list[tuple[int, float]] = []

    async def store(self, hashes: list[bytes], blocks: list[bytes]) -> int:
        self.puts.append((sum(len(b) for b in blocks), time.monotonic()))
        return len(hashes)


async def test_puts_are_cut_to_a_size_and_paced_to_a_rate() -> None:
    """A burst of blocks goes in puts of at most `max_put_bytes`, the next starting only once
    the bytes before it would have taken their time at `rate` (across submissions too)."""
    store = TimedStore()
    uploader = BlockUploader(  # type: ignore[arg-type]
        store, max_pending_bytes=1 << 20, max_put_bytes=3000, rate=50_000.0
    )
    uploader.start()
    started = time.monotonic()
    uploader.submit([b"%d" % i for i in range(10)], [b"x" * 1000] * 10)
    assert await uploader.drain(5.0)
    uploader.submit([b"late"], [b"y" * 1000])
    assert await uploader.drain(5.0)
    await uploader.close()
    assert [size for size, _ in store.puts] == [3000, 3000, 3000, 1000, 1000]
    sent = 0
    for size, at in store.puts:  # 3,000 bytes take 60 ms at 50 kB/s
        assert at >= started + sent / 50_000.0 - 0.005
        sent += size
    unpaced = TimedStore()
    fast = BlockUploader(unpaced, max_put_bytes=3000)  # type: ignore[arg-type]
    fast.start()
    fast.submit([b"%d" % i for i in range(10)], [b"x" * 1000] * 10)
    assert await fast.drain(5.0)
    await fast.close()
    assert [size for size, _ in unpaced.puts] == [3000, 3000, 3000, 1000]
    with pytest.raises(ValueError):
        BlockUploader(unpaced, rate=-1.0)  # type: ignore[arg-type]


def test_a_checkpoint_rate_must_be_a_rate() -> None:
    from services.decode.main import checkpoint_rate

    assert checkpoint_rate(0.0) == 0.0 and checkpoint_rate(120.0) == 120.0
    with pytest.raises(SystemExit, match="must be >= 0"):
        checkpoint_rate(-1.0)
    with pytest.raises(SystemExit, match="must be >= 0"):
        checkpoint_rate(float("nan"))
