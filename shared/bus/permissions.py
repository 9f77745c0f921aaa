"""Least privilege on NATS: one identity per role, allowed only the subjects it uses.

Each role's lists below were taken from what its code publishes, subscribes to and asks of
JetStream (every `$JS.API` call is a request on a subject of its own; KV puts are publishes
on `$KV.<bucket>.<key>`; acks go to `$JS.ACK...`), and checked against a nats-server with
these permissions: every role's normal work ran with no violation. What they stop, e.g.: a
kvcache node cannot publish tokens or read them, nor queue prefill jobs; a decode node
writes the journal's checkpoint records (`ckpt.*`) but no request's entry; no node but the
router reads the journal (prompts and outputs) or subscribes to token streams; the
autoscaler reads the registry and the queue's backlog, nothing else.

Replies: a role subscribes only to its own inbox prefix (`_INBOX_<role>.>`; `Bus` connects
with it), so one role cannot read another's replies (JetStream's answers carry journal
entries); responders answer through `allow_responses` (one reply per request) instead of
a right to publish on any inbox.

What an allow list cannot narrow (docs/security.md says so too): every model node may
publish on `tandem.tokens.*` (any request's stream) and write the registry entry of any
node of its own role (entries are keyed `<role>.<node id>`); per-node subjects
(`tandem.decode.*.assign`) are
open to every node of the role; and every role except the autoscaler may create the
streams while they do not exist (each service makes sure of them at start), but not
change them. Subjects are written with topology.py's helpers, a node id or request id
given as `*` (ANY), so a subject renamed there is renamed here. Nothing more: a stack's
traced run shows every grant used, or used only on a path that run does not take
(tests/e2e/test_permissions_used.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from shared.bus.topology import (
    JOURNAL_BUCKET,
    KV_EVENTS_STREAM,
    NODES_BUCKET,
    PREFILL_CONSUMER,
    PREFILL_MODEL_SUBJECTS,
    PREFILL_NODE_SUBJECTS,
    PREFILL_STREAM,
    assign_subject,
    cancel_subject,
    kv_events_subject,
    kvcache_subject,
    local_prefill_subject,
    ping_subject,
    prefetch_subject,
    token_subject,
)

ANY = "*"  # one subject token: any node id or request id
TOKENS = token_subject(ANY)
KV_EVENTS = kv_events_subject(ANY)

ROLES = ("router", "prefill", "decode", "kvcache", "autoscaler")
ADMIN = "admin"  # operators and tests: no restriction

API = "$JS.API"


def inbox_prefix(role: str) -> str:
    return f"_INBOX_{role}"


def _kv_reader(bucket: str) -> list[str]:
    """Read a KV bucket: get (MSG.GET), keys and watches (an ordered consumer)."""
    stream = f"KV_{bucket}"
    return [
        f"{API}.STREAM.INFO.{stream}",
        f"{API}.STREAM.MSG.GET.{stream}",
        f"{API}.CONSUMER.CREATE.{stream}",
        f"{API}.CONSUMER.INFO.{stream}.*",
        f"$JS.FC.{stream}.>",
    ]


# Making sure of the streams, the shared consumer and the buckets (each service, at start).
# Create, not update: a node identity that could update a stream could change what it
# holds (add `tandem.tokens.*` to a stream it consumes, and read every tenant's output) or
# drop its limits (issue 49). A stream made by an earlier version is brought up to date by
# an admin identity (shared/bus/topology.py says when).
_STREAM_OPS = [
    f"{API}.STREAM.{op}.{stream}"
    for stream in (PREFILL_STREAM, KV_EVENTS_STREAM)
    for op in ("INFO", "CREATE")
]
_TOPOLOGY = [
    f"{API}.INFO",
    *_STREAM_OPS,
    f"{API}.CONSUMER.DURABLE.CREATE.{PREFILL_STREAM}.{PREFILL_CONSUMER}",
    f"{API}.STREAM.CREATE.KV_{NODES_BUCKET}",
    f"{API}.STREAM.CREATE.KV_{JOURNAL_BUCKET}",
]


def _node(role: str) -> list[str]:
    """A node's: the topology, reading the registry, and its own role's entries in it."""
    return [*_TOPOLOGY, *_kv_reader(NODES_BUCKET), f"$KV.{NODES_BUCKET}.{role}.>"]


@dataclass(frozen=True)
class Permissions:
    publish: list[str]
    subscribe: list[str]
    responds: bool  # answers requests (allow_responses)


def permissions(role: str) -> Permissions:
    inbox = f"{inbox_prefix(role)}.>"
    if role == "router":
        return Permissions(
            [
                *_node("router"),
                cancel_subject(),
                local_prefill_subject(ANY),
                prefetch_subject(ANY),
                ping_subject(ANY, ANY),
                PREFILL_MODEL_SUBJECTS,  # every job names its model (prefill_subject)
                PREFILL_NODE_SUBJECTS,
                f"{API}.STREAM.PURGE.{PREFILL_STREAM}",
                *_kv_reader(JOURNAL_BUCKET),
                f"$KV.{JOURNAL_BUCKET}.>",
                f"{API}.STREAM.NAMES",
                f"{API}.CONSUMER.CREATE.{KV_EVENTS_STREAM}",
                f"$JS.FC.{KV_EVENTS_STREAM}.>",
            ],
            [inbox, TOKENS],
            responds=False,
        )
    if role == "prefill":
        return Permissions(
            [
                *_node("prefill"),
                TOKENS,
                assign_subject(ANY),
                kvcache_subject(ANY, "get"),
                kvcache_subject(ANY, "put"),
                kvcache_subject(ANY, "warm"),
                KV_EVENTS,
                f"{API}.CONSUMER.DURABLE.CREATE.{PREFILL_STREAM}.*",
                f"{API}.CONSUMER.CREATE.{PREFILL_STREAM}.*.>",  # (pull_subscribe's own)
                f"{API}.CONSUMER.INFO.{PREFILL_STREAM}.*",
                f"{API}.CONSUMER.MSG.NEXT.{PREFILL_STREAM}.*",
                f"$JS.ACK.{PREFILL_STREAM}.>",
            ],
            [inbox, cancel_subject(), ping_subject("prefill", ANY)],
            responds=True,
        )
    if role == "decode":
        return Permissions(
            [
                *_node("decode"),
                TOKENS,
                *(
                    kvcache_subject(ANY, op)
                    for op in ("get", "put", "put_tails", "get_tail", "pin", "unpin", "warm")
                ),
                KV_EVENTS,
                f"{API}.STREAM.INFO.KV_{JOURNAL_BUCKET}",
                f"$KV.{JOURNAL_BUCKET}.ckpt.>",  # checkpoint records, no request's entry
            ],
            [
                inbox,
                cancel_subject(),
                ping_subject("decode", ANY),
                assign_subject(ANY),
                local_prefill_subject(ANY),
                prefetch_subject(ANY),
            ],
            responds=True,
        )
    if role == "kvcache":
        return Permissions(
            [*_node("kvcache"), KV_EVENTS],
            [inbox, ping_subject("kvcache", ANY), kvcache_subject(ANY, ANY)],
            responds=True,
        )
    if role == "autoscaler":
        return Permissions(
            # the shared consumers' backlogs (one per model; the API names consumers whole)
            [*_kv_reader(NODES_BUCKET), f"{API}.CONSUMER.INFO.{PREFILL_STREAM}.*"],
            [inbox],
            responds=False,
        )
    raise ValueError(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")


def user_block(user: str, password: str, role: str | None) -> str:
    """One entry of nats-server's `authorization { users = [...] }`: `role`'s permissions,
    or none (`role` None: the admin). JSON quoting is valid NATS config quoting."""
    head = f"{{ user: {json.dumps(user)}, password: {json.dumps(password)}"
    if role is None:
        return head + " }"
    p = permissions(role)
    rules = [
        f"publish: {{ allow: {json.dumps(p.publish)} }}",
        f"subscribe: {{ allow: {json.dumps(p.subscribe)} }}",
    ]
    if p.responds:
        rules.append("allow_responses: true")
    return head + ", permissions: { " + ", ".join(rules) + " } }"


def compose_password_var(role: str) -> str:
    """The .env variable holding `role`'s NATS password under compose."""
    return f"NATS_{role.upper()}_PASSWORD"


def compose_authorization() -> str:
    """deploy/nats.conf's `authorization` block: every role's identity (its password a
    NATS environment reference, filled from .env) and the admin ($NATS_USER). `python -m
    shared.bus.permissions` prints it; tests/unit/test_compose.py checks the file has it."""
    users = []
    for role in ROLES:
        entry = user_block(role, "PASSWORD", role)
        users.append(entry.replace('"PASSWORD"', f"${compose_password_var(role)}", 1))
    users.append("{ user: $NATS_USER, password: $NATS_PASSWORD }")
    return "authorization {\n  users = [\n    " + ",\n    ".join(users) + "\n  ]\n}\n"


if __name__ == "__main__":
    print(compose_authorization(), end="")
