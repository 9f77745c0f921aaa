"""The OpenAI-compatible API over the real disaggregated stack, with the real openai client."""

from __future__ import annotations

import asyncio
import io
import json
import time
import urllib.request
from collections.abc import Callable

import aiohttp
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from shared.bus.client import Bus
from shared.bus.registry import NodeRegistry
from shared.errors import TandemError
from shared.model.loader import LoadedModel
from tandem.launcher import Stack

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference(model: LoadedModel, ids: list[int], n: int) -> list[int]:
    out = model.hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def text_of(model: LoadedModel, tokens: list[int]) -> str:
    return str(model.tokenizer.decode(tokens, skip_special_tokens=True))


def test_completions_match_generate(stack: Stack, real_model: LoadedModel) -> None:
    with client(stack) as c:
        check_completions(c, real_model)


def check_completions(c: openai.OpenAI, real_model: LoadedModel) -> None:
    for prompt in ["The capital of France is", "def fibonacci(n):", "Once upon a time"]:
        ids = real_model.encode(prompt)
        ref = reference(real_model, ids, 24)
        resp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert resp.choices[0].text == text_of(real_model, ref)
        assert resp.usage is not None
        assert resp.usage.prompt_tokens == len(ids)
        assert resp.usage.completion_tokens == len(ref)
        stream = c.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == resp.choices[0].text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in (
            "stop",
            "length",
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ref)


def test_chat_matches_generate(stack: Stack, real_model: LoadedModel) -> None:
    with client(stack) as c:
        check_chat(c, real_model)


def check_chat(c: openai.OpenAI, real_model: LoadedModel) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = real_model.apply_chat_template(messages)
    ref = reference(real_model, ids, 32)
    resp = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)  # type: ignore[arg-type]
    assert resp.choices[0].message.content == text_of(real_model, ref)
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage is not None and resp.usage.completion_tokens == len(ref)
    stream = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=32,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == resp.choices[0].message.content


def naive_sse(raw: bytes) -> list[object]:
    """Read a stream as `vllm bench serve` and many hand-written clients do: split on blank
    lines, strip a leading `data: `, `json.loads` the rest. Any other field line breaks it."""
    events = []
    for part in raw.decode().split("\n\n"):
        if not part.strip():
            continue
        data = part.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_streams_parse_with_a_naive_sse_reader_and_the_sdk(
    stack: Stack, real_model: LoadedModel
) -> None:
    """Events are exactly OpenAI's by default; `id:` lines only when a client asks for them."""
    prompt = "The capital of France is"
    ref = text_of(real_model, reference(real_model, real_model.encode(prompt), 24))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/completions", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = await resp.read()
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        chat |= {"max_tokens": 8, "temperature": 0, "stream": True}
        async with s.post(stack.url + "/v1/chat/completions", json=chat) as resp:
            chat_raw = await resp.read()
        headers = {"X-Tandem-Resumable": "true"}
        async with s.post(stack.url + "/v1/completions", json=body, headers=headers) as resp:
            resumable_raw = await resp.read()
    for stream in (raw, chat_raw):
        assert all(line.startswith(b"data: ") for line in stream.split(b"\n") if line)
    events = naive_sse(raw)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref
    assert naive_sse(chat_raw)[-1] == "[DONE]"
    ids = [line for line in resumable_raw.split(b"\n") if line.startswith(b"id: ")]
    assert len(ids) == sum(1 for line in resumable_raw.split(b"\n") if line.startswith(b"data: {"))
    with client(stack) as c:  # the SDK reads the same stream
        stream = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == ref


async def test_tokenize_detokenize_and_version(stack: Stack, real_model: LoadedModel) -> None:
    """vLLM's extension endpoints: the tokenizer's own ids, a round trip, clear 4xx."""
    text = "The capital of France is Paris. 日本 🙂"
    messages = [{"role": "user", "content": "Hi there"}]
    async with aiohttp.ClientSession(stack.url) as s:
        async with s.post("/tokenize", json={"model": MODEL, "prompt": text}) as r:
            assert r.status == 200
            body = await r.json()
        want = real_model.tokenizer.encode(text, add_special_tokens=True)
        assert body["tokens"] == want and body["count"] == len(want)
        assert body["max_model_len"] == real_model.max_model_len
        async with s.post("/tokenize", json={"model": MODEL, "messages": messages}) as r:
            assert (await r.json())["tokens"] == real_model.apply_chat_template(messages)
        async with s.post("/detokenize", json={"model": MODEL, "tokens": want}) as r:
            assert (await r.json())["prompt"] == real_model.tokenizer.decode(want)
        async with s.get("/version") as r:
            assert r.status == 200 and (await r.json())["version"]
        bad = [
            ("/tokenize", {"model": MODEL, "prompt": 5}, 400),
            ("/tokenize", {"model": "nope", "prompt": "x"}, 404),
            ("/detokenize", {"model": MODEL, "tokens": [1, "x"]}, 400),
            ("/detokenize", {"model": MODEL, "tokens": [10**9]}, 400),
        ]
        for path, payload, status in bad:
            async with s.post(path, json=payload) as r:
                assert r.status == status, (path, payload)
                assert (await r.json())["error"]["message"]


def test_models_health_ready_metrics(stack: Stack) -> None:
    with client(stack) as c:
        assert [m.id for m in c.models.list().data] == [MODEL]
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(stack.url + path) as r:
            assert r.status == 200
    with urllib.request.urlopen(stack.url + "/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    ttft = families["tandem_time_to_first_token_seconds"]
    count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
    assert count > 0  # earlier tests' traffic moved the histogram


async def test_32_concurrent_streams_complete_on_both_nodes_of_each_role(stack: Stack) -> None:
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]

    async def one(i: int) -> tuple[int, int]:
        prompt = " ".join(words[j % len(words)] for j in range(3 + (i * 37) % 300))
        want = 8 + (i * 7) % 40
        stream = await c.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=want,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for ch in stream:
            if ch.usage is not None:
                usage = ch.usage.completion_tokens
        assert usage is not None
        return want, usage

    try:
        results = await asyncio.gather(*(one(i) for i in range(32)))
    finally:
        await c.close()
    assert all(want == got for want, got in results)
    with urllib.request.urlopen(stack.url + "/metrics") as r:
        text = r.read().decode()
    served = {
        (s.labels["role"], s.labels["node"])
        for f in text_string_to_metric_families(text)
        if f.name == "tandem_node_requests"
        for s in f.samples
        if s.value > 0
    }
    # Both nodes of each role served. The prompts share their first words, so a decode node
    # that already holds a prefix may prefill a request itself (KV-aware routing): it then
    # counts under the prefill role too, which depends on timing.
    assert {"prefill-1", "prefill-2"} <= {n for role, n in served if role == "prefill"}
    assert {n for role, n in served if role == "decode"} == {"decode-1", "decode-2"}


async def decode_nodes(stack: Stack) -> dict[str, tuple[int, int, int]]:
    bus = await Bus(stack.nats_url, "e2e-probe", stack.auth).connect()
    try:
        nodes = await (await NodeRegistry(bus).start()).nodes()
        return {
            n.node_id: (n.running, n.free_kv_blocks, n.total_kv_blocks)
            for n in nodes.values()
            if n.role == "decode"
        }
    finally:
        await bus.close()


async def test_embedded_nats_refuses_connections_without_credentials(stack: Stack) -> None:
    with pytest.raises(TandemError, match="refused"):
        await Bus(stack.nats_url, "stranger").connect()


DecodeLoad = dict[str, tuple[int, int, int]]  # node → (running, free blocks, total blocks)


def idle(nodes: DecodeLoad) -> bool:
    return all(running == 0 and free == total for running, free, total in nodes.values())


def busy(nodes: DecodeLoad) -> bool:
    return any(running > 0 for running, _, _ in nodes.values())


async def wait_for_decode_nodes(
    stack: Stack, condition: Callable[[DecodeLoad], bool], within: float
) -> DecodeLoad:
    """The decode nodes' heartbeats (~0.7 s apart) until `condition` holds or `within` s pass."""
    deadline = time.monotonic() + within
    while True:
        now = await decode_nodes(stack)
        if condition(now) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.1)


def stack_log_lines(stack: Stack, word: str) -> list[str]:
    with open(stack.out.name) as log:
        return [line.rstrip() for line in log if word in line][-20:]


async def test_client_disconnect_frees_blocks_everywhere(stack: Stack) -> None:
    # From idle: the last heartbeats may still show the previous test's streams.
    before = await wait_for_decode_nodes(stack, idle, 10.0)
    assert idle(before), before
    async with aiohttp.ClientSession() as session:
        body = {
            "model": MODEL,
            "prompt": "Tell me a very long story about a robot. " * 20,
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        async with session.post(stack.url + "/v1/completions", json=body) as resp:
            got = 0
            async for line in resp.content:
                if line.startswith(b"data: "):
                    got += 1
                if got >= 5:
                    break
            running = await wait_for_decode_nodes(stack, busy, 4.0)
            assert busy(running), running
    # The router cancels on every node as soon as the client is gone; the stream would
    # run ~20 s more otherwise. 5 s is the design's bound for freeing a request's blocks.
    now = await wait_for_decode_nodes(stack, idle, 5.0)
    assert idle(now), (running, now, stack_log_lines(stack, "cancel"))


BAD = [
    (b"{not json", 400, None),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": 42}).encode(), 400, "prompt"),
    (json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(), 404, "model"),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hello " * 9000}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (
        json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 100000}).encode(),
        400,
        "max_tokens",
    ),
    (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}).encode(), 400, "temperature"),
    (b'{"model": "x", "prompt": "' + b"a" * (10 << 20) + b'"}', 413, None),
    *[
        (json.dumps({"model": MODEL, "prompt": "hi", key: value}).encode(), 400, key)
        for key, value in [
            ("presence_penalty", 3),
            ("frequency_penalty", "a lot"),
            ("repetition_penalty", 0),
            ("logit_bias", {"12": 500}),
            ("logit_bias", {"not-a-token": 1}),
            ("logit_bias", {"999999": 1}),
            ("min_tokens", 17),  # above the completions default max_tokens of 16
            ("stop_token_ids", [1, "x"]),
            ("stop_token_ids", [10**7]),
            ("user", 5),
            ("logprobs", 21),  # beyond the 20 alternatives served
            ("logprobs", True),  # a completion's is a count, a chat's a boolean
            ("echo", "yes"),
            ("n", 0),
            ("n", 17),  # more choices than one request may ask
            ("response_format", {"type": "xml"}),
            ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}),
        ]
    ],
]


async def test_bad_input_gets_openai_errors_while_good_request_completes(stack: Stack) -> None:
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    good = asyncio.create_task(
        c.completions.create(
            model=MODEL,
            prompt="Count to ten:",
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    )
    async with aiohttp.ClientSession() as session:
        for body, status, param in BAD:
            async with session.post(
                stack.url + "/v1/completions",
                data=io.BytesIO(body),
                headers={"Content-Type": "application/json"},
            ) as resp:
                assert resp.status == status, body[:80]
                err = (await resp.json())["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
                if param is not None:
                    assert err["param"] == param
    try:
        done = await good
    finally:
        await c.close()
    assert done.usage is not None and done.usage.completion_tokens == 40


def test_penalties_bias_min_tokens_and_stop_ids_through_the_stack(
    stack: Stack, real_model: LoadedModel
) -> None:
    """The OpenAI parameters that change tokens, sent by the SDK, give what the engine
    alone gives (tests/unit/test_logits.py holds the engine to transformers)."""
    from shared.engine.engine import Engine, EngineConfig
    from shared.sampling_params import SamplingParams

    prompt = "List the colours of the rainbow, again and again:"
    ids = real_model.encode(prompt)
    engine = Engine(real_model, EngineConfig(num_blocks=256))
    eos = min(real_model.eos_token_ids)
    cases = [
        {"repetition_penalty": 1.3, "presence_penalty": 0.6, "frequency_penalty": 0.8},
        {"logit_bias": {str(eos): 100}, "min_tokens": 4},  # EOS held back, then at once
    ]
    with client(stack) as c:
        for extra in cases:
            resp = c.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, temperature=0, user="u-1",
                extra_body=extra,
            )  # fmt: skip
            bias = tuple((int(k), float(v)) for k, v in extra.get("logit_bias", {}).items())
            params = SamplingParams(
                max_tokens=24, temperature=0, logit_bias=bias,
                **{k: v for k, v in extra.items() if k != "logit_bias"},
            )  # fmt: skip
            want = engine.generate([ids], params)[0]
            assert resp.choices[0].text == text_of(real_model, want), extra
            assert resp.usage is not None and resp.usage.completion_tokens == len(want)
        plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        free = engine.generate([ids], SamplingParams(max_tokens=24, temperature=0))[0]
        assert plain.choices[0].text == text_of(real_model, free)
        stop = free[3]
        cut = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
            extra_body={"stop_token_ids": [stop]},
        )  # fmt: skip
        assert cut.choices[0].finish_reason == "stop"
        assert plain.choices[0].text.startswith(cut.choices[0].text)
        assert len(cut.choices[0].text) < len(plain.choices[0].text)


def test_every_node_serves_metrics_that_move(stack: Stack) -> None:
    with client(stack) as c:
        for _ in range(2):
            c.completions.create(model=MODEL, prompt="Metrics move", max_tokens=5, temperature=0)
    values: dict[str, dict[str, float]] = {}
    for name, port in stack.metrics_ports.items():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            values[name] = {
                s.name: s.value
                for f in text_string_to_metric_families(r.read().decode())
                for s in f.samples
                if not s.labels or s.labels.get("direction") in ("send", "receive")
            }
    assert set(values) == {"kvcache-1", "prefill-1", "prefill-2", "decode-1", "decode-2"}
    prefill = [v for n, v in values.items() if n.startswith("prefill")]
    decode = [v for n, v in values.items() if n.startswith("decode")]
    assert sum(v["tandem_prefill_tokens_total"] for v in prefill) > 0
    assert sum(v["tandem_kv_transfer_bytes_total"] for v in prefill) > 0
    assert sum(v["tandem_prefill_batch_size_count"] for v in prefill) > 0
    assert sum(v["tandem_decode_tokens_total"] for v in decode) > 0
    assert sum(v["tandem_kv_transfer_bytes_total"] for v in decode) > 0
    assert all(v["tandem_kv_blocks_free"] > 0 for v in decode)
    assert "tandem_kvcache_memory_bytes" in values["kvcache-1"]
