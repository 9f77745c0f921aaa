"""`tandem purge-kv --producer NODE`: drop every KV block a node stored in the kvcache service.

The kvcache service keeps the first block stored under a hash and serves it to every request
whose prefix has that hash, so a faulty or compromised node could serve bad KV to others
through it. Each block remembers which node stored it; this asks every kvcache node in the
registry to drop that node's blocks. NATS credentials as for the services (an operator's:
no node role may publish the purge subject, shared/bus/permissions.py).
"""

from __future__ import annotations

import argparse
import asyncio

from shared.bus.auth import BusAuth
from shared.bus.client import Bus
from shared.bus.messages import KVPurge, KVPurgeReply, decode, encode
from shared.bus.registry import NodeRegistry
from shared.bus.topology import kvcache_subject
from shared.runtime.options import add_nats_auth_options, add_option

TIMEOUT = 10.0


async def purge(args: argparse.Namespace) -> int:
    bus = await Bus(args.nats, "purge-kv", BusAuth.from_args(args)).connect()
    try:
        assert bus.nc is not None
        nodes = await (await NodeRegistry(bus).start()).nodes()
        kvcache = sorted(n.node_id for n in nodes.values() if n.role == "kvcache")
        if not kvcache:
            print("no kvcache node is registered")
            return 1
        failed = 0
        for node in kvcache:
            ask = encode(KVPurge(producer=args.producer))
            try:
                msg = await bus.nc.request(kvcache_subject(node, "purge"), ask, timeout=TIMEOUT)
                reply = decode(msg.data, KVPurgeReply)
            except Exception as exc:  # one node down: say so, purge the others
                print(f"{node}: no answer ({exc!r})")
                failed += 1
                continue
            print(f"{node}: {reply.error}" if reply.error else f"{node}: {reply.removed} removed")
            failed += bool(reply.error)
        return 1 if failed else 0
    finally:
        await bus.close()


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("purge-kv", help="drop the KV blocks a node stored in the kvcache service")
    add_option(p, "--nats", default="nats://127.0.0.1:4222", help="NATS server URL")
    add_nats_auth_options(p)
    p.add_argument("--producer", required=True, help="node id whose blocks to drop")
    p.set_defaults(func=lambda args: asyncio.run(purge(args)))
