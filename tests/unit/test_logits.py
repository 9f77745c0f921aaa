"""Penalties, logit bias, min_tokens and stop_token_ids in the engine, against transformers
(its `generate` processors where it has them, its forward plus OpenAI's formula where it
does not), and through a resume: a sequence continued from its output samples the same."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.errors import InvalidRequestError
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

N = 16


def prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def run(model: LoadedModel, ids: list[int], params: SamplingParams) -> list[int]:
    return Engine(model, EngineConfig(num_blocks=64)).generate([ids], params)[0]


def hf(model: LoadedModel, ids: list[int], **kwargs: object) -> list[int]:
    out = model.hf_model.generate(torch.tensor([ids]), do_sample=False, **kwargs)
    return list(out[0, len(ids) :].tolist())


PLAIN = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


def repetitive(seed: int) -> list[int]:
    """A prompt repeating a few tokens: one the penalties change the greedy output of."""
    rng = random.Random(seed)
    few = [rng.randrange(3, 49152) for _ in range(3)]
    return [rng.choice(few) for _ in range(24)]


def test_repetition_penalty_matches_transformers(tiny_model: LoadedModel) -> None:
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, repetition_penalty=1.8)
    for seed in range(20):  # a prompt where the penalty changes the tokens, else proves nothing
        ids = repetitive(seed)
        ref = hf(tiny_model, ids, max_new_tokens=N, eos_token_id=None, repetition_penalty=1.8)
        if ref != run(tiny_model, ids, PLAIN):
            break
    else:
        pytest.fail("no prompt whose greedy output the penalty changes")
    assert run(tiny_model, ids, params) == ref


def test_logit_bias_and_min_tokens_match_transformers(tiny_model: LoadedModel) -> None:
    """EOS pushed to the top by a bias: held back for min_tokens, then it ends the request."""
    ids = prompt(2)
    eos = 2
    params = SamplingParams(max_tokens=N, temperature=0, logit_bias=((eos, 100.0),), min_tokens=5)
    got = run(tiny_model, ids, params)
    ref = hf(
        tiny_model,
        ids,
        max_new_tokens=N,
        eos_token_id=eos,
        sequence_bias={(eos,): 100.0},
        min_new_tokens=5,
    )
    assert got == ref and len(got) == 6 and got[-1] == eos


def openai_penalised(
    model: LoadedModel, ids: list[int], presence: float, frequency: float
) -> list[int]:
    """transformers' forward, OpenAI's presence/frequency formula, argmax."""
    out: list[int] = []
    for _ in range(N):
        logits = model.hf_model(torch.tensor([ids + out])).logits[0, -1].float()
        for tok in set(out):
            logits[tok] -= frequency * out.count(tok) + presence
        out.append(int(torch.argmax(logits)))
    return out


@torch.inference_mode()
def test_presence_and_frequency_penalties_follow_openai(tiny_model: LoadedModel) -> None:
    params = SamplingParams(
        max_tokens=N, temperature=0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=2.0
    )
    for seed in range(20):  # a prompt where the penalties change the tokens
        ids = repetitive(seed)
        ref = openai_penalised(tiny_model, ids, 1.5, 2.0)
        if ref != run(tiny_model, ids, PLAIN):
            break
    else:
        pytest.fail("no prompt whose greedy output the penalties change")
    assert run(tiny_model, ids, params) == ref


def test_a_stop_token_id_ends_the_request(tiny_model: LoadedModel) -> None:
    ids = prompt(4)
    free = run(tiny_model, ids, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
    stop = free[5]
    first = free.index(stop)
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    rid = engine.add_request(
        ids, SamplingParams(max_tokens=N, temperature=0, stop_token_ids=(stop,))
    )
    outs = [o for _ in range(N + 1) for o in engine.step() if o.request_id == rid]
    assert [o.new_token_ids[0] for o in outs] == free[: first + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_resumed_sequence_samples_what_it_would_have(
    tiny_model: LoadedModel, temperature: float
) -> None:
    ids = prompt(5)
    params = SamplingParams(
        max_tokens=N, temperature=temperature, seed=11, ignore_eos=True, repetition_penalty=1.3,
        presence_penalty=0.5, frequency_penalty=0.7, logit_bias=((7, 3.0),),
    )  # fmt: skip
    whole = run(tiny_model, ids, params)
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    rid = engine.add_request(ids, params, output_ids=whole[:7])  # a failover after 7 tokens
    rest = [
        t for _ in range(N) for o in engine.step() if o.request_id == rid for t in o.new_token_ids
    ]
    assert whole[:7] + rest == whole


def test_out_of_range_values_are_refused(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    for bad in [
        SamplingParams(presence_penalty=2.5),
        SamplingParams(repetition_penalty=0.0),
        SamplingParams(logit_bias=((5, 101.0),)),
        SamplingParams(logit_bias=((10**6, 1.0),)),
        SamplingParams(stop_token_ids=(10**6,)),
        SamplingParams(max_tokens=4, min_tokens=5),
    ]:
        with pytest.raises(InvalidRequestError):
            engine.add_request([5, 6, 7], bad)
    assert not engine.has_unfinished()
