"""The KV connector's saving side (a decode node): its running sequences' KV stored in the
kvcache service as they grow, and records of how far each one is stored.

After each step the engine hands over the blocks it filled (every `--checkpoint-every` of a
sequence, and at its end) and the partial last blocks (tails) that grew; both go to their
uploaders (`shared.kvclient`) from the event loop, never in the engine's way.

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
from collections.abc import Awaitable, Callable, Sequence

from opentelemetry.trace import SpanContext

from shared.bus.ids import AttemptId
from shared.bus.journal import RequestJournal
from shared.bus.messages import CheckpointRecord
from shared.engine.interface import EngineCore
from shared.engine.types import CheckpointPoint
from shared.kvclient.tails import TailUploader
from shared.kvclient.uploader import BlockUploader
from shared.tasks import WakeLoop
from shared.telemetry.metrics import NodeMetrics

log = logging.getLogger("tandem.decode.checkpoints")

WRITE_TIMEOUT = 2.0


class CheckpointWriter:
    def __init__(
        self,
        journal: RequestJournal,
        node_id: str,
        running: Callable[[str], bool],
        pin: Callable[[AttemptId, list[bytes]], Awaitable[None]] | None = None,
    ) -> None:
        self.journal = journal
        self.node_id = node_id
        self.running = running  # is the request still running here (else: no record)
        # keeps a recorded checkpoint's blocks in the kvcache service while the request runs
        self.pin = pin
        self.latest: dict[str, CheckpointPoint] = {}
        self.covered: dict[str, int] = {}  # request -> tokens its last written record covers
        self.written = 0
        self.failed = 0
        self._loop = WakeLoop(self._round)

    def stored(self, points: list[CheckpointPoint]) -> None:
        """The blocks behind these points are stored: record them (latest per request)."""
        for point in points:
            self.latest[point.request_id] = point
        if points:
            self._loop.wake()

    def start(self) -> CheckpointWriter:
        self._loop.start()
        return self

    async def _round(self) -> None:
        """The latest point of every sequence still running here, a record each."""
        while self.latest:
            rid = next(iter(self.latest))
            point = self.latest.pop(rid)
            if not self.running(rid):
                continue  # finished or moved: the router forgets the request anyway
            record = CheckpointRecord(
                attempt_id=AttemptId(rid),
                node_id=self.node_id,
                num_tokens=point.num_tokens,
                block_hashes=[bytes(h) for h in point.block_hashes],
                output_ids=point.output_ids,
            )
            try:
                await asyncio.wait_for(self.journal.put_checkpoint(record), WRITE_TIMEOUT)
                self.written += 1
                if self.running(rid):  # (it may have ended while the record was written)
                    self.covered[rid] = point.num_tokens
                if self.pin is not None:  # the blocks a failover would load: not evicted
                    await asyncio.wait_for(self.pin(record.attempt_id, record.block_hashes), 2)
            except Exception as exc:  # a later record supersedes it
                self.failed += 1
                log.debug("checkpoint record of %s not written: %r", rid, exc)

    async def close(self) -> None:
        await self._loop.close()


class Checkpointing:
    """A decode worker's part: what its steps fill goes to kvcache (blocks, then their
    records; tails), when an uploader is given for each."""

    def __init__(
        self,
        engine: EngineCore,
        running_contexts: Callable[[], list[SpanContext]],
        uploader: BlockUploader | None,
        tails: TailUploader | None,
        records: CheckpointWriter | None,
    ) -> None:
        self.engine = engine
        self.running_contexts = running_contexts  # of the running streams' spans: links
        self.loop = asyncio.get_running_loop()  # built inside the service coroutine
        # Blocks this node fills (generated tokens) go to the kvcache service, so the next
        # turn of a conversation finds its whole history cached.
        self.uploader = uploader
        engine.exchange.collect_filled = uploader is not None
        self.records = records  # of how far each sequence is stored, once it is
        # And each running sequence's partial last block after every step: a resume
        # elsewhere then recomputes one token, not up to a block.
        self.tails = tails
        engine.tails.collect = tails is not None
        self.unpinning: dict[bool, set[AttemptId]] = {False: set(), True: set()}
        self._unpins = WakeLoop(self._unpin_round)
        if tails is not None:
            tails.on_lost = engine.tails.resend

    def add_metrics(self, metrics: NodeMetrics) -> None:
        if self.records is not None:
            metrics.gauge(
                "tandem_checkpoint_lag_tokens",
                "Most tokens of one running sequence not covered by its last checkpoint "
                "record (a resume recomputes them, less what its stored tail covers)",
                self.checkpoint_lag,
            )
        tails = self.tails
        if tails is None:
            return
        metrics.gauge(
            "tandem_checkpoint_tails_stored", "Partial blocks stored", lambda: tails.stored
        )
        metrics.gauge(
            "tandem_checkpoint_tails_lost",
            "Partial blocks the store could not extend: sent again whole",
            lambda: tails.lost,
        )

    def checkpoint_lag(self) -> int:
        """Read from the metrics server's thread (a racing step makes it a step stale);
        the queued have nothing to lose yet."""
        assert self.records is not None
        covered = self.records.covered
        running = self.engine.running_tokens()
        return max((n - covered.get(rid, 0) for rid, n in running.items()), default=0)

    def start(self) -> None:
        if self.uploader is not None:
            self.uploader.start()
        if self.tails is not None:
            self.tails.start()
        if self.records is not None:
            self.records.start()
        self._unpins.start()

    def take(self) -> None:
        """On the engine thread, right after a step: take what it filled (before reuse)
        and hand it to the event loop."""
        if self.uploader is not None:
            hashes, blocks = self.engine.exchange.take_filled_blocks()
            points = self.engine.exchange.take_checkpoint_points()
            if hashes:
                self.loop.call_soon_threadsafe(self._store, hashes, blocks, points)
        if self.tails is not None:
            tails = self.engine.tails.take()
            if tails:
                self.loop.call_soon_threadsafe(self.tails.submit, tails)

    def _store(
        self, hashes: Sequence[bytes], blocks: list[memoryview], points: list[CheckpointPoint]
    ) -> None:
        """On the event loop (it owns the streams' spans): hand filled blocks to the
        uploader, linked to the requests running now (those that filled them); once stored,
        their sequences' checkpoint records follow."""
        assert self.uploader is not None
        running = self.running_contexts()
        writer = self.records
        after = (lambda: writer.stored(points)) if writer is not None and points else None
        self.uploader.submit(hashes, blocks, running, on_stored=after)

    def forget(self, request_id: str, over: bool) -> None:
        """The request left this node: a tail of it still pending is not written, and its
        checkpoint's pins are released: this node's (it went on elsewhere), or every node's
        (`over`: the request ended)."""
        if self.tails is not None:
            self.tails.forget(request_id)
        if self.records is not None:
            self.records.covered.pop(request_id, None)
        if self.records is not None and self.records.pin is not None:
            self.unpinning[over].add(AttemptId(request_id))
            self._unpins.wake()

    async def _unpin_round(self) -> None:
        """The left requests' pins, released in a message or two per kvcache node."""
        if self.uploader is None:
            return
        for over in (False, True):
            left, self.unpinning[over] = sorted(self.unpinning[over]), set()
            if not left:
                continue
            try:
                await asyncio.wait_for(self.uploader.client.unpin(left, over), 5)
            except Exception as exc:  # again shortly (the pins' lease is the last resort)
                log.warning("unpin of %d requests failed, retrying: %r", len(left), exc)
                self.unpinning[over].update(left)
                await asyncio.sleep(0.5)
                self._unpins.wake()

    async def close(self) -> None:
        if self.uploader is not None:
            await self.uploader.drain(2.0)
            await self.uploader.close()
        if self.tails is not None:
            await self.tails.close()
        if self.records is not None:
            await self.records.close()
        await self._unpins.close()
