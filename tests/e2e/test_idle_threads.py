"""A prefill node takes every core for a prompt sent while the router served nothing else
(the decode nodes idle then), and keeps to its own thread count for prompts sent beside
other streams. The package stack shares its cores among all nodes, so `tandem up` gives its
prefill nodes `--idle-threads` = the cores; the count a batch ran on is on its span."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tandem.launcher import Stack
from tests.e2e.test_tracing import trace_of
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
CORES = len(os.sched_getaffinity(0))


def compute_threads(otlp: OtlpReceiver, request_id: str) -> int:
    spans = trace_of(otlp, request_id)
    return int(next(s for s in spans if s.name == "prefill.compute").attributes["tandem.threads"])


def test_a_lone_prompt_takes_every_core_and_prompts_beside_streams_do_not(
    stack: Stack, otlp: OtlpReceiver
) -> None:
    if CORES < 2:
        pytest.skip(f"one CPU ({CORES}): no core to take beyond a node's own")
    argv = stack.child("prefill-1").argv
    assert argv[argv.index("--idle-threads") + 1] == str(CORES)
    own = int(argv[argv.index("--threads") + 1])
    assert own < CORES  # four nodes share the cores
    with openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0) as c:

        def ask(i: int) -> str:
            return c.completions.create(
                model=MODEL, prompt=f"Item {i} on the list is", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True},
            ).id  # fmt: skip

        lone = ask(0)
        with ThreadPoolExecutor(4) as pool:
            crowd = list(pool.map(ask, range(1, 5)))
    assert compute_threads(otlp, lone) == CORES
    used = [compute_threads(otlp, rid) for rid in crowd]
    # The first of the four may have come while the router served nothing else yet;
    # every later one was sent beside it.
    assert sorted(used)[:3] == [own] * 3, used
