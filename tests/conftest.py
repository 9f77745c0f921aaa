"""Shared fixtures: the real default model, and a tiny random Llama with the real tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from shared.model.convert import converted_dir
from shared.model.loader import LoadedModel, load_model
from shared.model.source import resolve_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The default model converted to safetensors (cached across runs in TANDEM_CACHE)."""
    return converted_dir(resolve_model(None))


@pytest.fixture(scope="session")
def real_model(real_model_dir: Path) -> LoadedModel:
    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (fixed seed) sharing the real tokenizer: fast engine tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config)
    # Larger-than-default weights give peaked, input-dependent logits, so token-level
    # comparisons actually exercise the KV cache instead of repeating one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real_model_dir / name).exists():
            shutil.copy(real_model_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir), dtype="float32", device="cpu")


@pytest.fixture
def nats_server():  # type: ignore[no-untyped-def]
    """A real nats-server with JetStream on a free port, removed after the test."""
    from shared.bus.server import NatsServer

    server = NatsServer().start()
    yield server
    server.cleanup()


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Every phase's seconds, per test (tests/durations.py keeps them)."""
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.durations import output_path, write

    if _durations and not hasattr(session.config, "workerinput"):
        write(_durations, output_path())
