"""Chained block hashes over token ids: the names of KV blocks for prefix reuse and routing.

A block's hash covers its own tokens and its parent's hash, so equal hashes mean equal whole
prefixes. xxh3-128 with a fixed seed over a fixed byte encoding is identical in every
process, run and machine (Python's `hash()` is salted per process, so it is never used).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", bytes)

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block unless an engine is configured otherwise

HASH_SEED = 0x7A4E_D3A1_5EED_0001
# The parent of a sequence's first block: a fixed value instead of None keeps the chain uniform.
ROOT_HASH = BlockHash(b"\x00" * 16)


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one block: (parent hash, little-endian uint32 token ids, extra key bytes)."""
    h = xxhash.xxh3_128(seed=HASH_SEED)
    h.update(parent)
    h.update(np.asarray(token_ids, dtype="<u4").tobytes())
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return BlockHash(h.digest())


@lru_cache(maxsize=4096)
def chain_root(cache_salt: str = "") -> BlockHash:
    """The parent of a sequence's first block: ROOT_HASH, or one keyed by the request's cache
    salt, so requests with different salts never share (or reveal) a cached block."""
    if not cache_salt:
        return ROOT_HASH
    return hash_block_tokens(ROOT_HASH, [], b"cache-salt\0" + cache_salt.encode())


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra: bytes = b"", parent: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Hashes of every *full* block of `token_ids` (a partial last block has no name yet).

    `extra` keys the chain to what else shapes the KV (the model's identity, its dtype), so
    two models never share a hash.
    """
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
