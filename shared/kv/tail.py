"""A sequence's partly filled last KV block: the checkpoint between two full blocks.

Full blocks are named by their chained hash and stored by it; the last block of a running
sequence is not full, so it has no such name. A decode node stores it per request instead
(replaced every step), saying which tokens it holds and which full block precedes it. A
node resuming the request uses it only if both agree with the context the client received,
so a resume recomputes one token instead of up to a block of them.

`data` holds the KV of those tokens only, slot-major (one row per token, every layer's keys
and values in it: `shared.kv.paged_cache`), so a tail grows by appending rows. A decode
node sends each tail in pieces: after a step only the rows added since it last sent that
request's tail (`first` > 0: rows `first` on), which the store appends to what it holds;
the whole tail (`first` == 0) when a new block starts or the store lost the earlier rows.
One token's row is ~46 KB for SmolLM2-135M in float32, a whole block 16 of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.kv.block_hash import ROOT_HASH, BlockHash


class TailPart(Protocol):
    """What a tail or a piece of one says about itself (`TailBlock`, and `KVTail` on the
    wire)."""

    @property
    def start(self) -> int: ...
    @property
    def parent(self) -> bytes: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def first(self) -> int: ...


def continues(tail: TailPart, piece: TailPart) -> bool:
    """Whether `piece`'s rows go right after `tail`'s: same block, same tokens so far."""
    return (
        piece.first == len(tail.token_ids)
        and piece.start == tail.start
        and piece.parent == tail.parent
        and piece.token_ids[: piece.first] == tail.token_ids
    )


@dataclass(frozen=True)
class TailBlock:
    request_id: str
    start: int  # position of its first token: a multiple of the block size
    parent: BlockHash  # hash of the full block before it (ROOT_HASH at position 0)
    token_ids: list[int]  # the tokens whose KV it holds, 1 to block size - 1 of them
    data: bytes | memoryview  # rows `first` to len(token_ids) - 1, slot-major
    first: int = 0  # > 0: a piece extending the tail stored before it (see above)

    @property
    def rows(self) -> int:
        """How many token rows `data` holds."""
        return len(self.token_ids) - self.first


def fit_tail(
    tail: TailBlock,
    context: list[int],
    hashes: list[BlockHash],
    block_size: int,
    root: BlockHash = ROOT_HASH,
) -> TailBlock | None:
    """The part of `tail` a resume of `context` can use, or None.

    `hashes`: the chained hashes of the context's full blocks (at least up to the tail's
    start). Usable: it is whole (not a piece) with a row per token, it starts on a block
    boundary right after a block of `hashes` (or at 0), its parent is that block (or `root`,
    the chain's start: chain_root of the request's cache salt), and its
    tokens equal the context's there. It is cut to leave
    the context's last token to compute (the next forward needs one); tokens the context no
    longer has (the client never received them) are cut too, since a slot's KV depends only
    on the tokens up to it.
    """
    if tail.start % block_size or not tail.token_ids or len(tail.token_ids) >= block_size:
        return None
    if tail.first or len(tail.data) % len(tail.token_ids):
        return None
    index = tail.start // block_size
    if index > len(hashes) or (hashes[index - 1] if index else root) != tail.parent:
        return None
    usable = min(len(tail.token_ids), len(context) - 1 - tail.start)
    if usable <= 0 or tail.token_ids[:usable] != context[tail.start : tail.start + usable]:
        return None
    if usable == len(tail.token_ids):
        return tail
    row = len(tail.data) // len(tail.token_ids)
    data = memoryview(tail.data)[: usable * row]
    return TailBlock(tail.request_id, tail.start, tail.parent, tail.token_ids[:usable], data)
