"""Tandem's CPU kernels (`csrc/cpu_kernels.cpp`), compiled for this machine on first use and
cached: decode attention read in place from the paged KV cache, fused RMSNorm (with the
residual add) and rotary embedding (with the KV cache write), and a linear layer for a few
rows (`small_linear`: one sequential pass over the weight; cpu_gemm.py times it against
the libraries and says where it serves). (A fused SiLU-times-up was
dropped: its scalar `exp` made it slower than torch's vectorised `silu` at every size.)

Why: the portable decode path gathers every sequence's blocks into a contiguous copy per
layer and runs SDPA over the copy; on CPU that copy and the attention over it were 22% of a
decode step at batch 16, and the Python and dispatch time between ~45 small ops per layer
another 12% (docs/benchmarks-log.md, "Where a step's time goes"). The kernels read each key and
value once, where it lies, and do each layer's small ops in four calls.

Where they apply: CPU, float32, when a C++ compiler is present. It is built with
`-march=native`, so the cached library is keyed by the CPU's flags (machines differ between
runs) as well as by the source, torch and the compiler. Everything else (CUDA, bfloat16,
no compiler, a failed build) keeps the portable torch ops, and `TANDEM_CPU_KERNELS=off`
forces them (CUDA never takes this path).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from shared.model.convert import cache_root

log = logging.getLogger("tandem.model")

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
BUILD_TIMEOUT = 600.0  # seconds; a build takes ~10 s on 2 cores
ENV_SWITCH = "TANDEM_CPU_KERNELS"  # "on" (default where they apply) or "off"

_lock = threading.Lock()
_loaded: Any = None
_tried = False


def wanted() -> bool:
    choice = os.environ.get(ENV_SWITCH, "on").strip().lower()
    if choice not in ("on", "off"):
        raise ValueError(f"{ENV_SWITCH} must be 'on' or 'off', not {choice!r}")
    return choice == "on"


def load(device: torch.device, dtype: torch.dtype) -> Any:
    """The kernels (`torch.ops.tandem`: paged_decode_attention, rms_norm, add_rms_norm,
    rope_store, small_linear) for a model on `device` in `dtype`, or None when the portable
    torch ops must serve (not CPU float32, switched off, or they could not be built)."""
    if device.type != "cpu" or dtype != torch.float32 or not wanted():
        return None
    global _loaded, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                torch.ops.load_library(str(build()))
                _loaded = torch.ops.tandem
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("CPU kernels unavailable, using the portable torch ops: %s", exc)
        return _loaded


def _machine_key(flags: list[str]) -> str:
    """What the compiled code depends on: source, torch, compiler, its flags and the CPU's."""
    try:
        cpu = next(
            (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")),
            "",
        )
    except OSError:
        cpu = ""
    compiler = _compiler()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__, version, " ".join(flags), cpu):
        digest.update(part if isinstance(part, bytes) else part.encode())
    return digest.hexdigest()[:20]


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r}; set CXX, or install g++)")
    return cxx


def build() -> Path:
    """The kernels' shared library for this machine, compiled if not cached yet. Several
    processes may build at once: each writes its own temporary file and renames it."""
    from torch.utils.cpp_extension import include_paths, library_paths

    lib_dirs = library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [
        "-O3",
        # Reassociation lets the compiler vectorise the dot products' sums; not -ffast-math,
        # which would also link code that flushes denormals to zero for the whole process.
        "-fassociative-math",
        "-fno-signed-zeros",
        "-fno-trapping-math",
        "-march=native",
        "-fopenmp",  # at::parallel_for's pragma; resolves to torch's own libgomp at load
        "-std=c++17",
        "-shared",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include_paths()),
    ]
    out_dir = cache_root() / "kernels"
    target = out_dir / f"cpu_kernels-{_machine_key(flags)}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    cmd = [
        _compiler(),
        *flags,
        str(SOURCE),
        "-o",
        tmp,
        *(f"-L{p}" for p in lib_dirs),
        *(f"-Wl,-rpath,{p}" for p in lib_dirs),
        "-lc10",
        "-ltorch_cpu",
    ]
    log.info("building the CPU kernels for this CPU (once, ~10 s)")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if done.returncode != 0:
            raise RuntimeError(f"kernel build failed: {done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
