"""The router's reading of logprobs, echo, n and response_format
(services/router/validation.py, options.py): what each endpoint accepts, what it maps to on
the wire, and the clear 400s."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from services.router.admission import new_job
from services.router.validation import Limits, ParsedRequest, parse_request
from shared.bus.ids import RequestId
from shared.bus.messages import NodeInfo
from shared.errors import InvalidRequestError
from shared.model.tokenizer import TokenizerInfo, load_tokenizer

pytestmark = pytest.mark.unit
MODEL = "smollm2-135m-instruct"
D1 = NodeInfo(node_id="d1", role="decode")
# what new_job reads of the router's parts
PARTS = SimpleNamespace(
    config=SimpleNamespace(first_token_timeout=60.0), inflight=SimpleNamespace(streaming=set())
)


@pytest.fixture(scope="module")
def tok() -> TokenizerInfo:
    return load_tokenizer(MODEL)


def parse(tok: TokenizerInfo, chat: bool = False, **body: Any) -> ParsedRequest:
    if chat:
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    else:
        body.setdefault("prompt", "Hello there")
    return parse_request({"model": MODEL, **body}, chat, {MODEL: tok}, Limits())


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


def test_n_and_each_choices_seed(tok: TokenizerInfo) -> None:
    from services.router.choices import choice_request

    assert parse(tok).n == 1
    parsed = parse(tok, n=4, seed=10, temperature=0.8)
    assert parsed.n == 4
    seeds = [choice_request(parsed, i).params.seed for i in range(4)]
    assert seeds == [10, 11, 12, 13] and all(choice_request(parsed, i).n == 1 for i in range(4))
    top = parse(tok, n=2, seed=2**63 - 1)
    assert choice_request(top, 1).params.seed == 0  # wraps within the 63-bit seed range
    unseeded = choice_request(parse(tok, n=3, temperature=0.8), 2)
    assert unseeded.params.seed is None  # each job draws its own, once, at admission:
    jobs = [new_job(cast(Any, PARTS), unseeded, RequestId("r"), D1) for _ in range(2)]
    assert all(job.params.seed is not None for job in jobs)  # what every node samples with
    assert jobs[0].params.seed != jobs[1].params.seed
    seeded_job = new_job(
        cast(Any, PARTS), parsed, RequestId("r"), NodeInfo(node_id="d1", role="decode")
    )
    assert seeded_job.params.seed == 10  # the client's own, untouched
    refused(tok, "n", n=0)
    refused(tok, "n", n=17)
    refused(tok, "n", n="2")


def test_response_format_becomes_a_checked_grammar(tok: TokenizerInfo) -> None:
    assert parse(tok).params.guide == ""
    assert parse(tok, response_format={"type": "text"}).params.guide == ""
    assert parse(tok, True, response_format={"type": "json_object"}).params.guide
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert '"a"' in parse(tok, response_format=fmt).params.guide
    refused(tok, "response_format", response_format="json")
    refused(tok, "response_format", response_format={"type": "yaml"})
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}
    refused(tok, "response_format", response_format=bad)


def test_a_response_not_streamed_has_bounded_logprobs(tok: TokenizerInfo) -> None:
    """Issue 49: n=16 x 4,096 tokens x 20 alternatives would keep ~1.4 million entries in the
    router and serialise them on its loop; refused with what to do instead. Streamed, each
    chunk carries its own tokens' entries and nothing accumulates: accepted."""
    big = {"n": 16, "max_tokens": 4000, "logprobs": 20}
    with pytest.raises(InvalidRequestError) as err:
        parse(tok, **big)
    assert err.value.param == "logprobs" and "stream it" in err.value.message
    assert parse(tok, stream=True, **big).params.logprobs == 20
    chat = {"n": 16, "max_tokens": 4000, "logprobs": True, "top_logprobs": 20}
    refused(tok, "logprobs", True, **chat)
    assert parse(tok, True, stream=True, **chat).n == 16
    # within the bound, and without logprobs at any size: as before
    assert parse(tok, n=2, max_tokens=1000, logprobs=20).params.logprobs == 20
    assert parse(tok, n=16, max_tokens=4000).params.logprobs is None


def test_a_prompt_too_long_for_the_limit_is_refused_before_tokenising(
    tok: TokenizerInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49: the one tokenising thread is every key's; text that no prompt of at most
    --max-prompt-tokens tokens can be is refused by its length alone. Just under that
    length it is tokenised (and refused by its count, as before)."""
    limits = Limits(max_prompt_tokens=50)
    most = 2 * 50 * tok.max_token_chars
    assert tok.max_token_chars >= max(len(tok.decode([t])) for t in range(tok.vocab_size))

    def no_tokenising(*args: Any) -> list[int]:
        raise AssertionError("tokenised")

    with monkeypatch.context() as m:
        m.setattr(TokenizerInfo, "encode", no_tokenising)
        m.setattr(TokenizerInfo, "chat", no_tokenising)
        for chat, body in (
            (False, {"prompt": "a" * (most + 1)}),
            (True, {"messages": [{"role": "user", "content": "a" * (most + 1)}]}),
        ):
            with pytest.raises(InvalidRequestError) as err:
                parse_request({"model": MODEL, **body}, chat, {MODEL: tok}, limits)
            assert "before tokenising" in err.value.message
    with pytest.raises(InvalidRequestError) as err:  # tokenised, then refused by its count
        parse_request({"model": MODEL, "prompt": "a " * (most // 2)}, False, {MODEL: tok}, limits)
    assert "accepts at most 50" in err.value.message


def test_sampling_ranges_are_the_ones_every_node_checks(tok: TokenizerInfo) -> None:
    """The router refuses by SamplingParams.validate's ranges, the nodes' own (one place)."""
    for param, value in (("temperature", 2.5), ("temperature", -1), ("top_p", 0), ("top_k", -2)):
        refused(tok, param, **{param: value})
    refused(tok, "seed", seed=2**63)
    refused(tok, "seed", seed=-1)
    assert parse(tok, temperature=2, seed=2**63 - 1).params.seed == 2**63 - 1
