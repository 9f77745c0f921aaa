"""response_format through the disaggregated stack: the prefill node constrains the first
token, a decode node the rest, and the output is what the engine alone makes under the same
grammar (tests/unit/test_guided.py holds the engine to transformers). A guided stream whose
decode node is SIGKILLed resumes elsewhere, under the same grammar, exactly."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from shared.engine.engine import Engine, EngineConfig
from shared.grammar import grammar_for
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams
from tandem.launcher import Stack
from tests.e2e.conftest import wait_for_every_node
from tests.e2e.streaming import complete, kill_its_decode_node
from tests.e2e.test_api import MODEL, client
from tests.e2e.test_failover import failovers

pytestmark = pytest.mark.e2e

ANSWER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "population_millions"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # bounded: it must end within max_tokens
}
# Long enough to fail over mid-way: 48 numbers, no room for anything else.
NUMBERS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 100, "maximum": 999},
    "minItems": 48,
    "maxItems": 48,
    "x-guidance": {"whitespace_flexible": False},
}


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def engine_text(model: LoadedModel, ids: list[int], fmt: dict[str, Any], n: int) -> str:
    params = SamplingParams(max_tokens=n, temperature=0, guide=grammar_for(fmt))
    tokens = Engine(model, EngineConfig(num_blocks=256)).generate([ids], params)[0]
    return str(model.tokenizer.decode(tokens, skip_special_tokens=True))


def test_json_schema_and_json_object_follow_the_engine(
    stack: Stack, real_model: LoadedModel
) -> None:
    messages = [{"role": "user", "content": "Which is the capital of France? Answer in JSON."}]
    ids = real_model.apply_chat_template(messages)
    with client(stack) as c:
        for fmt in (json_schema(ANSWER), {"type": "json_object"}):
            for stream in (False, True):
                resp = c.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=64, temperature=0,  # type: ignore[arg-type]
                    response_format=fmt, stream=stream,  # type: ignore[arg-type]
                )  # fmt: skip
                if stream:
                    text = "".join(ch.choices[0].delta.content or "" for ch in resp if ch.choices)
                else:
                    text = resp.choices[0].message.content or ""
                assert text == engine_text(real_model, ids, fmt, 64), (fmt, stream)
            if fmt["type"] == "json_schema":  # bounded: complete, so it parses
                value = json.loads(text)
                assert value["city"] in ("Paris", "Lyon", "Nice")
                assert 0 <= value["population_millions"] <= 99


async def test_a_guided_stream_resumes_under_its_grammar(
    stack: Stack, real_model: LoadedModel
) -> None:
    ids = real_model.encode("Write forty-eight three-digit numbers as a JSON list.")
    fmt = json_schema(NUMBERS)
    want = engine_text(real_model, ids, fmt, 400)
    assert len(json.loads(want)) == 48
    before = failovers(stack)
    events: list[str] = []
    victim = ""
    try:
        async with aiohttp.ClientSession() as session:
            extra = {"response_format": fmt}
            stream = asyncio.ensure_future(complete(session, stack.url, ids, 400, extra, events))
            victim = await kill_its_decode_node(stack, events, after=20)
            assert await asyncio.wait_for(stream, 180) == want
        assert failovers(stack) > before
    finally:
        if victim:
            stack.restart(victim)
    await asyncio.to_thread(wait_for_every_node, stack, 300)
