"""`tandem bench` against real stacks, a few requests each: the numbers are sane and complete,
the plots exist; and the colocated side of `compare` serves through its own stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tandem.bench.workload import Workload, load_bench_tokenizer, parse_lengths, word_vocabulary
from tandem.launcher import Stack

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"


def bench(*argv: str, timeout: float = 420) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", *argv, "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_sweep(sweep: dict[str, Any], requests: int, output_tokens: int) -> None:
    for point in sweep["points"]:
        m = point["metrics"]
        assert (m["requests"], m["completed"], m["failed"]) == (requests, requests, 0)
        assert m["request_throughput"] > 0 and m["output_throughput"] > 0
        for name in ("ttft", "tpot", "itl", "e2e"):
            s = m[name]
            assert s["n"] > 0 and 0 < s["p50"] <= s["p90"] <= s["p99"] <= s["max"] < 300, name
        assert m["ttft"]["max"] < m["e2e"]["max"]
        assert 0 <= m["slo_attainment"] <= 1
        for r in point["requests"]:
            assert r["error"] is None
            assert r["output_tokens"] == output_tokens  # ignore_eos: exactly max_tokens
            assert len(r["chunk_offsets"]) >= output_tokens - 2  # a chunk per visible token
            assert 0 < r["ttft"] <= r["e2e"]


def test_bench_serve_against_the_stack(stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    proc = bench(
        "serve", "--url", stack.url, "--model", MODEL,
        "--num-requests", "4", "--request-rate", "2,inf", "--warmup", "1",
        "--prompt-len", "mix:40:300:0.25", "--output-len", "8", "--output", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    (sweep,) = doc["sweeps"]
    assert [p["request_rate"] for p in sweep["points"]] == [2.0, None]
    check_sweep(sweep, requests=4, output_tokens=8)
    prompts = [r["prompt_tokens"] for p in sweep["points"] for r in p["requests"]]
    assert set(prompts) <= {40, 300}
    assert (tmp_path / "serve-latency-cdf.png").stat().st_size > 10_000
    assert (tmp_path / "serve-sweep.png").stat().st_size > 10_000
    assert "| " + stack.url + " | 2 | 4/4 |" in proc.stdout  # the table


async def test_text_prompts_have_the_exact_token_count(stack: Stack) -> None:
    """`--prompt-format text` relies on words that tokenize back one token each."""
    tok = load_bench_tokenizer(MODEL)
    ids, texts = word_vocabulary(tok)
    specs = Workload(parse_lengths("uniform:50:400"), parse_lengths("1"), ids, texts).requests(
        3, seed=7
    )
    async with aiohttp.ClientSession() as s:
        for spec in specs:
            body = {"model": MODEL, "prompt": spec.prompt_text, "max_tokens": 1}
            async with s.post(stack.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                usage = (await resp.json())["usage"]
            assert usage["prompt_tokens"] == len(spec.prompt_ids)


def test_bench_compare_colocated_side(tmp_path: Path) -> None:
    """A colocated stack of its own (`tandem up --colocated`: one decode node, no prefill
    node), driven by `compare`: the router's colocated path, live."""
    out = tmp_path / "compare.json"
    proc = bench(
        "compare", "--sides", "colocated", "--request-rate", "4", "--num-requests", "3",
        "--warmup", "0", "--prompt-len", "mix:30:200:0.34", "--output-len", "6",
        "--kv-cache-mb", "128", "--output", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [s["label"] for s in doc["sweeps"]] == ["colocated"]
    assert "--colocated" in doc["sides"]["colocated"]
    check_sweep(doc["sweeps"][0], requests=3, output_tokens=6)
    assert doc["sweeps"][0]["points"][0]["routes"] == {"local": 3}  # the router's counts
    log = (tmp_path / "compare-colocated.log").read_text()
    assert "routed local" in log and "prefill-1" not in log
    assert (tmp_path / "compare-sweep.png").exists()
