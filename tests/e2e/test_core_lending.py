"""Lent cores in a running stack (shared/runtime/core_share.py): one prefill and one decode
node on shared cores, as `tandem up` starts them on a small host. The decode node steps on
every core while the prefill node idles, gives its core back while a prompt is computed
beside its streams, and every stream's tokens stay those of `transformers`' greedy
`generate` across the changes of thread count."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from shared.bus.server import free_port
from shared.model.loader import LoadedModel
from tandem.launcher import Stack
from tests.e2e.conftest import running_stack

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
CORES = len(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if CORES < 2:
        pytest.skip(f"one CPU ({CORES}): no core to lend")
    argv = ["--split", "--port", str(free_port()), "--transport", "tcp", "--kv-cache-mb", "256"]
    log = tmp_path_factory.mktemp("lending") / "stack.log"
    with running_stack(argv, log) as s:
        yield s
        share = s.core_share
    assert share is not None and not share.exists()  # the stack removes it as it stops


def decode_metrics(stack: Stack) -> dict[str, float]:
    port = stack.metrics_ports["decode-1"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("tandem_decode_lent_steps", "tandem_decode_step_seconds_count"):
                out[s.name] = s.value
    return out


def lent_and_steps(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """The decode node's steps between two scrapes: those on lent cores, and all."""
    lent = after["tandem_decode_lent_steps"] - before["tandem_decode_lent_steps"]
    steps = after["tandem_decode_step_seconds_count"] - before["tandem_decode_step_seconds_count"]
    return lent, steps


def greedy(model: LoadedModel, prompt: str, n: int) -> str:
    ids = model.encode(prompt)
    out = model.hf_model.generate(
        torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    return str(model.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def test_the_decode_node_borrows_idle_cores_and_gives_them_back(
    pair: Stack, real_model: LoadedModel
) -> None:
    path = pair.core_share
    argv = pair.child("decode-1").argv
    assert path is not None and argv[argv.index("--core-share") + 1] == str(path)
    assert path.exists()  # the nodes made it
    with openai.OpenAI(base_url=pair.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:

        def ask(prompt: str, n: int) -> str:
            return c.completions.create(
                model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                extra_body={"ignore_eos": True},
            ).choices[0].text  # fmt: skip

        # alone: every step after the hand-off on the lent cores
        before = decode_metrics(pair)
        lone = "The capital of France is"
        assert ask(lone, 24) == greedy(real_model, lone, 24)
        after = decode_metrics(pair)
        lent = after["tandem_decode_lent_steps"] - before["tandem_decode_lent_steps"]
        steps = (
            after["tandem_decode_step_seconds_count"] - before["tandem_decode_step_seconds_count"]
        )
        assert steps >= 23 and lent == steps, after
        # a long stream while long prompts are prefilled beside it: the steps taken while
        # the prefill node computes run on the decode node's own core
        long_prompt = " ".join(f"line {i} of the log reads ok;" for i in range(60))
        prompts = ["Once upon a time", *(f"{long_prompt} {i}" for i in range(3))]
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(ask, prompts[0], 96)
            others = [pool.submit(ask, p, 8) for p in prompts[1:]]
            texts = [first.result(), *(f.result() for f in others)]
        lengths = (96, 8, 8, 8)
        assert texts == [greedy(real_model, p, n) for p, n in zip(prompts, lengths, strict=True)]
    end = decode_metrics(pair)
    lent, steps = lent_and_steps(after, end)
    assert 0 < lent < steps, end
