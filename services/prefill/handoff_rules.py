"""The rules of a prefill node's hand-off that the simulator runs too (tandem/plan/
simprefill.py), written once: which decode nodes a prefilled sequence is offered to, in
what order, and how long the node waits before offering it again when none had room.
Torch-free and bus-free, so the simulator imports them without the node's planes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from shared.bus.messages import NodeInfo

N = TypeVar("N")

FIRST_DELAY = 0.05  # seconds before the first retry of a sequence no decode node took
MAX_DELAY = 1.0  # doubling up to this


def next_delay(delay: float) -> float:
    return min(MAX_DELAY, delay * 2)


def takes_kv_of(node: NodeInfo, hash_key: str) -> bool:
    """A decode node that may take this prefill node's KV: not draining, and keying its
    blocks as this node does (the same model and dtype; an older node, without a key, is
    taken on trust)."""
    return node.role == "decode" and not node.draining and node.hash_key in ("", hash_key)


def offer_order(
    nodes: Iterable[N], preferred: str, name: Callable[[N], str], free_blocks: Callable[[N], int]
) -> list[N]:
    """The router's choice first, then the others by most free KV blocks."""
    return sorted(nodes, key=lambda n: (name(n) != preferred, -free_blocks(n)))
