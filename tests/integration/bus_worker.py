"""Child process for the work-queue test: take one prefill job, report it, never ack it.

Run as `python -m tests.integration.bus_worker NATS_URL`; prints `got <request_id>` and then
sleeps until killed, so the parent can SIGKILL it while the job is unacknowledged.
"""

from __future__ import annotations

import asyncio
import sys

from shared.bus.client import Bus
from shared.bus.workqueue import JobConsumer


async def main(url: str) -> None:
    bus = await Bus(url, "doomed-worker").connect()
    consumer = await JobConsumer(bus).start()
    while True:
        jobs = await consumer.fetch(batch=1, timeout=1.0)
        if jobs:
            print(f"got {jobs[0].job.attempt_id}", flush=True)
            await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
