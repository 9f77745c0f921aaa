"""A decode node's rule for prefilling a request itself, which the planner's simulated
decode nodes follow too (tandem/plan/simengine.py): a pure function, apart from the node's
I/O (services/decode/local_prefill.py)."""

from __future__ import annotations


def local_prefill_refusal(free_blocks: int, context_blocks: int, draining: bool) -> str | None:
    """Why a decode node refuses to prefill a request itself (the router sent it here: its
    prefix is cached here, or a conditional router chose this path), or None when it takes
    it: not while it drains, and only with room for the context's blocks and one more (its
    next token). `free_blocks`: free beyond those promised to arrivals under way. The real
    node (services/decode/local_prefill.py) and the simulated one (tandem/plan/simengine.py)
    both ask this; refused, the router sends the request the usual way
    (`placement.after_local_refusal`)."""
    if draining:
        return "draining"
    if free_blocks < context_blocks + 1:
        return "not enough free KV blocks"
    return None
