"""The router's torch-free tokenizer gives the token ids `transformers`' tokenizer gives,
for plain prompts and through the chat template, and loads no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shared.errors import InvalidRequestError
from shared.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.unit

TEXTS = [
    "The capital of France is",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "héllo wörld 日本語 🙂 ∑",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "日本語は？ 🙂"},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def both(real_model_dir: Path) -> tuple[object, object]:
    return load_tokenizer(None), AutoTokenizer.from_pretrained(real_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(both: tuple, text: str) -> None:  # type: ignore[type-arg]
    ours, theirs = both
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_matches_apply_chat_template(both: tuple, messages: list) -> None:  # type: ignore[type-arg]
    ours, theirs = both
    text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.chat(messages) == theirs.encode(text, add_special_tokens=False)


def test_a_template_that_raises_refuses_the_request(both: tuple) -> None:  # type: ignore[type-arg]
    """A template's raise_exception judges the messages (e.g. roles out of order): a 400
    naming `messages`, not a server error."""
    ours, _ = both
    template = ours.chat_template
    ours.chat_template = template.environment.from_string(
        "{{ raise_exception('no system messages') }}"
    )
    try:
        with pytest.raises(InvalidRequestError, match="no system messages") as refused:
            ours.chat([{"role": "user", "content": "x"}])
        assert refused.value.http_status == 400 and refused.value.param == "messages"
    finally:
        ours.chat_template = template


def test_loading_it_loads_no_torch(real_model_dir: Path) -> None:
    code = (
        "import sys; from shared.model.tokenizer import load_tokenizer; "
        "t = load_tokenizer(None); t.chat([{'role': 'user', 'content': 'hi'}]); "
        "print([m for m in sys.modules if m == 'torch' or m.startswith('transformers')])"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
