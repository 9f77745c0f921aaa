"""Least privilege, the other way round: every subject a role may use is one it uses.

tests/integration/test_nats_permissions.py checks that each role can do its own work and is
refused what it must not do; the e2e suite runs on these identities, so a grant a role
lacks fails it. What neither shows is a grant nobody needs. Here a stack's NATS server
traces every protocol operation from its start (`trace: true`), through the services'
start and a workload that takes the usual paths (remote prefills and hand-offs,
local prefills of a cached prompt, a stream its client leaves, standby prefetches, the
journal, kvcache stores and loads); each role's publish and subscribe grants
(shared/bus/permissions.py) are then matched against the subjects its identities used.
A grant no operation used must be one of RARE below, each with the path that needs it
and why a normal run does not take it; and RARE names nothing the role is not granted.
The autoscaler identity is not in this stack (tests/e2e/test_autoscale.py runs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shared.bus.permissions import ANY, ROLES, permissions
from shared.bus.server import NatsServer, free_port
from shared.bus.topology import (
    JOURNAL_BUCKET,
    KV_EVENTS_STREAM,
    NODES_BUCKET,
    PREFILL_NODE_SUBJECTS,
    PREFILL_STREAM,
    kvcache_subject,
)
from shared.model.loader import LoadedModel
from tandem import launcher
from tandem.launcher import Stack
from tests.e2e.chaos import Request, Stream, run_streams, workload
from tests.e2e.conftest import running_stack
from tests.e2e.streaming import completion_events

pytestmark = pytest.mark.e2e

TRACE = "trace: true\nmax_traced_msg_len: 16\n"
# `"$G/user:<role>" - <<- [PUB|HPUB|SUB <subject> ...`: what a client sent the server
OP = re.compile(r'"\$G/user:(\w+)" - <<- \[(H?PUB|SUB) (\S+)')

# Grants a normal run need not use: (role, "publish" | "subscribe", pattern) -> the path
# that uses it.
FIRST = "the first service to start makes the job and KV-event streams (any role may)"
WATCHES = [
    ("router", f"KV_{NODES_BUCKET}"), ("router", f"KV_{JOURNAL_BUCKET}"),
    ("router", KV_EVENTS_STREAM), ("prefill", f"KV_{NODES_BUCKET}"),
    ("decode", f"KV_{NODES_BUCKET}"), ("kvcache", f"KV_{NODES_BUCKET}"),
]  # fmt: skip
FLOW = "flow control of a watch (ordered consumer), asked for when the watcher falls behind"
RARE: dict[tuple[str, str, str], str] = {
    **{
        (role, "publish", f"$JS.API.STREAM.CREATE.{stream}"): FIRST
        for role in ("router", "prefill", "decode", "kvcache")
        for stream in (PREFILL_STREAM, KV_EVENTS_STREAM)
    },
    **{(role, "publish", f"$JS.FC.{stream}.>"): FLOW for role, stream in WATCHES},
    ("router", "publish", PREFILL_NODE_SUBJECTS): (
        "a job steered to the prefill node whose pool holds the prompt's prefix while no "
        "decode node does (admission.submit)"
    ),
    ("router", "publish", f"$JS.API.STREAM.PURGE.{PREFILL_STREAM}"): (
        "the own queue of a prefill node the router lost, purged (app.py, purge_steered)"
    ),
    ("prefill", "publish", f"$JS.API.CONSUMER.CREATE.{PREFILL_STREAM}.*.>"): (
        "nats-py's pull_subscribe creating its consumer by name, when it vanished between "
        "ensure_job_consumer and the subscribe (workqueue.JobConsumer.start)"
    ),
    ("decode", "publish", kvcache_subject(ANY, "get_tail")): (
        "a failed-over request prefilled on a decode node loads the partial last block its "
        "lost node stored (local_prefill._load_tail)"
    ),
}


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, `>` one or more at the end."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or token not in ("*", got[i]):
            return False
    return len(want) == len(got)


class TracedNats(NatsServer):
    """The launcher's server, tracing every operation (payloads cut short)."""

    def __init__(self, *args: Any, extra_config: str = "", **kwargs: Any) -> None:
        super().__init__(*args, extra_config=extra_config + TRACE, **kwargs)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """1 prefill, 2 decode (a stream's standby is the other) and 1 kvcache node."""
    argv = [
        "--prefill", "1",
        "--decode", "2",
        "--kvcache", "1",
        "--port", str(free_port()),
        "--transport", "tcp",
        "--kv-cache-mb", "128",
        "--kvcache-mb", "128",
        "--heartbeat-ttl", "2",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launcher, "NatsServer", TracedNats)
        log = tmp_path_factory.mktemp("traced") / "stack.log"
        with running_stack(argv, log) as stack:
            yield stack


def used(log: Path) -> dict[tuple[str, str], set[str]]:
    """(role, "publish" | "subscribe") -> the subjects its identities used, from the
    server's log and the files it rotated out."""
    seen: dict[tuple[str, str], set[str]] = {}
    for path in sorted(log.parent.glob(log.name + "*")):
        for m in OP.finditer(path.read_text(errors="replace")):
            role, op, subject = m.groups()
            kind = "subscribe" if op == "SUB" else "publish"
            seen.setdefault((role, kind), set()).add(subject)
    return seen


async def leave_a_stream(url: str, request: Request) -> None:
    """A client that reads a few events and goes: the router cancels the request."""
    body = {"model": "smollm2-135m-instruct", "prompt": request.prompt_ids,
            "max_tokens": 200, "stream": True, "ignore_eos": True}  # fmt: skip
    async with (
        aiohttp.ClientSession() as session,
        contextlib.aclosing(completion_events(session, url, body)) as events,
    ):
        seen = 0
        async for _ in events:
            seen += 1
            if seen == 5:
                break


async def test_every_grant_of_every_role_is_used(traced: Stack, real_model: LoadedModel) -> None:
    assert traced.nats is not None
    requests = [Request(r.prompt_ids, 40) for r in workload(real_model, 6, 40, seed=53)]
    await run_streams(traced.url, requests, [Stream() for _ in requests])
    again = requests[:3]  # cached now: prefilled where their prefix is
    await run_streams(traced.url, again, [Stream() for _ in again])
    await leave_a_stream(traced.url, requests[3])
    await asyncio.sleep(3)  # heartbeats, checkpoint records, the cancel's way round
    seen = used(traced.nats.log_path)
    unused: dict[tuple[str, str, str], None] = {}
    for role in ROLES:
        if role == "autoscaler":
            continue
        grants = permissions(role)
        for kind, patterns in (("publish", grants.publish), ("subscribe", grants.subscribe)):
            subjects = seen.get((role, kind), set())
            for pattern in patterns:
                if not any(matches(pattern, s) for s in subjects):
                    unused[(role, kind, pattern)] = None
    for key in unused:
        print("unused:", key)
    assert set(unused) <= set(RARE), sorted(set(unused) - set(RARE))
    for role, kind, pattern in RARE:
        grants = permissions(role)
        assert pattern in (grants.publish if kind == "publish" else grants.subscribe)
