"""The kvcache node faults its memory tier in ahead of the puts: pages resident before a
put needs them, nothing stored changed, and never more than the tier's limit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.kvcache import prefault
from services.kvcache.prefault import keep_faulted_in, prefault_step
from services.kvcache.slabs import SlabArena
from services.kvcache.store import MEMORY, BlockStore
from shared.buffers import PAGE
from tests.rss import status_kib

pytestmark = pytest.mark.unit

MB = 1 << 20


def populate_refused() -> str:
    """Why this kernel cannot fault pages in ahead (MADV_POPULATE_WRITE, Linux 5.14+), or ""."""
    arena = SlabArena(PAGE, 1)
    try:
        arena.prefault(PAGE)
        return ""
    except OSError as exc:
        return f"this kernel cannot fault pages in ahead (MADV_POPULATE_WRITE): {exc}"
    finally:
        arena.close()


REFUSED = populate_refused()
needs_populate = pytest.mark.skipif(bool(REFUSED), reason=REFUSED or "supported")


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


@needs_populate
def test_prefault_makes_the_next_slabs_resident_and_changes_no_stored_byte() -> None:
    arena = SlabArena(MB, 64)
    used = arena.alloc()
    assert used == 0
    arena.view(used)[:] = b"\x05" * MB
    before = status_kib("RssShmem") * 1024
    assert arena.prefault(32 * MB) == 32 * MB
    assert (
        status_kib("RssShmem") * 1024 - before >= 30 * MB
    )  # resident now, before any put wrote them
    assert arena.ahead_bytes() == 32 * MB
    assert bytes(arena.view(used)) == b"\x05" * MB
    assert bytes(arena.view(1)) == bytes(MB)  # faulted in, still empty
    # the next slabs handed out are the faulted-in ones; what is ahead shrinks
    assert [arena.alloc() for _ in range(4)] == [1, 2, 3, 4]
    assert arena.ahead_bytes() == 28 * MB
    # later rounds go on from where the last one stopped, up to the arena's end
    assert arena.prefault(64 * MB) == 31 * MB
    assert arena.prefault(MB) == 0
    arena.close()


def test_a_disk_arena_is_never_faulted_in(tmp_path: Path) -> None:
    arena = SlabArena(MB, 8, tmp_path / "arena")
    assert arena.prefault(8 * MB) == 0
    assert (tmp_path / "arena").stat().st_blocks == 0
    arena.close()


@needs_populate
def test_faulting_in_ahead_keeps_within_the_memory_tier_limit() -> None:
    block = 64 * 1024
    store = BlockStore(8 * block)
    assert prefault_step(store, 1 << 30) == 0  # no class yet: nothing to fault in for
    for i in range(6):
        assert store.put(h(i), bytes([i]) * block)
    assert prefault_step(store, 1 << 30) == 2 * block  # the room beside 6 blocks
    assert prefault_step(store, 1 << 30) == 0
    assert store.put(h(6), bytes([6]) * block)
    assert prefault_step(store, 1 << 30) == 0  # one block stored, one still ahead: full
    # a second class's room counts what the first has touched (used or faulted in ahead)
    assert store.put(h(100), b"\x01" * (2 * block))
    assert prefault_step(store, 1 << 30) == 0
    # the 2-block put evicted the least recent one; the rest are intact
    kept = {i: store.get(h(i)) for i in range(7)}
    assert [i for i, data in kept.items() if data is None] == [0]
    assert all(data == bytes([i]) * block for i, data in kept.items() if data is not None)
    store.close()


@needs_populate
def test_slabs_freed_keep_their_room_counted() -> None:
    """Removed blocks leave their slabs' pages resident (freed, not released): faulting in
    ahead counts them, so resident memory stays within the limit."""
    block = 64 * 1024
    store = BlockStore(8 * block)
    for i in range(6):
        assert store.put(h(i), bytes([i]) * block)
    for i in range(6):
        assert store.remove(h(i))
    assert store.used_bytes() == 0
    assert prefault_step(store, 1 << 30) == 2 * block  # not 8: six slabs were touched
    store.close()


@needs_populate
async def test_the_background_task_keeps_the_latest_class_ahead_until_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefault, "AHEAD_BYTES", 12 * MB)
    store = BlockStore(64 * MB)
    assert store.put(h(1), b"\x02" * MB)
    arena = store.classes[MB][MEMORY]
    task = asyncio.create_task(keep_faulted_in(store))
    async with asyncio.timeout(10):
        while arena.ahead_bytes() < 12 * MB:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert arena.ahead_bytes() == 12 * MB  # and no further: AHEAD_BYTES bounds it
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.get(h(1)) == b"\x02" * MB
    store.close()
