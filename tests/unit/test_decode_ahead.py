"""An engine that makes several tokens a step (shared/engine/ahead.py) over the native one,
on a tiny random Llama: the same tokens and text, several per output, and checkpoints that
see every block and tail the step-by-step engine hands out, byte for byte."""

from __future__ import annotations

import argparse
import random

import pytest

from services.decode.main import MAX_DECODE_AHEAD, decode_ahead
from shared.engine.ahead import MAX_AHEAD, DecodeAhead
from shared.engine.engine import Engine, EngineConfig
from shared.engine.interface import EngineCore
from shared.engine.types import StepOutput
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def run(engine: EngineCore, reqs: list[tuple[list[int], SamplingParams]]) -> list[StepOutput]:
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(prompt, params, request_id=f"r{i}")
    outs: list[StepOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def per_request(outs: list[StepOutput]) -> dict[str, tuple[list[int], str]]:
    got: dict[str, tuple[list[int], str]] = {}
    for o in outs:
        ids, text = got.get(o.request_id, ([], ""))
        got[o.request_id] = (ids + o.new_token_ids, text + o.text)
    return got


def test_same_tokens_and_text_several_a_step(tiny_model: LoadedModel) -> None:
    greedy = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True)
    reqs = [(p, greedy if i % 2 else seeded) for i, p in enumerate(prompts(5))]
    plain = run(Engine(tiny_model, EngineConfig(num_blocks=128)), reqs)
    ahead = run(DecodeAhead(Engine(tiny_model, EngineConfig(num_blocks=128)), 4), reqs)
    assert per_request(ahead) == per_request(plain)
    # each token's text, as a client served token by token had it: where text_ends cut
    by_token: dict[str, list[str]] = {}
    for o in plain:
        by_token.setdefault(o.request_id, []).append(o.text)
    cut: dict[str, list[str]] = {}
    for o in ahead:
        ends = o.text_ends or [len(o.text)]
        assert len(ends) == len(o.new_token_ids)
        cut.setdefault(o.request_id, []).extend(
            o.text[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)
        )
    assert cut == by_token
    assert max(len(o.new_token_ids) for o in ahead) == 4
    for o in ahead:  # a delta numbers its last token by the count after it
        assert o.logprobs is None or len(o.logprobs) == len(o.new_token_ids)
    last = {o.request_id: o for o in ahead}
    assert all(o.finished and o.finish_reason == "length" for o in last.values())
    assert {o.request_id: o.num_output_tokens for o in last.values()} == {
        f"r{i}": p.max_tokens for i, (_, p) in enumerate(reqs)
    }


def checkpointed(
    engine: EngineCore, reqs: list[tuple[list[int], SamplingParams]]
) -> tuple[dict[bytes, bytes], dict[str, bytes]]:
    """Every filled block (hash → bytes) and each request's tail rows, taken after each
    step as a decode node's checkpointing does."""
    engine.exchange.collect_filled = True
    engine.tails.collect = True
    for i, (prompt, params) in enumerate(reqs):
        engine.add_request(prompt, params, request_id=f"r{i}")
    blocks: dict[bytes, bytes] = {}
    tails: dict[str, bytes] = {}
    while engine.has_unfinished():
        engine.step()
        hashes, data = engine.exchange.take_filled_blocks()
        blocks.update({h: bytes(d) for h, d in zip(hashes, data, strict=True)})
        for t in engine.tails.take():
            kept = tails.get(t.request_id, b"") if t.first else b""
            tails[t.request_id] = kept + bytes(t.data)
    return blocks, tails


def test_checkpoints_see_every_block_and_tail(tiny_model: LoadedModel) -> None:
    """A short request ends within an outer step and a waiting one takes its blocks in the
    next inner step (a pool of four blocks, one request at a time): its filled blocks must be
    copied out before that, or the checkpoint would store the other's KV under its hash."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    rng = random.Random(5)
    reqs = [([rng.randrange(3, 49152) for _ in range(30)], p) for p in (short, params, params)]
    config = EngineConfig(num_blocks=4, block_size=16, max_num_seqs=1)
    plain_blocks, plain_tails = checkpointed(Engine(tiny_model, config), reqs)
    blocks, tails = checkpointed(DecodeAhead(Engine(tiny_model, config), 5), reqs)
    assert len(plain_blocks) >= 6
    assert blocks == plain_blocks
    assert tails == plain_tails and tails


def test_out_of_range_is_refused(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, EngineConfig(num_blocks=8))
    for k in (0, 65):
        with pytest.raises(ValueError, match="between 1 and 64"):
            DecodeAhead(engine, k)
    assert MAX_DECODE_AHEAD == MAX_AHEAD  # the option's bound is the engine's
    assert decode_ahead("64") == 64
    for bad in ("0", "65", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            decode_ahead(bad)
