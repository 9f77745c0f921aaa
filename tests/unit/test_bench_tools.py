"""`tandem bench` plumbing: length specs, prompts, SSE parsing, arrivals, the load loop
against a fake streaming server on localhost, and the report files."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tandem.bench import report
from tandem.bench.client import handle_event, request_body
from tandem.bench.loadgen import Load, Target, arrival_times, run_load
from tandem.bench.metrics import RequestRecord, Slo, run_metrics
from tandem.bench.sweep import Point, Sweep, SweepConfig, parse_rates, run_sweep
from tandem.bench.workload import LengthDist, Workload, parse_lengths
from tandem.cli import build_parser

pytestmark = pytest.mark.unit


def workload(prompt: str = "mix:5:50:0.5", output: str = "4") -> Workload:
    ids = list(range(1000, 1100))
    return Workload(parse_lengths(prompt), parse_lengths(output), ids, [f" w{i}" for i in ids])


def test_length_specs() -> None:
    assert parse_lengths("128") == LengthDist("fixed", 128, 128)
    assert parse_lengths("fixed:7") == LengthDist("fixed", 7, 7)
    assert parse_lengths("uniform:10:20") == LengthDist("uniform", 10, 20)
    assert parse_lengths("mix:100:1500:0.2") == LengthDist("mix", 100, 1500, 0.2)
    assert str(parse_lengths("mix:100:1500:0.2")) == "mix:100:1500:0.2"
    for bad in ("", "x", "0", "uniform:5:2", "mix:1:2", "mix:1:2:1.5", "zipf:3"):
        with pytest.raises(ValueError):
            parse_lengths(bad)
    rng = random.Random(0)
    mix = [parse_lengths("mix:100:1500:0.2").sample(rng) for _ in range(2000)]
    assert set(mix) == {100, 1500}
    assert 0.17 < mix.count(1500) / len(mix) < 0.23
    uniform = {parse_lengths("uniform:3:5").sample(rng) for _ in range(200)}
    assert uniform == {3, 4, 5}


def test_prompts_have_exact_lengths_and_repeat_with_the_seed() -> None:
    w = workload("uniform:1:40", "uniform:2:9")
    specs = w.requests(50, seed="s/0")
    for s in specs:
        assert 1 <= len(s.prompt_ids) <= 40 and 2 <= s.max_tokens <= 9
        assert s.prompt_text.split() == [f"w{i}" for i in s.prompt_ids]
    again = w.requests(50, seed="s/0")
    assert [s.prompt_ids for s in again] == [s.prompt_ids for s in specs]
    other = w.requests(50, seed="s/1")
    assert [s.prompt_ids for s in other] != [s.prompt_ids for s in specs]


def test_request_body_tokens_or_text() -> None:
    spec = workload().requests(1, seed=1)[0]
    body = request_body(spec, "m", "tokens", ignore_eos=True)
    assert body["prompt"] == spec.prompt_ids and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    body = request_body(spec, "m", "text", ignore_eos=False)
    assert body["prompt"] == spec.prompt_text and "ignore_eos" not in body


def test_sse_events() -> None:
    rec = RequestRecord(prompt_tokens=3, max_tokens=4)
    assert not handle_event(rec, b' {"choices": [{"text": ""}]}', 1.0)  # no content yet
    assert not handle_event(rec, b' {"choices": [{"text": "a"}]}', 2.0)
    assert not handle_event(rec, b'{"choices": [{"delta": {"content": "b"}}]}', 3.0)  # chat
    assert not handle_event(rec, b'{"choices": [], "usage": {"completion_tokens": 4}}', 4.0)
    assert handle_event(rec, b" [DONE]\n", 5.0)
    assert rec.chunks == [2.0, 3.0] and rec.output_tokens == 4 and rec.error is None
    err = RequestRecord(prompt_tokens=3, max_tokens=4)
    assert handle_event(err, b'{"error": {"message": "overloaded", "code": 503}}', 1.0)
    assert err.error == "overloaded"
    with pytest.raises(ValueError):
        handle_event(err, b"{not json", 1.0)


def test_arrivals() -> None:
    assert arrival_times(3, None, "poisson", random.Random(0)) == [0.0, 0.0, 0.0]
    assert arrival_times(4, 2.0, "constant", random.Random(0)) == [0.0, 0.5, 1.0, 1.5]
    times = arrival_times(4001, 4.0, "poisson", random.Random(1))
    assert times == arrival_times(4001, 4.0, "poisson", random.Random(1))
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / 4000 == pytest.approx(0.25, rel=0.06)  # mean gap 1/rate


class FakeServer:
    """Streams `max_tokens` chunks per request, `gap` s apart; counts requests in flight."""

    def __init__(self, gap: float = 0.02, fail_every: int = 0) -> None:
        self.gap = gap
        self.fail_every = fail_every
        self.seen = 0
        self.inflight = 0
        self.peak = 0
        self.bodies: list[dict[str, Any]] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.seen += 1
        if self.fail_every and self.seen % self.fail_every == 0:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(body["max_tokens"]):
                await asyncio.sleep(self.gap)
                event = {"choices": [{"text": f"t{i}", "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            return resp
        finally:
            self.inflight -= 1


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeServer, str]]:
    server = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield server, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_closed_loop_respects_concurrency_and_times_chunks(
    fake: tuple[FakeServer, str],
) -> None:
    server, url = fake
    specs = workload(output="5").requests(8, seed=0)
    records = await run_load(Target(url, "m"), specs, Load(rate=None, concurrency=2))
    assert server.peak == 2 and len(records) == 8
    for r in records:
        assert r.ok and r.output_tokens == 5 and len(r.chunks) == 5
        assert r.chunks[0] - r.sent >= 0.02 and r.done >= r.chunks[-1]
    m = run_metrics(records, Slo(ttft=1.0, tpot=1.0))
    assert m.itl.p50 == pytest.approx(0.02, abs=0.015)
    assert m.slo_attainment == 1.0 and server.bodies[0]["ignore_eos"] is True


async def test_open_loop_paces_sends_and_stops_at_the_duration(
    fake: tuple[FakeServer, str],
) -> None:
    _, url = fake
    specs = workload(output="2").requests(50, seed=0)
    started = time.perf_counter()
    records = await run_load(
        Target(url, "m"), specs, Load(rate=20, arrival="constant", duration=0.5)
    )
    assert 9 <= len(records) <= 11  # sends at 0, 0.05, … < 0.5 s
    sends = [r.sent for r in records]
    assert sends[-1] == pytest.approx(0.05 * (len(records) - 1), abs=0.05)
    assert time.perf_counter() - started < 2.0


async def test_failures_are_recorded_not_raised(fake: tuple[FakeServer, str]) -> None:
    server, url = fake
    server.fail_every = 2
    specs = workload(output="2").requests(4, seed=0)
    records = await run_load(Target(url, "m"), specs, Load(rate=None))
    assert sum(r.error is not None for r in records) == 2
    assert all("HTTP 503" in (r.error or "") for r in records if not r.ok)
    dead = await run_load(Target("http://127.0.0.1:9", "m"), specs[:1], Load(rate=None))
    assert dead[0].error is not None and not dead[0].ok
    slow = await run_load(Target(url, "m", timeout=0.05), workload(output="20").requests(1, 0),
                          Load(rate=None))  # fmt: skip
    assert slow[0].error == "timed out after 0.05s"


async def test_sweep_then_report_files(fake: tuple[FakeServer, str], tmp_path: Path) -> None:
    server, url = fake
    cfg = SweepConfig(rates=[20.0, 40.0], num_requests=6, warmup=1, quiet=True)

    def routes() -> dict[str, int]:  # as a router's counter would: every request so far
        return {"local": server.seen, "remote": 2}

    said: list[str] = []
    sweep = await run_sweep(Target(url, "m"), workload(), cfg, Slo(), "fake", said.append, routes)
    assert [p.rate for p in sweep.points] == [20.0, 40.0]
    # each point counts what it sent, not the warm-up's or the other point's
    assert [p.routes for p in sweep.points] == [{"local": 6}, {"local": 6}]
    assert said[-1].endswith("routes {'local': 6}")
    assert report.sweep_json(sweep)["points"][1]["routes"] == {"local": 6}
    assert sweep.goodput == 40.0  # the fake server is fast at any rate
    doc = report.sweep_json(sweep)
    assert doc["points"][0]["metrics"]["completed"] == 6
    assert len(doc["points"][0]["requests"][0]["chunk_offsets"]) == 4
    json.dumps(doc, allow_nan=False)  # strict JSON: no NaN or Infinity
    other = Sweep("other", Slo(), [Point(20.0, None, sweep.points[0].metrics, [])])
    text = report.table([sweep, other])
    assert "| fake | 20 | 6/6 |" in text and "| other | 20 |" in text
    assert "fake: goodput 40.000 req/s" in text
    paths = report.plot([sweep, other], tmp_path / "run.json")
    assert [p.name for p in paths] == ["run-latency-cdf.png", "run-sweep.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)


def test_rates_and_cli_options() -> None:
    assert parse_rates("0.5,1,inf") == [0.5, 1.0, None]
    for bad in ("0", "-1", "x", "nan"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    args = build_parser().parse_args(["bench", "serve", "--request-rate", "1,2", "--quiet"])
    assert isinstance(args, argparse.Namespace)
    assert args.request_rate == [1.0, 2.0] and args.prompt_len == parse_lengths("mix:100:1500:0.2")
    args = build_parser().parse_args(["bench", "compare"])
    assert args.request_rate == [0.05, 0.1, 0.15] and args.sides == "colocated,disaggregated"


def test_a_duration_that_cuts_a_rates_requests_short_is_said() -> None:
    from tandem.bench.serve import duration_warnings

    argv = ["bench", "compare", "--num-requests", "30", "--request-rate", "0.25,0.5,inf"]
    (warning,) = duration_warnings(build_parser().parse_args([*argv, "--duration", "80"]))
    assert "at 0.25 req/s" in warning and "about 20 of the 30" in warning
    assert "--duration 120" in warning
    assert duration_warnings(build_parser().parse_args([*argv, "--duration", "120"])) == []
    args = build_parser().parse_args(["bench", "serve", "--num-requests", "30"])
    assert args.duration is None and duration_warnings(args) == []
