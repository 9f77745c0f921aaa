"""The tokenizer side of a model, without its weights: what the router needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shared.errors import ModelLoadError
from shared.model.convert import converted_dir
from shared.model.source import resolve_model


@dataclass
class TokenizerInfo:
    served_name: str
    tokenizer: Any
    max_model_len: int

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja raises several types for bad input
            raise ModelLoadError(f"chat template failed: {exc}") from exc
        return self.encode(str(text))


def load_tokenizer(name: str | None) -> TokenizerInfo:
    source = resolve_model(name)
    model_dir = converted_dir(source)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        with open(model_dir / "config.json") as f:
            max_len = int(json.load(f).get("max_position_embeddings", 2048))
    except Exception as exc:  # any unreadable tokenizer is a model error
        raise ModelLoadError(f"cannot load tokenizer from {model_dir}: {exc}") from exc
    return TokenizerInfo(source.served_name, tokenizer, max_len)
