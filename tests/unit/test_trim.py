"""Cutting a delta of several tokens between two of them (services/router/trim.py)."""

from __future__ import annotations

from services.router.trim import tail_of
from shared.bus.messages import TokenDelta, TokenLogprob


def delta(**kw: object) -> TokenDelta:
    fields: dict[str, object] = {
        "attempt_id": "r1",
        "seq": 7,  # tokens 4..7
        "token_ids": [14, 15, 16, 17],
        "text": " a bc d",
        "text_ends": [2, 2, 5, 7],  # " a", "" (5 held its text back), " bc", " d"
        "logprobs": [TokenLogprob(-float(i)) for i in range(4)],
        "prompt_logprobs": [TokenLogprob(-9.0)],
    }
    return TokenDelta(**(fields | kw))  # type: ignore[arg-type]


def test_cut_between_tokens() -> None:
    cut = tail_of(delta(), 6)
    assert cut is not None
    assert (cut.first_seq, cut.seq, cut.token_ids) == (6, 7, [16, 17])
    assert cut.text == " bc d" and cut.text_ends == [3, 5]
    assert cut.logprobs == [TokenLogprob(-2.0), TokenLogprob(-3.0)]
    assert cut.prompt_logprobs is None
    after_held = tail_of(delta(), 5)  # token 5 brought no text of its own
    assert after_held is not None and after_held.text == " bc d" and after_held.token_ids[0] == 15


def test_no_cut_outside_or_without_text_ends() -> None:
    assert tail_of(delta(), 4) is None  # nothing to cut
    assert tail_of(delta(), 8) is None  # past its end
    assert tail_of(delta(text_ends=None), 6) is None
    assert tail_of(delta(text_ends=[2, 2, 5]), 6) is None  # one short
    assert tail_of(delta(text_ends=[2, 1, 5, 7]), 6) is None  # not increasing
    assert tail_of(delta(text_ends=[2, 2, 5, 6]), 6) is None  # does not end at the text's end
    assert tail_of(delta(text_ends=[-1, 2, 5, 7]), 6) is None
    assert tail_of(delta(logprobs=[TokenLogprob(0.0)]), 6) is None
