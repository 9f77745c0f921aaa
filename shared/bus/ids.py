"""The ids a request is known by, and the one place each is minted.

**RequestId** — what the client knows: the response id (`cmpl-…`/`chatcmpl-…`, 24 random
hex digits: knowing it is the capability to resume the stream), the journal's key. Minted
once, by the router that admits the request (`new_request_id`).

**AttemptId** — one router's attempt at serving the request: what the nodes know it by.
It names the sequence on a prefill or decode node, the token subject its deltas go to,
its checkpoint record and stored partial block in the kvcache service, and what a Cancel
drops. The first attempt's id is the request id. A router that picks up the stream of a
router that died mints a new one (`attempt_id(rid, takeover=True)`), so that cancelling the
dead router's attempt everywhere can never touch the new one. Both go through
`attempt_id`, the only constructor.

A **failover** does not change the attempt: it moves the same attempt to another decode
node (its checkpoints and stored tail carry over) as its next **handoff**, numbered from 0.
The handoff number tells a superseded handoff's late error from the current one's, and with
the attempt id names the KV transfer of that handoff (`handoff_transfer_id`) and the
de-duplicated work-queue message that carries it.
"""

from __future__ import annotations

import secrets
from typing import NewType

RequestId = NewType("RequestId", str)
AttemptId = NewType("AttemptId", str)


def new_request_id(chat: bool) -> RequestId:
    return RequestId(("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12))


def attempt_id(request_id: RequestId, *, takeover: bool = False) -> AttemptId:
    """The first attempt's id is the request's; a takeover gets a fresh one."""
    if not takeover:
        return AttemptId(request_id)
    return AttemptId(f"{request_id}-r{secrets.token_hex(3)}")


def handoff_transfer_id(attempt: AttemptId, handoff: int) -> str:
    """The id of the KV transfer (and work-queue message) of an attempt's n-th handoff."""
    return attempt if handoff == 0 else f"{attempt}/failover-{handoff}"
