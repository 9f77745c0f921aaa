"""The `tandem` command: runs one service, the embedded stack, or a quick local generation."""

import os

__version__ = "0.1.0"

# Before anything imports torch (it reads this once): torch's CPU allocator asks for
# transparent huge pages on allocations of 2 MiB and more, i.e. the weights and the KV pool.
# A node then has ~500x fewer page-table entries, and a SIGKILLed one is torn down in a
# fraction of the time (1.1 GB: ~40 instead of ~160 ms), which is time its streams wait
# before anyone can tell it is gone. THP_MEM_ALLOC_ENABLE=0 turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
