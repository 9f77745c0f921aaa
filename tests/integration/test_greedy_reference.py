"""The engine's greedy tokens equal transformers' `generate(do_sample=False)` (real model, fp32)."""

from __future__ import annotations

import pytest
import torch

from shared.bus.params import SamplingParams
from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import LoadedModel
from tests.integration.prompts import varied_prompts

pytestmark = pytest.mark.integration

NEW_TOKENS = 64


def test_batched_greedy_equals_generate(real_model: LoadedModel) -> None:
    prompts = varied_prompts(real_model)
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8 and lengths[0] <= 8 and lengths[-1] >= 1200
    engine = Engine(real_model, EngineConfig(num_blocks=1024))
    ours = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    for i, (prompt, got) in enumerate(zip(prompts, ours, strict=True)):
        ref = real_model.hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
        )[0, len(prompt) :].tolist()
        assert got == ref, f"prompt {i} ({len(prompt)} tokens) diverged"
    assert engine.pool.num_used == 0
