"""A data-plane receiver in a process of its own, for `tandem plan profile`'s transfer
points: KV moves between two processes in a deployment, so it is measured that way.

    python -m tandem.plan.transfer_peer tcp|ucx

Prints its listener's address on one line, then receives until killed, into one reused
buffer per size (as a node receives into its pool), keeping nothing.
"""

from __future__ import annotations

import asyncio
import sys

from shared.transport.base import ReusedBuffers
from shared.transport.factory import make_transport


async def serve(kind: str) -> None:
    transport = make_transport(kind)
    await transport.start(ReusedBuffers())
    print(transport.address, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
