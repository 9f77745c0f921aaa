"""The linear layers' weights prepacked for oneDNN, for CPU float32 GEMMs.

Why: torch's CPU `linear` calls MKL's sgemm, which on AMD CPUs is far from the memory
bandwidth and the FLOP rate the same CPU gives oneDNN (the library vLLM-CPU's linear layers
use). Measured on an AMD EPYC (Zen 4, AVX-512), 2 threads, SmolLM2-135M's shapes: the LM
head (49,152 x 576) took 13.1 ms at 1 row and 27.1 ms at 16 through MKL against 6.9 and
8.7 ms through oneDNN with its weight reordered once; a 1,536 x 576 projection 0.35 against
0.18 ms at 16 rows, 13.6 against 9.5 ms at 1,024 (docs/benchmarks.md, "oneDNN GEMMs").

The packed weights are copies made once when the model runner is built, in anonymous
memory (the 513 MB of SmolLM2-135M's linear weights in float32); the modules keep their own, so the
transformers model stays usable as it was (the tests' reference). Loaded from safetensors,
those originals are pages of the mapped file that nothing reads any more (the embedding's
rows aside): resident until the kernel needs the memory, then reclaimed like page cache.
The results differ from MKL's in the last bits (another summation order), as any two GEMM
libraries do; the greedy identity tests hold.

Where it applies: CPU, float32, a torch built with oneDNN. `TANDEM_CPU_GEMM=torch` keeps
torch's own `linear` (MKL, or whatever the build uses); CUDA never takes this path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

ENV_SWITCH = "TANDEM_CPU_GEMM"  # "onednn" (default where it applies) or "torch"

Linear = Callable[[torch.Tensor], torch.Tensor]


def wanted() -> bool:
    choice = os.environ.get(ENV_SWITCH, "onednn").strip().lower()
    if choice not in ("onednn", "torch"):
        raise ValueError(f"{ENV_SWITCH} must be 'onednn' or 'torch', not {choice!r}")
    return choice == "onednn"


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


def linears(modules: list[Any], device: torch.device, dtype: torch.dtype) -> dict[Any, Linear]:
    """Each module's linear function: a packed copy's where it applies, else the module."""
    if not applies(device, dtype):
        return {m: m for m in modules}
    return {m: PackedLinear(m) for m in modules}
