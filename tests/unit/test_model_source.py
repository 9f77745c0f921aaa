"""`--model` values: a source, or `NAME=SOURCE` serving it under a name of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.bus.topology import model_token, prefill_consumer, prefill_subject
from shared.errors import ModelLoadError
from shared.model.source import (
    DEFAULT_MODEL,
    SourceKind,
    resolve_model,
    split_model_option,
)


def test_a_named_source_is_served_under_its_name(tmp_path: Path) -> None:
    model = tmp_path / "weights"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert resolve_model(str(model)).served_name == "weights"
    named = resolve_model(f"org/tiny:v1={model}")
    assert (named.served_name, named.kind, named.path) == ("org/tiny:v1", SourceKind.HF_DIR, model)
    assert resolve_model(f"second={DEFAULT_MODEL}").served_name == "second"
    assert resolve_model(f"second={DEFAULT_MODEL}").path == resolve_model(None).path
    odd = tmp_path / "a=b"  # a path with '=' in it is still a path
    odd.mkdir()
    (odd / "config.json").write_text("{}")
    assert resolve_model(str(odd)).served_name == "a=b"


@pytest.mark.parametrize("value", ["=x", "bad name=x", ".hidden=x", "a" * 129 + "=x", "ok="])
def test_bad_names_are_refused_clearly(value: str) -> None:
    with pytest.raises(ModelLoadError, match=r"name|source"):
        split_model_option(value)


def test_an_unknown_source_after_a_name_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="model not found"):
        resolve_model("name=/nonexistent/dir")


def test_model_tokens_are_subject_safe_and_distinct() -> None:
    names = ["SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct_Q4_1", "org/m:1", "org_m_1"]
    tokens = [model_token(n) for n in names]
    assert len(set(tokens)) == len(tokens)
    for token in tokens:
        assert token.replace("_", "").replace("-", "").isalnum()
    assert model_token(names[0]) == model_token(names[0])  # stable
    # each model's own queue and consumer; a job naming no model keeps the old ones
    assert prefill_subject("org/m:1") == f"tandem.prefill.jobs.{tokens[2]}"
    assert prefill_consumer("org/m:1") == f"prefill-workers-{tokens[2]}"
    assert (prefill_subject(), prefill_consumer()) == ("tandem.prefill.jobs", "prefill-workers")
