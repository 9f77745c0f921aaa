"""A models file (issue 27): `tandem up --models-file` serves SmolLM2 twice, once in
float32 and once in bfloat16 under a second name with limits of its own. Each model's
nodes run in its dtype, each answer equals `transformers`' greedy output in that dtype, and
each model's requests are held to its own limits."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shared.bus.client import Bus
from shared.bus.registry import NodeRegistry
from shared.bus.server import free_port
from shared.model.loader import LoadedModel, load_model
from tandem.launcher import Stack
from tests.e2e.conftest import running_stack
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
        assert text == text_of(model, reference(model, ids, 12)), (name, prompt)
    # the bf16 model's own max_tokens limit (12); the float32 one keeps the server's
    body = {"prompt": "Hello", "max_tokens": 13, "temperature": 0}
    status, doc = post(stack, {**body, "model": BF16})
    assert status == 400 and doc["error"]["param"] == "max_tokens", doc  # type: ignore[index]
    status, doc = post(stack, {**body, "model": MODEL})
    assert status == 200 and doc["usage"]["completion_tokens"] > 0, doc  # type: ignore[index]
