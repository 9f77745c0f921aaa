"""Several models in one cluster (issue 27): `tandem up --model A --model NAME=DIR` starts
each model's own prefill and decode nodes; the router lists both, routes each request to
its model's nodes (jobs on the model's own queue), and every answer is its model's."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from shared.bus.server import free_port
from shared.model.loader import LoadedModel
from tests.e2e.conftest import running_stack, wait_for_every_node
from tests.e2e.streaming import MODEL, complete
from tests.e2e.test_api import reference, text_of

TINY = "tiny-random"  # a 2-layer random Llama: other layers, heads and KV layout

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]


def test_two_models_in_one_cluster_each_answer_is_its_models(
    tmp_path: Path, real_model: LoadedModel, tiny_model: LoadedModel, tiny_model_dir: Path
) -> None:
    argv = [
        "--model", MODEL,
        "--model", f"{TINY}={tiny_model_dir}",
        "--prefill", "1",
        "--decode", "1",
        "--kvcache", "0",  # (the kvcache service keeps one KV layout: not yet per model)
        "--transport", "tcp",
        "--kv-cache-mb", "128",
        "--heartbeat-ttl", "2",
        "--port", str(free_port()),
    ]  # fmt: skip
    with running_stack(argv, tmp_path / "stack.log") as stack:
        wait_for_every_node(stack, timeout=300)
        with urllib.request.urlopen(stack.url + "/v1/models", timeout=10) as r:
            listed = [m["id"] for m in json.load(r)["data"]]
        assert listed == [MODEL, TINY]
        unknown = json.dumps({"model": "nope", "prompt": "x", "max_tokens": 1}).encode()
        try:
            urllib.request.urlopen(
                urllib.request.Request(
                    stack.url + "/v1/completions",
                    unknown,
                    {"Content-Type": "application/json"},
                ),
                timeout=10,
            )
            raise AssertionError("an unknown model was served")
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
            assert json.load(exc)["error"]["code"] == "model_not_found"

        # 16 concurrent streams, the two models alternating
        requests = [
            (real_model if i % 2 == 0 else tiny_model, PROMPTS[i % len(PROMPTS)] + " " * (i // 8))
            for i in range(16)
        ]
        ids = [model.tokenizer.encode(prompt) for model, prompt in requests]

        async def run() -> list[str]:
            async with aiohttp.ClientSession() as session:
                return list(
                    await asyncio.gather(
                        *(
                            complete(
                                session,
                                stack.url,
                                prompt_ids,
                                8,
                                {"model": MODEL if model is real_model else TINY},
                            )
                            for (model, _), prompt_ids in zip(requests, ids, strict=True)
                        )
                    )
                )

        got = asyncio.run(run())
        for (model, prompt), prompt_ids, text in zip(requests, ids, got, strict=True):
            want = text_of(model, reference(model, prompt_ids, 8))
            assert text == want, (prompt, "tiny" if model is tiny_model else MODEL)
        # the router's latency metrics are per model
        with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as r:
            counts = {
                s.labels.get("model"): s.value
                for family in text_string_to_metric_families(r.read().decode())
                for s in family.samples
                if s.name == "tandem_time_to_first_token_seconds_count"
            }
        assert counts == {MODEL: 8, TINY: 8}
        # the two models answer differently: each request really ran on its own model
        assert text_of(real_model, reference(real_model, ids[0], 8)) != text_of(
            tiny_model, reference(tiny_model, ids[0], 8)
        )
