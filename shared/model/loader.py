"""Load a model for serving: weights (via the safetensors cache), tokenizer and chat template.

Any failure becomes one `ModelLoadError` line; callers at the command line print it and
exit instead of showing a traceback.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.errors import ModelLoadError
from shared.model.architectures import (
    check_architecture,
    check_config,
    max_context,
    to_runner_shape,
)
from shared.model.convert import converted_dir
from shared.model.source import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """Everything the engine needs from a model, independent of where it came from."""

    served_name: str
    hf_model: Any  # a transformers *ForCausalLM; the runner reads its weights and modules
    tokenizer: Any
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def config(self) -> Any:
        return self.hf_model.config

    @property
    def max_model_len(self) -> int:
        return max_context(self.config)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat rendered with the model's own template (generation prompt added)."""
        try:
            out = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja errors come as several types
            raise ModelLoadError(f"chat template failed: {exc}") from exc
        return self.encode(str(out))


def pick_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without it is an error, not a fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda requested but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise ModelLoadError(f"unknown device {name!r} (expected auto, cpu or cuda)")
    return torch.device(name)


def _check_architecture(model_dir: os.PathLike[str]) -> None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"unreadable config.json in {model_dir}: {exc}") from exc
    check_architecture(archs)


def load_model(name: str | None, dtype: str = "float32", device: str = "auto") -> LoadedModel:
    """Resolve, convert once if needed, and load a model ready for the engine."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    source = resolve_model(name)
    target_device = pick_device(device)
    model_dir = converted_dir(source)
    _check_architecture(model_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weights load in well under a second from the cache
    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        hf_model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa"
        )
    except Exception as exc:  # transformers raises many types for a broken directory
        raise ModelLoadError(f"cannot load model from {model_dir}: {exc}") from exc
    check_config(hf_model.config)
    to_runner_shape(hf_model)
    hf_model.to(target_device)  # type: ignore[arg-type]
    hf_model.eval()
    hf_model.requires_grad_(False)
    eos = hf_model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    return LoadedModel(
        served_name=source.served_name,
        hf_model=hf_model,
        tokenizer=tokenizer,
        dtype=DTYPES[dtype],
        device=target_device,
        eos_token_ids=frozenset(eos_ids),
    )
