"""Where a kvcache node may send blocks: the data-plane addresses of registered nodes.

A get (and a tail get, and a warm request) names the address the blocks go to. Any holder
of a node identity may send one, so without a check a compromised node could aim a kvcache
node's sends at any host and port it can reach (issue 49). A kvcache node sends only to an
address a prefill or decode node registered as its own data plane (draining ones too: they
still load checkpoints for the streams they finish).

The registry view is `CachedNodes`': read again when an address is not in it (a node that
registered since) or when it is older than `max_age`, at most once every `min_interval`,
so a stream of gets naming strangers costs one registry read a second, not one each; a
registry that cannot be read keeps the last view.
"""

from __future__ import annotations

from shared.bus.messages import NodeInfo
from shared.bus.registry import CachedNodes, NodeRegistry

SENDING_ROLES = ("prefill", "decode")
NOT_A_PEER = "the reply address is no registered node's data plane"


class Peers:
    def __init__(
        self, registry: NodeRegistry, min_interval: float = 1.0, max_age: float = 30.0
    ) -> None:
        self.view = CachedNodes(registry, refresh=max_age, min_interval=min_interval)
        self.refused = 0

    async def allows(self, address: str) -> bool:
        """Whether `address` is a registered node's data plane (counted when not)."""
        if address in self._addresses(await self.view.nodes()):
            return True
        if address in self._addresses(await self.view.nodes(fresh=True)):
            return True
        self.refused += 1
        return False

    @staticmethod
    def _addresses(nodes: dict[str, NodeInfo]) -> set[str]:
        return {
            n.data_address for n in nodes.values() if n.role in SENDING_ROLES and n.data_address
        }
