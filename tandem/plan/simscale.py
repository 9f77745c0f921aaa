"""Nodes that come and go during a simulation (simulator.py), as an autoscaler adds and
removes them: a mixin of `Simulation`, compiled with it (tandem/plan/compiled.py).

- `add_node(role)`: a node of that role, after `starting` seconds (a process loading its
  model): its first heartbeat then brings it into the router's table, as a real node's
  first registry entry does.
- `drain_node(node_id)`: the node's heartbeats say draining from now on, so the router
  sends it nothing new and the prefill nodes hand it no KV (`offer_order` skips it, as
  services/prefill/handoff.py does); it finishes what it holds, then leaves the table and
  the simulation (its registry entry expires).

Which nodes to add or drain, and when, is the driver's (tandem/plan/autoscale_sim.py: the
autoscaler's own policies). Without it nothing here runs, and a simulation is what it was.
"""

from __future__ import annotations

from services.router.nodes import NodeTable
from shared.costs.model import CostModel
from tandem.plan.simengine import SimEngine
from tandem.plan.simnodes import DecodeNode, PrefillNode
from tandem.plan.simprefill import PrefillSide


class ScalingSide(PrefillSide):
    """`Simulation`'s nodes added and drained while it runs (one chain of bases: mypyc
    compiles no multiple inheritance but of traits)."""

    prefillers: dict[str, PrefillNode]
    nodes: NodeTable
    starting: dict[str, str]  # node id -> role, of nodes added and not up yet
    decode_costs: CostModel
    numbered: dict[str, int]  # role -> nodes of it made so far (the next one's number)

    # Simulation's (defined here, not declared under TYPE_CHECKING: mypyc compiles no
    # conditional methods)
    def _set_info(self, node_id: str) -> None:
        raise NotImplementedError

    def _heartbeat(self, node_id: str) -> None:
        raise NotImplementedError

    def add_node(self, role: str, starting: float) -> str:
        """Start a node of `role` (decode or prefill); up after `starting` seconds."""
        number = self.numbered[role]
        self.numbered[role] = number + 1
        node_id = f"{role}-{number}"
        self.starting[node_id] = role
        self.at(self.now + starting, self._node_up, node_id)
        return node_id

    def _node_up(self, node_id: str) -> None:
        role = self.starting.pop(node_id, "")
        if role == "decode":
            engine = SimEngine(
                self.topology.decode_engine, self.decode_costs, self.topology.kvcache > 0
            )
            self.decoders[node_id] = DecodeNode(node_id, engine)
        elif role == "prefill":
            engine = SimEngine(self.topology.prefill_engine, self.transfer_costs)
            self.prefillers[node_id] = PrefillNode(node_id, engine)
        else:
            return  # drained before it came up
        self._set_info(node_id)
        self.at(self.now + self.topology.heartbeat, self._heartbeat, node_id)

    def drain_node(self, node_id: str) -> None:
        """Take no new work, finish what it holds, then leave."""
        if self.starting.pop(node_id, None) is not None:
            return  # never came up: nothing to finish
        if node_id not in self.decoders and node_id not in self.prefillers:
            return
        self.draining.add(node_id)
        self._set_info(node_id)  # the router hears it at once, as a node's own put
        self.retire_if_idle(node_id)

    def retire_if_idle(self, node_id: str) -> None:
        """A draining node holding nothing leaves the simulation and the router's table."""
        if node_id not in self.draining:
            return
        decoder = self.decoders.get(node_id)
        if decoder is not None:
            if decoder.stepping or decoder.engine.scheduler.has_unfinished() or decoder.records:
                return
            del self.decoders[node_id]
        else:
            prefiller = self.prefillers.get(node_id)
            if prefiller is None or prefiller.holding:
                return
            del self.prefillers[node_id]
        self.draining.discard(node_id)
        self.nodes.drop(node_id)

    def live(self, role: str) -> list[str]:
        """Node ids of `role` in the simulation now (draining ones included)."""
        return list(self.decoders if role == "decode" else self.prefillers)
