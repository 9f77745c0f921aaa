"""response_format in the engine (shared/engine/guided.py): the output follows the grammar
and equals a reference loop (transformers' forward, llguidance's mask, argmax); a sequence
resumed from part of its output continues exactly; unguided rows of the same batch are
untouched; a grammar llguidance cannot follow is refused before anything runs."""

from __future__ import annotations

import json
import random

import llguidance.hf
import pytest
import torch
from llguidance import LLMatcher

from shared.engine.engine import Engine, EngineConfig
from shared.errors import InvalidRequestError
from shared.grammar import grammar_for
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

SCHEMA = {  # bounded (a random model would write digits or spaces for ever otherwise)
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["answer", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
MAX = 40


def prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def guide() -> str:
    return grammar_for({"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})


def reference(model: LoadedModel, ids: list[int], grammar: str) -> list[int]:
    """Greedy under the grammar, the slow obvious way."""
    tok = llguidance.hf.from_tokenizer(model.tokenizer, n_vocab=model.hf_model.config.vocab_size)
    matcher = LLMatcher(tok, grammar)
    out: list[int] = []
    while len(out) < MAX and not matcher.is_stopped():
        with torch.no_grad():
            logits = model.hf_model(torch.tensor([ids + out])).logits[0, -1].float()
        # a byte per token this time (the engine reads llguidance's bits)
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
        logits[: len(allowed)][allowed == 0] = float("-inf")
        logits[len(allowed) :] = float("-inf")
        out.append(int(logits.argmax()))
        matcher.consume_token(out[-1])
    return out


def test_output_follows_the_schema_and_the_reference(tiny_model: LoadedModel) -> None:
    ids, grammar = prompt(1), guide()
    params = SamplingParams(max_tokens=MAX, temperature=0, guide=grammar)
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    rid = engine.add_request(ids, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    tokens = [t for o in outs for t in o.new_token_ids]
    assert outs[-1].finish_reason == "stop"  # the object closed, before max_tokens
    assert tokens == reference(tiny_model, ids, grammar)
    value = json.loads(tiny_model.tokenizer.decode(tokens))
    assert set(value) == {"answer", "n"} and value["answer"] in ("yes", "no")
    assert isinstance(value["n"], int)
    # Resumed after 5 tokens (a failover): the new matcher is fed them, the rest is the same.
    resumed = Engine(tiny_model, EngineConfig(num_blocks=64))
    resumed.add_request(ids, params, output_ids=tokens[:5])
    rest = []
    while resumed.has_unfinished():
        rest += [t for o in resumed.step() for t in o.new_token_ids]
    assert tokens[:5] + rest == tokens


def test_unguided_rows_of_the_batch_are_untouched(tiny_model: LoadedModel) -> None:
    a, b = prompt(2), prompt(3, 18)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = Engine(tiny_model, EngineConfig(num_blocks=64)).generate([b], plain)[0]
    guided = SamplingParams(max_tokens=MAX, temperature=0, guide=guide())
    both = Engine(tiny_model, EngineConfig(num_blocks=64))
    both.add_request(a, guided)
    rid = both.add_request(b, plain)
    got = []
    while both.has_unfinished():
        got += [t for o in both.step() if o.request_id == rid for t in o.new_token_ids]
    assert got == alone


def test_grammars_that_cannot_be_followed_are_refused(tiny_model: LoadedModel) -> None:
    with pytest.raises(InvalidRequestError) as err:
        grammar_for({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}})
    assert err.value.param == "response_format"
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": "x"}):
        with pytest.raises(InvalidRequestError):
            grammar_for(bad)
    assert grammar_for({"type": "text"}) == ""
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    with pytest.raises(InvalidRequestError):  # a node checks what the router sent
        engine.add_request(prompt(4), SamplingParams(max_tokens=4, guide='{"grammars": 7}'))
    assert not engine.has_unfinished()


def test_a_matcher_in_error_lets_only_the_end_through(tiny_model: LoadedModel) -> None:
    """Resumed with output its grammar refuses (a JSON object cannot start with "x"): the
    matcher is in error, the next token can only end the request, and it does at once."""
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    (bad,) = tiny_model.tokenizer.encode("x", add_special_tokens=False)
    params = SamplingParams(max_tokens=MAX, temperature=0, guide=guide())
    rid = engine.add_request(prompt(5), params, output_ids=[bad])
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert len(outs) == 1 and outs[0].finish_reason == "stop"
    assert outs[0].new_token_ids[0] in tiny_model.eos_token_ids
    assert engine.guides.failed == 1


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, object]:
    """A random bounded schema: every value has a bounded length, so the output must end."""
    kinds = ["integer", "enum", "boolean", "array", "pattern"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randrange(1, 500)}
    if kind == "enum":
        words = ["red", "green", "blue", "cat", "dog", "a b", "x-y", "42"]
        return {"type": "string", "enum": rng.sample(words, rng.randrange(1, 5))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "pattern":
        return {"type": "string", "pattern": f"^[a-z]{{1,{rng.randrange(1, 6)}}}$"}
    if kind == "array":
        n = rng.randrange(0, 4)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": n,
            "maxItems": n,
        }
    names = rng.sample(["id", "name", "tags", "ok", "size", "kind", "child"], rng.randrange(1, 4))
    return {
        "type": "object",
        "properties": {name: random_schema(rng, depth + 1) for name in names},
        "required": names,
        "additionalProperties": False,
    }


def test_twenty_random_schemas_always_give_output_that_validates(tiny_model: LoadedModel) -> None:
    """A random model drawing at temperature 1 goes wherever the grammar lets it: each of
    20 random schemas' outputs ends (finish "stop"), parses, and validates (jsonschema)."""
    import jsonschema

    rng = random.Random(25)
    schemas = []
    for _ in range(20):
        schema = random_schema(rng)
        if schema.get("type") != "object":  # a top-level object, as APIs ask for
            schema = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
        schema["additionalProperties"] = False
        schema["x-guidance"] = {"whitespace_flexible": False}
        schemas.append(schema)
    engine = Engine(tiny_model, EngineConfig(num_blocks=512))
    ids = {}
    for i, schema in enumerate(schemas):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        params = SamplingParams(max_tokens=400, temperature=1.0, seed=i, guide=grammar_for(fmt))
        ids[engine.add_request(prompt(100 + i), params)] = i
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    for rid, i in ids.items():
        text = tiny_model.tokenizer.decode(tokens[rid])
        assert reasons[rid] == "stop", (schemas[i], text)
        schema = {k: v for k, v in schemas[i].items() if k != "x-guidance"}
        jsonschema.validate(json.loads(text), schema)
