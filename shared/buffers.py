"""Large byte buffers without the cost of zeroing them.

`bytearray(n)` zero-fills, and a large one is freed back to the OS, so every 90 MB KV
payload (a 2,048-token context) faulted in and zeroed every 4 KiB page again: ~100 ms to
allocate and fill here, measured on the kvcache node's get and again on the receiving
node. A numpy array is left uninitialised, and numpy asks for transparent huge pages for
large ones: allocating and filling 90 MB took ~20 ms (the first one in a process ~150 ms).

Every byte of such a buffer is written before anyone reads it: a transfer's receive buffer
is filled whole and verified before it is used (a failed transfer's buffer is dropped), a
get's payload is cut to the blocks copied into it, and an export frame is its header plus
a payload the gather that follows fills whole (the alignment slack around it is never
part of the frame). Nothing stale can leave the process.
"""

from __future__ import annotations

import mmap

import numpy as np

PAGE = mmap.PAGESIZE


def uninitialised(nbytes: int) -> memoryview:
    """A writable byte buffer (format "B") of `nbytes` whose contents are undefined."""
    return np.empty(nbytes, dtype=np.uint8).data


def release_pages(mapping: mmap.mmap, lo: int, hi: int, advice: int) -> None:
    """`madvise(advice)` the pages wholly inside bytes `lo`..`hi` of `mapping` (those
    shared with a neighbouring range are kept): handing a slab's or a block's memory back
    to the system."""
    start, end = -(-lo // PAGE) * PAGE, hi // PAGE * PAGE
    if end > start:
        mapping.madvise(advice, start, end - start)
