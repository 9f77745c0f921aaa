"""Every model family the native engine serves is greedy-identical to `transformers`, token
for token (shared/model/architectures.py). Each is a tiny randomly initialised model saved
from a `transformers` config with a fixed seed (no download), loaded by the engine's own
loader and run batched through prefill and decode; the reference is `generate` on a
separate copy of the same weights. A family the engine does not serve is refused at load,
naming those it does."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from shared.engine.engine import Engine, EngineConfig
from shared.errors import ModelLoadError
from shared.model.loader import load_model
from shared.sampling_params import SamplingParams
from tests.tiny_models import FAMILIES, save_tiny

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_is_greedy_identical_to_transformers(
    family: str, real_model_dir: Path, tmp_path: Path
) -> None:
    kind, extra = FAMILIES[family]
    path = save_tiny(kind, extra, tmp_path / family, real_model_dir)
    model = load_model(str(path), dtype="float32", device="cpu")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 23, 61)]
    ours = Engine(model, EngineConfig(num_blocks=64)).generate(prompts, GREEDY)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt, got in zip(prompts, ours, strict=True):
        want = reference.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
        assert got == want, family
    assert len({tuple(t) for t in ours}) > 1  # the prompts lead apart: not one repeated token


def test_a_family_it_does_not_serve_is_refused_by_name(
    real_model_dir: Path, tmp_path: Path
) -> None:
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=49152)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    shutil.copy(real_model_dir / "tokenizer.json", tmp_path / "gpt2" / "tokenizer.json")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*Qwen3ForCausalLM"):
        load_model(str(tmp_path / "gpt2"), dtype="float32", device="cpu")
