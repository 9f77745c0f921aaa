"""The router process at its edge: API keys, per-key concurrency, every documented limit.

A real `tandem router` (the command, with its options) on a real nats-server; no model
nodes are needed: each check is decided before any work is queued, except the request
deadline, for which the test registers a prefill and a decode node that never answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.router.auth import owner_digest
from shared.bus.client import Bus
from shared.bus.ids import RequestId, attempt_id
from shared.bus.journal import RequestJournal
from shared.bus.messages import JournalEntry, PrefillJob
from shared.bus.registry import NodeRegistry, node_info
from shared.bus.server import NatsServer, free_port
from tests.polling import wait_until

pytestmark = pytest.mark.integration

KEY_A = "tk-alpha-0123456789abcdef"
KEY_B = "tk-bravo-0123456789abcdef"
MODEL = "smollm2-135m-instruct"
LIMITS = {
    "--max-inflight-per-key": "2",
    "--max-prompt-tokens": "50",
    "--max-stop": "2",
    "--max-stop-len": "8",
    "--max-tokens-limit": "64",
    "--max-body-bytes": "4096",
    "--request-timeout": "2",
}


class Router:
    def __init__(self, url: str, nats: NatsServer, proc: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.nats = nats
        self.proc = proc

    def call(
        self, path: str, body: Any = None, key: str | None = KEY_A, raw: bytes | None = None
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data)
        req.add_header("Content-Type", "application/json")
        if key is not None:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                text = resp.read()
                status, headers = resp.status, dict(resp.headers)
        except urllib.error.HTTPError as exc:
            text, status, headers = exc.read(), exc.code, dict(exc.headers)
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = {"text": text.decode(errors="replace")}
        return status, parsed, headers


@contextlib.contextmanager
def running_router(
    nats: NatsServer, argv: list[str], metrics_auth: bool = True
) -> Iterator[Router]:
    """`tandem router ARGV` on `nats`, answering its health probe."""
    port = free_port()
    argv = ["router", "--nats", nats.url, "--port", str(port), *argv]
    env = dict(os.environ, TANDEM_METRICS_AUTH="true" if metrics_auth else "false")
    env.pop("TANDEM_API_KEYS", None)
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *argv], env=env)
    try:
        r = Router(f"http://127.0.0.1:{port}", nats, proc)
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "router exited at start"
            try:
                if r.call("/healthz", key=None)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.2)
        yield r
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# API keys\n{KEY_A}\n\n{KEY_B}\n")
    argv = ["--api-keys-file", str(keys)]
    for flag, value in LIMITS.items():
        argv += [flag, value]
    with NatsServer() as nats, running_router(nats, argv) as r:
        yield r


def good(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, **fields}


def assert_error(reply: tuple[int, dict[str, Any], dict[str, str]], status: int) -> dict[str, Any]:
    got, body, _ = reply
    assert got == status, body
    err = body["error"]  # the OpenAI error shape
    assert isinstance(err["message"], str) and err["message"]
    assert {"type", "param", "code"} <= err.keys()
    return dict(err)


def test_requests_without_a_valid_key_are_refused(router: Router) -> None:
    for key in (None, "tk-wrong-0123456789abcdef", KEY_A + "x", KEY_A[:-1]):
        status, body, headers = router.call("/v1/completions", good(), key=key)
        assert status == 401, (key, body)
        assert body["error"]["code"] == "invalid_api_key"
        assert headers.get("WWW-Authenticate") == "Bearer"
    # A key in a scheme other than Bearer is not a key.
    req = urllib.request.Request(router.url + "/v1/models")
    req.add_header("Authorization", f"Basic {KEY_A}")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=10)
    assert caught.value.code == 401
    caught.value.close()
    assert router.call("/v1/models", key=None)[0] == 401
    assert router.call("/metrics", key=None)[0] == 401  # --metrics-auth (from the env)


def test_valid_keys_pass_and_probes_stay_open(router: Router) -> None:
    for key in (KEY_A, KEY_B):
        status, body, _ = router.call("/v1/models", key=key)
        assert status == 200 and body["data"][0]["id"] == MODEL
    assert router.call("/healthz", key=None)[0] == 200
    assert router.call("/readyz", key=None)[0] == 503  # open, and honest: no nodes yet
    status, body, _ = router.call("/metrics", key=KEY_B)
    assert status == 200 and "tandem_errors_total" in body["text"]


def test_a_keyed_router_keeps_its_metrics_off_the_api_port(tmp_path: Path) -> None:
    """Issue 49: the route counters tell one tenant what others sent (prefix-cache hits).
    With API keys and no --metrics-auth, the API port answers /metrics 404 even to a valid
    key, and the operator's --metrics-port serves it."""
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY_A}\n")
    metrics = free_port()
    argv = ["--api-keys-file", str(keys), "--metrics-port", str(metrics)]
    with NatsServer() as nats, running_router(nats, argv, metrics_auth=False) as r:
        status, body, _ = r.call("/metrics", key=KEY_A)
        assert status == 404 and "metrics port" in body["error"]["message"], body
        assert r.call("/metrics", key=None)[0] == 404
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as resp:
            assert b"tandem_errors_total" in resp.read()


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"prompt": "word " * 60}, 400, "prompt"),  # over --max-prompt-tokens 50
        ({"max_tokens": 65}, 400, "max_tokens"),  # over --max-tokens-limit 64
        ({"n": 17}, 400, "n"),  # over the 16 choices one request may ask
        ({"stop": ["a", "b", "c"]}, 400, "stop"),  # over --max-stop 2
        ({"stop": "123456789"}, 400, "stop"),  # over --max-stop-len 8
        ({"prompt": "x" * 5000}, 413, None),  # body over --max-body-bytes 4096
        ({"model": "gpt-unknown"}, 404, "model"),
        ({"temperature": "hot"}, 400, "temperature"),
        ({"cache_salt": 5}, 400, "cache_salt"),
        ({"cache_salt": ""}, 400, "cache_salt"),
        ({"cache_salt": "s" * 300}, 400, "cache_salt"),
    ],
)
def test_every_limit_returns_its_documented_error(
    router: Router, fields: dict[str, Any], status: int, param: str | None
) -> None:
    err = assert_error(router.call("/v1/completions", good(**fields)), status)
    assert err["param"] == param


def test_malformed_bodies_are_400(router: Router) -> None:
    for raw in (b"{", b"[]", b"\xff\xfe", b'{"model": 1}'):
        assert_error(router.call("/v1/completions", raw=raw), 400)


async def _hold(router: Router, key: str) -> asyncio.StreamWriter:
    """A request whose body never finishes: it stays in flight as long as we like."""
    host, port = router.url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
    )
    await writer.drain()
    return writer


async def test_a_key_over_its_concurrency_gets_429_others_do_not(router: Router) -> None:
    held = [await _hold(router, KEY_A) for _ in range(2)]  # --max-inflight-per-key 2

    async def key_a() -> tuple[int, dict[str, Any], dict[str, str]]:
        return await asyncio.to_thread(router.call, "/v1/completions", good(), KEY_A)

    async def not_admitted() -> tuple[int, dict[str, Any], dict[str, str]] | None:
        reply = await key_a()
        return reply if reply[0] != 503 else None

    try:
        # Until the router has both held requests counted: a call admitted before that is
        # answered 503 (no nodes) at once, and takes no share once answered.
        reply = await wait_until("a KEY_A call not admitted (2 held ones counted)", not_admitted)
        err = assert_error(reply, 429)
        assert err["code"] == "too_many_concurrent_requests"
        assert reply[2].get("Retry-After") == "1"
        # Another key is not held back by KEY_A's share (no nodes: 503 after admission).
        other = await asyncio.to_thread(router.call, "/v1/completions", good(), KEY_B)
        assert other[0] == 503
    finally:
        for w in held:
            w.close()

    async def admitted() -> tuple[int, dict[str, Any], dict[str, str]] | None:
        reply = await key_a()
        return reply if reply[0] != 429 else None

    # The held handlers end once their connections close, and KEY_A's share is free again.
    again = await wait_until("a KEY_A call not refused (its held ones ended)", admitted)
    assert again[0] == 503, again[1]


async def test_a_request_past_its_deadline_ends_with_504(router: Router) -> None:
    bus = await Bus(router.nats.url, "fake-nodes").connect()
    try:
        registry = await NodeRegistry(bus, ttl=60).start()
        for role in ("prefill", "decode"):  # nodes that take the job and never answer
            await registry.heartbeat(
                node_info(f"{role}-mute", role, free_kv_blocks=1000, total_kv_blocks=1000)
            )
        deadline = time.monotonic() + 10
        while router.call("/readyz", key=None)[0] != 200:
            assert time.monotonic() < deadline, "router never saw the registered nodes"
            await asyncio.sleep(0.2)
        started = time.monotonic()
        reply = await asyncio.to_thread(router.call, "/v1/completions", good(), KEY_A)
        took = time.monotonic() - started
        err = assert_error(reply, 504)
        assert "deadline of 2s" in err["message"]
        assert took < 10  # --request-timeout 2, not the 120 s first-token timeout
    finally:
        await bus.close()


async def test_a_stream_resumes_only_with_the_key_that_made_it(router: Router) -> None:
    """An orphaned stream (its router gone) in the journal, made with key A: key B is told
    there is no such request, exactly as for an unknown id; key A gets past that check."""
    rid = "cmpl-" + "ab" * 12
    job = PrefillJob(attempt_id=attempt_id(RequestId(rid)), prompt_ids=[1, 2, 3])
    entry = JournalEntry(
        request_id=RequestId(rid),
        router_id="router-gone",
        job=job,
        owner=owner_digest(KEY_A),
    )
    bus = await Bus(router.nats.url, "journal-writer").connect()
    try:
        await (await RequestJournal(bus).start()).put(entry)
    finally:
        await bus.close()
    path = f"/v1/requests/{rid}/stream"
    other = "/v1/requests/cmpl-" + "cd" * 12 + "/stream"
    unknown = assert_error(router.call(other, key=KEY_B), 404)
    assert assert_error(router.call(path, key=KEY_B), 404)["message"] == unknown["message"]
    assert_error(router.call(path, key=None), 401)
    status, body, _ = await asyncio.to_thread(router.call, path, None, KEY_A)
    assert status != 404, body  # the owner: resumed, or refused for another reason


HOSTILE = [  # (body, param the 400 names; None: any)
    (b'{"model": "M", "prompt": [1, 2, 99999999], "max_tokens": 4}', "prompt"),
    (b'{"model": "M", "prompt": [1, -2, 3], "max_tokens": 4}', "prompt"),
    (b'{"model": "M", "prompt": [[1, 2], [3]], "max_tokens": 4}', "prompt"),
    (b'{"model": "M", "prompt": "hi", "max_tokens": 4, "top_k": 99999999999999999999999}', "top_k"),
    (b'{"model": "M", "prompt": "hi", "max_tokens": 4, "seed": 99999999999999999999999}', "seed"),
    (b'{"model": "M", "prompt": "hi", "max_tokens": 99999999999999999999999}', "max_tokens"),
    (b'{"model": "M", "prompt": "\\ud800 lone", "max_tokens": 4}', "prompt"),
    (b'{"model": "M", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (b'{"model": "M", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    (b'{"model": "M", "messages": [{"role": "wizard", "content": "x"}]}', "messages"),
    (b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "image"}]}]}', "messages"),
]


@pytest.mark.parametrize("raw,param", HOSTILE)
def test_hostile_bodies_get_a_400_in_the_openai_shape(
    router: Router, raw: bytes, param: str | None
) -> None:
    raw = raw.replace(b'"M"', json.dumps(MODEL).encode())
    path = "/v1/chat/completions" if b'"messages"' in raw else "/v1/completions"
    status, body, _ = router.call(path, raw=raw)
    assert status in (400, 413), body  # the nesting is over --max-body-bytes here
    if status == 400:
        err = assert_error((status, body, {}), 400)
        assert param is None or err["param"] == param, err


def test_prompts_are_tokenised_off_the_event_loop_and_count_as_in_flight(
    router: Router,
) -> None:
    """Three ~1 MB prompts at once on a router taking 2 requests in flight: while the first
    two are read and tokenised (about a second each, one at a time, off the event loop),
    the third is refused with 429 at once. (Tokenised on the loop, before being counted,
    they were taken one after another and none was refused.)"""
    with running_router(router.nats, ["--max-inflight", "2"]) as small:
        body = good(prompt="The quick brown fox jumps over the lazy dog. " * 22_000)

        def one(delay: float) -> int:
            time.sleep(delay)
            return small.call("/v1/completions", body, key=None)[0]

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            statuses = list(pool.map(one, [0.0, 0.05, 0.3]))
        # 400: over the model's context. Which one is refused depends on arrival order: the
        # delays set it, but a loaded machine may start a thread late. Either way, of three
        # arriving while the first is still read and tokenised, one must be refused.
        assert sorted(statuses) == [400, 400, 429], statuses


def _raw_socket(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the router sent before closing `sock`, read until it closed (a socket it
    keeps open past `seconds` fails the test)."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the router kept a slow client's socket open past {seconds:g} s")
    except ConnectionResetError:
        pass
    return got


def test_slow_clients_hold_no_slot_and_no_socket() -> None:
    """Issue 49: 300 connections that sent headers announcing a 1 MB body and then nothing
    took every router-wide slot (the next request got 429) and held their sockets for an
    hour. Now a slot is taken once a body is in: an ordinary request is served beside them;
    each trickler gets a 408 at --body-timeout, and a connection that never finishes its
    headers is closed at --idle-timeout."""
    argv = ["--max-inflight", "8", "--body-timeout", "2", "--idle-timeout", "2"]
    with NatsServer() as nats, running_router(nats, argv) as router:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n"
        )
        tricklers = [_raw_socket(router.url) for _ in range(40)]  # 5x --max-inflight
        for sock in tricklers:
            sock.sendall(head + b'{"model": ')
        half = _raw_socket(router.url)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: rou")
        status, body, _ = router.call("/v1/completions", good(), key=None)
        assert status != 429, body  # no node serves it (503), but nothing refused it as busy
        # the deadlines run from their last progress: 2 s, with room for a loaded host
        for sock in tricklers:
            answer = _closed_within(sock, 30)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            sock.close()
        assert _closed_within(half, 30) == b""
        half.close()


def test_each_choice_counts_against_the_limits(router: Router) -> None:
    """Issue 49: `n` up to 16 multiplied every per-key limit by 16. A key allowed 2 in
    flight may ask for 2 choices (refused further on only because no node serves them
    here), not 3; the refusal names the count."""
    status, body, _ = router.call("/v1/completions", good(n=3))
    assert status == 429 and "asks for 3" in body["error"]["message"], body
    status, body, _ = router.call("/v1/completions", good(n=2))
    assert status != 429, body
    # the key's slots came back: a plain request is not refused as busy either
    assert router.call("/v1/completions", good())[0] != 429


def test_choices_count_router_wide_too() -> None:
    with NatsServer() as nats, running_router(nats, ["--max-inflight", "2"]) as router:
        status, body, _ = router.call("/v1/completions", good(n=3), key=None)
        assert status == 429, body
        assert router.call("/v1/completions", good(n=2), key=None)[0] != 429
