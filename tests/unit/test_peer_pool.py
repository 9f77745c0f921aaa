"""PeerPool: a connection goes back to its peer only after a clean transfer, a dead one is
never handed out, and a peer never has more than its slots in use."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from itertools import count

import pytest

from shared.transport.pool import PeerPool

_ids = count()


@dataclass
class Conn:
    peer: str
    n: int = field(default_factory=lambda: next(_ids))
    alive: bool = True


def make_pool(max_per_peer: int = 2) -> tuple[PeerPool[Conn], list[Conn], list[Conn]]:
    made: list[Conn] = []
    discarded: list[Conn] = []

    async def connect(peer: str) -> Conn:
        made.append(Conn(peer))
        return made[-1]

    pool = PeerPool(max_per_peer, connect, discarded.append, usable=lambda c: c.alive)
    return pool, made, discarded


async def test_a_clean_lease_returns_its_connection_and_the_next_reuses_it() -> None:
    pool, made, discarded = make_pool()
    async with pool.lease("a") as first:
        pass
    async with pool.lease("a") as second:
        assert second is first
    assert made == [first] and discarded == []
    assert pool.idle["a"] == [first]


async def test_a_lease_that_raises_discards_its_connection() -> None:
    pool, made, discarded = make_pool()
    with pytest.raises(RuntimeError):
        async with pool.lease("a"):
            raise RuntimeError("stream position in doubt")
    assert discarded == made and pool.idle["a"] == []


async def used_once(pool: PeerPool[Conn], peer: str) -> None:
    async with pool.lease(peer):
        pass


async def test_an_unusable_idle_connection_is_discarded_not_handed_out() -> None:
    pool, made, discarded = make_pool()
    await used_once(pool, "a")
    [dead] = pool.idle["a"]
    dead.alive = False
    conn = await pool.checkout("a")
    assert conn is not dead and discarded == [dead] and made == [dead, conn]


async def test_a_peer_has_at_most_its_slots_in_use() -> None:
    pool, _, _ = make_pool(max_per_peer=2)
    in_use = most = 0
    release = asyncio.Event()

    async def transfer() -> None:
        nonlocal in_use, most
        async with pool.lease("a"):
            in_use += 1
            most = max(most, in_use)
            await release.wait()
            in_use -= 1

    tasks = [asyncio.create_task(transfer()) for _ in range(5)]
    await asyncio.sleep(0.01)
    assert most == 2
    release.set()
    await asyncio.gather(*tasks)
    assert most == 2 and len(pool.idle["a"]) == 2


async def test_close_discards_every_idle_connection() -> None:
    pool, made, discarded = make_pool()
    await used_once(pool, "a")
    await used_once(pool, "b")
    pool.close()
    assert discarded == made and not pool.idle
