"""A models file (issue 27): `tandem up --models-file` serves SmolLM2 twice, once in
float32 and once in bfloat16 under a second name with limits of its own. Each model's
nodes run in its dtype, each answer equals `transformers`' greedy output in that dtype (in
bfloat16, up to the reference's first near tie: `untied`), and
each model's requests are held to its own limits. The stack is colocated, so it also
checks greedy identity with chunked prefill on through the whole stack (issue 23)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch

from shared.bus.client import Bus
from shared.bus.registry import NodeRegistry
from shared.bus.server import free_port
from shared.model.loader import LoadedModel, load_model
from tandem.launcher import Stack
from tests.e2e.conftest import running_stack
from tests.e2e.netns_client import metric as port_metric
from tests.e2e.streaming import MODEL, complete
from tests.e2e.test_api import reference, text_of

pytestmark = pytest.mark.e2e

BF16 = "smol-bf16"
MODELS_FILE = f"""
[[model]]
name = "{MODEL}"
source = "{MODEL}"

[[model]]
name = "{BF16}"
source = "{MODEL}"
dtype = "bfloat16"
max_tokens_limit = 12
"""
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module")
def two_dtypes(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Iterator[Stack]:
    """Each model on a decode node of its own that prefills its prompts (colocated)."""
    tmp = tmp_path_factory.mktemp("models-file")
    models = tmp / "models.toml"
    models.write_text(MODELS_FILE)
    argv = [
        "--models-file", str(models),
        "--colocated",
        "--decode", "1",
        "--kvcache", "0",
        "--transport", "tcp",
        "--kv-cache-mb", "128",
        "--port", str(free_port()),
    ]  # fmt: skip
    with running_stack(argv, tmp / "stack.log") as stack:
        yield stack


async def hash_keys(stack: Stack) -> dict[str, str]:
    """Each model's decode node's block-hash key (it names the node's dtype)."""
    bus = await Bus(stack.nats_url, "models-file-check", stack.auth).connect()
    try:
        nodes = (await (await NodeRegistry(bus).start()).nodes()).values()
        return {n.model: n.hash_key for n in nodes if n.role == "decode"}
    finally:
        await bus.close()


def post(stack: Stack, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        stack.url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


# Logits closer than this are a tie in bfloat16 (its step between 16 and 32, where these
# models' top logits lie): which one wins depends on the order of the sums, which differs
# between a batched paged step and `generate` and between CPUs (on an AVX2-only host,
# "Once upon a time" continued "New" by 0.031 over "Nova", and the engine said "Nova").
BF16_TIE = 0.125


def untied(model: LoadedModel, ids: list[int], ref: list[int]) -> int:
    """How many of the reference's tokens come before its first near tie (all: none)."""
    with torch.no_grad():
        logits = model.hf_model(torch.tensor([ids + ref])).logits[0, len(ids) - 1 : -1]
    top = logits.float().topk(2, dim=-1).values
    margins = (top[:, 0] - top[:, 1]).tolist()
    return next((i for i, m in enumerate(margins) if m < BF16_TIE), len(ref))


def test_one_model_in_two_dtypes_each_with_its_limits(
    two_dtypes: Stack, real_model: LoadedModel
) -> None:
    stack = two_dtypes
    with urllib.request.urlopen(stack.url + "/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.load(r)["data"]] == [MODEL, BF16]
    keys = asyncio.run(hash_keys(stack))
    assert "bfloat16" in keys[BF16] and "float32" in keys[MODEL], keys
    bf16 = load_model(MODEL, dtype="bfloat16", device="cpu")
    requests = [(name, prompt) for prompt in PROMPTS for name in (MODEL, BF16)]

    async def run() -> list[str]:
        async with aiohttp.ClientSession() as session:
            return list(
                await asyncio.gather(
                    *(
                        complete(session, stack.url, real_model.encode(p), 12, {"model": name})
                        for name, p in requests
                    )
                )
            )

    for (name, prompt), text in zip(requests, asyncio.run(run()), strict=True):
        model = real_model if name == MODEL else bf16
        ids = model.encode(prompt)
        ref = reference(model, ids, 12)
        if name == MODEL:
            assert text == text_of(model, ref), (name, prompt)
        else:  # exact up to the reference's first near tie (bfloat16: BF16_TIE)
            sure = ref[: untied(model, ids, ref)]
            assert text.startswith(text_of(model, sure)), (name, prompt, text, ref)
    # the bf16 model's own max_tokens limit (12); the float32 one keeps the server's
    body = {"prompt": "Hello", "max_tokens": 13, "temperature": 0}
    status, doc = post(stack, {**body, "model": BF16})
    assert status == 400 and doc["error"]["param"] == "max_tokens", doc  # type: ignore[index]
    status, doc = post(stack, {**body, "model": MODEL})
    assert status == 200 and doc["usage"]["completion_tokens"] > 0, doc  # type: ignore[index]


def test_a_long_prompt_chunked_beside_a_running_stream_is_still_greedy(
    two_dtypes: Stack, real_model: LoadedModel
) -> None:
    """Issue 23's identity through the whole stack: on a colocated node (a 256-token step
    budget, its default) a 700-token prompt that arrives while another stream decodes is
    prefilled in chunks beside it; both answers are still transformers' greedy text."""
    stack = two_dtypes
    short = real_model.encode("List the planets of the solar system, one per line.")
    long = real_model.encode("The history of lighthouses, told slowly. " * 80)[:700]
    assert len(long) == 700
    want_short = text_of(real_model, reference(real_model, short, 48))
    want_long = text_of(real_model, reference(real_model, long, 8))
    ports = [str(p) for name, p in stack.metrics_ports.items() if name.startswith("decode")]
    name = "tandem_decode_chunked_prefill_steps_total"
    before = sum(port_metric(p, name) for p in ports)

    async def run() -> tuple[str, str]:
        events: list[str] = []
        async with aiohttp.ClientSession() as session:
            first = asyncio.ensure_future(complete(session, stack.url, short, 48, None, events))
            async with asyncio.timeout(60):
                while len(events) < 4:  # it decodes: the long prompt joins a running batch
                    await asyncio.sleep(0.02)
            second = await complete(session, stack.url, long, 8)
            return await first, second

    got_short, got_long = asyncio.run(run())
    assert got_short == want_short
    assert got_long == want_long
    assert sum(port_metric(p, name) for p in ports) > before, "the long prompt was not chunked"
