"""`tandem plan validate` against a real split stack (the measured and the simulated sweep
of the same requests, side by side with their errors), and a stack routing conditionally."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from shared.bus.server import free_port
from shared.model.loader import LoadedModel
from tests.e2e.conftest import running_stack, wait_for_prefill
from tests.e2e.test_api import MODEL, client, reference, text_of
from tests.e2e.test_prefix_cache import routes
from tests.unit.test_plan_simulate import profile

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_validate_runs_both_sides_on_the_same_requests(tmp_path: Path) -> None:
    prof = tmp_path / "profile.json"
    prof.write_bytes(msgspec.json.encode(profile()))  # synthetic: the numbers are not judged
    out = tmp_path / "validate.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "tandem.cli", "plan", "validate", "--profile", str(prof),
            "--prefill", "1", "--decode", "1", "--transport", "tcp", "--kv-cache-mb", "128",
            "--request-rate", "4", "--num-requests", "3", "--warmup", "0", "--duration", "30",
            "--prompt-len", "mix:30:200:0.34", "--output-len", "6", "--output", str(out),
            "--quiet",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    measured, simulated = doc["sweeps"]
    assert measured["label"] == "measured" and simulated["label"] == "simulated 1P:1D"
    assert "--prefill" in doc["up"] and "--colocated" not in doc["up"]
    # the simulated prefill nodes run every batch on one thread count: so do the measured
    assert doc["up"][doc["up"].index("--prefill-idle-threads") + 1] == "0"
    sent = [r["sent"] for r in measured["points"][0]["requests"]]
    assert len(sent) == 3
    # the simulation replayed the measured requests: same lengths, same send times
    for m, s in zip(
        measured["points"][0]["requests"], simulated["points"][0]["requests"], strict=True
    ):
        assert (m["prompt_tokens"], m["max_tokens"]) == (s["prompt_tokens"], s["max_tokens"])
        assert s["sent"] == pytest.approx(m["sent"], abs=1e-5)
        assert s["output_tokens"] == m["output_tokens"] == 6
    metrics = [e["metric"] for e in doc["errors"]]
    assert metrics == ["TTFT p50", "TTFT p90", "TPOT p50", "out tok/s"]
    for e in doc["errors"]:
        assert e["measured"] > 0 and e["simulated"] > 0
        assert e["relative_error"] == pytest.approx(
            (e["simulated"] - e["measured"]) / e["measured"]
        )
    assert "median |error|" in proc.stdout


def test_conditional_stack_prefills_on_the_idle_decode_node(
    tmp_path: Path, real_model: LoadedModel
) -> None:
    """`tandem up --conditional --profile`: with the decode node idle, prefilling there is
    the same prefill without the transfer, so a long prompt goes local, and through that
    path the text is still transformers' greedy text; the route and its reason are counted
    and logged."""
    prof = tmp_path / "profile.json"
    prof.write_bytes(msgspec.json.encode(profile()))
    argv = [
        "--prefill", "1", "--decode", "1", "--kvcache", "0", "--conditional",
        "--profile", str(prof), "--port", str(free_port()), "--transport", "tcp",
        "--kv-cache-mb", "128", "--log-level", "DEBUG",
    ]  # fmt: skip
    ids = real_model.encode("Tell me a long story about a lighthouse keeper. " * 30)
    assert len(ids) > 200  # well past the fixed rule's 96-token local limit
    want = text_of(real_model, reference(real_model, ids, 16))
    log = tmp_path / "stack.log"
    with running_stack(argv, log) as stack:
        wait_for_prefill(stack)  # the choice is between the two: the pool must be there
        with client(stack) as c:
            resp = c.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
        assert resp.choices[0].text == want
        assert routes(stack, "local") == 1 and routes(stack, "remote") == 0
    assert "route local: local " in log.read_text()  # the reason: both estimates, in seconds
