"""bfloat16: the float32-matmul path for CPUs without bf16 units agrees with the plain path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import load_model
from shared.model.runner import PackedItem
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def test_upcast_path_matches_plain_bf16(tiny_model_dir: Path) -> None:
    model = load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    engine = Engine(model, EngineConfig(num_blocks=32))
    runner = engine.runner
    items = [PackedItem([5, 9, 200, 31, 7], 0, [0]), PackedItem([8, 8, 300], 0, [1])]
    runner.upcast = False
    plain = runner.forward_packed(items)
    runner.upcast = True
    upcast = runner.forward_packed(items)
    assert plain.dtype == upcast.dtype == torch.float32
    # bf16 rounding differs between the paths; the logits must still agree closely.
    assert torch.allclose(plain, upcast, atol=0.15, rtol=0.05)
    assert torch.equal(plain.argmax(-1), upcast.argmax(-1))


def test_bf16_engine_generates(tiny_model_dir: Path) -> None:
    model = load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    engine = Engine(model, EngineConfig(num_blocks=64))
    assert engine.cache.kv.dtype == torch.bfloat16
    out = engine.generate(
        [[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    )
    assert [len(o) for o in out] == [9, 9]
