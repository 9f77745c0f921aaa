"""Which kvcache node owns a block: rendezvous (highest-random-weight) hashing.

Each block goes to the node with the highest score `xxh3_64(node id, block hash)`. Adding a
node moves only the blocks it now wins (about 1/n of them) and removing one moves only its
own, with no ring to maintain and the same answer in every process.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

SHARD_SEED = 0x5A4D_0000_0000_0001


def score(node_id: str, block_hash: bytes) -> int:
    h = xxhash.xxh3_64(seed=SHARD_SEED)
    h.update(node_id.encode())
    h.update(b"\x00")
    h.update(block_hash)
    return h.intdigest()


def owner(block_hash: bytes, node_ids: Sequence[str]) -> str:
    if not node_ids:
        raise ValueError("no kvcache node to own a block")
    return max(node_ids, key=lambda n: (score(n, block_hash), n))


def shard(hashes: Sequence[bytes], node_ids: Sequence[str]) -> dict[str, list[int]]:
    """Positions of `hashes` grouped by owning node (each group in chain order)."""
    groups: dict[str, list[int]] = {}
    for i, h in enumerate(hashes):
        groups.setdefault(owner(h, node_ids), []).append(i)
    return groups
