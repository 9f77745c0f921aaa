"""Prefix caching through the real stack: a multi-turn chat hits the kvcache service.

Each turn resends the whole history. Its prefix was stored by the previous turn's prefill
(prompt blocks) and decode (generated blocks) nodes. The kvcache service supplies what the
prefill node's own pool lacks (the answers, at least), and the router steers a long turn to
the prefill node whose pool holds most of its history. Tokens must equal transformers'
greedy generate on the same prompt.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.bus.client import Bus
from shared.bus.registry import NodeRegistry
from shared.kvclient.client import DOWN_BACKOFF
from shared.model.loader import LoadedModel
from tandem.launcher import Stack
from tests.e2e.test_api import MODEL, client, reference, text_of
from tests.polling import wait_until

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "Tell me about the moon in two sentences.",
    "How far away is it from the Earth?",
    "Why do we always see the same side?",
    "Could people live there one day?",
    "Summarise what you told me so far.",
]
SYSTEM = "You are a concise astronomy tutor. " * 6  # a long shared system prompt
# Turns adding > 96 new tokens (the router's local-prefill limit): always disaggregated.
LONG_QUESTIONS = [
    f"Here are my notes on topic {i}: "
    + " ".join(f"fact {i}.{j} about planets;" for j in range(30))
    + " What is the single most surprising one?"
    for i in range(4)
]


def scrape(stack: Stack, prefix: str, name: str) -> float:
    """Sum of a metric over the stack's nodes whose name starts with `prefix`."""
    total = 0.0
    for node, port in stack.metrics_ports.items():
        if not node.startswith(prefix):
            continue
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            for family in text_string_to_metric_families(r.read().decode()):
                for s in family.samples:
                    if s.name == name:
                        total += s.value
    return total


def hit_tokens(stack: Stack) -> float:
    """Prompt tokens served from a prefix cache: prefill nodes' and (local route) decode's."""
    return sum(
        scrape(stack, role, "tandem_prefix_cache_hit_tokens_total")
        for role in ("prefill", "decode")
    )


async def registered_since(stack: Stack, node: str, since: float) -> bool:
    """Whether `node`'s registry entry is from a heartbeat after `since` (wall clock): a
    restarted node's own, not the entry its dead process left until its TTL ran out."""
    bus = await Bus(stack.nats_url, "e2e-registry", stack.auth).connect()
    try:
        info = (await (await NodeRegistry(bus).start()).nodes()).get(node)
    finally:
        await bus.close()
    return info is not None and info.timestamp > since


def router_counter(stack: Stack, name: str, **labels: str) -> float:
    with urllib.request.urlopen(stack.url + "/metrics", timeout=5) as r:
        for family in text_string_to_metric_families(r.read().decode()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
    return 0.0


def routes(stack: Stack, path: str) -> float:
    return router_counter(stack, "tandem_router_routes_total", route=path)


def chat_turns(
    c: openai.OpenAI, stack: Stack, model: LoadedModel, questions: list[str]
) -> list[tuple[int, float]]:
    """Run the chat; per turn (prompt tokens, prefix-cache hit tokens). Asserts cold tokens."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    turns = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        ids = model.apply_chat_template(messages)
        ref = text_of(model, reference(model, ids, 24))
        before = hit_tokens(stack)
        resp = c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,  # type: ignore[arg-type]
        )
        answer = resp.choices[0].message.content or ""
        assert answer == ref, f"turn {len(turns) + 1} differs from a cold greedy run"
        turns.append((len(ids), hit_tokens(stack) - before))
        messages.append({"role": "assistant", "content": answer})
        # A head start for the uploads of the answer's last blocks. Fixed, as nothing reports
        # a decode node's uploads landed, and no check needs them: check_hits asks for the
        # previous prompt's blocks (in the pools that computed them, uploaded as they filled),
        # and the answer blocks a later turn loads were filled, and uploaded, mid-answer.
        time.sleep(0.3)
    return turns


def check_hits(turns: list[tuple[int, float]]) -> None:
    prev_len = 0
    for i, (prompt_len, hits) in enumerate(turns):
        if i == 0:
            assert hits < prompt_len  # nothing of this conversation was cached yet
        else:  # at least the previous turn's prompt (whole blocks), often its answer too
            assert hits >= 16 * (prev_len // 16) - 16, f"turn {i + 1}: {hits} of {prompt_len}"
        prev_len = prompt_len


def test_chat_turns_go_where_their_history_lives(stack: Stack, real_model: LoadedModel) -> None:
    """Short turns: the decode node that holds the history prefills the new tail itself."""
    local_before = routes(stack, "local")
    with client(stack) as c:
        turns = chat_turns(c, stack, real_model, QUESTIONS)
    check_hits(turns)
    assert routes(stack, "local") - local_before >= 3  # turns 2-5, barring a full node


def test_long_turns_load_history_from_the_kvcache_service(
    stack: Stack, real_model: LoadedModel
) -> None:
    """Long turns take the disaggregated path: prefill loads the history from kvcache."""
    loaded_before = scrape(stack, "prefill", "tandem_prefix_cache_loaded_blocks")
    kv_hits_before = scrape(stack, "kvcache", "tandem_kvcache_hit_blocks")
    remote_before = routes(stack, "remote")
    steered_before = router_counter(stack, "tandem_router_prefill_steered_total")
    with client(stack) as c:
        turns = chat_turns(c, stack, real_model, LONG_QUESTIONS)
    check_hits(turns)
    assert routes(stack, "remote") - remote_before == len(LONG_QUESTIONS)
    # Turns 3-4 went to the prefill node that holds most of their history (600+ tokens in
    # its pool: it loads only the answer's blocks from kvcache), not to the shared queue.
    assert router_counter(stack, "tandem_router_prefill_steered_total") - steered_before >= 1
    # The kvcache service served blocks (the answers exist nowhere else but the decode pools).
    assert scrape(stack, "kvcache", "tandem_kvcache_hit_blocks") > kv_hits_before
    assert scrape(stack, "prefill", "tandem_prefix_cache_loaded_blocks") > loaded_before


def test_serving_continues_while_the_kvcache_node_is_down(
    stack: Stack, real_model: LoadedModel
) -> None:
    stack.kill("kvcache-1")
    try:
        with client(stack) as c:  # degraded: no remote hits, but correct and no hang
            started = time.monotonic()
            chat_turns(c, stack, real_model, LONG_QUESTIONS[:2])
            assert time.monotonic() - started < 60
    finally:
        restarted = time.time()
        stack.restart("kvcache-1")
    # Back in the registry (the new process's entry, not the dead one's), then hits resume.
    asyncio.run(
        wait_until(
            "the restarted kvcache-1 in the registry",
            lambda: registered_since(stack, "kvcache-1", restarted),
            timeout=120,  # a process start, with imports, on a loaded machine
            interval=0.5,
        )
    )
    # Every node's client skips a kvcache node for DOWN_BACKOFF after a failed call, and a
    # call may fail just as the node returns (a decode node's upload or a standby's load):
    # wait that out, and for the node lists to refresh.
    time.sleep(DOWN_BACKOFF + 2)
    loaded_before = scrape(stack, "prefill", "tandem_prefix_cache_loaded_blocks")
    with client(stack) as c:
        chat_turns(c, stack, real_model, LONG_QUESTIONS[2:])
    assert scrape(stack, "prefill", "tandem_prefix_cache_loaded_blocks") > loaded_before


def test_a_cache_salt_shares_prefixes_only_within_its_salt(
    stack: Stack, real_model: LoadedModel
) -> None:
    """The same long prompt under salt A twice hits its cached prefix the second time (on
    whichever node); under salt B it hits nothing, though every node and the kvcache
    service hold it under A: no tenant learns from timing what another sent."""
    prompt = "Salted notes: " + " ".join(f"item {j} is a quiet blue stone;" for j in range(40))
    ids = real_model.encode(prompt)
    ref = text_of(real_model, reference(real_model, ids, 8))

    def run(salt: str) -> float:
        before = hit_tokens(stack)
        with client(stack) as c:
            resp = c.completions.create(
                model=MODEL, prompt=ids, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                extra_body={"cache_salt": salt},
            )  # fmt: skip
        assert resp.choices[0].text == ref  # salted or not, the same tokens
        # A head start for the background uploads, not a precondition (nothing reports them
        # landed): a repeat goes where the prompt's blocks are, the decode node that holds
        # them or the prefill node steered to, and they were uploaded while it decoded.
        time.sleep(0.5)
        return hit_tokens(stack) - before

    assert run("tenant-a") < len(ids)  # cold
    assert run("tenant-a") >= 16 * (len(ids) // 16) - 16  # its own prefix: found
    assert run("tenant-b") == 0  # another salt: nothing
