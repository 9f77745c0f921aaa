"""The router's reading of logprobs and echo (services/router/validation.py): what each
endpoint accepts, what it maps to on the wire, and the clear 400s."""

from __future__ import annotations

from typing import Any

import pytest

from services.router.validation import Limits, ParsedRequest, parse_request
from shared.errors import InvalidRequestError
from shared.model.tokenizer import TokenizerInfo, load_tokenizer

pytestmark = pytest.mark.unit
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tok() -> TokenizerInfo:
    return load_tokenizer(MODEL)


def parse(tok: TokenizerInfo, chat: bool = False, **body: Any) -> ParsedRequest:
    if chat:
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    else:
        body.setdefault("prompt", "Hello there")
    return parse_request({"model": MODEL, **body}, chat, tok, {MODEL}, Limits())


def refused(tok: TokenizerInfo, param: str, chat: bool = False, **body: Any) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse(tok, chat, **body)
    assert err.value.param == param, err.value.message


def test_completions_and_chat_ask_in_their_own_words(tok: TokenizerInfo) -> None:
    assert parse(tok).params.logprobs is None
    assert parse(tok, logprobs=0).params.logprobs == 0
    assert parse(tok, logprobs=5).params.logprobs == 5
    assert parse(tok, True, logprobs=True).params.logprobs == 0
    assert parse(tok, True, logprobs=True, top_logprobs=4).params.logprobs == 4
    assert parse(tok, True, logprobs=False).params.logprobs is None
    refused(tok, "logprobs", logprobs=21)
    refused(tok, "logprobs", logprobs=True)  # a completion's is a count
    refused(tok, "logprobs", True, logprobs=3)  # a chat's is a boolean
    refused(tok, "top_logprobs", True, top_logprobs=2)  # needs logprobs: true
    refused(tok, "top_logprobs", True, logprobs=True, top_logprobs=21)


def test_echo_maps_to_prompt_logprobs_and_max_tokens_zero_hides_one_token(
    tok: TokenizerInfo,
) -> None:
    plain = parse(tok, echo=True)
    assert plain.echo and plain.params.prompt_logprobs is None and not plain.hide_output
    scored = parse(tok, echo=True, logprobs=2, max_tokens=0)
    assert scored.params.prompt_logprobs == 2 and scored.params.logprobs == 2
    assert scored.hide_output and scored.params.max_tokens == 1
    refused(tok, "max_tokens", max_tokens=0)  # without echo there is nothing to return
    refused(tok, "echo", True, echo=True)
    refused(tok, "echo", echo="yes")
    long = "word " * 2000  # ~2,000 tokens: fine with 0 alternatives, too many with 20
    assert parse(tok, prompt=long, echo=True, logprobs=0).params.prompt_logprobs == 0
    refused(tok, "logprobs", prompt=long, echo=True, logprobs=20)
