"""The real stack for e2e tests: `tandem up`'s own launcher code, 2 prefill + 2 decode nodes."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.bus.server import free_port
from shared.model.loader import LoadedModel
from tandem.cli import build_parser
from tandem.launcher import Stack
from tests.e2e import reference_cache
from tests.e2e.chaos import Request, chaos_requests, reference
from tests.otlp_receiver import OtlpReceiver


def wait_for_every_node(stack: Stack, timeout: float) -> None:
    """/readyz needs one node per role; tests that read every node's metrics need all. A
    node that does not answer in time fails the test naming it, whether its process lives,
    and its last lines in the stack's log."""
    deadline = time.monotonic() + timeout
    for name, port in stack.metrics_ports.items():
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2):
                    break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise AssertionError(not_answering(stack, name, exc)) from exc
                time.sleep(0.25)


def not_answering(stack: Stack, name: str, exc: OSError) -> str:
    proc = stack.child(name).proc
    state = "not started" if proc is None else f"exit code {proc.poll()}"
    lines: list[str] = []
    log = getattr(stack.out, "name", "")
    if isinstance(log, str) and Path(log).is_file():
        lines = [ln for ln in Path(log).read_text().splitlines() if ln.startswith(f"[{name}]")]
    tail = "\n".join(ln[:400] for ln in lines[-15:])
    return f"{name}'s /metrics did not answer ({exc}); process: {state}; its last lines:\n{tail}"


def wait_ready(
    stack: Stack, timeout: float = 60, until: Callable[[dict[str, Any]], bool] = lambda _: True
) -> None:
    """Until the router answers /readyz with 200 (after a restart of it or of NATS), and
    with a body `until` accepts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(stack.url + "/readyz", timeout=2) as r:
                if r.status == 200 and until(json.loads(r.read())):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{stack.url} not ready within {timeout:.0f}s")
        time.sleep(0.2)


def wait_for_prefill(stack: Stack, timeout: float = 120) -> None:
    """Until the router counts a prefill node: a conditional router is ready with none
    (it prefills on decode nodes), and a test of the choice between the two needs both."""
    wait_ready(stack, timeout, lambda body: body.get("prefill", 0) >= 1)


@pytest.fixture(scope="package")
def otlp() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    receiver.start()
    yield receiver
    receiver.stop()


@contextlib.contextmanager
def running_stack(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[Stack]:
    """`tandem up ARGV` through the launcher's own code, ready; its output goes to `log`,
    whose tail is printed if a service ended badly. `env`: extra environment for every
    service, restarted ones included."""
    s = Stack(build_parser().parse_args(["up", *argv]))
    s.env.update(env or {})
    with log.open("w") as out:
        s.out = out
        s.start()
        try:
            s.wait_ready(timeout=300)
            yield s
        finally:
            s.stop()
            if any(c.proc is not None and c.proc.returncode not in (0, -15) for c in s.children):
                print(log.read_text()[-5000:])


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory, otlp: OtlpReceiver) -> Iterator[Stack]:
    """Exports traces to a real OTLP receiver, so every e2e test also runs with tracing on."""
    # Every service (restarted ones too) gets these: spans export within 0.2 s; SIGUSR1/2
    # hang and release a node's engine thread (test_engine_hang.py), found out after 5 s
    # instead of 20. (In os.environ they reached only the first start of each service: a
    # node a test restarted died of SIGUSR1.)
    testing_env = {
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "TANDEM_FAULT_INJECTION": "1",
        "TANDEM_ENGINE_STALL_TIMEOUT": "5",
    }
    argv = [
        "--prefill", "2",
        "--decode", "2",
        "--port", str(free_port()),
        "--transport", "ucx",
        "--kv-cache-mb", "256",
        "--heartbeat-ttl", "2",
        "--otlp-endpoint", otlp.url,
    ]  # fmt: skip
    log: Path = tmp_path_factory.mktemp("stack") / "stack.log"
    with running_stack(argv, log, testing_env) as s:
        wait_for_every_node(s, timeout=300)
        yield s


@pytest.fixture(scope="package")
def chaos_reference(
    real_model: LoadedModel, real_model_dir: Path
) -> tuple[list[Request], list[list[str]]]:
    """The chaos tests' 32 requests and, per request, the text each token of its
    uninterrupted run added (other tests use prefixes of them): the stored one if it holds
    on this machine (tests/e2e/reference_cache.py), else computed now."""
    requests = chaos_requests(real_model)
    started = time.monotonic()
    texts, why = reference_cache.load(real_model, real_model_dir, requests)
    if texts is None:
        print(f"chaos reference computed now: {why}")
        texts = reference(real_model, requests)
    print(f"chaos reference: {why}, {time.monotonic() - started:.0f}s")
    return requests, texts


@pytest.fixture(scope="package")
def chaos_workload(
    chaos_reference: tuple[list[Request], list[list[str]]],
) -> tuple[list[Request], list[str]]:
    """The chaos tests' 32 requests and their uninterrupted texts."""
    requests, pieces = chaos_reference
    return requests, ["".join(p) for p in pieces]
