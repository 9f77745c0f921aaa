"""Tail checkpoints: a running sequence's partial last block, taken on one engine and placed on
another, lets a resume compute one token instead of up to a block, with the same output; the
decode node's uploader writes only each request's latest tail."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.decode.tails import TailUploader
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.errors import WireFormatError
from shared.kv.block_hash import ROOT_HASH, BlockHash
from shared.kv.tail import TailBlock, fit_tail
from shared.model.loader import LoadedModel

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=30, temperature=0.9, seed=11, ignore_eos=True)


def dying_node(
    model: LoadedModel, prompt: list[int], params: SamplingParams, tokens: int
) -> tuple[list[BlockHash], list[bytes], TailBlock | None, list[int]]:
    """Run until `tokens` are out, as a checkpointing decode node: its stored full blocks,
    its latest tail, and the tokens it delivered."""
    engine = Engine(model, EngineConfig(num_blocks=64))
    engine.collect_filled = engine.collect_tails = True
    rid = engine.add_request(prompt, params, "r")
    hashes: list[BlockHash] = []
    blocks: list[bytes] = []
    tail = None
    out: list[int] = []
    while len(out) < tokens:
        for o in engine.step():
            out.extend(o.new_token_ids)
        h, b = engine.take_filled_blocks()
        hashes += h
        blocks += b
        for t in engine.take_tails():
            assert t.request_id == rid
            tail = t
        assert engine.take_tails() == []  # nothing grew since: nothing new
    return hashes, blocks, tail, out


def resume(
    model: LoadedModel,
    prompt: list[int],
    params: SamplingParams,
    stored: tuple[list[BlockHash], list[bytes], TailBlock | None, list[int]],
) -> tuple[list[int], int]:
    """A fresh node resumes the request: (tokens it makes, context tokens it recomputed)."""
    hashes, blocks, tail, delivered = stored
    engine = Engine(model, EngineConfig(num_blocks=64))
    engine.import_cached_blocks(hashes, blocks)
    context = prompt + delivered
    fitted = engine.fit_tail(tail, context) if tail is not None else None
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
    assert engine.fit_tail(tail, context) == tail
    other = list(context)
    other[33] += 1  # a token inside the tail differs
    assert engine.fit_tail(tail, other) is None
    other = list(context)
    other[3] += 1  # a token before it differs: its parent block is another
    assert engine.fit_tail(tail, other) is None
    assert engine.fit_tail(TailBlock("r", 32, tail.parent, tail.token_ids, b"x"), context) is None
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
    tests/integration/test_kvcache_service.py) whose first write waits to be released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.writes: list[list[tuple[str, list[int]]]] = []

    async def store_tails(self, tails: list[TailBlock]) -> int:
        self.writes.append([(t.request_id, t.token_ids) for t in tails])
        if len(self.writes) == 1:
            await self.release.wait()
        return len(tails)


async def test_the_uploader_writes_only_the_latest_tail_and_never_queues() -> None:
    client = SlowTailStore()
    uploader = TailUploader(client).start()  # type: ignore[arg-type]

    def t(rid: str, n: int) -> TailBlock:
        return TailBlock(rid, 0, ROOT_HASH, list(range(n)), b"")

    uploader.submit([t("a", 1)])
    await asyncio.sleep(0.01)  # the first write is in flight, held
    uploader.submit([t("a", 2), t("b", 1)])
    uploader.submit([t("a", 3), t("c", 1)])
    uploader.forget("c")  # ended here meanwhile: not written
    client.release.set()
    for _ in range(100):
        if len(client.writes) == 2:
            break
        await asyncio.sleep(0.01)
    await uploader.close()
    assert client.writes[0] == [("a", [0])]
    assert sorted(client.writes[1]) == [("a", [0, 1, 2]), ("b", [0])]
    assert uploader.skipped == 1 and uploader.stored == 3
