"""Tail checkpoints: a running sequence's partial last block, taken on one engine (a piece
per step: the rows it added) and placed on another, lets a resume compute one token instead
of up to a block, with the same output; the decode node's uploader writes only each
request's latest state, merging pieces, and asks for a whole tail when the store lost one."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest

from shared.engine.engine import Engine, EngineConfig
from shared.errors import WireFormatError
from shared.kv.block_hash import ROOT_HASH, BlockHash
from shared.kv.tail import TailBlock, fit_tail
from shared.kvclient.tails import TailUploader, extend
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams
from tests.polling import wait_until

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=30, temperature=0.9, seed=11, ignore_eos=True)


def dying_node(
    model: LoadedModel, prompt: list[int], params: SamplingParams, tokens: int
) -> tuple[list[BlockHash], list[bytes | memoryview], TailBlock | None, list[int]]:
    """Run until `tokens` are out, as a checkpointing decode node: its stored full blocks,
    its latest tail, and the tokens it delivered."""
    engine = Engine(model, EngineConfig(num_blocks=64))
    engine.exchange.collect_filled = engine.tails.collect = True
    rid = engine.add_request(prompt, params, "r")
    hashes: list[BlockHash] = []
    blocks: list[bytes | memoryview] = []
    tail = None
    out: list[int] = []
    while len(out) < tokens:
        for o in engine.step():
            out.extend(o.new_token_ids)
        h, b = engine.exchange.take_filled_blocks()
        hashes += h
        blocks += b
        for t in engine.tails.take():
            assert t.request_id == rid
            if tail is not None and t.first:  # a piece: the rows this step added
                assert t.rows == len(o.new_token_ids) and t.first == len(tail.token_ids)
                tail = extend(tail, t)
                assert tail is not None
            else:  # whole: the first here, or a new block
                assert t.first == 0 and (tail is None or t.start > tail.start)
                tail = t
        assert engine.tails.take() == []  # nothing grew since: nothing new
    if tail is not None:  # the pieces add up to the tail read whole
        engine.tails.resend([rid])
        (whole,) = engine.tails.take()
        assert whole.first == 0 and whole.token_ids == tail.token_ids
        assert bytes(whole.data) == bytes(tail.data)
    return hashes, blocks, tail, out


def resume(
    model: LoadedModel,
    prompt: list[int],
    params: SamplingParams,
    stored: tuple[list[BlockHash], list[bytes | memoryview], TailBlock | None, list[int]],
) -> tuple[list[int], int]:
    """A fresh node resumes the request: (tokens it makes, context tokens it recomputed)."""
    hashes, blocks, tail, delivered = stored
    engine = Engine(model, EngineConfig(num_blocks=64))
    engine.exchange.import_cached_blocks(hashes, blocks)
    context = prompt + delivered
    fitted = engine.tails.fit(tail, context) if tail is not None else None
    engine.add_request(prompt, params, "r", output_ids=delivered, tail=fitted)
    made: list[int] = []
    recomputed = -1
    while engine.has_unfinished():
        for o in engine.step():
            if recomputed < 0:
                recomputed = len(context) - o.num_cached_tokens
            made.extend(o.new_token_ids)
    return made, recomputed


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resume_with_the_tail_recomputes_one_token_and_continues_exactly(
    tiny_model: LoadedModel, params: SamplingParams
) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(3, 49152) for _ in range(40)]
    full = Engine(tiny_model, EngineConfig(num_blocks=64)).generate([prompt], params)[0]
    for cut in (3, 8, 15, 24):  # 40 + cut - 1 tokens of KV: 2 or 3 full blocks and a tail
        stored = dying_node(tiny_model, prompt, params, cut)
        assert stored[3] == full[:cut]
        assert stored[2] is not None and stored[2].start == 16 * ((40 + cut - 1) // 16)
        made, recomputed = resume(tiny_model, prompt, params, stored)
        assert full[:cut] + made == full
        assert recomputed == 1  # only the last delivered token: its KV was never computed
        # without the tail, the rest of the block is recomputed (the old behaviour)
        made, recomputed = resume(tiny_model, prompt, params, (*stored[:2], None, stored[3]))
        assert full[:cut] + made == full
        assert recomputed == (40 + cut) - 16 * ((40 + cut - 1) // 16)


def test_a_tail_ahead_of_what_the_client_got_is_cut_to_it(tiny_model: LoadedModel) -> None:
    """The dead node computed KV of tokens whose delivery was lost: only the delivered part
    of its tail is used."""
    rng = random.Random(6)
    prompt = [rng.randrange(3, 49152) for _ in range(40)]
    full = Engine(tiny_model, EngineConfig(num_blocks=64)).generate([prompt], GREEDY)[0]
    hashes, blocks, tail, out = dying_node(tiny_model, prompt, GREEDY, 8)  # tail: 47 - 32 = 15
    assert tail is not None and len(tail.token_ids) == 15
    delivered = out[:5]  # the client got 5 of the 8
    made, recomputed = resume(tiny_model, prompt, GREEDY, (hashes, blocks, tail, delivered))
    assert delivered + made == full
    assert recomputed == 1


def test_a_tail_that_does_not_match_the_context_is_refused(tiny_model: LoadedModel) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 49152) for _ in range(40)]
    _, _, tail, out = dying_node(tiny_model, prompt, GREEDY, 4)
    assert tail is not None
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    context = prompt + out
    assert engine.tails.fit(tail, context) == tail
    other = list(context)
    other[33] += 1  # a token inside the tail differs
    assert engine.tails.fit(tail, other) is None
    other = list(context)
    other[3] += 1  # a token before it differs: its parent block is another
    assert engine.tails.fit(tail, other) is None
    assert engine.tails.fit(TailBlock("r", 32, tail.parent, tail.token_ids, b"x"), context) is None
    n = len(tail.token_ids)
    piece = TailBlock(
        "r", 32, tail.parent, tail.token_ids, tail.data[-(len(tail.data) // n) :], n - 1
    )
    assert engine.tails.fit(piece, context) is None  # a piece alone cannot be resumed from
    # a tail cut for a longer context, offered to admission as is, is refused there
    with pytest.raises(WireFormatError):
        engine.add_request(prompt, GREEDY, "r", output_ids=out[:2], tail=tail)
    assert not engine.has_unfinished()


def test_fit_tail_rules() -> None:
    hashes = [BlockHash(b"\x01" * 16)]
    context = list(range(100, 140))  # 40 tokens
    tail = TailBlock("r", 16, hashes[0], context[16:30], b"")
    assert fit_tail(tail, context, hashes, 16) == tail
    assert fit_tail(TailBlock("r", 8, hashes[0], context[8:20], b""), context, hashes, 16) is None
    assert fit_tail(TailBlock("r", 16, ROOT_HASH, context[16:30], b""), context, hashes, 16) is None
    assert fit_tail(TailBlock("r", 0, ROOT_HASH, context[0:5], b""), context, hashes, 16) == (
        TailBlock("r", 0, ROOT_HASH, context[0:5], b"")
    )
    assert fit_tail(TailBlock("r", 32, hashes[0], context[32:40], b""), context, hashes, 16) is None
    short = fit_tail(tail, context[:20], hashes, 16)  # the last token stays to compute
    assert short is not None and short.token_ids == context[16:19]
    assert fit_tail(tail, context[:17], hashes, 16) is None


class SlowTailStore:
    """A kvcache client (the real one: tested against a kvcache node in
    tests/integration/test_kvcache_service.py) whose writes each wait to be released, and
    then report the requests in `lose` as not stored."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.hold = True
        self.lose: list[str] = []
        self.writes: list[list[tuple[str, list[int], bytes, int]]] = []
        self.times: list[float] = []  # when each write started

    async def store_tails(self, tails: list[TailBlock]) -> list[str]:
        self.writes.append([(t.request_id, t.token_ids, bytes(t.data), t.first) for t in tails])
        self.times.append(time.monotonic())
        if self.hold:
            await self.release.wait()
            self.release.clear()
        return [t.request_id for t in tails if t.request_id in self.lose]

    async def wait_writes(self, n: int) -> None:
        await wait_until(f"{n} tail writes", lambda: len(self.writes) >= n, interval=0.01)


def t(rid: str, n: int, first: int = 0) -> TailBlock:
    """A tail of tokens 0..n-1, or a piece with rows `first` on; each row is one byte: its
    token."""
    return TailBlock(rid, 0, ROOT_HASH, list(range(n)), bytes(range(first, n)), first)


async def test_the_uploader_merges_pieces_writes_the_latest_and_never_queues() -> None:
    client = SlowTailStore()
    uploader = TailUploader(client).start()  # type: ignore[arg-type]
    uploader.submit([t("a", 1)])
    await client.wait_writes(1)  # the first write is in flight, held
    uploader.submit([t("a", 2, first=1), t("b", 1)])
    uploader.submit([t("a", 3, first=2), t("c", 1)])
    uploader.submit([t("b", 2, first=1)])
    uploader.forget("c")  # ended here meanwhile: not written
    client.release.set()
    await client.wait_writes(2)
    assert client.writes[0] == [("a", [0], b"\x00", 0)]
    # a's two pieces go as one, after the rows in flight; b's piece joins its whole tail
    assert sorted(client.writes[1]) == [
        ("a", [0, 1, 2], b"\x01\x02", 1),
        ("b", [0, 1], b"\x00\x01", 0),
    ]
    client.release.set()
    await wait_until("the second write's 2 tails stored", lambda: uploader.stored == 3)
    await uploader.close()
    assert uploader.skipped == 2 and uploader.stored == 3 and uploader.lost == 0


async def test_a_tail_the_store_lost_is_asked_for_whole() -> None:
    client = SlowTailStore()
    uploader = TailUploader(client).start()  # type: ignore[arg-type]
    asked: list[str] = []
    uploader.on_lost = asked.extend
    client.lose = ["a"]
    uploader.submit([t("a", 3, first=2), t("b", 3, first=2)])
    await client.wait_writes(1)
    uploader.submit([t("a", 4, first=3), t("b", 4, first=3)])  # pending while it fails
    client.release.set()
    await client.wait_writes(2)
    assert asked == ["a"] and uploader.lost == 1
    # a's pending piece would not continue anything stored: dropped, the whole tail comes
    assert client.writes[1] == [("b", [0, 1, 2, 3], b"\x03", 3)]
    client.lose = []
    uploader.submit([t("a", 5)])
    client.release.set()
    await client.wait_writes(3)
    client.release.set()
    await uploader.close()
    assert client.writes[2] == [("a", [0, 1, 2, 3, 4], bytes(range(5)), 0)]


def test_pieces_continue_only_their_own_tail() -> None:
    whole = t("a", 3)
    assert extend(whole, t("a", 5, first=3)) == t("a", 5)
    assert extend(whole, t("a", 5, first=2)) is None  # overlaps
    assert extend(whole, t("a", 5, first=4)) is None  # a gap
    assert extend(whole, TailBlock("a", 16, ROOT_HASH, [0, 1, 2, 3], b"\x03", 3)) is None
    other = TailBlock("a", 0, ROOT_HASH, [0, 1, 9, 3], b"\x03", 3)  # another token before
    assert extend(whole, other) is None


async def test_a_put_is_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many whole tails at once (say after a kvcache restart) go in several puts."""
    monkeypatch.setattr("shared.kvclient.tails.MAX_PUT_BYTES", 10)
    client = SlowTailStore()
    client.hold = False
    uploader = TailUploader(client).start()  # type: ignore[arg-type]
    uploader.submit([t("a", 4), t("b", 4), t("c", 4), t("d", 12)])
    await client.wait_writes(3)
    await uploader.close()
    assert [[w[0] for w in put] for put in client.writes] == [["a", "b"], ["c"], ["d"]]


async def test_puts_start_an_interval_apart_and_carry_every_step_in_between() -> None:
    """Steps every 10 ms, puts at most every 100 ms: each put holds the rows of all the steps
    since the last one, and the tail stored at the end is whole and the latest."""
    client = SlowTailStore()
    client.hold = False
    uploader = TailUploader(client, interval=0.1).start()  # type: ignore[arg-type]
    started = time.monotonic()
    uploader.submit([t("a", 1)])
    for n in range(2, 31):
        await asyncio.sleep(0.01)
        uploader.submit([t("a", n, first=n - 1)])
    steps = time.monotonic() - started  # ~0.3 s; longer on a loaded machine
    # The last piece goes in the put after the interval (close() drops what is pending).
    await wait_until(
        "a put of the whole 30-row tail",
        lambda: client.writes and client.writes[-1][0][1] == list(range(30)),
        interval=0.01,
    )
    await uploader.close()
    assert 2 <= len(client.writes) <= steps / 0.1 + 2  # one per 0.1 s, not one per step
    assert all(b - a >= 0.099 for a, b in itertools.pairwise(client.times))
    rows = b"".join(data for [(_, _, data, _)] in client.writes)
    assert rows == bytes(range(30))  # every row once, in order: the stored tail is whole
    assert client.writes[-1][0][1] == list(range(30))
