"""Varied prompts for correctness tests: chat-templated and raw, from a few to ~1,500 tokens."""

from __future__ import annotations

from shared.model.loader import LoadedModel

_ESSAY = (
    "The history of computing is a story of abstractions piled on abstractions. "
    "Early machines were programmed by rewiring panels; then came stored programs, "
    "assemblers, compilers, operating systems and networks. Each layer hid the one "
    "below and let more people build more things. "
)


def varied_prompts(model: LoadedModel) -> list[list[int]]:
    chat = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in two sentences why the sky is blue.",
    ]
    raw = [
        "Once upon a time",
        "def quicksort(arr):",
        "The three primary colours are",
    ]
    out = [model.apply_chat_template([{"role": "user", "content": c}]) for c in chat]
    out += [model.encode(r) for r in raw]
    long_doc = _ESSAY * 22  # ~1,250 tokens
    out.append(
        model.apply_chat_template(
            [{"role": "user", "content": long_doc + "\nSummarise the text above in one line."}]
        )
    )
    out.append(model.encode(_ESSAY * 6 + "In conclusion,"))
    return out
