"""A data-plane receiver in a process of its own, for `tandem plan profile`'s transfer
points: KV moves between two processes in a deployment, so it is measured that way.

    python -m tandem.plan.transfer_peer tcp|ucx

Prints its listener's address on one line, then receives until killed, into one reused
buffer per size (as a node receives into its pool), keeping nothing.
"""

from __future__ import annotations

import asyncio
import sys

from shared.transport.base import BufferHandler
from shared.transport.factory import make_transport
from shared.transport.frames import TransferHeader


class ReusedBuffers(BufferHandler):
    def __init__(self) -> None:
        super().__init__()
        self.buffers: dict[int, memoryview] = {}

    def allocate(self, header: TransferHeader) -> memoryview:
        if header.nbytes > self.max_bytes:
            return super().allocate(header)  # refused there, with its reason
        if header.nbytes not in self.buffers:
            self.buffers[header.nbytes] = memoryview(bytearray(header.nbytes))
        return self.buffers[header.nbytes]

    async def complete(self, header: TransferHeader, payload: memoryview) -> None:
        return None


async def serve(kind: str) -> None:
    transport = make_transport(kind)
    await transport.start(ReusedBuffers())
    print(transport.address, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
