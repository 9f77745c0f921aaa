"""`tandem plan project`: a profile (shared/costs/profile.py) for hardware that is not here, from a
hardware description and a model's config.json, by roofline formulas. Every figure is an
estimate; the document's `projection` says so and what was assumed.

One instance spans G GPUs of a node, tensor-parallel with ideal scaling (the all-reduces
are not costed). With P_f the parameters a forward multiplies by (all but the embedding
table, which is only indexed, unless it is also the LM head), n layers, d_attn = heads ·
head_dim, d_kv = kv_heads · head_dim, w = 2 bytes a value (bf16), η the efficiencies:

- KV bytes per token:   k = 2 · n · d_kv · w                        (K and V, every layer)
- prefill of B × L:     F = B · (2 · P_f · L + 2 · n · L² · d_attn)  (matmuls; causal QKᵀ, AV)
                        time = max(F / (G · peak · η_c),
                                   (P_f · w + B · L · k) / (G · bw · η_m)) + overhead
                        (never faster than reading the weights once and writing the KV)
- decode step, B × C:   bytes = P_f · w + B · C · k                 (weights, then each KV)
                        F = B · (2 · P_f + 4 · n · C · d_attn)
                        time = max(bytes / (G · bw · η_m), F / (G · peak · η_c)) + overhead
- KV transfer of S:     time = latency + S / (interconnect · η_n)

The hardware's defaults below say why each value was chosen.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import msgspec

from shared.costs.profile import (
    PROFILE_VERSION,
    DecodePoint,
    Machine,
    PrefillPoint,
    Profile,
    Projection,
    TransferPoint,
)
from shared.runtime.options import add_option

NOTE = "projection: roofline estimate, not a measurement"
DTYPE, DTYPE_BYTES = "bfloat16", 2
TRANSPORT = "rdma"
# config.json keys without a default (num_key_value_heads, head_dim and tie_word_embeddings
# have one: heads, hidden / heads and false)
REQUIRED = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)

Positive = Annotated[float, msgspec.Meta(gt=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]


class Hardware(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One node type, as a JSON file describes it (peaks are per GPU, from datasheets)."""

    name: str
    gpus: Annotated[int, msgspec.Meta(ge=1)]  # accelerators per node
    peak_flops: Positive  # dense bf16 FLOP/s (not the 2:4-sparsity figure)
    memory_bandwidth: Positive  # bytes/s
    memory_bytes: Positive
    interconnect_bandwidth: Positive  # bytes/s, node to node: what the KV crosses
    # Large prefill GEMMs reach about half of peak once attention, norms and
    # activations are counted (serving engines report 50-60% MFU on prefill).
    compute_efficiency: Fraction = 0.55
    # Decode's weight-streaming GEMVs and paged-attention reads reach 70-80% of HBM peak.
    bandwidth_efficiency: Fraction = 0.75
    # RDMA on large messages runs near line rate; headers and flow control take ~10%.
    network_efficiency: Fraction = 0.9
    # An RDMA round trip plus the rendezvous that starts a transfer: some microseconds.
    network_latency: Annotated[float, msgspec.Meta(ge=0)] = 10e-6
    # Every forward pays kernel launches (~10 kernels a layer at a few µs each), the
    # scheduler's Python and sampling: about 2 ms a step without CUDA graphs.
    step_overhead: Annotated[float, msgspec.Meta(ge=0)] = 2e-3
    source: str = ""  # where the numbers come from


@dataclass(frozen=True)
class ModelShape:
    """The architectural numbers of a Llama-style decoder (an HF config.json's)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str) -> ModelShape:
        if any(k in config for k in ("num_local_experts", "num_experts", "n_routed_experts")):
            raise ProjectionError(f"{name}: mixture-of-experts models are not modelled")
        missing = [k for k in REQUIRED if k not in config]
        if missing:
            raise ProjectionError(f"{name}: config lacks {', '.join(missing)}")

        def count(key: str, default: int | None = None) -> int:
            value = config.get(key)
            if value is None and default is not None:
                return default
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProjectionError(f"{name}: {key} must be a positive integer, not {value!r}")
            return value

        hidden, heads = count("hidden_size"), count("num_attention_heads")
        return cls(
            name=name,
            layers=count("num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=count("num_key_value_heads", heads),
            head_dim=count("head_dim", hidden // heads),
            intermediate=count("intermediate_size"),
            vocab=count("vocab_size"),
            tied=config.get("tie_word_embeddings", False) is True,
        )

    @property
    def parameters(self) -> int:
        """Embeddings, per layer q, k, v, o, gate, up, down and two norms, final norm, head."""
        d_attn, d_kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (2 * d_attn + 2 * d_kv)
        mlp = 3 * self.hidden * self.intermediate
        layer = attention + mlp + 2 * self.hidden
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * layer + self.hidden + head

    @property
    def forward_parameters(self) -> int:
        """P_f: the parameters a forward reads and multiplies by (an untied table is indexed)."""
        return self.parameters - (0 if self.tied else self.vocab * self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES


class ProjectionError(Exception):
    """A description or config that cannot be projected from; the message says why."""


@dataclass(frozen=True)
class Grid:
    prefill_tokens: tuple[int, ...] = tuple(1 << i for i in range(6, 16))  # 64 .. 32768
    prefill_batches: tuple[int, ...] = (2, 4, 8, 16)  # at the middle prompt length
    decode_batches: tuple[int, ...] = tuple(1 << i for i in range(10))  # 1 .. 512
    decode_contexts: tuple[int, ...] = tuple(1 << i for i in range(7, 16))  # 128 .. 32768
    transfer_bytes: tuple[int, ...] = tuple(1 << i for i in range(16, 34))  # 64 KiB .. 8 GiB


GRID = Grid()  # wide enough for GPU-scale simulation


@dataclass(frozen=True)
class Roofline:
    hardware: Hardware
    model: ModelShape
    gpus: int

    def _compute(self, flops: float) -> float:
        hw = self.hardware
        return flops / (self.gpus * hw.peak_flops * hw.compute_efficiency)

    def _memory(self, nbytes: float) -> float:
        hw = self.hardware
        return nbytes / (self.gpus * hw.memory_bandwidth * hw.bandwidth_efficiency)

    @property
    def weight_bytes(self) -> int:
        return self.model.forward_parameters * DTYPE_BYTES

    def prefill(self, tokens: int, batch: int = 1) -> float:
        m = self.model
        flops = batch * (
            2 * m.forward_parameters * tokens + 2 * m.layers * tokens**2 * m.heads * m.head_dim
        )
        written = self.weight_bytes + batch * tokens * m.kv_bytes_per_token
        return max(self._compute(flops), self._memory(written)) + self.hardware.step_overhead

    def decode(self, batch: int, context: int) -> float:
        m = self.model
        read = self.weight_bytes + batch * context * m.kv_bytes_per_token
        flops = batch * (2 * m.forward_parameters + 4 * m.layers * context * m.heads * m.head_dim)
        return max(self._memory(read), self._compute(flops)) + self.hardware.step_overhead

    def transfer(self, nbytes: int) -> float:
        hw = self.hardware
        return hw.network_latency + nbytes / (hw.interconnect_bandwidth * hw.network_efficiency)


def kv_transfer_example(hardware: Hardware, model: ModelShape, tokens: int) -> tuple[int, float]:
    """(bytes, seconds) to move `tokens` tokens of KV at the link's line rate, no latency:
    the back-of-envelope figure (80 layers x 8 KV heads x 128, 4,096 tokens: 1.34 GB,
    26.8 ms at 50 GB/s)."""
    nbytes = tokens * model.kv_bytes_per_token
    return nbytes, nbytes / hardware.interconnect_bandwidth


def project(
    hardware: Hardware,
    model: ModelShape,
    *,
    gpus: int | None = None,
    model_config: str = "",
    grid: Grid = GRID,
) -> Profile:
    """The profile `tandem plan profile` would measure on `hardware`, estimated."""
    used = hardware.gpus if gpus is None else gpus
    if not 1 <= used <= hardware.gpus:
        raise ProjectionError(f"--gpus must be 1 to {hardware.gpus} on {hardware.name}")
    roof = Roofline(hardware, model, used)
    if roof.weight_bytes > used * hardware.memory_bytes:
        raise ProjectionError(
            f"{model.name}'s weights ({roof.weight_bytes / 1e9:.0f} GB in {DTYPE}) do not fit"
            f" in {used} x {hardware.memory_bytes / 1e9:.0f} GB"
        )
    # every other number of the description, as it was used
    assumed = {
        k: v
        for k, v in msgspec.structs.asdict(hardware).items()
        if k in Projection.__struct_fields__ and k not in ("hardware", "gpus")
    }
    middle = grid.prefill_tokens[len(grid.prefill_tokens) // 2]
    shapes = [(t, 1) for t in grid.prefill_tokens] + [(middle, b) for b in grid.prefill_batches]
    return Profile(
        version=PROFILE_VERSION,
        machine=Machine(
            cpu=f"{used} x {hardware.name} (projected)",
            cpu_flags=[],
            cores=0,  # no CPU was measured
            device="cuda (projected)",
        ),
        model=model.name,
        dtype=DTYPE,
        threads=0,
        torch="n/a (projection)",
        kv_bytes_per_token=model.kv_bytes_per_token,
        prefill=[PrefillPoint(tokens=t, batch=b, seconds=roof.prefill(t, b)) for t, b in shapes],
        decode=[
            DecodePoint(batch=b, context=c, seconds=roof.decode(b, c))
            for c in grid.decode_contexts
            for b in grid.decode_batches
        ],
        transfer=[
            TransferPoint(transport=TRANSPORT, bytes=s, seconds=roof.transfer(s))
            for s in grid.transfer_bytes
        ],
        created=time.time(),
        projection=Projection(
            hardware=hardware.name,
            gpus=used,
            model_config=model_config,
            parameters=model.parameters,
            note=NOTE,
            **assumed,
        ),
    )


def _shipped(folder: str) -> list[str]:
    return sorted(
        f.name.removesuffix(".json")
        for f in resources.files("tandem.plan").joinpath(folder).iterdir()
        if f.name.endswith(".json")
    )


def _read(spec: str, folder: str) -> tuple[bytes, str]:
    """The bytes of a file path (a directory: its config.json) or of a shipped name."""
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path.read_bytes(), path.stem if path.name != "config.json" else path.parent.name
    if spec in _shipped(folder):
        return resources.files("tandem.plan").joinpath(folder, f"{spec}.json").read_bytes(), spec
    choices = ", ".join(_shipped(folder))
    raise ProjectionError(f"{spec!r} is neither a file nor a shipped {folder} name ({choices})")


def load_hardware(spec: str) -> Hardware:
    data, _ = _read(spec, "hardware")
    try:
        return msgspec.json.decode(data, type=Hardware)
    except msgspec.DecodeError as exc:
        raise ProjectionError(f"hardware {spec}: {exc}") from exc


def load_model_shape(spec: str) -> ModelShape:
    data, name = _read(spec, "models")
    try:
        config = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ProjectionError(f"model config {spec}: {exc}") from exc
    if not isinstance(config, dict):
        raise ProjectionError(f"model config {spec}: not a JSON object")
    return ModelShape.from_config(config, name)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("project", help="estimate a profile for hardware not here (roofline)")
    add_option(p, "--hardware", default="h100", help="shipped name (h100, h200) or JSON file")
    add_option(
        p, "--model-config", default="llama-8b", help="shipped name or an HF config.json path"
    )
    add_option(p, "--output", default="projected-profile.json", help="where the profile goes")
    add_option(p, "--tokens", type=int, default=4096, help="prompt length the summary shows")
    add_option(p, "--gpus", type=int, default=None, help="GPUs per instance (default: node's)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.tokens < 1:
            raise ProjectionError("--tokens must be at least 1")
        hardware = load_hardware(args.hardware)
        model = load_model_shape(args.model_config)
        profile = project(hardware, model, gpus=args.gpus, model_config=args.model_config)
        Path(args.output).write_bytes(msgspec.json.format(msgspec.json.encode(profile)))
    except (ProjectionError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(summary(hardware, model, profile, args.tokens))
    print(f"profile written to {args.output} (projection)")
    return 0


def summary(hardware: Hardware, model: ModelShape, profile: Profile, tokens: int) -> str:
    assert profile.projection is not None
    roof = Roofline(hardware, model, profile.projection.gpus)
    kv, line_rate = kv_transfer_example(hardware, model, tokens)
    eta, link = hardware.network_efficiency, hardware.interconnect_bandwidth
    rows = [
        ("parameters", f"{model.parameters / 1e9:.2f} B"),
        ("KV cache per token", f"{model.kv_bytes_per_token:,} bytes"),
        (f"prefill, {tokens} tokens", f"{roof.prefill(tokens) * 1e3:.1f} ms"),
        (f"decode step, batch 1, context {tokens}", f"{roof.decode(1, tokens) * 1e3:.2f} ms"),
        (f"decode step, batch 64, context {tokens}", f"{roof.decode(64, tokens) * 1e3:.2f} ms"),
        (f"KV of {tokens} tokens", f"{kv / 1e9:.3g} GB"),
        (f"KV transfer at {link / 1e9:.0f} GB/s line rate", f"{line_rate * 1e3:.1f} ms"),
        (f"KV transfer at {eta:.0%} of it, +latency", f"{roof.transfer(kv) * 1e3:.1f} ms"),
    ]
    head = f"{model.name} on {profile.projection.gpus} x {hardware.name}, {DTYPE}: {NOTE}"
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value:>16}  (projection)" for label, value in rows]
    return "\n".join([head, *lines])
