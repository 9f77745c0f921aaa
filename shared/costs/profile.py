"""The profile document `tandem plan profile` writes: versioned, typed, msgspec-checked.

Times are seconds, medians of repeated measurements. A reader checks `version` first: a
document of another version is refused, not guessed at.

`tandem plan project` writes the same document for hardware that is not here, from roofline
formulas; its `projection` says so and what it assumed. A measured profile has none (and a
document written before the field existed still reads: it is optional, at the end).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

import msgspec

PROFILE_VERSION = 1


class Machine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cpu: str
    cpu_flags: list[str]  # avx2, avx512*, amx*: what decides a dtype's speed on a CPU
    cores: int
    device: str


class PrefillPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tokens: int  # prompt tokens per sequence
    batch: int  # sequences prefilled together in one forward
    seconds: float


class DecodePoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    batch: int  # running sequences
    context: int  # tokens of KV each attends over
    seconds: float  # one engine step


class TransferPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    transport: str
    bytes: int
    seconds: float


KVCopyOp = Literal["export", "import", "load", "checkpoint"]
KV_COPY_OPS: tuple[KVCopyOp, ...] = get_args(KVCopyOp)


class KVCopyPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A copy of KV in or out of an engine's pool, on its engine thread (between steps:
    the streams of a decode node wait for it). `op` is one of KV_COPY_OPS:
    - export: a prefill node reads a prompt's KV out of its pool into the frame it ships;
    - import: a decode node checks such a frame and writes it into its pool (add_snapshot);
    - load: a prefix fetched from kvcache is placed into the pool as cached blocks;
    - checkpoint: a decode node copies its newly filled blocks out for kvcache.
    The network's share is the transfer points'."""

    op: KVCopyOp
    tokens: int
    seconds: float


class Projection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a projected profile assumed: its times are estimates, not measurements."""

    hardware: str  # the description's name, e.g. "NVIDIA H100 SXM 80GB"
    gpus: int  # accelerators one instance spans (tensor-parallel, ideal scaling)
    peak_flops: float  # per GPU, dense bf16 FLOP/s
    memory_bandwidth: float  # per GPU, bytes/s
    memory_bytes: float  # per GPU
    interconnect_bandwidth: float  # node to node, bytes/s (the KV transfer's link)
    compute_efficiency: float  # fraction of peak_flops reached (prefill, decode compute)
    bandwidth_efficiency: float  # fraction of memory_bandwidth reached (decode)
    network_efficiency: float  # fraction of interconnect_bandwidth reached
    network_latency: float  # seconds added to every transfer
    step_overhead: float  # seconds added to every forward (launches, scheduling)
    model_config: str  # the config.json it read: a path or a shipped name
    parameters: int
    note: str  # "projection: roofline estimate, not a measurement"


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    machine: Machine
    model: str
    dtype: str
    threads: int
    torch: str
    kv_bytes_per_token: int
    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    transfer: list[TransferPoint]
    created: float  # unix seconds
    projection: Projection | None = None  # set only by `tandem plan project`
    # Copies of KV on the engine thread; a profile written before they were measured has
    # none (and reads as before: the simulator then counts them as free).
    kv_copy: list[KVCopyPoint] = msgspec.field(default_factory=list)


def load_profile(data: bytes) -> Profile:
    """A profile document, checked; ValueError says what is wrong."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("version") != PROFILE_VERSION:
        found = raw.get("version") if isinstance(raw, dict) else None
        raise ValueError(f"profile version {found!r}, this Tandem reads {PROFILE_VERSION}")
    try:
        return msgspec.json.decode(data, type=Profile)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a Tandem profile: {exc}") from exc


def read_profile(path: str) -> Profile:
    """The profile document in a file, checked; ValueError names the file and the fault."""
    try:
        return load_profile(Path(path).read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
