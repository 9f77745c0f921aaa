"""A sequence's partly filled last KV block: the checkpoint between two full blocks.

Full blocks are named by their chained hash and stored by it; the last block of a running
sequence is not full, so it has no such name. A decode node stores it per request instead
(replaced every step), saying which tokens it holds and which full block precedes it. A
node resuming the request uses it only if both agree with the context the client received,
so a resume recomputes one token instead of up to a block of them.

Only the first `len(token_ids)` slots of `data` hold KV; the rest are whatever the block
held before, and a sequence using the tail overwrites them as it goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.kv.block_hash import ROOT_HASH, BlockHash


@dataclass(frozen=True)
class TailBlock:
    request_id: str
    start: int  # position of its first token: a multiple of the block size
    parent: BlockHash  # hash of the full block before it (ROOT_HASH at position 0)
    token_ids: list[int]  # the tokens whose KV it holds, 1 to block size - 1 of them
    data: bytes | memoryview  # one whole block, block-major as the pool stores it


def fit_tail(
    tail: TailBlock, context: list[int], hashes: list[BlockHash], block_size: int
) -> TailBlock | None:
    """The part of `tail` a resume of `context` can use, or None.

    `hashes`: the chained hashes of the context's full blocks (at least up to the tail's
    start). Usable: it starts on a block boundary right after a block of `hashes` (or at 0),
    its parent is that block, and its tokens equal the context's there. It is cut to leave
    the context's last token to compute (the next forward needs one); tokens the context no
    longer has (the client never received them) are cut too, since a slot's KV depends only
    on the tokens up to it.
    """
    if tail.start % block_size or not tail.token_ids or len(tail.token_ids) >= block_size:
        return None
    index = tail.start // block_size
    if index > len(hashes) or (hashes[index - 1] if index else ROOT_HASH) != tail.parent:
        return None
    usable = min(len(tail.token_ids), len(context) - 1 - tail.start)
    if usable <= 0 or tail.token_ids[:usable] != context[tail.start : tail.start + usable]:
        return None
    if usable == len(tail.token_ids):
        return tail
    return TailBlock(tail.request_id, tail.start, tail.parent, tail.token_ids[:usable], tail.data)
