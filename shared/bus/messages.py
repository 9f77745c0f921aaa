"""Typed, versioned control messages: every kind that crosses NATS, and their codec.

Each message is a msgspec Struct tagged with its `kind` and carrying a schema version `v`.
`decode(data, Kind)` validates everything (types, unknown fields, version) and raises
`WireFormatError` on any mismatch; receivers count and drop such messages instead of
crashing. Bodies are msgpack; nothing here can execute code on decode.
"""

from __future__ import annotations

from typing import Literal, TypeVar

import msgspec

from shared.bus.ids import AttemptId, RequestId
from shared.errors import WireFormatError
from shared.sampling_params import SamplingParams

SCHEMA_VERSION = 1

NodeRole = Literal["prefill", "decode", "kvcache", "router"]
KVEventOp = Literal["stored", "evicted", "cleared"]  # cleared: the node dropped all it had
# A journal entry is written when a request is queued, as its stream delivers each block,
# and when another router resumes it; finished, failed and cancelled requests are deleted.
JournalState = Literal["queued", "decoding", "resumed"]
# NATS' max_payload counts headers too; bodies stay well under the 1 MiB default.
MAX_MESSAGE_BYTES = 512 * 1024


class SequenceSnapshot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What another node needs to continue a sequence, beside its KV blocks."""

    attempt_id: AttemptId
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams  # its seed fixed (sampling_params.seeded)
    num_computed: int  # KV tokens the accompanying export covers


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    """Base of all control messages."""

    v: int = SCHEMA_VERSION


class PrefillJob(Message, frozen=True, tag="prefill_job"):
    """Router → prefill work queue: compute this prompt's KV and ship it to `decode_node`."""

    attempt_id: AttemptId = AttemptId("")
    prompt_ids: list[int] = []
    params: SamplingParams = SamplingParams()  # its seed fixed at admission (seeded)
    decode_node: str = ""
    handoff: int = 0  # 0: the attempt's first; a failover counts one more (ids.py)
    token_subject: str = ""
    deadline: float = 0.0  # unix seconds; past it the job is dropped, not computed
    output_ids: list[int] = []  # a failover: tokens already delivered; continue after them
    model: str = ""  # the served name it is for (the router names it in every job)
    # The router served no other request when it sent this: the decode nodes run nothing of
    # its. A prefill node sharing their cores may then take them all (--idle-threads).
    alone: bool = False


class DecodeAssignment(Message, frozen=True, tag="decode_assignment"):
    """Prefill → decode node: a KV transfer `transfer_id` carries this sequence's blocks."""

    transfer_id: str = ""
    snapshot: SequenceSnapshot | None = None
    token_subject: str = ""
    prefill_node: str = ""
    deadline: float = 0.0
    transfer_secret: str = ""  # the transfer must carry it (data-plane admission)
    handoff: int = 0  # the job's handoff: every token delta of this node carries it
    model: str = ""  # the served name the KV is of: a node serving another refuses it


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One generated token's log-probability under the model (before penalties and
    temperature), and the most likely tokens' at its position (`SamplingParams.logprobs`)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class TokenDelta(Message, frozen=True, tag="token_delta"):
    """Node → router: the next tokens of a request, one or more (an engine may make several
    a step). `seq` is the index of its last token in the request's output, so any node
    numbers alike; `first_seq` its first's."""

    attempt_id: AttemptId = AttemptId("")
    seq: int = 0
    token_ids: list[int] = []
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    node_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # The handoff that sent it. The router takes tokens from its current handoff only (a
    # node the request failed over from may still be running it), and a superseded
    # handoff's error (a job still queued when its request went on elsewhere) does not end it.
    handoff: int | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asks
    prompt_logprobs: list[TokenLogprob] | None = None  # the first delta's, when asked
    # With several tokens: the length `text` had after each, so the router can cut the
    # delta between two tokens (services/router/trim.py). None: one token, or not known.
    text_ends: list[int] | None = None

    @property
    def first_seq(self) -> int:
        return self.seq - max(1, len(self.token_ids)) + 1


class Reply(Message, frozen=True, tag="reply"):
    """← a node's answer to what it may refuse (expect a transfer, prefill locally, store
    blocks): taken, or why not."""

    accepted: bool = False
    reason: str = ""
    # The request itself cannot be served there, whatever the load (an invalid parameter
    # for that node's engine): another try of the same would meet the same refusal.
    invalid: bool = False


def accepted() -> bytes:
    return encode(Reply(accepted=True))


def refused(reason: str, invalid: bool = False) -> bytes:
    return encode(Reply(accepted=False, reason=reason, invalid=invalid))


def read_reply(data: bytes) -> Reply:
    """The answer; bytes that are no Reply are a refusal saying so (never an exception)."""
    try:
        return decode(data, Reply)
    except WireFormatError as exc:
        return Reply(accepted=False, reason=f"malformed reply: {exc}")


class Cancel(Message, frozen=True, tag="cancel"):
    """Router → all nodes: stop work on a request and free its blocks."""

    attempt_id: AttemptId = AttemptId("")
    reason: str = ""
    # Only this node acts ("": every node). A failover cancels the request on the node it
    # left, which may be alive after all (cut off, or slow), without touching the new one.
    node_id: str = ""


class Prefetch(Message, frozen=True, tag="prefetch"):
    """Router → the decode node it chose as a stream's standby: load the stored KV blocks of
    this context into your pool now (cached, evictable). If the stream's node dies, its
    resume here then loads only what was stored since."""

    attempt_id: AttemptId = AttemptId("")
    token_ids: list[int] = []
    cache_salt: str = ""  # the request's (its blocks are named under it)


class NodeInfo(Message, frozen=True, tag="node_info", kw_only=True):
    """A node's registry entry, refreshed by heartbeats."""

    node_id: str = ""
    role: NodeRole
    data_address: str = ""  # where its KV data-plane listener is reached
    load: int = 0  # queued + running requests
    running: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    hash_key: str = ""  # what keys its block hashes (model, dtype): routers hash prompts alike
    block_size: int = 0
    draining: bool = False  # shutting down: finishing its work, taking none
    timestamp: float = 0.0
    model: str = ""  # the served name of the model it serves ("": unknown, an older node)
    ttl: float = 0.0  # seconds its entry outlives its last heartbeat (0: unknown, an older node)
    # Sequences its process runs or queues for every model it hosts (a decode process
    # hosting several, each a node; 0: unknown, or the node's own `running`): the others'
    # steps take turns with its own on one engine thread.
    host_running: int = 0
    hosted_models: int = 0  # models its process hosts (0: unknown, an older node; 1: alone)
    # The process's first node id, the same for every node of a process hosting several
    # models ("" alone): a router counts what it sent to any of them as that process's load.
    host: str = ""
    # The engine its model runs on: "native" or "vllm" ("": native, an older node). A
    # router refuses what no node of the model's engines serves (vLLM: grammars, yet).
    engine: str = ""


class KVEvent(Message, frozen=True, tag="kv_event", kw_only=True):
    """A node stored or evicted KV blocks (for KV-aware routing)."""

    node_id: str = ""
    op: KVEventOp
    block_hashes: list[bytes] = []
    timestamp: float = 0.0


class CheckpointRecord(Message, frozen=True, tag="checkpoint"):
    """A decode node checkpointed a sequence's KV up to `num_tokens` in the kvcache service."""

    attempt_id: AttemptId = AttemptId("")
    node_id: str = ""
    num_tokens: int = 0
    block_hashes: list[bytes] = []
    output_ids: list[int] = []
    timestamp: float = 0.0


class JournalEntry(Message, frozen=True, tag="journal"):
    """The request journal's record of one request (outlives any router process).

    It holds what another router needs to resume the request's stream: its current
    attempt's job (prompt, parameters with the seed, model, attempt id: a takeover writes
    the new attempt's), the response's shape, and the tokens delivered so far (a prefix of
    the request's output, written every block; decode nodes' checkpoint records may know
    more). Nothing in it repeats the job.
    """

    request_id: RequestId = RequestId("")  # what the client knows (response id, journal key)
    state: JournalState = "queued"
    router_id: str = ""
    updated_at: float = 0.0
    job: PrefillJob | None = None
    chat: bool = False
    include_usage: bool = False
    created: int = 0
    output_ids: list[int] = []
    owner: str = ""  # digest of the API key that created it ("" on an open API): resumes
    echo: bool = False  # the response shows the prompt first (completions' `echo`)
    hide_output: bool = False  # an echo with `max_tokens: 0`: its one token is not shown

    @property
    def attempt_id(self) -> AttemptId:
        """The current attempt's id (its job's): its checkpoint record's key."""
        return self.job.attempt_id if self.job is not None else AttemptId("")


class KVPut(Message, frozen=True, tag="kv_put"):
    """→ kvcache node: expect transfer `transfer_id` holding these blocks, in this order."""

    transfer_id: str = ""
    block_hashes: list[bytes] = []
    block_bytes: int = 0
    transfer_secret: str = ""
    producer: str = ""  # the node storing them (kept with each block: a purge by node)


class KVPin(Message, frozen=True, tag="kv_pin"):
    """Decode node → kvcache node: keep these blocks (a running sequence's checkpoint, the
    prompt's blocks included) from eviction until the sequence ends here (KVUnpin) or the
    pin's lease runs out; each pin of the attempt renews the lease."""

    attempt_id: AttemptId = AttemptId("")
    node_id: str = ""  # the decode node pinning (a failover's next node pins its own)
    block_hashes: list[bytes] = []


class KVUnpin(Message, frozen=True, tag="kv_unpin"):
    """Decode node → every kvcache node: these sequences left it; release its pins of them,
    or (`over`: the requests ended) every node's."""

    attempt_ids: list[AttemptId] = []
    node_id: str = ""
    over: bool = False


class KVPurge(Message, frozen=True, tag="kv_purge"):
    """Operator → kvcache node: drop every block `producer` stored (a node found bad)."""

    producer: str = ""


class KVPurgeReply(Message, frozen=True, tag="kv_purge_reply"):
    removed: int = 0
    error: str = ""


class KVGet(Message, frozen=True, tag="kv_get"):
    """→ kvcache node: send the longest stored prefix of these blocks to `reply_address`."""

    transfer_id: str = ""
    block_hashes: list[bytes] = []
    reply_address: str = ""
    transfer_secret: str = ""  # the reply transfer carries it back


class KVWarm(Message, frozen=True, tag="kv_warm"):
    """Node → kvcache node: send a one-byte transfer `transfer_id` to `reply_address` now,
    over the connection later gets will take, so it is open and proven before one needs it
    (`services/kvcache/warm.py`). Answered with a Reply."""

    transfer_id: str = ""
    reply_address: str = ""
    transfer_secret: str = ""


class KVGetReply(Message, frozen=True, tag="kv_get_reply"):
    """← kvcache node: how many leading blocks it has and will send (0: nothing follows)."""

    hits: int = 0
    block_bytes: int = 0
    error: str = ""


class KVTail(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request's partial last KV block (`shared.kv.tail`): where it starts, the full block
    before it, the tokens whose KV it holds; as a piece (`first` > 0), the rows it adds."""

    attempt_id: AttemptId
    start: int
    parent: bytes
    token_ids: list[int]
    first: int = 0


class KVPutTails(Message, frozen=True, tag="kv_put_tails"):
    """→ kvcache node: expect transfer `transfer_id` holding, tail after tail in order, each
    tail's rows from its `first` on (`row_bytes` each). A whole tail (`first` 0) replaces
    the one its request had stored; a piece extends it."""

    transfer_id: str = ""
    tails: list[KVTail] = []
    row_bytes: int = 0
    transfer_secret: str = ""


class KVPutTailsReply(Message, frozen=True, tag="kv_put_tails_reply"):
    """← kvcache node: the transfer is expected, but the pieces of the requests in `missing`
    do not continue what it holds (it lost or never had their earlier rows): they will be
    dropped, and only a whole tail helps. `error`: refused, send nothing."""

    missing: list[AttemptId] = []
    error: str = ""


class KVGetTail(Message, frozen=True, tag="kv_get_tail"):
    """→ kvcache node: send attempt `attempt_id`'s stored tail to `reply_address`."""

    transfer_id: str = ""
    attempt_id: AttemptId = AttemptId("")
    reply_address: str = ""
    transfer_secret: str = ""


class KVTailReply(Message, frozen=True, tag="kv_tail_reply"):
    """← kvcache node: the whole tail it will send, `nbytes` long (None: none stored,
    nothing follows)."""

    tail: KVTail | None = None
    nbytes: int = 0
    error: str = ""


M = TypeVar("M", bound=Message)

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder[Message]] = {}


def encode(msg: Message) -> bytes:
    data = _encoder.encode(msg)
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireFormatError(f"{type(msg).__name__} of {len(data)} bytes exceeds the limit")
    return data


def decode(data: bytes, kind: type[M]) -> M:
    """Decode and validate one message of the expected kind, or raise WireFormatError."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireFormatError(f"message of {len(data)} bytes exceeds the limit")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        msg = decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, ValueError, TypeError) as exc:
        raise WireFormatError(f"bad {kind.__name__}: {exc}") from exc
    if msg.v != SCHEMA_VERSION:
        raise WireFormatError(f"unsupported {kind.__name__} version {msg.v}")
    return msg  # type: ignore[return-value]
