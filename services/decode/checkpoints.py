"""Checkpoint records: how far each running sequence's KV is stored in the kvcache service.

After the uploader reports a sequence's handed-over blocks stored, the decode node writes
a CheckpointRecord to the request journal (`ckpt.<request id>`): the positions covered,
the block hashes, and the tokens generated so far (with the seed, the sampler's whole
state, since draws are keyed by (seed, position)). A router resuming the request after
its router died starts from the longest output it knows, this record's or its journal's.

Writes coalesce per request (only the latest record matters), run one at a time in the
background, and are bounded: the decode loop never waits on them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from shared.bus.journal import RequestJournal
from shared.bus.messages import CheckpointRecord
from shared.engine.block_exchange import CheckpointPoint
from shared.tasks import cancel_and_wait

log = logging.getLogger("tandem.decode.checkpoints")

WRITE_TIMEOUT = 2.0


class CheckpointWriter:
    def __init__(
        self, journal: RequestJournal, node_id: str, running: Callable[[str], bool]
    ) -> None:
        self.journal = journal
        self.node_id = node_id
        self.running = running  # is the request still running here (else: no record)
        self.latest: dict[str, CheckpointPoint] = {}
        self.written = 0
        self.failed = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def stored(self, points: list[CheckpointPoint]) -> None:
        """The blocks behind these points are stored: record them (latest per request)."""
        for point in points:
            self.latest[point.request_id] = point
        if points:
            self._wake.set()

    def start(self) -> CheckpointWriter:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.latest:
                rid = next(iter(self.latest))
                point = self.latest.pop(rid)
                if not self.running(rid):
                    continue  # finished or moved: the router forgets the request anyway
                record = CheckpointRecord(
                    request_id=rid,
                    node_id=self.node_id,
                    num_tokens=point.num_tokens,
                    block_hashes=[bytes(h) for h in point.block_hashes],
                    output_ids=point.output_ids,
                    seed=point.seed,
                )
                try:
                    await asyncio.wait_for(self.journal.put_checkpoint(record), WRITE_TIMEOUT)
                    self.written += 1
                except Exception as exc:  # a later record supersedes it
                    self.failed += 1
                    log.debug("checkpoint record of %s not written: %r", rid, exc)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
