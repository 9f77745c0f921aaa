"""Cutting a delta of several tokens between two of them.

A node may send a request's tokens several at a time (an engine that makes several a
step), grouped as its steps fell. Two readers then need part of a delta: a stream whose
next delta overlaps what it delivered (grouped differently by a node it failed over to),
and a client resuming a dead router's stream whose last event falls inside a regenerated
delta. The delta's `text_ends` (the text's length after each token) say where to cut the
text; without them, or with ones that do not add up, the delta is not cut.
"""

from __future__ import annotations

from itertools import pairwise

import msgspec

from shared.bus.messages import TokenDelta


def tail_of(delta: TokenDelta, start: int) -> TokenDelta | None:
    """`delta` from token index `start` on (first_seq < start <= seq), or None when it
    cannot be cut there exactly."""
    n = len(delta.token_ids)
    k = start - delta.first_seq
    ends = delta.text_ends
    if not 0 < k < n or ends is None or len(ends) != n or ends[-1] != len(delta.text):
        return None
    if ends[0] < 0 or any(a > b for a, b in pairwise(ends)):
        return None
    if delta.logprobs is not None and len(delta.logprobs) != n:
        return None
    cut = ends[k - 1]
    return msgspec.structs.replace(
        delta,
        token_ids=delta.token_ids[k:],
        text=delta.text[cut:],
        text_ends=[e - cut for e in ends[k:]],
        logprobs=None if delta.logprobs is None else delta.logprobs[k:],
        prompt_logprobs=None,  # the first token's, and it is cut off
    )
