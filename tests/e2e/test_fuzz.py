"""Fuzzing the running stack: random and mutated HTTP requests at the router, random and
mutated bytes at every NATS subject a node listens on. Nothing may answer 5xx, crash or
hang, and a good request still returns the reference tokens afterwards.

(The UCX/TCP data-plane listener is fuzzed in tests/integration/test_transport.py; the
decoders alone, with far more examples, in tests/unit/test_messages.py and test_frames.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import urllib.error
import urllib.request
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.bus.client import Bus
from shared.bus.messages import (
    Cancel,
    DecodeAssignment,
    KVEvent,
    KVGet,
    KVPut,
    Message,
    PrefillJob,
    SequenceSnapshot,
    encode,
)
from shared.bus.registry import NodeRegistry
from shared.bus.topology import (
    KV_EVENTS_SUBJECT,
    assign_subject,
    cancel_subject,
    kvcache_subject,
    local_prefill_subject,
    prefill_subject,
)
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams
from tandem.launcher import Stack
from tests.e2e.test_api import MODEL, reference, text_of

pytestmark = pytest.mark.e2e

PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz", "/readyz"]
hostile_scalars = (
    st.integers(min_value=2**63 - 2, max_value=2**90)  # beyond 64 bits
    | st.integers(min_value=-(2**90), max_value=-(2**63) + 2)
    | st.text(st.characters(categories=["Cs", "Ll"]), min_size=1, max_size=4)  # surrogates
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=40)
    | hostile_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=12,
)
# Generation is the slow part: keep any request that happens to be valid short (null would
# mean "up to the context": minutes of output, past the client's timeout).
small_max_tokens = st.integers(-2, 3) | json_values.filter(lambda v: v is not None)


@st.composite
def mutated_body(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    if chat:
        body["messages"] = [{"role": "user", "content": "Hi there"}]
    else:
        body["prompt"] = "Once upon a time"
    keys = ["model", "prompt", "messages", "stream", "stop", "temperature", "top_p", "top_k"]
    keys += ["seed", "n", "ignore_eos", "stream_options", "max_completion_tokens", "logprobs"]
    for key in draw(st.lists(st.sampled_from(keys), max_size=4)):
        if draw(st.booleans()):
            body.pop(key, None)
        else:
            body[key] = draw(json_values)
    if not chat and draw(st.booleans()):  # token ids, some outside the vocabulary
        body["prompt"] = draw(st.lists(st.integers(-5, 200_000) | hostile_scalars, max_size=4))
    body["max_tokens"] = draw(small_max_tokens)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = draw(small_max_tokens)
    return body


@st.composite
def http_request(draw: st.DrawFn) -> tuple[str, str, bytes]:
    path = draw(st.sampled_from(PATHS) | st.text(max_size=20).map(lambda t: "/v1/" + t))
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]))
    kind = draw(st.sampled_from(["mutated", "mutated", "json", "bytes", "deep"]))
    if kind == "mutated":
        body = json.dumps(draw(mutated_body("chat" in path))).encode()
    elif kind == "deep":  # nesting past any recursion limit, within the body limit
        depth = draw(st.integers(1, 100_000))
        body = b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * depth + b"]" * depth + b"}"
    elif kind == "json":
        body = json.dumps(draw(json_values)).encode()
    else:
        body = draw(st.binary(max_size=300))
    return method, path, body


def send(stack: Stack, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    quoted = urllib.request.quote(path, safe="/")
    req = urllib.request.Request(stack.url + quoted, data=body or None, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()  # a stream is read to its end
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def alive(stack: Stack) -> set[str]:
    return {c.name for c in stack.children if c.proc is not None and c.proc.poll() is None}


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=http_request())
def test_random_http_requests_never_get_a_5xx(
    stack: Stack, request: tuple[str, str, bytes]
) -> None:
    method, path, body = request
    status, text = send(stack, method, path, body)
    assert status < 500, (request, status, text[:300])
    if status >= 400 and path.startswith("/v1/"):
        assert "error" in json.loads(text)  # the OpenAI error shape, not an HTML page


def _samples() -> list[Message]:
    params = SamplingParams(max_tokens=4)
    snap = SequenceSnapshot("fuzz-1", [1, 2, 3], [], params, 3)
    return [
        PrefillJob(attempt_id="fuzz-1", prompt_ids=[1, 2, 3], params=params, decode_node="x"),
        DecodeAssignment(transfer_id="fuzz-1", snapshot=snap, token_subject="tandem.fuzz"),
        Cancel(attempt_id="fuzz-1", reason="fuzz"),
        KVPut(transfer_id="fuzz-p", block_hashes=[b"\0" * 8], block_bytes=16),
        KVGet(transfer_id="fuzz-g", block_hashes=[b"\0" * 8], reply_address="tcp://127.0.0.1:9"),
        KVEvent(node_id="fuzz", op="stored", block_hashes=[b"\1" * 8]),
    ]


def _garbage(rng: random.Random) -> list[bytes]:
    out = [rng.randbytes(rng.randint(0, 400)) for _ in range(15)]
    out.append(msgspec.msgpack.encode({"kind": "prefill_job", "v": 99}))  # unknown version
    for msg in _samples():
        raw = bytearray(encode(msg))
        out.append(bytes(raw))  # well-formed but meaningless here
        for _ in range(3):
            for _ in range(3):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            out.append(bytes(raw))
    return out


async def test_random_bytes_on_every_subject_change_nothing(
    stack: Stack, real_model: LoadedModel
) -> None:
    before = alive(stack)
    bus = await Bus(stack.nats_url, "fuzzer", stack.auth).connect()
    assert bus.nc is not None and bus.js is not None
    try:
        nodes = await (await NodeRegistry(bus).start()).nodes()
        requests = []  # request/reply subjects
        for node in nodes.values():
            if node.role == "decode":
                requests += [assign_subject(node.node_id), local_prefill_subject(node.node_id)]
            if node.role == "kvcache":
                requests += [kvcache_subject(node.node_id, op) for op in ("put", "get")]
        assert len(requests) >= 5, nodes
        for data in _garbage(random.Random(11)):
            await bus.nc.publish(cancel_subject(), data)  # every node listens; no reply
            for subject in requests:
                # A timeout is a fine answer to garbage; a crash is not.
                with contextlib.suppress(Exception):
                    await bus.nc.request(subject, data, timeout=1.0)
            # the model's workers must term() these
            await bus.js.publish(prefill_subject(MODEL), data)
            await bus.js.publish(KV_EVENTS_SUBJECT + ".fuzz", data)  # routers must skip
    finally:
        await bus.close()
    await asyncio.sleep(1.0)
    assert alive(stack) == before
    # A good request still gets exactly the reference tokens.
    ids = real_model.tokenizer.encode("The capital of France is")
    started = time.monotonic()
    body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0}
    status, text = await asyncio.to_thread(
        send, stack, "POST", "/v1/completions", json.dumps(body).encode()
    )
    assert status == 200, text[:300]
    assert json.loads(text)["choices"][0]["text"] == text_of(
        real_model, reference(real_model, ids, 8)
    )
    assert time.monotonic() - started < 60
