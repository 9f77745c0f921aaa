"""The engine's greedy tokens equal transformers' `generate(do_sample=False)` (real model, fp32)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams
from tests.integration.prompts import varied_prompts

pytestmark = pytest.mark.integration

NEW_TOKENS = 64


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def references(real_model: LoadedModel) -> list[tuple[list[int], list[int]]]:
    """(prompt, transformers' greedy continuation) for prompts of 1 to 1,200+ tokens."""
    prompts = varied_prompts(real_model)
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8 and lengths[0] <= 8 and lengths[-1] >= 1200
    return [
        (
            p,
            real_model.hf_model.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False
            )[0, len(p) :].tolist(),
        )
        for p in prompts
    ]


def test_batched_greedy_equals_generate(
    real_model: LoadedModel, references: list[tuple[list[int], list[int]]]
) -> None:
    engine = Engine(real_model, EngineConfig(num_blocks=1024))
    ours = engine.generate([p for p, _ in references], GREEDY)
    for i, ((prompt, ref), got) in enumerate(zip(references, ours, strict=True)):
        assert got == ref, f"prompt {i} ({len(prompt)} tokens) diverged"
    assert engine.pool.num_used == 0


def test_chunked_prefill_equals_generate(
    real_model: LoadedModel, references: list[tuple[list[int], list[int]]]
) -> None:
    """With chunked prefill on, prompts that arrive while others decode are prefilled a
    chunk per step beside the decodes (the 1,200-token one over many steps): the same
    tokens."""
    config = EngineConfig(num_blocks=1024, step_token_budget=96, prefill_chunk_tokens=64)
    engine = Engine(real_model, config)
    first, *rest = references
    ids = {engine.add_request(first[0], GREEDY): 0}
    got: dict[str, list[int]] = {}
    chunk_steps = 0
    while engine.has_unfinished() or rest:
        if rest and engine.num_running:  # join while something decodes: chunked
            ids[engine.add_request(rest[0][0], GREEDY)] = len(references) - len(rest)
            rest = rest[1:]
        before = engine.stats.prefill_steps
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        chunk_steps += engine.stats.prefill_steps - before
    assert chunk_steps >= 1200 // 64  # the long prompt really went in chunks
    assert engine.stats.chunked_steps >= 1200 // 64  # counted as chunked: beside decodes
    for rid, i in ids.items():
        prompt, ref = references[i]
        assert got[rid] == ref, f"prompt {i} ({len(prompt)} tokens) diverged when chunked"
    assert engine.pool.num_used == 0


def test_a_burst_prefilled_whole_equals_generate(
    real_model: LoadedModel, references: list[tuple[list[int], list[int]]]
) -> None:
    """Every prompt but the first arrives at once while the first decodes: the short ones
    at the head of the queue (a burst) are prefilled whole in one step, the rest (the
    1,200-token one among them) chunked: the same tokens."""
    config = EngineConfig(
        num_blocks=1024, step_token_budget=96, prefill_chunk_tokens=64, enable_prefix_caching=False
    )
    engine = Engine(real_model, config)
    first, *rest = references
    got: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)

    ids = {engine.add_request(first[0], GREEDY): 0}
    step()
    ids |= {engine.add_request(p, GREEDY): i for i, (p, _) in enumerate(rest, start=1)}
    burst = 0
    for p, _ in rest:
        if len(p) > 64:
            break
        burst += len(p)
    assert burst > 64, "the references need a burst of short prompts"
    before = engine.stats.prefill_tokens
    step()
    assert engine.stats.prefill_tokens - before == burst  # whole, beyond the 96-token budget
    while engine.has_unfinished():
        step()
    for rid, i in ids.items():
        prompt, ref = references[i]
        assert got[rid] == ref, f"prompt {i} ({len(prompt)} tokens) diverged"
    assert engine.pool.num_used == 0
