"""The native engine through its interface (shared/engine/interface.py): what a node reads
of it, on a tiny random Llama."""

from __future__ import annotations

import pytest

from shared.engine.engine import Engine, EngineConfig
from shared.engine.interface import EngineCore
from shared.kv.block_hash import block_hashes, chain_root
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def core(model: LoadedModel) -> EngineCore:
    return Engine(model, EngineConfig(num_blocks=64, block_size=16))  # mypy: it is one


def test_identity_and_counts(tiny_model: LoadedModel) -> None:
    engine = core(tiny_model)
    assert engine.served_name == tiny_model.served_name
    assert engine.serves("") and engine.serves(tiny_model.served_name)
    assert not engine.serves("another-model")
    assert engine.block_size == 16 and engine.blocks_for(16) == 1 and engine.blocks_for(17) == 2
    assert engine.max_model_len == tiny_model.max_model_len
    assert "/" in engine.hash_key  # the model's name and the KV dtype
    assert engine.pool.num_free == engine.pool.num_blocks == 64


def test_running_tokens_counts_running_sequences_only(tiny_model: LoadedModel) -> None:
    engine = core(tiny_model)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    a = engine.add_request(list(range(3, 23)), params)
    assert engine.running_tokens() == {}  # queued: nothing computed to lose yet
    engine.step()  # prefill: its first token
    b = engine.add_request(list(range(3, 10)), params)
    assert engine.running_tokens() == {a: 21}
    engine.step()  # the classic schedule (no chunking): b's prefill first, a waits
    assert engine.running_tokens() == {a: 21, b: 8}
    engine.step()  # both decode
    assert engine.running_tokens() == {a: 22, b: 9}
    engine.abort(a)
    assert a not in engine.running_tokens()


def test_context_block_hashes_are_the_prompt_chain(tiny_model: LoadedModel) -> None:
    engine = core(tiny_model)
    tokens = list(range(3, 3 + 40))
    full = engine.exchange.context_block_hashes(tokens, "salt")
    extra = engine.hash_key.encode()
    assert full == block_hashes(tokens, 16, extra, parent=chain_root("salt"))
    assert len(full) == 2  # 40 tokens: two full blocks
    # a prefix hit leaves a prompt's last token to compute: 32 tokens give one block
    assert engine.exchange.prompt_block_hashes(tokens[:32], "salt") == full[:1]
    assert engine.exchange.context_block_hashes(tokens, "other") != full
