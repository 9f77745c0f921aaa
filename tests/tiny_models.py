"""Tiny randomly initialised checkpoints of the model families the tests serve, saved from
`transformers` configs with a fixed seed (no download), with the real model's tokenizer.

The native engine's families (tests/integration/test_architectures.py) and what vLLM's
engine serves through the stack beyond them (tests/e2e/test_vllm_engine.py: a MoE)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

COMMON: dict[str, Any] = {
    "vocab_size": 49152,  # SmolLM2's tokenizer
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-rope": (
        "LlamaConfig",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": 512}),
    "qwen2": ("Qwen2Config", {}),  # q/k/v with bias
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # q/k norms per head
    "phi3": ("Phi3Config", {"pad_token_id": 0}),  # fused qkv and gate/up projections
}
# Served by vLLM's engine only: a mixture of experts (4 experts, 2 a token, every layer).
MOE: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        },
    ),
}


def save_tiny(kind: str, extra: dict[str, Any], out: Path, tokenizer_dir: Path) -> Path:
    config = getattr(transformers, kind)(**{**COMMON, **extra})
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Larger-than-default weights, and a scaled head, give peaked logits whose greedy
    # choices are far apart: an identity test then tests the arithmetic, not rounding.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out
