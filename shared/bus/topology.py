"""The control plane's JetStream objects, created or updated idempotently at start-up.

- `TANDEM_PREFILL`: work-queue stream of prefill jobs, de-duplicated by Nats-Msg-Id: per
  served model, one durable pull consumer shared by all that model's prefill nodes
  (explicit ack, `ack_wait`, `max_deliver`) on `tandem.prefill.jobs.<model token>` (the
  first of its nodes creates it), and one per prefill node on `tandem.prefill.node.<id>`
  for jobs a router steered to it (its pool holds their prefix); each prefill node creates
  its own at start-up. `tandem.prefill.jobs` itself holds jobs that name no model.
- `TANDEM_KV_EVENTS`: stream of KV block stored/evicted events for KV-aware routing.
- `tandem-nodes`: KV bucket, the node registry; entries expire by per-message TTL unless
  refreshed by heartbeats, and expiry leaves a marker watchers see as a leave.
- `tandem-journal`: KV bucket, request id → JournalEntry, file storage (survives routers).

Each is kept on `TopologyConfig.replicas` servers of a clustered NATS (3 on Kubernetes:
any one server may be lost with no job or journal entry lost); 1 for a single server.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass

import xxhash
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

log = logging.getLogger("tandem.bus")

PREFILL_STREAM = "TANDEM_PREFILL"
PREFILL_SUBJECT = "tandem.prefill.jobs"
PREFILL_CONSUMER = "prefill-workers"
PREFILL_NODE_SUBJECTS = "tandem.prefill.node.*"
PREFILL_MODEL_SUBJECTS = "tandem.prefill.jobs.*"  # one per served model (prefill_subject)
KV_EVENTS_STREAM = "TANDEM_KV_EVENTS"
KV_EVENTS_SUBJECT = "tandem.kv.events"
NODES_BUCKET = "tandem-nodes"
JOURNAL_BUCKET = "tandem-journal"


def token_subject(request_id: str) -> str:
    return f"tandem.tokens.{request_id}"


def is_token_subject(subject: str) -> bool:
    """Whether a job's reply subject is one a node may publish tokens to: a plain subject
    under `tandem.tokens.` (a job naming another subject, a wildcard or an empty token is
    refused, so no message can make a node publish elsewhere)."""
    prefix = "tandem.tokens."
    rest = subject[len(prefix) :]
    return (
        subject.startswith(prefix)
        and 0 < len(subject) <= 256
        and all(part and part not in ("*", ">") for part in rest.split("."))
        and not any(c.isspace() for c in subject)
    )


def cancel_subject() -> str:
    return "tandem.cancel"


def model_token(served_name: str) -> str:
    """A served model name as one subject token (subjects cannot hold '.', and names may):
    its safe characters, and a digest so that names differing only in the others stay apart."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", served_name)[:48]
    return f"{safe}-{xxhash.xxh3_64_hexdigest(served_name.encode())[:8]}"


def prefill_subject(model: str = "") -> str:
    """The shared queue of one served model's jobs (no model: the queue of a job that names
    none, from a router of before several models; routers now name one in every job, and
    no role may publish there, shared/bus/permissions.py)."""
    return f"{PREFILL_SUBJECT}.{model_token(model)}" if model else PREFILL_SUBJECT


def prefill_consumer(model: str = "") -> str:
    """The durable consumer of `prefill_subject(model)`, shared by that model's nodes."""
    return f"{PREFILL_CONSUMER}-{model_token(model)}" if model else PREFILL_CONSUMER


def prefill_node_subject(node_id: str) -> str:
    """Jobs steered to one prefill node (its own consumer takes them)."""
    return f"tandem.prefill.node.{node_id}"


def prefill_node_consumer(node_id: str) -> str:
    return f"prefill-node-{node_id}"


def kvcache_subject(node_id: str, op: str) -> str:
    return f"tandem.kvcache.{node_id}.{op}"


def kv_events_subject(node_id: str) -> str:
    return f"{KV_EVENTS_SUBJECT}.{node_id}"


def local_prefill_subject(node_id: str) -> str:
    return f"tandem.decode.{node_id}.prefill"


# Header of a local-prefill request: unix seconds after which the asking router has given
# up waiting and taken another path; the decode node must not admit the request after it.
REPLY_BY_HEADER = "Tandem-Reply-By"


def prefetch_subject(node_id: str) -> str:
    return f"tandem.decode.{node_id}.prefetch"


# A probe's answer starting with this: the node is alive but its streams should move (its
# engine hangs); any other answer means alive and well.
PING_STALLED = "stalled"


def ping_subject(role: str, node_id: str) -> str:
    """Every node answers here: a router probes a node whose stream went quiet. A dead
    node's subscription is gone, so NATS answers "no responders" at once. The role is in
    the subject so that each role's identity may answer its own role's pings only
    (shared/bus/permissions.py): a kvcache node cannot declare a decode node stalled."""
    return f"tandem.node.{role}.{node_id}.ping"


def assign_subject(node_id: str) -> str:
    return f"tandem.decode.{node_id}.assign"


@dataclass(frozen=True)
class TopologyConfig:
    # Seconds without an ack or an in_progress before a job is redelivered: prefill nodes
    # send in_progress every 2 s while they hold a job, so this is how long a dead node's
    # jobs wait before another node takes them.
    ack_wait: float = 8.0
    max_deliver: int = 5  # attempts before a job is given up
    duplicate_window: float = 120.0
    kv_events_max_age: float = 600.0
    node_ttl: float = 6.0  # registry entries vanish this long after the last heartbeat
    journal_ttl: float = 3600.0
    node_consumer_idle: float = 3600.0  # a prefill node's own consumer, unused, is deleted
    # Servers of a NATS cluster holding each stream and bucket (`--nats-replicas`); a
    # single server refuses more than 1. Every service of a deployment must say the same.
    replicas: int = 1
    # What each stream and bucket may hold, so that no writer (a flood, a compromised node)
    # can fill the server's store (issue 49). A full job queue or journal refuses new
    # writes (the router answers 503 and serves on); a full KV-event stream drops its
    # oldest events (routing hints); a full registry refuses an entry as too many nodes.
    prefill_max_bytes: int = 256 << 20
    kv_events_max_bytes: int = 128 << 20
    journal_max_bytes: int = 256 << 20
    nodes_max_bytes: int = 16 << 20


# What ensure_topology sets on a stream (the server fills in the rest)
_STREAM_FIELDS = (
    "subjects", "retention", "storage", "duplicate_window", "max_msgs", "max_bytes",
    "max_age", "discard", "num_replicas",
)  # fmt: skip


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream, or update one that differs from `config` (an earlier version's).
    Node identities may create streams but not update them (shared/bus/permissions.py):
    for them a differing stream is left as it is, with a warning; a Tandem service started
    once with the admin's NATS credentials updates it (docs/security.md)."""
    try:
        info = await js.stream_info(config.name or "")
    except NotFoundError:
        await js.add_stream(config)
        return
    differs = [  # (None or 0: left to the server's default, e.g. the duplicate window)
        f for f in _STREAM_FIELDS
        if getattr(config, f) not in (None, 0) and getattr(info.config, f) != getattr(config, f)
    ]  # fmt: skip
    if not differs:
        return
    try:
        await js.update_stream(config)
    except Exception as exc:  # a node identity: not allowed to
        log.warning(
            "stream %s differs from this version's in %s (%r): update it with an admin identity",
            config.name, ", ".join(differs), exc,
        )  # fmt: skip


async def _ensure_bucket(js: JetStreamContext, config: KeyValueConfig) -> None:
    """Create a KV bucket, or bring an existing one to `config`'s size limit (a bucket made
    before it had one refuses to be created again with it)."""
    try:
        await js.create_key_value(config)
    except BadRequestError:
        stream = f"KV_{config.bucket}"
        try:
            info = await js.stream_info(stream)
            if info.config.max_bytes != config.max_bytes:
                await js.update_stream(dataclasses.replace(info.config, max_bytes=config.max_bytes))
        except Exception as exc:  # a role without the right: the bucket works, unbounded
            log.warning(
                "bucket %s is not limited to %d bytes (%r): update it with an admin identity",
                config.bucket,
                config.max_bytes,
                exc,
            )


async def ensure_job_consumer(
    js: JetStreamContext, durable: str, subject: str, cfg: TopologyConfig | None = None
) -> None:
    """Create or update a durable pull consumer of prefill jobs on one subject (work-queue
    consumers may not overlap: the shared one takes only unsteered jobs)."""
    cfg = cfg or TopologyConfig()
    consumer = ConsumerConfig(
        durable_name=durable,
        filter_subject=subject,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=cfg.ack_wait,
        max_deliver=cfg.max_deliver,
        max_ack_pending=1000,
        # A node's own consumer outlives the node that made it by this much (its jobs'
        # requests have long since failed over: a router purges its subject).
        # (a model's shared consumer lives on: jobs queued while none of its nodes is up
        # wait for the next one)
        inactive_threshold=None if durable.startswith(PREFILL_CONSUMER) else cfg.node_consumer_idle,
    )
    try:
        await js.add_consumer(PREFILL_STREAM, consumer)
    except BadRequestError:
        await js.add_consumer(PREFILL_STREAM, consumer)  # update of an existing durable


async def ensure_topology(js: JetStreamContext, cfg: TopologyConfig | None = None) -> None:
    """Create or update every stream, consumer and bucket; safe to call from every node."""
    cfg = cfg or TopologyConfig()
    await _ensure_stream(
        js,
        StreamConfig(
            name=PREFILL_STREAM,
            subjects=[PREFILL_SUBJECT, PREFILL_MODEL_SUBJECTS, PREFILL_NODE_SUBJECTS],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=cfg.duplicate_window,
            max_msgs=100_000,
            max_bytes=cfg.prefill_max_bytes,
            discard=DiscardPolicy.NEW,  # full: refuse the next job, never drop a queued one
            num_replicas=cfg.replicas,
        ),
    )
    await ensure_job_consumer(js, PREFILL_CONSUMER, PREFILL_SUBJECT, cfg)
    await _ensure_stream(
        js,
        StreamConfig(
            name=KV_EVENTS_STREAM,
            subjects=[f"{KV_EVENTS_SUBJECT}.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=cfg.kv_events_max_age,
            max_msgs=1_000_000,
            max_bytes=cfg.kv_events_max_bytes,
            num_replicas=cfg.replicas,
        ),
    )
    await _ensure_bucket(
        js,
        KeyValueConfig(
            bucket=NODES_BUCKET,
            history=1,
            storage=StorageType.MEMORY,
            limit_marker_ttl=cfg.node_ttl,
            replicas=cfg.replicas,
            max_bytes=cfg.nodes_max_bytes,
        ),
    )
    await _ensure_bucket(
        js,
        KeyValueConfig(
            bucket=JOURNAL_BUCKET,
            history=1,
            storage=StorageType.FILE,
            ttl=cfg.journal_ttl,
            replicas=cfg.replicas,
            max_bytes=cfg.journal_max_bytes,
        ),
    )
