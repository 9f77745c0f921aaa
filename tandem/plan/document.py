"""The profile document `tandem plan profile` writes: versioned, typed, msgspec-checked.

Times are seconds, medians of repeated measurements. A reader checks `version` first: a
document of another version is refused, not guessed at.
"""

from __future__ import annotations

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
