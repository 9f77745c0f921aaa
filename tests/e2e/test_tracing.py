"""One trace per request across router, prefill and decode, with no opaque gap before TTFT."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from tandem.launcher import Stack
from tests.otlp_receiver import CollectedSpan, OtlpReceiver

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
PHASES = {
    "router.admission": "request",
    "prefill.queue_wait": "request",
    "prefill.compute": "request",
    "prefill.handoff": "request",
    "prefill.first_token": "prefill.handoff",
    "kv.transfer.send": "prefill.handoff",
    "kv.transfer.receive": "kv.transfer.send",
    "decode.admission": "kv.transfer.send",
    "decode.stream": "kv.transfer.send",
    "router.stream": "request",
}


def covered(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Length of the union of intervals clipped to [lo, hi]."""
    total, cursor = 0, lo
    for a, b in sorted(intervals):
        a, b = max(a, cursor), min(b, hi)
        if b > a:
            total += b - a
            cursor = b
    return total


def trace_of(otlp: OtlpReceiver, request_id: str, timeout: float = 20) -> list[CollectedSpan]:
    """All spans of the request's trace, once every phase has arrived."""
    deadline = time.monotonic() + timeout
    while True:
        spans = otlp.snapshot()
        roots = [s for s in spans if s.attributes.get("tandem.request_id") == request_id]
        if roots:
            trace = [s for s in spans if s.trace_id == roots[0].trace_id]
            if set(PHASES) <= {s.name for s in trace}:
                return trace
        assert time.monotonic() < deadline, f"trace of {request_id} incomplete"
        time.sleep(0.2)


def checkpoints_of(otlp: OtlpReceiver, trace_id: str, timeout: float = 10) -> list[CollectedSpan]:
    deadline = time.monotonic() + timeout
    while True:
        found = [s for s in otlp.snapshot() if s.name == "kv.checkpoint" and trace_id in s.links]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_every_request_is_one_trace_with_phase_spans(stack: Stack, otlp: OtlpReceiver) -> None:
    with openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0) as c:
        responses = [
            c.completions.create(
                model=MODEL, prompt=f"Story number {i}: once upon a time", max_tokens=12,
                temperature=0, extra_body={"ignore_eos": True},
            )
            for i in range(3)
        ]  # fmt: skip
    for resp in responses:
        spans = trace_of(otlp, resp.id)
        by_name = {s.name: s for s in spans}
        by_id = {s.span_id: s for s in spans}
        request = next(s for s in spans if s.attributes.get("tandem.request_id") == resp.id)
        assert request.name == "POST /v1/completions" and request.parent_id == ""
        assert {"router", "prefill", "decode"} <= {s.service for s in spans}
        for name, parent in PHASES.items():
            want = request if parent == "request" else by_name[parent]
            assert by_id[by_name[name].parent_id] is want, f"{name} should be under {parent}"
        assert resp.usage is not None
        assert (
            by_name["prefill.compute"].attributes["tandem.prompt_tokens"]
            == resp.usage.prompt_tokens
        )
        compute = by_name["prefill.compute"].attributes
        # which step of its batch it came out of: a lone request's batch has one step
        assert compute["tandem.batch_size"] >= 1 and compute["tandem.step"] == 1
        for name in ("kv.transfer.send", "kv.transfer.receive"):
            attrs = by_name[name].attributes
            assert attrs["tandem.bytes"] > 0 and attrs["tandem.transport"] == "ucx"
            assert attrs["tandem.gbps"] > 0
        stream = by_name["decode.stream"].attributes
        assert stream["tandem.completion_tokens"] == resp.usage.completion_tokens
        # The blocks its decode node filled were checkpointed, linked to the request.
        assert checkpoints_of(otlp, request.trace_id), "no kv.checkpoint span links here"
        # Children account for the time to first token but 5% of it (or 10 ms, on a short
        # one: a 2-core host's scheduler alone leaves gaps of a few ms between spans):
        # no opaque phase.
        first = request.events["first_token"]
        parts = [(s.start, s.end) for s in spans if s is not request and s.name != "router.stream"]
        ttft = first - request.start
        assert ttft > 0
        slack = max(0.05 * ttft, 10_000_000)  # ns
        assert covered(parts, request.start, first) >= ttft - slack, (
            sorted(
                (s.name, (s.start - request.start) / 1e6, (s.end - request.start) / 1e6)
                for s in spans
            ),
            ttft / 1e6,
        )


def test_logs_of_a_request_join_across_services_by_trace_id(
    stack: Stack, otlp: OtlpReceiver
) -> None:
    with openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0) as c:
        resp = c.completions.create(model=MODEL, prompt="Logs are", max_tokens=6, temperature=0)
    spans = trace_of(otlp, resp.id)
    trace_id = spans[0].trace_id
    assert stack.out is not None
    deadline = time.monotonic() + 10
    while True:
        lines = Path(stack.out.name).read_text().splitlines()
        records = []
        for line in lines:
            _, _, rest = line.partition("] ")
            if rest.startswith("{"):
                records.append(json.loads(rest))
        mine = [r for r in records if r.get("request_id") == resp.id]
        if {r["service"] for r in mine} >= {"router", "prefill", "decode"}:
            break
        assert time.monotonic() < deadline, mine
        time.sleep(0.2)
    assert {r["trace_id"] for r in mine} == {trace_id}
    assert all({"service", "node_id", "span_id", "timestamp", "level"} <= set(r) for r in mine)
