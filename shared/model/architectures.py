"""The model families the native engine serves, and how each is brought to one shape.

The runner (runner.py) computes a decoder layer as Llama does: RMS norms, separate q/k/v
projections (with or without bias), rotary on the whole head, an optional RMS norm of q and
k per head (Qwen3), a SiLU-gated MLP with separate gate and up projections. Each supported
family is that shape, or is made so here once at load:

| architecture | what differs from Llama | how it is served |
|---|---|---|
| LlamaForCausalLM | (Llama 3's RoPE scaling is in the model's own rotary module) | as is |
| MistralForCausalLM | nothing within its sliding window | as is; prompts past the window refused |
| Qwen2ForCausalLM | q/k/v projections with bias | as is (the projections carry it) |
| Qwen3ForCausalLM | q and k RMS-normed per head before rotary | as is (the runner applies them) |
| Phi3ForCausalLM | fused qkv and gate/up projections | split once into separate layers |

Anything else is refused at load with the list above. Each is checked greedy-identical to
`transformers` in tests/integration/test_architectures.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shared.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)


def check_architecture(archs: list[str]) -> str:
    """The supported architecture among `archs` (a config's), or ModelLoadError."""
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ModelLoadError(
        f"unsupported architecture {archs or 'unknown'}: the native engine serves "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def check_config(config: Any) -> None:
    """Refuse what the runner would compute wrongly rather than serve wrong tokens."""
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ModelLoadError("rotary on part of each head (partial_rotary_factor) is not served")
    act = str(getattr(config, "hidden_act", "silu"))
    if act != "silu":
        raise ModelLoadError(f"MLP activation {act!r} is not served (SiLU-gated MLPs only)")
    if getattr(config, "use_sliding_window", False) and getattr(config, "max_window_layers", 0):
        raise ModelLoadError("sliding-window attention layers are not served")


def max_context(config: Any) -> int:
    """The longest sequence served: the model's context, or its attention window if shorter
    (past the window the model attends to a window, the runner to everything)."""
    most = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    return min(most, int(window)) if window else most


def to_runner_shape(hf_model: Any) -> None:
    """Give every layer the modules the runner reads (separate q/k/v, gate and up, and
    `act_fn`), splitting fused projections (Phi-3) once."""
    for layer in hf_model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "qkv_proj") and not hasattr(attn, "q_proj"):
            cfg = hf_model.config
            head_dim = int(attn.head_dim)
            sizes = [cfg.num_attention_heads * head_dim, *[cfg.num_key_value_heads * head_dim] * 2]
            attn.q_proj, attn.k_proj, attn.v_proj = _split(attn.qkv_proj, sizes)
            del attn.qkv_proj
        if hasattr(mlp, "gate_up_proj") and not hasattr(mlp, "gate_proj"):
            half = mlp.gate_up_proj.out_features // 2
            mlp.gate_proj, mlp.up_proj = _split(mlp.gate_up_proj, [half, half])  # gate first
            del mlp.gate_up_proj
        if not hasattr(mlp, "act_fn"):
            mlp.act_fn = mlp.activation_fn


def _split(fused: nn.Linear, sizes: list[int]) -> list[nn.Linear]:
    """`fused`'s output rows as one linear layer per part, in order (copies, so the fused
    weight is freed)."""
    out, start = [], 0
    for size in sizes:
        part = nn.Linear(fused.in_features, size, bias=fused.bias is not None)
        part.to(device=fused.weight.device, dtype=fused.weight.dtype)
        with torch.no_grad():
            part.weight.copy_(fused.weight[start : start + size])
            if fused.bias is not None:
                part.bias.copy_(fused.bias[start : start + size])
        part.requires_grad_(False)
        out.append(part)
        start += size
    return out
