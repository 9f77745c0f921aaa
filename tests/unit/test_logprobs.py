"""Logprobs in the engine, against transformers' log-softmax of the model's own logits: the
sampled token's and the top-k's, before penalties and temperature; only rows that ask pay,
and a batch mixing both gives each what it asked."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.types import StepOutput
from shared.errors import InvalidRequestError
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

N = 8
TOL = 1e-4  # float32, batched against unbatched (the bar)


def prompt(seed: int, n: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def outputs(
    model: LoadedModel, prompts: list[list[int]], params: list[SamplingParams]
) -> dict[str, list[StepOutput]]:
    engine = Engine(model, EngineConfig(num_blocks=64))
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    got: dict[str, list[StepOutput]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out)
    return {i: got[i] for i in ids}


def reference(model: LoadedModel, ids: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each generated token's position, `[len(generated), vocab]`."""
    with torch.no_grad():
        logits = model.hf_model(torch.tensor([ids + generated])).logits[0].float()
    return torch.log_softmax(logits[len(ids) - 1 : len(ids) + len(generated) - 1], dim=-1)


@pytest.mark.parametrize("k", [0, 5])
def test_greedy_logprobs_match_transformers(tiny_model: LoadedModel, k: int) -> None:
    ids = prompt(1)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=k)
    (outs,) = outputs(tiny_model, [ids], [params]).values()
    tokens = [t for o in outs for t in o.new_token_ids]
    ref = reference(tiny_model, ids, tokens)
    for pos, out in enumerate(outs):
        assert out.logprobs is not None and len(out.logprobs) == 1
        lp = out.logprobs[0]
        assert lp.logprob == pytest.approx(float(ref[pos, tokens[pos]]), abs=TOL)
        assert len(lp.top_ids) == len(lp.top_logprobs) == k
        if k:
            values, top = torch.topk(ref[pos], k)
            assert lp.top_ids[0] == tokens[pos]  # greedy: the sampled token leads
            assert lp.top_ids == top.tolist()
            assert lp.top_logprobs == pytest.approx(values.tolist(), abs=TOL)


def test_logprobs_are_the_models_before_penalties_and_temperature(tiny_model: LoadedModel) -> None:
    """A repetition penalty and a temperature change which token is drawn, not the logprobs
    reported for it: they are the raw model's."""
    ids = prompt(2)
    params = SamplingParams(
        max_tokens=N, temperature=0.7, seed=3, repetition_penalty=1.5, ignore_eos=True, logprobs=3
    )
    (outs,) = outputs(tiny_model, [ids], [params]).values()
    tokens = [t for o in outs for t in o.new_token_ids]
    ref = reference(tiny_model, ids, tokens)
    for pos, out in enumerate(outs):
        assert out.logprobs is not None
        assert out.logprobs[0].logprob == pytest.approx(float(ref[pos, tokens[pos]]), abs=TOL)
        assert out.logprobs[0].top_ids == torch.topk(ref[pos], 3).indices.tolist()


def test_a_batch_mixing_requests_gives_each_what_it_asked(tiny_model: LoadedModel) -> None:
    a, b = prompt(3), prompt(4, 20)
    plain = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    asking = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=2)
    got = list(outputs(tiny_model, [a, b], [plain, asking]).values())
    assert all(o.logprobs is None for o in got[0])
    tokens = [t for o in got[1] for t in o.new_token_ids]
    ref = reference(tiny_model, b, tokens)
    for pos, out in enumerate(got[1]):
        assert out.logprobs is not None
        assert out.logprobs[0].logprob == pytest.approx(float(ref[pos, tokens[pos]]), abs=TOL)


@pytest.mark.parametrize("bad", [-1, 21])
def test_logprobs_out_of_range_are_refused(bad: int) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(logprobs=bad).validate()
    assert err.value.param == "logprobs"


def prompt_reference(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at prompt positions 0..n-2 (each predicting the next)."""
    with torch.no_grad():
        logits = model.hf_model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(model: LoadedModel, ids: list[int], out: StepOutput, k: int) -> None:
    ref = prompt_reference(model, ids)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) - 1
    want = [float(ref[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    assert [lp.logprob for lp in got] == pytest.approx(want, abs=TOL)
    for p, lp in enumerate(got):
        assert lp.top_ids == torch.topk(ref[p], k).indices.tolist()


def test_prompt_logprobs_come_with_the_first_token_whole_or_chunked_and_despite_the_cache(
    tiny_model: LoadedModel,
) -> None:
    """Prefilled whole; prefilled in 16-token chunks beside a running stream; and again
    once the prompt's blocks are cached (which must not skip the positions they hold)."""
    ids = prompt(5, 40)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    (outs,) = outputs(tiny_model, [ids], [params]).values()
    check_prompt_logprobs(tiny_model, ids, outs[0], 2)
    assert all(o.prompt_logprobs is None for o in outs[1:])  # once, with the first token

    engine = Engine(tiny_model, EngineConfig(num_blocks=64, step_token_budget=16))
    running = engine.add_request(prompt(6), SamplingParams(max_tokens=30, temperature=0))
    engine.step()  # now decoding: the next prompt is chunked beside it
    for _ in range(2):  # the second time its blocks are cached
        asking = engine.add_request(ids, params)
        firsts = []
        chunk_steps = 0
        while not firsts:
            step = engine.step()
            chunk_steps += 1
            firsts = [o for o in step if o.request_id == asking]
        assert chunk_steps >= 3  # 40 tokens in 16-token chunks
        check_prompt_logprobs(tiny_model, ids, firsts[0], 2)
        engine.abort(asking)
    engine.abort(running)
