"""Logprobs through the disaggregated stack (the prefill node samples the first token, a
decode node the rest), with the real openai client, against transformers' log-softmax of
the same model: the completions shape (legacy lists) and the chat shape, streamed and not;
an echoed prompt's logprobs across a decode node's failover."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
import torch

from shared.model.loader import LoadedModel
from tandem.launcher import Stack
from tests.e2e.conftest import wait_for_every_node
from tests.e2e.streaming import kill_its_decode_node, stream_events
from tests.e2e.test_api import MODEL, client
from tests.e2e.test_failover import failovers

pytestmark = pytest.mark.e2e

N = 12
TOL = 1e-4  # float32: a batched, paged forward against transformers' plain one


def reference(model: LoadedModel, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the log-softmax at each of their positions."""
    out = model.hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    tokens = out[0, len(ids) :].tolist()
    with torch.no_grad():
        logits = model.hf_model(out).logits[0, len(ids) - 1 : -1].float()
    return tokens, torch.log_softmax(logits, dim=-1)


def token_text(model: LoadedModel, token: int) -> str:
    return str(model.tokenizer.decode([token], skip_special_tokens=False))


def test_completion_logprobs_match_transformers(stack: Stack, real_model: LoadedModel) -> None:
    prompt = "The capital of France is"
    tokens, ref = reference(real_model, real_model.encode(prompt), N)
    texts = [token_text(real_model, t) for t in tokens]
    with client(stack) as c:
        whole = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=N, temperature=0, logprobs=3
        )
        lp = whole.choices[0].logprobs
        assert lp is not None and lp.tokens == texts
        assert lp.token_logprobs == pytest.approx(
            [float(ref[i, t]) for i, t in enumerate(tokens)], abs=TOL
        )
        assert lp.top_logprobs is not None
        for i, top in enumerate(lp.top_logprobs):
            values, ids = torch.topk(ref[i], 3)
            want = {
                token_text(real_model, t): v
                for t, v in zip(ids.tolist(), values.tolist(), strict=True)
            }
            assert top == pytest.approx(want, abs=TOL)  # greedy: the sampled one is among them
        assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        streamed = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=N, temperature=0, logprobs=3, stream=True
        )
        parts = [ch.choices[0].logprobs for ch in streamed if ch.choices]
        got = [t for p in parts if p is not None for t in (p.tokens or [])]
        offsets = [o for p in parts if p is not None for o in (p.text_offset or [])]
        assert got == texts and offsets == lp.text_offset


def test_chat_logprobs_match_transformers(stack: Stack, real_model: LoadedModel) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    tokens, ref = reference(real_model, real_model.apply_chat_template(messages), N)
    with client(stack) as c:
        for stream in (False, True):
            resp = c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=N, temperature=0,  # type: ignore[arg-type]
                logprobs=True, top_logprobs=2, stream=stream,
            )  # fmt: skip
            if stream:
                content = [e for ch in resp for e in (ch.choices[0].logprobs.content or [])
                           if ch.choices and ch.choices[0].logprobs]  # fmt: skip
            else:
                assert resp.choices[0].logprobs is not None
                content = resp.choices[0].logprobs.content or []
            assert [e.token for e in content] == [token_text(real_model, t) for t in tokens]
            for i, entry in enumerate(content):
                assert entry.logprob == pytest.approx(float(ref[i, tokens[i]]), abs=TOL)
                assert entry.bytes == list(entry.token.encode("utf-8"))
                values, ids = torch.topk(ref[i], 2)
                assert [t.token for t in entry.top_logprobs] == [
                    token_text(real_model, t) for t in ids.tolist()
                ]
                assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
                    values.tolist(), abs=TOL
                )


def test_chat_top_logprobs_without_logprobs_gets_a_400(stack: Stack) -> None:
    """(The completions endpoint's bad values are in test_api.py's BAD list.)"""
    with client(stack) as c:
        for extra in ({"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21}):
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                    extra_body=extra,
                )  # fmt: skip
            assert "top_logprobs" in str(err.value)


def test_echo_scores_the_prompt_as_transformers_does(stack: Stack, real_model: LoadedModel) -> None:
    """How evaluation harnesses score text: `echo` with `logprobs` and `max_tokens: 0` gives
    the prompt back with each token's logprob (none for the first) and generates nothing;
    with tokens to generate, the prompt's part comes first and the output's follows."""
    prompt = "Paris is the capital of France."
    ids = real_model.encode(prompt)
    with torch.no_grad():
        logits = real_model.hf_model(torch.tensor([ids])).logits[0, :-1].float()
    ref = torch.log_softmax(logits, dim=-1)
    want = [None] + [float(ref[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    texts = [token_text(real_model, t) for t in ids]
    with client(stack) as c:
        scored = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
        )
        choice = scored.choices[0]
        assert choice.text == prompt and choice.finish_reason == "length"
        assert scored.usage is not None and scored.usage.completion_tokens == 0
        lp = choice.logprobs
        assert lp is not None and lp.tokens == texts and lp.token_logprobs is not None
        assert lp.token_logprobs[0] is None and lp.top_logprobs is not None
        assert lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=TOL)
        for p, top in enumerate(lp.top_logprobs[1:]):  # the top one and the actual one
            best = int(torch.argmax(ref[p]))
            assert top is not None and token_text(real_model, best) in top
            assert texts[p + 1] in top
        tokens, _ = reference(real_model, ids, 4)
        both = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=0, temperature=0
        )
        generated = [token_text(real_model, t) for t in tokens]
        assert both.choices[0].text == prompt + "".join(generated)
        lp = both.choices[0].logprobs
        assert lp is not None and lp.tokens == texts + generated
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        streamed = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, echo=True, temperature=0, stream=True
        )
        chunks = [ch.choices[0].text for ch in streamed if ch.choices]
        assert chunks[0].startswith(prompt) and "".join(chunks) == both.choices[0].text
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                extra_body={"echo": True},
            )  # fmt: skip
        assert "echo" in str(err.value)


async def echo_stream(
    session: aiohttp.ClientSession, url: str, ids: list[int], events: list[str]
) -> tuple[str, list[float | None]]:
    """A streamed greedy completion with `echo` and `logprobs`: its text and every token
    logprob (the prompt's first, which has none, included), as the chunks bring them."""
    body = {
        "model": MODEL, "prompt": ids, "max_tokens": 100, "temperature": 0, "stream": True,
        "echo": True, "logprobs": 0, "ignore_eos": True,
    }  # fmt: skip
    text: list[str] = []
    logprobs: list[float | None] = []
    async for data in stream_events(session, url, body):
        for choice in data["choices"]:
            text.append(choice["text"])
            logprobs += choice["logprobs"]["token_logprobs"]
            events.append(choice["text"])
    return "".join(text), logprobs


async def test_echoed_prompt_logprobs_come_once_across_a_decode_failover(
    stack: Stack, real_model: LoadedModel
) -> None:
    """The prompt's logprobs come with the first token (from the prefill node). SIGKILL the
    decode node mid-stream: the resumed stream does not send them again, and the whole
    stream, text and logprobs, is the uninterrupted run's."""
    ids = real_model.encode("Paris is the capital of France. Write about its history.")
    async with aiohttp.ClientSession() as session:
        want_text, want = await echo_stream(session, stack.url, ids, [])
        assert len(want) == len(ids) + 100 and want[0] is None
        before = failovers(stack)
        events: list[str] = []
        victim = ""
        try:
            stream = asyncio.ensure_future(echo_stream(session, stack.url, ids, events))
            victim = await kill_its_decode_node(stack, events, after=20)
            text, got = await asyncio.wait_for(stream, 180)
        finally:
            if victim:
                stack.restart(victim)
    assert text == want_text and len(got) == len(want) and got[0] is None
    assert got[1:] == pytest.approx(want[1:], abs=TOL)
    assert failovers(stack) > before
    await asyncio.to_thread(wait_for_every_node, stack, 300)
