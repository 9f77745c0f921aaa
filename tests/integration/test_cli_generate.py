"""`tandem generate` end to end, and its one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

TANDEM = [sys.executable, "-m", "tandem.cli"]


def test_generate_prints_the_engine_completion(real_model: LoadedModel) -> None:
    out = subprocess.run(
        [*TANDEM, "generate", "What is the capital of France?", "--chat", "--max-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    ids = real_model.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    tokens = Engine(real_model, EngineConfig(num_blocks=64)).generate(
        [ids], SamplingParams(max_tokens=12, temperature=0)
    )[0]
    expected = real_model.tokenizer.decode(tokens, skip_special_tokens=True)
    assert out.stdout == expected + "\n"
    assert "Paris" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--model", "/no/such/model"], "model not found"),
        (["generate", ""], "prompt is empty"),
        (["generate", "hi", "--max-tokens", "0"], "max_tokens must be a positive integer"),
    ],
)
def test_errors_are_one_line_without_traceback(args: list[str], message: str) -> None:
    out = subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr
